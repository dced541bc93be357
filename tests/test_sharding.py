"""Global tensors: redistribution between every pair of placements equals numpy, round-trips exactly,
and sends the bytes ``minipar.cost.sharding`` predicts.

Property: for drawn shapes (sides 2 to 8, so many cuts are uneven: DTensor's ``ceil(n/p)`` rows per piece,
the last ones shorter or empty, written again here as ``rows``), on 1-D meshes (2 and 4 ranks)
and 2-D meshes (dp x tp = 2 x 2, with the axes in either order), for every pair of placement lists
A, B: the pieces after ``redistribute(A -> B)`` are the numpy slices of the original (replicas equal,
partial pieces summing to it), ``to_global`` is the original, ``B -> A`` gives back A's pieces exactly
(A without ``Partial``; with it, pieces that still sum to the original), and every rank's bytes on each
axis, read from the trace, equal the formulas: on 1-D meshes from counts written here by hand from the
pieces' sizes (``N (p-1)/p`` and the like when the cuts are even), on 2-D meshes
``cost.sharding.redistribute_bytes`` over ``greedy``'s steps, plus hand-computed 2-D cases (one uneven).
Drawn pairs also cover 3-D tensors on 2-D meshes and a 2 x 2 x 2 mesh (three axes sharding
one dimension). Values are small integers in float64, so every sum is exact.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from refusals import refusal
from strategies import budget

from minipar import trace
from minipar.comm import launch
from minipar.cost.sharding import redistribute_bytes
from minipar.mesh import DeviceMesh, MeshShape
from minipar.sharding import GlobalTensor, Partial, Replicate, Shard, greedy, redistribute
from minipar.sharding.redistribute import plan_text
from minipar.testing import run_each

MESHES = {"tp2": ({"tp": 2}, ("tp",)), "tp4": ({"tp": 4}, ("tp",)),
          "dp2xtp2": ({"dp": 2, "tp": 2}, ("dp", "tp")), "tp2xdp2": ({"dp": 2, "tp": 2}, ("tp", "dp")),
          "pp2xdp2xtp2": ({"pp": 2, "dp": 2, "tp": 2}, ("pp", "dp", "tp")),
          "tp2xpp2xdp2": ({"pp": 2, "dp": 2, "tp": 2}, ("tp", "pp", "dp"))}


def placement_lists(ndim: int, n_axes: int) -> list[tuple]:
    one = [Shard(d) for d in range(ndim)] + [Replicate(), Partial()]
    return list(itertools.product(one, repeat=n_axes))


def original(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8, 9, size=shape).astype(np.float64)


def rows(n: int, p: int, c: int) -> slice:
    """Coordinate ``c``'s rows of ``n`` cut over ``p`` ranks: ``ceil(n/p)`` each, the last shorter or empty."""
    size = -(-n // p)
    return slice(min(n, c * size), min(n, (c + 1) * size))


def cut(x: np.ndarray, deg: int, c: int, axis: int) -> np.ndarray:
    return np.moveaxis(np.moveaxis(x, axis, 0)[rows(x.shape[axis], deg, c)], 0, axis)


def piece_of(x: np.ndarray, degrees, coords, placements, seed: int) -> np.ndarray:
    """The piece at ``coords``, by nested cutting (the first axis cuts first); along Partial axes
    random integer addends, the last combination of coordinates taking the remainder."""
    for deg, c, p in zip(degrees, coords, placements, strict=True):
        if isinstance(p, Shard):
            x = cut(x, deg, c, p.dim)
    partial = [k for k, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial:
        return x.copy()
    combos = list(itertools.product(*[range(degrees[k]) for k in partial]))
    addends = [np.random.default_rng([seed, i]).integers(-5, 6, size=x.shape).astype(np.float64)
               for i in range(len(combos) - 1)]
    i = combos.index(tuple(coords[k] for k in partial))
    return addends[i] if i < len(addends) else x - sum(addends, np.zeros_like(x))


def sent_by_axis(events, mesh: DeviceMesh) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        if e.kind == "comm" and e.src == mesh.rank:
            ax = mesh.shape.axis_of(e.src, e.dst)
            out[ax] = out.get(ax, 0) + e.nbytes
    return out


def collectives_run(events, mesh: DeviceMesh) -> list[tuple[str, str]]:
    """``(axis, collective)`` of this rank's sent messages in order, repeats of one collective merged."""
    out: list[tuple[str, str]] = []
    for e in events:
        if e.kind == "comm" and e.src == mesh.rank:
            here = (mesh.shape.axis_of(e.src, e.dst), e.op)
            if not out or out[-1] != here:
                out.append(here)
    return out


def run_pairs(comm, mesh_kw: dict, axes: tuple, shape: tuple, seed: int, pairs: list[int] | None = None) -> list:
    mesh = DeviceMesh(comm, **mesh_kw)
    x = original(shape, seed)
    degrees, coords = [mesh.degree(a) for a in axes], [mesh.coords[a] for a in axes]
    lists = placement_lists(len(shape), len(axes))
    every = list(itertools.product(lists, repeat=2))
    out = []
    for i in pairs if pairs is not None else range(len(every)):
        a, b = every[i]
        t = GlobalTensor(piece_of(x, degrees, coords, a, seed), shape, mesh, axes, a)
        with trace.recording(comm.world_rank) as rec:
            u = redistribute(t, b, plan="greedy")
        back = redistribute(u, a, plan="greedy")
        out.append({"a": a, "b": b, "src": t.local, "dst": u.local, "back": back.local,
                    "global": u.to_global(), "sent": sent_by_axis(rec.events, mesh),
                    "ops": collectives_run(rec.events, mesh)})
    return out


def assemble(pieces: list[np.ndarray], shape, placements, axes, mesh_shape: MeshShape) -> np.ndarray:
    """The global array from every rank's piece: replicas equal, partial pieces summed, shards placed."""
    full = np.zeros(shape)
    degrees = [mesh_shape.degrees()[a] for a in axes]
    for r, piece in enumerate(pieces):
        mine = mesh_shape.coords(r)
        coords = [mine[a] for a in axes]
        if any(isinstance(p, Replicate) and c for p, c in zip(placements, coords, strict=True)):
            first = dict(mine, **{a: 0 for a, p in zip(axes, placements, strict=True) if isinstance(p, Replicate)})
            assert np.array_equal(piece, pieces[mesh_shape.rank_of(**first)]), (r, placements)
            continue
        index = np.arange(full.size).reshape(shape)
        for deg, c, p in zip(degrees, coords, placements, strict=True):
            if isinstance(p, Shard):
                index = cut(index, deg, c, p.dim)
        full.reshape(-1)[index.reshape(-1)] += piece.reshape(-1)
    return full


def hand_bytes_1d(a, b, shape: tuple, p: int, c: int) -> int:
    """The bytes the rank at ``c`` sends for A -> B on one axis of degree p, by hand: all-reduce, every
    chunk of the flat piece but its own then but its successor's (N (p-1)/p twice when p divides);
    reduce-scatter and all-to-all, the piece but the part it keeps; all-gather (S -> P too), every piece
    but its successor's (N (p-1)/p when even)."""
    ka, kb = str(a)[0], str(b)[0]
    n = int(np.prod(shape))
    if a == b or ka == "B":
        return 0
    if (ka, kb) == ("P", "B"):
        chunk = [len(x) for x in np.array_split(np.arange(n), p)]
        return 8 * (2 * n - chunk[c] - chunk[(c + 1) % p])
    if ka == "P" or kb in ("B", "P"):  # reduce-scatter; all-gather (S -> P too)
        d = b.dim if ka == "P" else a.dim
        part = [n // shape[d] * len(range(shape[d])[rows(shape[d], p, m)]) for m in range(p)]
        return 8 * (n - part[c] if ka == "P" else sum(part) - part[(c + 1) % p])
    mine = len(range(shape[a.dim])[rows(shape[a.dim], p, c)])
    kept = len(range(shape[b.dim])[rows(shape[b.dim], p, c)])
    return 8 * (n // shape[a.dim] * mine - n // shape[a.dim] // shape[b.dim] * mine * kept)  # all-to-all


def hand_collective_1d(a, b) -> list[str]:
    """The collective of A -> B on one axis, by hand (OneFlow's table)."""
    ka, kb = str(a)[0], str(b)[0]
    if a == b or ka == "B":
        return []
    if ka == "P":
        return ["allreduce" if kb == "B" else "reduce_scatter"]
    return ["all_to_all" if kb == "S" else "allgather"]


def check_pairs(results_by_rank: list[list[dict]], mesh_kw: dict, axes: tuple, shape: tuple, seed: int) -> None:
    mesh_shape = MeshShape(**mesh_kw)
    x = original(shape, seed)
    for i in range(len(results_by_rank[0])):
        rows = [res[i] for res in results_by_rank]
        a, b = rows[0]["a"], rows[0]["b"]
        what = f"{[str(p) for p in a]} -> {[str(p) for p in b]}"
        assert np.array_equal(assemble([r["dst"] for r in rows], shape, b, axes, mesh_shape), x), what
        assert np.array_equal(assemble([r["back"] for r in rows], shape, a, axes, mesh_shape), x), what
        if not any(isinstance(p, Partial) for p in a):
            assert all(np.array_equal(r["back"], r["src"]) for r in rows), what
        assert all(np.array_equal(r["global"], x) for r in rows), what
        steps = [(s.axis, str(s.src), str(s.dst)) for s in greedy(a, b)]
        for rank, row in enumerate(rows):
            coords = [mesh_shape.coords(rank)[ax] for ax in axes]
            degrees = [mesh_shape.degrees()[ax] for ax in axes]
            if len(axes) == 1:
                want = {axes[0]: hand_bytes_1d(a[0], b[0], shape, degrees[0], coords[0])}
                ops = [(axes[0], op) for op in hand_collective_1d(a[0], b[0])]
            else:
                ops = [(axes[s.axis], s.collective) for s in greedy(a, b) if s.collective not in ("slice", "zero")]
                want = dict(zip(axes, redistribute_bytes(shape, 8, degrees, coords, [str(p) for p in a], steps),
                                strict=True))
            sent = {k: v for k, v in row["sent"].items() if v}  # an empty piece's message carries 0 bytes
            assert sent == {k: v for k, v in want.items() if v}, (what, rank)
            assert [op for op in ops if op in row["ops"]] == row["ops"], (what, rank)  # an empty piece sends nothing
        assert {op for r in rows for op in r["ops"]} == set(ops), what


def dims(max_dims: int) -> st.SearchStrategy:
    return st.lists(st.sampled_from([2, 3, 4, 5, 8]), min_size=1, max_size=max_dims).map(tuple)


def every_pair_threads(mesh: str, shape: tuple, seed: int) -> None:
    kw, axes = MESHES[mesh]
    check_pairs(launch(run_pairs, MeshShape(**kw).size, "threads", kw, axes, shape, seed), kw, axes, shape, seed)


@budget(4)
@given(mesh=st.sampled_from(["tp2", "tp4"]), shape=dims(3), seed=st.integers(0, 10**6))
@example(mesh="tp4", shape=(4, 8), seed=1)
@example(mesh="tp4", shape=(3, 5), seed=1)  # 3 rows on 4 ranks: 1, 1, 1, 0; 5 columns: 2, 2, 1, 0
def test_every_pair_on_1d_meshes_threads(mesh: str, shape: tuple, seed: int) -> None:
    every_pair_threads(mesh, shape, seed)


@budget(3)
@given(mesh=st.sampled_from(["dp2xtp2", "tp2xdp2"]), shape=dims(2), seed=st.integers(0, 10**6))
@example(mesh="dp2xtp2", shape=(4, 8), seed=2)
@example(mesh="tp2xdp2", shape=(5, 3), seed=2)
def test_every_pair_on_2d_meshes_threads(mesh: str, shape: tuple, seed: int) -> None:
    every_pair_threads(mesh, shape, seed)



@st.composite
def drawn_pairs(draw: st.DrawFn, meshes: list[str], sides: list[int], max_dims: int, most: int) -> dict:
    """A mesh, a shape and a few pair indices among its placement lists' pairs."""
    mesh = draw(st.sampled_from(meshes))
    kw, axes = MESHES[mesh]
    shape = draw(st.lists(st.sampled_from(sides), min_size=1, max_size=max_dims).map(tuple))
    n = len(placement_lists(len(shape), len(axes))) ** 2
    pairs = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=most, unique=True))
    return {"mesh_kw": kw, "axes": axes, "shape": shape, "seed": draw(st.integers(0, 10**6)), "pairs": pairs}


@budget(3)
@given(c=drawn_pairs(["dp2xtp2", "tp2xdp2"], [3, 4], 3, 30) | drawn_pairs(["pp2xdp2xtp2", "tp2xpp2xdp2"], [5, 8], 3,
                                                                                12))
def test_drawn_pairs_3d_tensors_and_3d_meshes_threads(c: dict) -> None:
    """Beyond every pair: 3-D tensors on 2-D meshes and a 2 x 2 x 2 mesh (three axes may shard one dimension)."""
    results = launch(run_pairs, MeshShape(**c["mesh_kw"]).size, "threads", c["mesh_kw"], c["axes"], c["shape"],
                     c["seed"], c["pairs"])
    check_pairs(results, c["mesh_kw"], c["axes"], c["shape"], c["seed"])


# ---- 2-D cases by hand: dp x tp = 2 x 2, axes (dp, tp), a (4, 8) float64 tensor of N = 256 bytes ----------
HAND_2D = [
    ((Partial(), Partial()), (Replicate(), Replicate()), {"dp": 256, "tp": 256}),  # two all-reduces of N
    # tp gathers quarters (64 of 64-byte pieces sent), dp then gathers halves (128), tp slices again
    ((Shard(0), Shard(0)), (Replicate(), Shard(0)), {"dp": 128, "tp": 64}),
    # tp gathers its quarter of columns (64), dp swaps rows for columns on halves (all-to-all: 128/2)
    ((Shard(0), Shard(1)), (Shard(1), Shard(0)), {"dp": 64, "tp": 64}),
    # tp gathers column halves (128), dp reduce-scatters the whole (256/2)
    ((Partial(), Shard(1)), (Shard(0), Replicate()), {"dp": 128, "tp": 128}),
    ((Replicate(), Replicate()), (Shard(1), Partial()), {}),  # slice and zero: no message
]


def run_hand(comm, a: tuple, b: tuple, shape: tuple = (4, 8)) -> tuple[dict, np.ndarray]:
    mesh = DeviceMesh(comm, dp=2, tp=2)
    x = original(shape, 5)
    t = GlobalTensor(piece_of(x, [2, 2], [mesh.coords["dp"], mesh.coords["tp"]], a, 5), x.shape, mesh, ("dp", "tp"), a)
    with trace.recording(comm.world_rank) as rec:
        u = redistribute(t, b, plan="greedy")
    return sent_by_axis(rec.events, mesh), u.to_global()


@pytest.mark.parametrize(("a", "b", "want"), HAND_2D, ids=[f"{[str(p) for p in a]}->{[str(p) for p in b]}"
                                                            for a, b, _ in HAND_2D])
def test_2d_bytes_by_hand(a: tuple, b: tuple, want: dict) -> None:
    for rank, (sent, full) in enumerate(launch(run_hand, 4, "threads", a, b)):
        assert sent == want, rank
        assert np.array_equal(full, original((4, 8), 5))


def test_uneven_2d_bytes_by_hand() -> None:
    """A (5, 3) tensor [S(0), S(0)] -> [B, B] on dp x tp = 2 x 2: dp cuts the 5 rows 3, 2, tp cuts those 2, 1
    and 1, 1 (24 bytes a row). tp gathers first (each rank sends its own piece: 48 at (0, 0), else 24),
    then dp (each sends its 3 or 2 rows: 72 on dp = 0, 48 on dp = 1)."""
    want = [{"tp": 48, "dp": 72}, {"tp": 24, "dp": 72}, {"tp": 24, "dp": 48}, {"tp": 24, "dp": 48}]
    out = launch(run_hand, 4, "threads", (Shard(0), Shard(0)), (Replicate(), Replicate()), (5, 3))
    assert [sent for sent, _ in out] == want
    assert all(np.array_equal(full, original((5, 3), 5)) for _, full in out)


# ---- bad annotations: the same message on every rank, before any message -------------------------------
BAD = [
    (lambda m: redistribute(GlobalTensor.from_global(np.ones((4, 4)), m, ("dp", "tp"), [Replicate()] * 2),
                            [Shard(0)]), "1 placements [S(0)] for 2 mesh axes ('dp', 'tp')"),
    (lambda m: GlobalTensor.from_global(np.ones(4), m, ("dp", "dp"), [Replicate()] * 2), "name an axis twice"),
    (lambda m: GlobalTensor.from_global(np.ones(4), m, ("xp",), [Replicate()]), "unknown mesh axes ['xp']"),
    (lambda m: GlobalTensor.from_global(np.ones(4), m, ("dp",), [Shard(1)]), "names dimension 1"),
    (lambda m: GlobalTensor.from_global(np.ones(4), m, ("dp",), ["S(0)"]), "'S(0)' is not a placement"),
]


def run_bad(comm, i: int) -> tuple[str, int]:
    mesh = DeviceMesh(comm, dp=2, tp=2)
    return refusal(comm, lambda: BAD[i][0](mesh))


@pytest.mark.parametrize("i", range(len(BAD)), ids=[n[:30] for _, n in BAD])
def test_bad_annotations_refused_on_every_rank(i: int) -> None:
    out = launch(run_bad, 4, "threads", i)
    assert BAD[i][1] in out[0][0], out[0][0]
    assert all(o == (out[0][0], 0) for o in out)


def test_placement_names() -> None:
    assert [str(p) for p in (Shard(0), Shard(2), Replicate(), Partial())] == ["S(0)", "S(2)", "B", "P"]
    with pytest.raises(ValueError, match="only op='sum'"):
        Partial("max")


# ---- the same property under mpiexec: several drawn cases in one job ----------------------------------------
@pytest.mark.mpi
@budget(1)
@given(drawn=st.lists(drawn_pairs(["dp2xtp2", "tp2xdp2", "tp4"], [4, 8], 2, 6), min_size=1, max_size=3))
def test_drawn_pairs_mpiexec(drawn: list[dict]) -> None:
    fixed = {"mesh_kw": {"dp": 2, "tp": 2}, "axes": ("dp", "tp"), "shape": (4, 8), "seed": 7,
             "pairs": [0, 37, 100, 255]}
    cases = [fixed, *drawn]
    for c, results in zip(cases, run_each(run_pairs, 4, cases, timeout=240, comm_timeout=60), strict=True):
        check_pairs(results, c["mesh_kw"], c["axes"], c["shape"], c["seed"])


def scalar_loss(comm) -> tuple:
    mesh = DeviceMesh(comm, tp=2)
    t = GlobalTensor.from_global(np.array(3.0), mesh, ("tp",), [Partial()])  # a partial-sum loss
    u = redistribute(t, [Replicate()])
    return u.local.shape, float(u.local)


def test_a_scalar_partial_sum_is_all_reduced_to_a_scalar() -> None:
    assert launch(scalar_loss, 2, "threads") == [((), 3.0), ((), 3.0)]  # coordinate 0 held 3, the other 0


def test_plan_text_names_each_step_that_does_anything() -> None:
    assert plan_text((Shard(0),), (Replicate(),), "A") == ["allgather A"]
    assert plan_text((Partial(),), (Shard(1),), "B") == ["reduce-scatter B"]
    assert plan_text((Shard(0),), (Shard(1),), "A") == ["all-to-all A"]
    assert plan_text((Replicate(),), (Shard(0),), "B") == ["slice B"]
    assert plan_text((Shard(1), Replicate()), (Shard(1), Replicate()), "A") == []
