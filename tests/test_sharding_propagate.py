"""Sharding propagation of a matmul: the result equals numpy, its placement and bytes equal tables by hand.

1-D meshes of 2 and 3 ranks, the seed document's 4x5 by 5x8 float64 matmul: all 16 pairs of input
placements from {S(0), S(1), B, P}, the uneven ones cut as DTensor cuts them (5 columns on 2 ranks: 3, 2;
4 rows on 3 ranks: 2, 2, 0). The output's placement, the collectives and the bytes each rank sends (trace)
equal ``SEED_TABLE`` (2 ranks) and ``SEED_TABLE_3``, worked out by hand below; the threads backend and
mpiexec alike. A 4x6 by 6x8 matmul (even): every one of its 16 pairs checked against a small chooser
written here from the per-step bytes in terms of the global sizes (not the module's code).
2 x 2 meshes: drawn pairs (values, and the bytes of the chosen strategy) and two cases by hand. Elementwise
add and mul: every pair of placements of two (4, 6) tensors on 2 ranks against a table by hand, broadcasting
cases by hand, drawn pairs with broadcasting on a 2 x 2 mesh. Values are small integers, so sums are exact.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar import trace
from minipar.comm import launch
from minipar.mesh import DeviceMesh
from minipar.sharding import GlobalTensor, Partial, Replicate, Shard
from minipar.sharding.ops import elementwise, matmul
from minipar.sharding.propagate import matmul_strategies, table_row
from minipar.testing import run_each

S0, S1, B, P = Shard(0), Shard(1), Replicate(), Partial()


def operands(m: int, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-5, 6, size=(m, k)).astype(np.float64), rng.integers(-5, 6, size=(k, n)).astype(np.float64))


def partial_piece(x: np.ndarray, c: int, p: int, seed: int) -> np.ndarray:
    """Coordinate ``c``'s addend of ``x`` (random integers, the last coordinate the remainder)."""
    rest = [np.random.default_rng([seed, i]).integers(-3, 4, size=x.shape).astype(np.float64) for i in range(p - 1)]
    return rest[c] if c < p - 1 else x - sum(rest, np.zeros_like(x))


def make(x: np.ndarray, mesh: DeviceMesh, axes: tuple, placements: tuple, seed: int) -> GlobalTensor:
    """A global tensor whose partial pieces are not just (x, 0, ...)."""
    t = GlobalTensor.from_global(x, mesh, axes, [B if p == P else p for p in placements])
    local = t.local
    for k, (a, p) in enumerate(zip(axes, placements, strict=True)):
        if p == P:
            local = partial_piece(local, mesh.coords[a], mesh.degree(a), seed + k)
    return GlobalTensor(local, x.shape, mesh, axes, placements)


def run_matmul(comm, mesh_kw: dict, axes: tuple, mkn: tuple, pairs: list, seed: int) -> list[dict]:
    mesh = DeviceMesh(comm, **mesh_kw)
    x, y = operands(*mkn, seed)
    out = []
    for pa, pb in pairs:
        a, b = make(x, mesh, axes, pa, seed), make(y, mesh, axes, pb, seed + 7)
        with trace.recording(comm.world_rank) as rec:
            c = matmul(a, b)
        mine = [e for e in rec.events if e.kind == "comm" and e.src == mesh.rank]
        out.append({"placement": c.placements, "sent": sum(e.nbytes for e in mine), "global": c.to_global(),
                    "best": matmul_strategies(a, b)[0], "ops": " ".join(sorted({e.op for e in mine}))})
    return out


