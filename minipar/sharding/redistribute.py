"""Redistribution: from one list of placements to another, one or two mesh axes at a time.

A single-axis step changes the placement on one axis and runs (at most) one collective on that
axis's communicator (``mesh[axis]``, whose rank ``i`` is the mesh coordinate ``i``), on this rank's
piece (``minipar.cost.sharding.TABLE``):

- ``P -> B``: all-reduce (ring). ``P -> S(j)``: reduce-scatter of dimension ``j``.
- ``S(i) -> B``: all-gather along ``i``. ``S(i) -> S(j)``: all-to-all (split ``j``, gather ``i``).
- ``B -> S(j)``: keep the local slice ``j`` (no message). ``B -> P``: coordinate 0 keeps its values,
  the others zero theirs (no message).
- ``S(i) -> P``: two steps, all-gather to ``B`` then zero. (OneFlow pads its slice with zeros to the
  full size instead: no message, the same memory; here the all-gather keeps every step one of the
  table's collectives.) ``P -> P``, ``B -> B``, ``S(i) -> S(i)``: nothing.

Uneven cuts (``tensor.py``: ``ceil(n/p)`` rows a piece, the last shorter or empty) need no padding: the
ring all-gather passes pieces of any length; a reduce-scatter or all-to-all to unequal blocks runs as
one pairwise exchange over the axis (``_pairwise``), each rank sending every other member the part of
its piece that member keeps, the bytes of the collective (``cost.sharding.step_bytes``'s ``sizes``).

Order of the steps (``greedy``). With the tile order of ``tensor.py`` (an earlier axis cuts larger
blocks), a step on axis ``k`` is a plain collective only when ``k`` is the last axis sharding the
dimension it gathers, and the last axis sharding the dimension it splits once it has. For each
dimension ``d`` the axes that shard it in both layouts as a common prefix (in axis order) are kept;
then

1. from the last axis to the first, every axis sharding a dimension outside that kept prefix is
   un-sharded: by one all-to-all straight to its target ``S(j)`` when ``j`` is then sharded by its
   kept prefix alone and this axis is the first new one of ``j``'s target list, else by an all-gather
   to ``B``;
2. from the first axis to the last, every axis still off its target moves there from ``B`` or ``P``
   (slice, zeroing, all-reduce or reduce-scatter), appending new shards after the kept ones.

Every step's legality is checked as it runs (a planner mistake raises ``AssertionError``). This plan
(``redistribute(..., plan="greedy")``) is simple, not the cheapest: it may gather a shard that a
cleverer order would keep, and reduces partial sums after the gathers. ``redistribute`` runs by
default (``plan="cheapest"``) the plan of least bytes of ``minipar.sharding.plan``, which searches
over these steps and two-axis exchanges: ``[S(0), S(1)] -> [S(1), S(0)]`` on 2 x 2 sends ``N/4`` per
rank (off the diagonal) in one exchange where this plan sends ``N/2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minipar.cost.sharding import shard_bounds
from minipar.sharding import agree
from minipar.sharding.placement import Placement, Replicate, Shard, describe
from minipar.sharding.plan import Move, Step, after_move, cheapest, legal, sharding_axes
from minipar.sharding.tensor import GlobalTensor, check_layout, local_slices

PLANS = ("cheapest", "greedy")


def greedy(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Step]:
    """The single-axis steps from ``src`` to ``dst`` (module docstring); validity of the placements
    themselves is ``check_layout``'s job."""
    cur, dst = list(src), list(dst)
    dims = {p.dim for p in [*cur, *dst] if isinstance(p, Shard)}
    keep: dict[int, list[int]] = {}
    for d in dims:
        a, b = sharding_axes(d, cur), sharding_axes(d, dst)
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        keep[d] = a[:i]
    steps = []
    for k in reversed(range(len(cur))):
        p, t = cur[k], dst[k]
        if not isinstance(p, Shard) or k in keep[p.dim]:
            continue
        new: Placement = Replicate()
        if isinstance(t, Shard) and t.dim != p.dim and sharding_axes(t.dim, cur) == keep[t.dim]:
            first_new = [m for m in sharding_axes(t.dim, dst) if m not in keep[t.dim]][0]
            new = t if first_new == k else new
        steps.append(Step(k, p, new))
        cur[k] = new
    for k in range(len(cur)):
        if cur[k] != dst[k]:
            steps.append(Step(k, cur[k], dst[k]))
            cur[k] = dst[k]
    return steps


