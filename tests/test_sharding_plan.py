"""The cheapest redistribution (``minipar.sharding.plan.cheapest``) against brute force, and run.

Brute force, written here apart from the planner's search: every axis changes along a route of at
most two single-axis steps (``src -> dst``, or through one other placement; an axis already at its
target either stays or goes out and back), or two axes sharded before and after change together in
one exchange; every interleaving of the routes' steps that keeps each step a plain collective (the
tile order, written again here) is costed with ``cost.sharding``'s formulas (``step_bytes`` with
``step_sizes``' pieces, uneven ones too; ``exchange_bytes``), a move costing its busiest rank's bytes.
The planner's cost equals the least of them for every pair of placement lists drawn from {S(0),
S(1), B, P} per axis on 2 x 2 and 2 x 2 x 2 meshes, for a (4, 8) or (8, 8) tensor and for a (3, 5) one
cut unevenly (2 + 1 rows, 3 + 2 columns; some pieces empty on 2 x 2 x 2), never exceeds the greedy
order's, and the redistribution it runs (threads) sends, on every rank, the bytes it predicts and
gives numpy's values.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_sharding import assemble, original, piece_of

from minipar import trace
from minipar.comm import launch
from minipar.cost.sharding import exchange_bytes, step_bytes, step_sizes
from minipar.mesh import DeviceMesh, MeshShape
from minipar.sharding import Exchange, GlobalTensor, Partial, Replicate, Shard, cheapest, greedy, redistribute
from minipar.sharding.plan import plan_bytes
from minipar.sharding.tensor import check_layout, local_slices
from minipar.testing import run_each

ONE = [Shard(0), Shard(1), Replicate(), Partial()]
CASES = {"2x2": ({"dp": 2, "tp": 2}, ("dp", "tp"), (4, 8)), "tp2xdp2": ({"dp": 2, "tp": 2}, ("tp", "dp"), (4, 8)),
         "2x2x2": ({"pp": 2, "dp": 2, "tp": 2}, ("pp", "dp", "tp"), (8, 8)),
         "2x2 uneven": ({"dp": 2, "tp": 2}, ("dp", "tp"), (3, 5)),  # pieces 2 + 1, 3 + 2: the last shorter
         "2x2x2 uneven": ({"pp": 2, "dp": 2, "tp": 2}, ("pp", "dp", "tp"), (3, 5))}  # and some empty


DEPTH = {"2x2": 5, "2x2x2": 7, "2x2 uneven": 5, "2x2x2 uneven": 7}


def pairs(n_axes: int) -> list[tuple[tuple, tuple]]:
    lists = list(itertools.product(ONE, repeat=n_axes))
    return list(itertools.product(lists, repeat=2))


def on(dim: int, layout: Sequence) -> list[int]:
    return [k for k, p in enumerate(layout) if p == Shard(dim)]


def plain(k: int, a, b, layout: Sequence) -> bool:
    """A single-axis step a -> b on axis k is one collective (or local) from ``layout``."""
    kinds = (str(a)[0], str(b)[0])
    if a == b or kinds == ("S", "P"):
        return False
    if isinstance(a, Shard) and on(a.dim, layout)[-1] != k:
        return False
    return not (isinstance(b, Shard) and on(b.dim, layout) and max(on(b.dim, layout)) > k)


def group_last(layout: Sequence, group: tuple[int, int]) -> bool:
    return all(max((m for m in on(d, layout) if m not in group), default=-1) < min(
        (g for g in group if g in on(d, layout)), default=99) for d in range(2))


def fits(shape, degrees, layout) -> bool:
    try:
        check_layout(shape, ("pp", "dp", "tp")[-len(degrees):], layout)
    except ValueError:
        return False
    return True


def move_cost(shape, degrees, layout, move) -> int:
    """The busiest rank's bytes for ``move`` (``("step", k, a, b)`` or ``("x", (a, b), new layout)``)."""
    worst = 0
    for coords in itertools.product(*[range(d) for d in degrees]):
        sl = local_slices(shape, degrees, coords, layout)
        numel = int(np.prod([s.stop - s.start for s in sl]))
        if move[0] == "step":
            _, k, a, b = move
            _, sizes = step_sizes(shape, degrees, coords, [str(p) for p in layout], k, str(b))
            sent = step_bytes(str(a), str(b), numel, 8, degrees[k], coords[k], sizes)
        else:
            new = local_slices(shape, degrees, coords, move[2])
            kept = int(np.prod([max(0, min(s.stop, t.stop) - max(s.start, t.start)) for s, t in zip(sl, new,
                                                                                                   strict=True)]))
            sent = exchange_bytes(numel, kept, 8)
        worst = max(worst, sent)
    return worst