# ---- the seed's 4x5 @ 5x8: |A| = 160 bytes, |B| = 320 -----------------------------------------------------
# Pieces, DTensor's rule (ceil(n/p) rows each, the last shorter). 2 ranks: A S(0) 2x5, 2x5 (80, 80 B); A S(1)
# 4x3, 4x2 (96, 64); B S(0) 3x8, 2x8 (192, 128); B S(1) 5x4, 5x4 (160, 160). A step's bytes for the rank at c:
# all-gather (ring): every piece but its successor's; reduce-scatter, all-to-all: every part of its piece but
# the one it keeps; all-reduce (ring over the flat piece cut as np.array_split): every chunk but its own, then
# every chunk but its successor's; from B: 0. Cheapest by the busiest rank, then fewest inputs' placements
# changed (a free slice or zeroing counts), then rules in order S(0)xB, BxS(1), S(1)xS(0), PxB, BxP, BxB.
SEED_TABLE = {  # (A, B): (C, collectives, bytes rank 0, rank 1)
    (S0, S0): (P, "all_to_all", (32, 48)),   # A to S(1): rank 0 keeps 2x3 of 2x5, sends 2x2; rank 1 sends 2x3
    (S0, S1): (S1, "allgather", (80, 80)),   # all-gather A; A and B to S(1) x S(0): 32 + 64, 48 + 96
    (S0, B): (S0, "", (0, 0)),
    (S0, P): (P, "allgather", (80, 80)),     # A to B, B x P; S(1) x S(0) would reduce-scatter B (128, 192)
    (S1, S0): (P, "", (0, 0)),               # the row-parallel case: the contraction split, no message
    (S1, S1): (S1, "allgather", (96, 64)),   # all-gather A (96, 64) ties all-to-all B to S(0) (64, 96): BxS(1) first
    (S1, B): (P, "", (0, 0)),                # slice B to S(0), free
    (S1, P): (P, "allgather", (96, 64)),     # A to B, B x P; reduce-scatter B to S(0) would be 128, 192
    (B, S0): (P, "", (0, 0)),                # slice A to S(1), free
    (B, S1): (S1, "", (0, 0)),
    (B, B): (B, "", (0, 0)),                 # every rule is free (slice, zero), B x B changes nothing
    (B, P): (P, "", (0, 0)),
    (P, S0): (P, "reduce_scatter", (64, 96)),  # A to S(1): rank 0 sends 4x2, rank 1 4x3; all-gather B: 192
    (P, S1): (S1, "allreduce", (160, 160)),  # all-reduce A ties all-gather B (160), one change each: BxS(1) first
    (P, B): (P, "", (0, 0)),
    (P, P): (P, "allreduce", (160, 160)),    # all-reduce A, B x P; all-reduce B would be 320
}
# 3 ranks: A S(0) 2x5, 2x5, 0x5 (80, 80, 0 B); A S(1) 4x2, 4x2, 4x1 (64, 64, 32); B S(0) 2x8, 2x8, 1x8
# (128, 128, 64); B S(1) 5x3, 5x3, 5x2 (120, 120, 80). All-reduce of A: 20 elements in chunks 7, 7, 6.
SEED_TABLE_3 = {  # (A, B): (C, collectives, bytes rank 0, 1, 2)
    (S0, S0): (P, "all_to_all", (48, 48, 0)),      # A to S(1): 2x5 cut 2, 2, 1 columns, 6 of 10 sent; rank 2 empty
    (S0, S1): (P, "all_to_all", (120, 120, 64)),   # A as above + B to S(0): 72, 72, 64 (5x3 cut 2, 2, 1 rows;
    #                                                 rank 2 keeps 1x2 of 5x2); all-gather A would be 80, 160, 80
    (S0, B): (S0, "", (0, 0, 0)),
    (S0, P): (P, "allgather", (80, 160, 80)),      # A to B: 160 - 80 (rank 1's), 160 - 0, 160 - 80; then B x P
    (S1, S0): (P, "", (0, 0, 0)),
    (S1, S1): (P, "all_to_all", (72, 72, 64)),     # B to S(0); all-gather A: 160 - 64, 160 - 32, 160 - 64
    (S1, B): (P, "", (0, 0, 0)),
    (S1, P): (P, "allgather", (96, 128, 96)),      # A to B, then B x P
    (B, S0): (P, "", (0, 0, 0)),
    (B, S1): (S1, "", (0, 0, 0)),
    (B, B): (B, "", (0, 0, 0)),
    (B, P): (P, "", (0, 0, 0)),
    (P, S0): (P, "reduce_scatter", (96, 96, 128)),  # A to S(1): 160 - 64, 160 - 64, 160 - 32
    (P, S1): (P, "all_to_all reduce_scatter", (168, 168, 192)),  # A to S(1) (96, 96, 128) + B to S(0) (72, 72,
    #                                                 64); all-reduce A: 8 (13 + 13), 8 (13 + 14), 8 (14 + 13)
    (P, B): (P, "", (0, 0, 0)),
    (P, P): (P, "allreduce", (208, 216, 216)),     # all-reduce A: 8 (13 + 13), 8 (13 + 14), 8 (14 + 13)
}