def plan_text(src: Sequence[Placement], dst: Sequence[Placement], name: str) -> list[str]:
    """``greedy(src, dst)`` for the tensor called ``name``, in words: one entry per step that does anything,
    its collective (``minipar.cost.sharding.collective``'s name, dashed) and the name: "reduce-scatter A"."""
    return [f"{s.collective.replace('_', '-')} {name}" for s in greedy(src, dst) if s.collective != "none"]


def _members(t: GlobalTensor, placements: Sequence[Placement], axis: int) -> list[tuple[slice, ...]]:
    """The pieces of the ranks that differ from this one only on ``axis`` (by coordinate there)."""
    return [local_slices(t.shape, t.degrees, [*t.coords[:axis], m, *t.coords[axis + 1:]], placements)
            for m in range(t.degrees[axis])]


def _even(local: np.ndarray, step: Step, cur: Sequence[Placement], t: GlobalTensor) -> bool:
    """Whether the axis's collective sees equal blocks: the split dimension divides, and (all-to-all)
    every member's piece has this one's shape."""
    p, dst = t.degrees[step.axis], step.dst
    assert isinstance(dst, Shard)
    if local.shape[dst.dim] % p:
        return False
    shapes = {tuple(s.stop - s.start for s in piece) for piece in _members(t, cur, step.axis)}
    return step.collective != "all_to_all" or len(shapes) == 1


def _apply(local: np.ndarray, step: Step, cur: Sequence[Placement], t: GlobalTensor) -> np.ndarray:
    """One single-axis step on this rank's piece, from the layout ``cur``. Uneven blocks: an all-gather
    of unequal pieces is the ring's (shapes travel in headers); a reduce-scatter or all-to-all to
    unequal blocks is a pairwise exchange over the axis (``_pairwise``: the same bytes per rank as the
    ring and the pairwise collective, every part but the rank's own)."""
    comm = t.mesh[t.axes[step.axis]]
    p, c = comm.size, comm.rank
    src, dst, how = step.src, step.dst, step.collective
    if how == "none":
        return local
    if how == "allreduce":
        return comm.allreduce(local, op="sum")
    if how in ("reduce_scatter", "all_to_all") and not _even(local, step, cur, t):
        return _pairwise(local, (step.axis,), cur, after_move(cur, step), t, how)
    if how == "reduce_scatter":
        assert isinstance(dst, Shard)
        out = comm.reduce_scatter(np.moveaxis(local, dst.dim, 0), op="sum")
        return np.moveaxis(out, 0, dst.dim)
    if how == "allgather":
        assert isinstance(src, Shard)
        out = comm.allgather(np.moveaxis(local, src.dim, 0))
        return np.moveaxis(out, 0, src.dim)
    if how == "all_to_all":
        assert isinstance(src, Shard) and isinstance(dst, Shard)
        got = comm.all_to_all(np.stack(np.split(local, p, axis=dst.dim)))  # block j goes to coordinate j
        return np.concatenate(list(got), axis=src.dim)  # blocks by source coordinate
    if how == "slice":
        assert isinstance(dst, Shard)
        index = [slice(None)] * local.ndim
        index[dst.dim] = slice(*shard_bounds(local.shape[dst.dim], p, c))
        return local[tuple(index)].copy()
    if how == "zero":
        return local if c == 0 else np.zeros_like(local)
    raise AssertionError(f"no single step {src} -> {dst} ({how})")


