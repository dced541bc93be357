"""The cheapest redistribution: a shortest path over single-axis steps and two-axis exchanges.

A redistribution from the placements ``src`` to ``dst`` (one per axis of the tensor) is a sequence
of moves, each changing the layout on one axis or two, from one layout to the next (any layout is
valid: a cut that does not divide is uneven, ``tensor.py``):

- a ``Step`` on axis ``k``: one collective of ``minipar.cost.sharding.TABLE`` on that axis (all-reduce,
  reduce-scatter, all-gather, all-to-all) or a local slice or zeroing. It is a plain collective only
  with the tile order of ``tensor.py`` respected (``legal``): a shard is gathered or exchanged only by
  the last axis sharding its dimension, and a new shard is cut only by an axis after every axis then
  sharding that dimension. ``S(i) -> P`` (a gather and a zeroing) takes two steps, through ``B``.
- an ``Exchange`` over axes ``a < b``, both sharded before and after (any dimensions), every other
  axis unchanged, and for every dimension the two axes after every other axis sharding it (so the
  ``pa pb`` ranks of the flattened group hold, before and after, the same block between them): one
  pairwise exchange over the group, each rank sending each other member the part of its piece that
  member's new piece holds (``cost.sharding.exchange_bytes``). ``[S(0), S(1)] -> [S(1), S(0)]`` on
  2 x 2 is one: a rank's tile goes whole to the rank with the transposed coordinates.

``cheapest`` returns the moves of least cost, the cost of a plan being the sum over its moves of the
bytes the busiest rank sends in that move (moves run one after another; a collective ends with its
slowest rank), by Dijkstra's algorithm over layouts (at most ``(ndim + 2) ** axes`` of them); ties go
to fewer moves, then to the first found, in a fixed order, so every rank finds the same plan.
``redistribute.greedy`` (the fixed order of earlier versions, ``plan="greedy"``) is one of the paths
searched, so the cheapest never costs more by this measure.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from minipar.cost.sharding import collective, exchange_bytes, overlap, piece_bounds, step_bytes, step_sizes
from minipar.sharding.placement import Partial, Placement, Replicate, Shard

RUNNABLE = ("all_to_all", "allgather", "reduce_scatter", "allreduce", "slice", "zero")


@dataclass(frozen=True)
class Step:
    """Axis ``axis`` (an index into the tensor's ``axes``) goes from ``src`` to ``dst``."""

    axis: int
    src: Placement
    dst: Placement

    @property
    def collective(self) -> str:
        return collective(str(self.src), str(self.dst))


@dataclass(frozen=True)
class Exchange:
    """Axes ``axes`` (two indices into the tensor's axes, in order) go from the shards ``src`` to the
    shards ``dst`` by one pairwise exchange over their flattened group (module docstring)."""

    axes: tuple[int, int]
    src: tuple[Shard, Shard]
    dst: tuple[Shard, Shard]
    collective = "all_to_all"


Move = Step | Exchange


def sharding_axes(dim: int, placements: Sequence[Placement]) -> list[int]:
    """The axes sharding dimension ``dim``, in order."""
    return [k for k, p in enumerate(placements) if p == Shard(dim)]


def legal(step: Step, cur: Sequence[Placement]) -> bool:
    """Whether ``step`` is one plain collective (or local slice or zeroing) from the layout ``cur``."""
    k, src, dst = step.axis, step.src, step.dst
    if cur[k] != src or step.collective not in RUNNABLE:
        return False
    if isinstance(src, Shard) and sharding_axes(src.dim, cur)[-1] != k:
        return False
    return not (isinstance(dst, Shard) and any(m >= k for m in sharding_axes(dst.dim, cur)))


def after(placements: Sequence[Placement], group: Sequence[int]) -> bool:
    """Whether, for every dimension, the axes of ``group`` come after every other axis sharding it."""
    dims = {p.dim for p in placements if isinstance(p, Shard)}
    for d in dims:
        on = sharding_axes(d, placements)
        if any(m not in group and any(g < m for g in group if g in on) for m in on):
            return False
    return True


@functools.lru_cache(maxsize=65536)
def _moves(ndim: int, cur: tuple[Placement, ...]) -> list[tuple[Move, tuple[Placement, ...]]]:
    """Every move from the layout ``cur``, in a fixed order: steps by axis, then exchanges."""
    shards = [Shard(d) for d in range(ndim)]
    alphabet = [*shards, Replicate(), Partial()]
    out: list[tuple[Move, tuple[Placement, ...]]] = []
    for k, new in itertools.product(range(len(cur)), alphabet):
        nxt = cur[:k] + (new,) + cur[k + 1:]
        if new != cur[k] and legal(Step(k, cur[k], new), cur):
            out.append((Step(k, cur[k], new), nxt))
    for a, b in itertools.combinations(range(len(cur)), 2):
        src = (cur[a], cur[b])
        if not all(isinstance(p, Shard) for p in src) or not after(cur, (a, b)):
            continue
        for pair in itertools.product(shards, repeat=2):
            nxt = tuple(pair[(a, b).index(k)] if k in (a, b) else p for k, p in enumerate(cur))
            if pair != src and after(nxt, (a, b)):
                out.append((Exchange((a, b), src, pair), nxt))  # type: ignore[arg-type]
    return out


def after_move(cur: Sequence[Placement], move: Move) -> tuple[Placement, ...]:
    """The layout ``cur`` after ``move``."""
    out = list(cur)
    if isinstance(move, Step):
        out[move.axis] = move.dst
    else:
        out[move.axes[0]], out[move.axes[1]] = move.dst
    return tuple(out)


def move_bytes(shape: Sequence[int], itemsize: int, degrees: Sequence[int], coords: Sequence[int],
               cur: Sequence[Placement], move: Move) -> int:
    """Bytes the rank at ``coords`` sends in ``move`` from the layout ``cur`` (``cost.sharding``)."""
    names = [str(p) for p in cur]
    if isinstance(move, Step):
        numel, sizes = step_sizes(shape, degrees, coords, names, move.axis, str(move.dst))
        return step_bytes(names[move.axis], str(move.dst), numel, itemsize, degrees[move.axis], coords[move.axis],
                          sizes)
    mine = piece_bounds(shape, degrees, coords, names)
    new = piece_bounds(shape, degrees, coords, [str(p) for p in after_move(cur, move)])
    return exchange_bytes(overlap(mine, mine), overlap(mine, new), itemsize)


def plan_bytes(shape: Sequence[int], itemsize: int, degrees: Sequence[int], src: Sequence[Placement],
               moves: Sequence[Move]) -> tuple[int, ...]:
    """The bytes each rank sends over ``moves`` from ``src``, one entry per combination of coordinates
    (``itertools.product`` order)."""
    out = []
    for coords in itertools.product(*[range(d) for d in degrees]):
        cur, total = tuple(src), 0
        for m in moves:
            total += move_bytes(shape, itemsize, degrees, coords, cur, m)
            cur = after_move(cur, m)
        out.append(total)
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _busiest(shape: tuple[int, ...], itemsize: int, degrees: tuple[int, ...], cur: tuple[Placement, ...],
             move: Move) -> int:
    return max(move_bytes(shape, itemsize, degrees, coords, cur, move)
               for coords in itertools.product(*[range(d) for d in degrees]))


@functools.lru_cache(maxsize=4096)
def cheapest(shape: tuple[int, ...], itemsize: int, degrees: tuple[int, ...], src: tuple[Placement, ...],
             dst: tuple[Placement, ...]) -> tuple[tuple[Move, ...], int]:
    """The moves of least cost from ``src`` to ``dst`` (valid layouts of ``shape`` on axes of ``degrees``)
    and that cost: the sum over the moves of the busiest rank's bytes (module docstring)."""
    best = {src: (0, 0)}
    back: dict[tuple[Placement, ...], tuple[tuple[Placement, ...], Move]] = {}
    heap, order = [(0, 0, 0, src)], itertools.count(1)
    while heap:
        cost, n, _, cur = heapq.heappop(heap)
        if cur == dst:
            moves: list[Move] = []
            while cur != src:
                cur, m = back[cur]
                moves.append(m)
            return tuple(reversed(moves)), cost
        if (cost, n) > best[cur]:
            continue
        for move, nxt in _moves(len(shape), cur):
            here = (cost + _busiest(shape, itemsize, degrees, cur, move), n + 1)
            if here < best.get(nxt, (float("inf"), 0)):
                best[nxt], back[nxt] = here, (cur, move)
                heapq.heappush(heap, (*here, next(order), nxt))
    raise AssertionError(f"no path from {src} to {dst}")  # B everywhere is always reachable and leads anywhere