def check_seed(results: list[list[dict]], table: dict) -> None:
    x, y = operands(4, 5, 8, 3)
    for i, (pa, pb) in enumerate(table):
        want_c, want_ops, want_bytes = table[(pa, pb)]
        ops = " ".join(sorted({op for res in results for op in res[i]["ops"].split()}))  # a rank may send nothing
        assert ops == want_ops, (pa, pb, ops)
        for rank, res in enumerate(results):
            row = res[i]
            assert np.array_equal(row["global"], x @ y), (pa, pb, rank)
            assert row["placement"] == (want_c,), (pa, pb, rank, row)
            assert row["sent"] == want_bytes[rank], (pa, pb, rank, row["sent"])
            assert row["best"][3] == max(want_bytes), (pa, pb, row["best"])


@pytest.mark.parametrize(("p", "table"), [(2, SEED_TABLE), (3, SEED_TABLE_3)])
def test_seed_matmul_every_pair(p: int, table: dict) -> None:
    pairs = [((pa,), (pb,)) for pa, pb in table]
    check_seed(launch(run_matmul, p, "threads", {"tp": p}, ("tp",), (4, 5, 8), pairs, 3), table)


def run_row(comm) -> str:
    mesh = DeviceMesh(comm, tp=2)
    x, y = operands(4, 5, 8, 3)
    return table_row(GlobalTensor.from_global(x, mesh, ("tp",), [P]), GlobalTensor.from_global(y, mesh, ("tp",), [S1]))


def test_table_row() -> None:
    assert launch(run_row, 2, "threads") == ["[P] x [S(1)] -> needs [B] x [S(1)] -> [S(1)], 160 bytes"] * 2


def hand_cost(src, dst, n_bytes: int, p: int) -> int:
    """Per-rank bytes of one step ``src -> dst`` on one axis of degree p, N = the tensor's global bytes."""
    if src == dst or src == B:
        return 0
    if src == P:
        return 2 * (p - 1) * n_bytes // p if dst == B else (p - 1) * n_bytes // p
    return (p - 1) * n_bytes // p // p if isinstance(dst, Shard) else (p - 1) * n_bytes // p


def hand_choice(pa, pb, m: int, k: int, n: int, p: int) -> tuple:
    """The cheapest legal rule, then the one changing fewer placements, then first in the table's order,
    from hand_cost."""
    table = [(S0, B, S0), (B, S1, S1), (S1, S0, P), (P, B, P), (B, P, P), (B, B, B)]
    best = None
    for ra, rb, rc in table:
        cost = hand_cost(pa, ra, m * k * 8, p) + hand_cost(pb, rb, k * n * 8, p)
        key = (cost, (pa != ra) + (pb != rb))
        if best is None or key < best[1]:
            best = (rc, key)
    return best[0], best[1][0]