def moves_from(shape, degrees, layout: tuple) -> list[tuple]:
    """Every move from ``layout``: single-axis steps, then two-axis exchanges, to divisible layouts."""
    out = []
    for k, x in itertools.product(range(len(layout)), ONE):
        new = layout[:k] + (x,) + layout[k + 1:]
        if plain(k, layout[k], x, layout) and fits(shape, degrees, new):
            out.append((("step", k, layout[k], x), new))
    for group in itertools.combinations(range(len(layout)), 2):
        if not all(isinstance(layout[k], Shard) for k in group) or not group_last(layout, group):
            continue
        for to in itertools.product(ONE[:2], repeat=2):
            new = tuple(to[group.index(k)] if k in group else p for k, p in enumerate(layout))
            if new != layout and group_last(new, group) and fits(shape, degrees, new):
                out.append((("x", group, new), new))
    return out


def brute_force(shape, degrees, src: tuple, dst: tuple, depth: int, bound: int) -> tuple[int, int]:
    """The least cost over every sequence of at most ``depth`` moves from ``src`` to ``dst`` that visits no
    layout twice, and how many reached ``dst``; sequences already dearer than ``bound`` (the greedy
    order's cost, an upper bound) are cut."""
    best, counted, memo = bound, 0, {}

    def walk(layout: tuple, seen: set, spent: int) -> None:
        nonlocal best, counted
        if layout == dst:
            counted, best = counted + 1, min(best, spent)
            return
        if len(seen) > depth:
            return
        if layout not in memo:
            memo[layout] = [(m, new, move_cost(shape, degrees, layout, m)) for m, new in
                            moves_from(shape, degrees, layout)]
        for _, new, c in memo[layout]:
            if new not in seen and spent + c <= best:
                walk(new, seen | {new}, spent + c)

    walk(tuple(src), {tuple(src)}, 0)
    return best, counted


def greedy_cost(shape, degrees, src, dst) -> int:
    layout, total = tuple(src), 0
    for s in greedy(src, dst):
        total += move_cost(shape, degrees, layout, ("step", s.axis, s.src, s.dst))
        layout = layout[:s.axis] + (s.dst,) + layout[s.axis + 1:]
    return total


def check_brute_force(case: str, which: Sequence[int]) -> tuple[int, int]:
    """The planner's cost equals brute force for the pairs ``which``; how many pairs, how many cheaper than greedy."""
    kw, axes, shape = CASES[case]
    degrees, every, cheaper = tuple(kw[a] for a in axes), pairs(len(axes)), 0
    for i in which:
        src, dst = every[i]
        old = greedy_cost(shape, degrees, src, dst)
        want, counted = brute_force(shape, degrees, src, dst, DEPTH[case], old)
        moves, got = cheapest(shape, 8, degrees, src, dst)
        assert counted and got == want, (src, dst, moves)
        cheaper += got < old
    return len(which), cheaper


SWAP = ((Shard(0), Shard(1)), (Shard(1), Shard(0)))


def test_planner_equals_brute_force_on_2x2() -> None:
    assert check_brute_force("2x2", range(256)) == (256, 75)  # 75 pairs cheaper than the greedy order


@budget(3)
@given(which=st.lists(st.integers(0, 64 ** 2 - 1), min_size=1, max_size=40, unique=True))
@example(which=[pairs(3).index(((Shard(0), Shard(0), Shard(1)), (Shard(0), Shard(1), Shard(0))))])
def test_planner_equals_brute_force_on_2x2x2(which: list[int]) -> None:
    check_brute_force("2x2x2", which)


def test_planner_equals_brute_force_on_2x2_with_uneven_shards() -> None:
    assert check_brute_force("2x2 uneven", range(256))[0] == 256


@budget(3)
@given(which=st.lists(st.integers(0, 64 ** 2 - 1), min_size=1, max_size=40, unique=True))
def test_planner_equals_brute_force_on_2x2x2_with_uneven_shards(which: list[int]) -> None:
    check_brute_force("2x2x2 uneven", which)


def run_moves(comm, case: str, which: Sequence[int], shape: tuple, seed: int) -> list[dict]:
    kw, axes, _ = CASES[case]
    mesh = DeviceMesh(comm, **kw)
    x, every = original(shape, seed), pairs(len(axes))
    degrees, coords = [mesh.degree(a) for a in axes], [mesh.coords[a] for a in axes]
    out = []
    for i in which:
        a, b = every[i]
        t = GlobalTensor(piece_of(x, degrees, coords, a, seed), shape, mesh, axes, a)
        with trace.recording(comm.world_rank) as rec:
            u = redistribute(t, b)
        sent = sum(e.nbytes for e in rec.events if e.kind == "comm" and e.src == mesh.rank)
        out.append({"dst": u.local, "sent": sent, "coords": tuple(coords)})
    return out