def _pairwise(local: np.ndarray, group: Sequence[int], cur: Sequence[Placement], new: Sequence[Placement],
              t: GlobalTensor, op: str) -> np.ndarray:
    """A pairwise exchange over the flattened group of the axes ``group`` (member ``g`` at the
    coordinates ``np.unravel_index(g, degrees)`` there): in step ``k`` this rank sends member ``g + k``
    the part of its piece (layout ``cur``) that member's new piece (layout ``new``) holds, and receives
    from ``g - k``; empty parts are not sent. ``op="reduce_scatter"`` (from a partial sum) adds what it
    receives to its own part; ``"all_to_all"`` (a two-axis exchange, or an uneven split) places it."""
    names, degrees = [t.axes[a] for a in group], [t.degrees[a] for a in group]
    q = int(np.prod(degrees))
    me = int(np.ravel_multi_index([t.coords[a] for a in group], degrees))

    def member(g: int) -> dict[str, int]:
        return dict(t.mesh.coords, **dict(zip(names, (int(i) for i in np.unravel_index(g, degrees)), strict=True)))

    def piece(g: int, placements: Sequence[Placement]) -> tuple[slice, ...]:
        coords = member(g)
        return local_slices(t.shape, t.degrees, [coords[x] for x in t.axes], placements)

    def part(have: tuple[slice, ...], want: tuple[slice, ...], origin: tuple[slice, ...]) -> tuple[slice, ...] | None:
        lo = [max(h.start, w.start) for h, w in zip(have, want, strict=True)]
        hi = [min(h.stop, w.stop) for h, w in zip(have, want, strict=True)]
        if any(x >= y for x, y in zip(lo, hi, strict=True)):
            return None  # 0-d pieces have no dimension: the whole (empty) tuple
        return tuple(slice(x - o.start, y - o.start) for x, y, o in zip(lo, hi, origin, strict=True))

    mine, target = piece(me, cur), piece(me, new)
    out = np.zeros(tuple(s.stop - s.start for s in target), dtype=local.dtype)
    own = part(mine, target, target)
    if own is not None:
        out[own] = local[part(mine, target, mine)]
    world = t.mesh.comm
    for k in range(1, q):
        to, frm = (me + k) % q, (me - k) % q
        send, recv = part(mine, piece(to, new), mine), part(piece(frm, cur), target, target)
        rreq = None if recv is None else world.irecv(t.mesh.shape.rank_of(**member(frm)), op=op,
                                                      algorithm="pairwise")
        sreq = None if send is None else world.isend(np.ascontiguousarray(local[send]),
                                                      t.mesh.shape.rank_of(**member(to)), op=op,
                                                      algorithm="pairwise")
        if rreq is not None:
            assert recv is not None
            got = rreq.wait()
            out[recv] = out[recv] + got if op == "reduce_scatter" else got
        if sreq is not None:
            sreq.wait()
    return out


def redistribute(t: GlobalTensor, placements: Sequence[Placement], plan: str = "cheapest") -> GlobalTensor:
    """The same global tensor over the same axes with ``placements`` (one per axis), by the moves of
    ``minipar.sharding.plan.cheapest`` (``plan="cheapest"``) or this module's fixed order
    (``plan="greedy"``). A list that does not match the axes raises ``ValueError`` on every rank before
    any message; a dimension its axes do not divide is cut unevenly (``tensor.py``). Where no step
    changes the piece (nothing to do, ``B -> P`` at coordinate 0) the result shares the input's array,
    as DTensor returns the tensor itself: copy before writing into it."""
    placements = tuple(placements)
    if plan not in PLANS:
        raise ValueError(f"redistribute: plan={plan!r}; choose one of {PLANS}")
    check_layout(t.shape, t.axes, placements)
    agree.op("redistribute", [t], f"to {describe(placements)}, plan {plan}")  # debug mode only
    local, cur = t.local, t.placements
    moves: Sequence[Move] = (greedy(cur, placements) if plan == "greedy" else
                             cheapest(t.shape, local.dtype.itemsize, t.degrees, cur, placements)[0])
    for move in moves:
        if isinstance(move, Step):
            assert legal(move, cur), (move, cur)
            local = _apply(local, move, cur, t)
        else:
            local = _pairwise(local, move.axes, cur, after_move(cur, move), t, "all_to_all")
        cur = after_move(cur, move)
    out = np.require(local, requirements="C")  # 0-d stays 0-d
    return GlobalTensor(out, t.shape, t.mesh, t.axes, placements, check=False)  # t checked, the move ran everywhere


def to_global(t: GlobalTensor) -> np.ndarray:
    """The whole tensor on every rank, by redistributing to ``Replicate()`` on every axis (traced
    collectives; for tests and examples): ``GlobalTensor.to_global``."""
    return redistribute(t, [Replicate()] * len(t.axes)).local