def test_divisible_matmul_every_pair_on_2_ranks() -> None:
    """4x6 @ 6x8: all 16 pairs, including the contraction dimension split (S(1) x S(0) -> P)."""
    one = [S0, S1, B, P]
    pairs = list(itertools.product(one, repeat=2))
    results = launch(run_matmul, 2, "threads", {"tp": 2}, ("tp",), (4, 6, 8), [((a,), (b,)) for a, b in pairs], 4)
    x, y = operands(4, 6, 8, 4)
    for i, (pa, pb) in enumerate(pairs):
        want_c, want_bytes = hand_choice(pa, pb, 4, 6, 8, 2)
        for rank in range(2):
            row = results[rank][i]
            assert np.array_equal(row["global"], x @ y), (pa, pb, rank)
            assert (row["placement"], row["sent"]) == ((want_c,), want_bytes), (pa, pb, rank, row)
    # S(1) x S(0) is chosen where it is free, and from S(0) x S(1) it is not (all-to-alls of 48 + 96 > 96)
    assert results[0][pairs.index((S1, S0))]["placement"] == (P,)
    assert results[0][pairs.index((S0, S1))]["placement"] == (S1,)


MESH_2X2 = ({"dp": 2, "tp": 2}, ("dp", "tp"))


def all_pairs_2d() -> list[tuple]:
    lists = list(itertools.product([S0, S1, B, P], repeat=2))
    return list(itertools.product(lists, repeat=2))


@budget(3)
@given(picks=st.lists(st.integers(0, 255), min_size=1, max_size=12, unique=True), seed=st.integers(0, 10**6))
def test_drawn_pairs_on_a_2x2_mesh_threads(picks: list[int], seed: int) -> None:
    pairs = [all_pairs_2d()[i] for i in picks]
    results = launch(run_matmul, 4, "threads", *MESH_2X2, (4, 8, 4), pairs, seed)
    x, y = operands(4, 8, 4, seed)
    for i in range(len(pairs)):
        assert all(np.array_equal(results[r][i]["global"], x @ y) for r in range(4)), pairs[i]
        assert max(results[r][i]["sent"] for r in range(4)) == results[0][i]["best"][3], pairs[i]


@pytest.mark.parametrize(("pa", "pb", "want"), [
    # dp: S(0) x B as given; tp: A's S(1) and a free slice of B to S(0) make S(1) x S(0) -> P: no message
    ((S0, S1), (B, B), ((S0, P), 0)),
    # both partial on tp (A, B of 256 bytes): dp's rule sets the piece sizes tp's reduction sees. dp S(0) x B
    # (free slice of A) then tp B x P: all-reduce A's 4x8/2 piece = 128 bytes sent. Nothing is cheaper:
    # tp must reduce A (its piece), B (its piece) or half of each, and dp halves at most one of them free
    # (S(0)xB, BxS(1)) or both (S(1)xS(0): then two reduce-scatters of 64, again 128); S(0)xB is first.
    ((B, P), (B, P), ((S0, P), 128)),
])
def test_2x2_mesh_by_hand(pa: tuple, pb: tuple, want: tuple) -> None:
    out = launch(run_matmul, 4, "threads", *MESH_2X2, (4, 8, 4), [(pa, pb)], 1)
    x, y = operands(4, 8, 4, 1)
    for o in out:
        assert (o[0]["placement"], o[0]["sent"]) == want
        assert np.array_equal(o[0]["global"], x @ y)


# ---- elementwise add and mul on 2 ranks: x, y of shape (4, 6), N = 192 bytes each ------------------------
# Per rank (p = 2): S(i) -> S(j) N/4 = 48; S -> B, S -> P, P -> S N/2 = 96; P -> B N = 192; from B 0.
# Cheapest, then fewest placements changed, then rules in order S(0), S(1), P (add: P+P; mul: P*B, B*P), B.
SAME = {  # (x, y): (out, bytes) for add; MUL_DIFF overrides for mul
    (S0, S0): (S0, 0), (S0, S1): (S0, 48), (S0, B): (S0, 0), (S0, P): (S0, 96),  # S(0): 96 ties P (S->P 96)
    (S1, S0): (S0, 48), (S1, S1): (S1, 0), (S1, B): (S1, 0), (S1, P): (S1, 96),
    (B, S0): (S0, 0), (B, S1): (S1, 0), (B, B): (B, 0), (B, P): (P, 0),  # B + P: zero x (free)
    (P, S0): (S0, 96), (P, S1): (S1, 96), (P, B): (P, 0), (P, P): (P, 0),
}
MUL_DIFF = {(P, P): (P, 192)}  # P * P: two reduce-scatters (192, two changes) tie P*B (all-reduce y, 192, one)