def check_run(results: list[list[dict]], case: str, which: Sequence[int], shape: tuple, seed: int) -> None:
    kw, axes, _ = CASES[case]
    degrees, every = tuple(kw[a] for a in axes), pairs(len(axes))
    grid = list(itertools.product(*[range(d) for d in degrees]))
    for j, i in enumerate(which):
        a, b = every[i]
        rows = [res[j] for res in results]
        predicted = plan_bytes(shape, 8, degrees, a, cheapest(shape, 8, degrees, a, b)[0])
        assert [r["sent"] for r in rows] == [predicted[grid.index(r["coords"])] for r in rows], (a, b)
        full = assemble([r["dst"] for r in rows], shape, b, axes, MeshShape(**kw))
        assert np.array_equal(full, original(shape, seed)), (a, b)


def valid(case: str) -> list[int]:
    kw, axes, shape = CASES[case]
    degrees = tuple(kw[a] for a in axes)
    return [i for i, (a, b) in enumerate(pairs(len(axes))) if fits(shape, degrees, a) and fits(shape, degrees, b)]


@pytest.mark.parametrize("case", ["2x2", "tp2xdp2"])  # the tensor's axes in the mesh's order and reversed
def test_every_pair_runs_as_planned_on_2x2_threads(case: str) -> None:
    which = valid(case)
    check_run(launch(run_moves, 4, "threads", case, which, (4, 8), 3), case, which, (4, 8), 3)


@budget(3)
@given(which=st.lists(st.sampled_from(valid("2x2x2")), min_size=1, max_size=25, unique=True),
       seed=st.integers(0, 10 ** 6))
@example(which=[pairs(3).index(((Shard(0), Shard(0), Shard(1)), (Shard(0), Shard(1), Shard(0))))], seed=1)
def test_drawn_pairs_run_as_planned_on_2x2x2_threads(which: list[int], seed: int) -> None:
    check_run(launch(run_moves, 8, "threads", "2x2x2", which, (8, 8), seed), "2x2x2", which, (8, 8), seed)


def swap(comm, plan: str) -> tuple[int, bool]:
    mesh = DeviceMesh(comm, dp=2, tp=2)
    x = original((8, 12), 0)  # N = 768 bytes
    t = GlobalTensor.from_global(x, mesh, ("dp", "tp"), SWAP[0])
    with trace.recording(comm.world_rank) as rec:
        u = redistribute(t, SWAP[1], plan=plan)
    sent = sum(e.nbytes for e in rec.events if e.kind == "comm" and e.src == mesh.rank)
    return sent, bool(np.array_equal(u.local, x[4 * mesh.coords["tp"]:4 * mesh.coords["tp"] + 4,
                                                 6 * mesh.coords["dp"]:6 * mesh.coords["dp"] + 6]))


def test_swapping_two_shards_is_one_exchange_384_to_192_bytes() -> None:
    """The issue's case: the greedy order gathers on tp (N/4) then exchanges on dp (N/4); one exchange
    sends each tile to the transposed coordinates: 192 B off the diagonal, nothing on it."""
    assert launch(swap, 4, "threads", "greedy") == [(384, True)] * 4
    assert launch(swap, 4, "threads", "cheapest") == [(0, True), (192, True), (192, True), (0, True)]
    moves, cost = cheapest((8, 12), 8, (2, 2), *SWAP)
    assert moves == (Exchange((0, 1), SWAP[0], SWAP[1]),) and cost == 192  # type: ignore[arg-type]


def refuse(comm) -> tuple[str, int]:
    t = GlobalTensor.from_global(np.ones(4), DeviceMesh(comm, tp=2), ("tp",), [Replicate()])
    with trace.recording(comm.world_rank) as rec, pytest.raises(ValueError) as err:
        redistribute(t, [Shard(0)], plan="best")
    return str(err.value), sum(e.kind == "comm" for e in rec.events)


def test_an_unknown_plan_is_refused_on_every_rank() -> None:
    msg = "redistribute: plan='best'; choose one of ('cheapest', 'greedy')"
    assert launch(refuse, 2, "threads") == [(msg, 0)] * 2


@pytest.mark.mpi
def test_every_pair_runs_as_planned_on_2x2_mpiexec() -> None:
    which = valid("2x2")
    (results,) = run_each(run_moves, 4, [{"case": "2x2", "which": which, "shape": (4, 8), "seed": 5}], timeout=240,
                          comm_timeout=60)
    check_run(results, "2x2", which, (4, 8), 5)