def run_elementwise(comm, op: str, sx: tuple, sy: tuple, pairs: list, seed: int, mesh_kw: dict | None = None,
                    axes: tuple = ("tp",)) -> list[dict]:
    mesh = DeviceMesh(comm, **(mesh_kw or {"tp": 2}))
    rng = np.random.default_rng(seed)
    x, y = rng.integers(-5, 6, size=sx).astype(np.float64), rng.integers(-5, 6, size=sy).astype(np.float64)
    out = []
    for px, py in pairs:
        a, b = make(x, mesh, axes, px, seed), make(y, mesh, axes, py, seed + 7)
        with trace.recording(comm.world_rank) as rec:
            c = elementwise(op, a, b)
        sent = sum(e.nbytes for e in rec.events if e.kind == "comm" and e.src == mesh.rank)
        out.append({"placement": c.placements, "sent": sent, "global": c.to_global(),
                    "want": x + y if op == "add" else x * y})
    return out


@pytest.mark.parametrize("op", ["add", "mul"])
def test_elementwise_same_shape_every_pair(op: str) -> None:
    table = {**SAME, **(MUL_DIFF if op == "mul" else {})}
    pairs = [((px,), (py,)) for px, py in table]
    results = launch(run_elementwise, 2, "threads", op, (4, 6), (4, 6), pairs, 5)
    for i, key in enumerate(table):
        for rank in range(2):
            row = results[rank][i]
            assert np.array_equal(row["global"], row["want"]), (op, key, rank)
            assert (row["placement"], row["sent"]) == ((table[key][0],), table[key][1]), (op, key, rank, row)


BROADCAST = [  # (op, x shape, y shape, x, y, out, bytes per rank), by hand on 2 ranks
    ("add", (4, 6), (6,), S0, B, S0, 0),   # y broadcasts along rows: stays whole
    ("add", (4, 6), (6,), S1, B, S1, 0),   # y sliced to S(0) (its only dimension becomes 1): free
    ("add", (4, 6), (6,), P, B, P, 0),     # zero y on coordinate 1: P + P
    ("mul", (4, 6), (6,), P, B, P, 0),     # P * B
    ("mul", (4, 6), (4, 1), S1, S0, S1, 16),  # gather y's 32 bytes (16 sent) beats x's all-to-all (48)
    ("add", (4, 1), (1, 6), S0, S1, S1, 16),  # x (32 bytes) gathered for S(1): 16; y (48) for S(0) would be 24
]


@pytest.mark.parametrize(("op", "sx", "sy", "px", "py", "pc", "nbytes"), BROADCAST)
def test_elementwise_broadcasting_by_hand(op, sx, sy, px, py, pc, nbytes) -> None:
    for row in launch(run_elementwise, 2, "threads", op, sx, sy, [((px,), (py,))], 6):
        assert np.array_equal(row[0]["global"], row[0]["want"])
        assert (row[0]["placement"], row[0]["sent"]) == ((pc,), nbytes)


@budget(3)
@given(op=st.sampled_from(["add", "mul"]), sy=st.sampled_from([(4, 8), (8,), (4, 1), (1, 8)]),
       picks=st.lists(st.integers(0, 255), min_size=1, max_size=10, unique=True), seed=st.integers(0, 10**6))
def test_elementwise_drawn_on_a_2x2_mesh(op: str, sy: tuple, picks: list[int], seed: int) -> None:
    """x (4, 8) and a y that broadcasts, drawn placements (y's impossible splits replaced by B): values."""
    pairs = []
    for i in picks:
        px, py = all_pairs_2d()[i]
        pairs.append((px, tuple(B if isinstance(p, Shard) and (p.dim >= len(sy) or sy[p.dim] == 1) else p
                                for p in py)))
    results = launch(run_elementwise, 4, "threads", op, (4, 8), sy, pairs, seed, MESH_2X2[0], MESH_2X2[1])
    for i in range(len(pairs)):
        assert all(np.array_equal(results[r][i]["global"], results[r][i]["want"]) for r in range(4)), pairs[i]


# ---- bad inputs: the same error on every rank, before any message ----------------------------------------
BAD = [
    (lambda m: matmul(GlobalTensor.from_global(np.ones((4, 5)), m, ("tp",), [B]),
                      GlobalTensor.from_global(np.ones((4, 8)), m, ("tp",), [B])), "inner dimensions differ"),
    (lambda m: matmul(GlobalTensor.from_global(np.ones(4), m, ("tp",), [B]),
                      GlobalTensor.from_global(np.ones((4, 8)), m, ("tp",), [B])), "@ (k, n) or equal batch"),
    (lambda m: matmul(GlobalTensor.from_global(np.ones((4, 4)), m, ("tp",), [B]),
                      GlobalTensor.from_global(np.ones((4, 8)), m, ("dp",), [B])), "same mesh and axes"),
    (lambda m: elementwise("add", GlobalTensor.from_global(np.ones((4, 6)), m, ("tp",), [S0]),
                           GlobalTensor.from_global(np.ones((4,)), m, ("tp",), [B])), "do not broadcast"),
    (lambda m: elementwise("div", GlobalTensor.from_global(np.ones((4, 6)), m, ("tp",), [S0]),
                           GlobalTensor.from_global(np.ones((4, 6)), m, ("tp",), [B])), "op must be one of"),
]


def run_bad(comm, bad: list, i: int) -> tuple[str, int]:
    mesh = DeviceMesh(comm, tp=2)
    with trace.recording(comm.world_rank) as rec, pytest.raises(ValueError) as err:
        bad[i][0](mesh)
    return str(err.value), sum(e.kind == "comm" for e in rec.events)


def check_refused(bad: list, i: int) -> None:
    """``bad[i]``'s call raises the same ``ValueError`` naming ``bad[i][1]`` on both ranks, before any message."""
    out = launch(run_bad, 2, "threads", bad, i)
    assert bad[i][1] in out[0][0], out[0][0]
    assert all(o == (out[0][0], 0) for o in out)


@pytest.mark.parametrize("i", range(len(BAD)), ids=[n for _, n in BAD])
def test_bad_matmuls_refused_on_every_rank(i: int) -> None:
    check_refused(BAD, i)


@pytest.mark.mpi
def test_seed_tables_2x2_and_elementwise_under_mpiexec() -> None:
    for p, table in ((2, SEED_TABLE), (3, SEED_TABLE_3)):
        [seed_res] = run_each(run_matmul, p, [{"mesh_kw": {"tp": p}, "axes": ("tp",), "mkn": (4, 5, 8),
                                               "pairs": [((a,), (b,)) for a, b in table], "seed": 3}], timeout=120)
        check_seed(seed_res, table)
    picks = [all_pairs_2d()[i] for i in (0, 37, 100, 170, 255)]
    [res] = run_each(run_matmul, 4, [{"mesh_kw": MESH_2X2[0], "axes": MESH_2X2[1], "mkn": (4, 8, 4),
                                      "pairs": picks, "seed": 9}], timeout=120)
    x, y = operands(4, 8, 4, 9)
    for i in range(len(picks)):
        assert all(np.array_equal(row[i]["global"], x @ y) for row in res), picks[i]
    [ew] = run_each(run_elementwise, 2, [{"op": "add", "sx": (4, 6), "sy": (4, 6), "seed": 5,
                                          "pairs": [((px,), (py,)) for px, py in SAME]}], timeout=120)
    for i, key in enumerate(SAME):
        for row in ew:
            assert np.array_equal(row[i]["global"], row[i]["want"])
            assert (row[i]["placement"], row[i]["sent"]) == ((SAME[key][0],), SAME[key][1]), key
