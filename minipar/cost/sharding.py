"""Global tensors (``minipar.sharding``): which collective each single-axis redistribution needs, and
the bytes one rank sends for it.

OneFlow's SBP (Yuan et al. 2021) and GSPMD (Xu et al. 2021): a placement on one mesh axis of degree
``p`` is ``S(i)`` (split dimension ``i``), ``B`` (broadcast: replicated) or ``P`` (partial sum). One step
changes one axis; ``n`` = the bytes of this rank's piece BEFORE the step, ``c`` its coordinate on the
axis (its rank in the axis's communicator). Rows: from, columns: to.

    from \\ to  S(j)                 B                  P
    S(i)        all-to-all (i != j)  all-gather         all-gather, then zero
    B           slice (0 bytes)      -                  zero (0 bytes)
    P           reduce-scatter       all-reduce         -

Uneven shards, as PyTorch DTensor cuts them (``Shard._local_shard_size_and_offset``,
``compute_local_shape_and_global_offset``): ``n`` rows over ``p`` ranks are cut into pieces of
``ceil(n/p)`` rows, coordinate ``c`` holding rows ``[min(n, c ceil(n/p)), min(n, (c+1) ceil(n/p)))``:
the last pieces are shorter and may be empty (5 rows on 3 ranks: 2, 2, 1; 4 rows on 3 ranks: 2, 2,
0). Several axes sharding one dimension cut it in axis order, each cutting the piece the axes
before it left (``shard_bounds``, ``piece_bounds``). No padding travels: each message carries real
elements only.

Bytes one rank sends, from ``minipar.cost.collectives`` (ring algorithms, pairwise all-to-all), with
``sizes`` the element counts the step moves between the ``p`` members of the axis (``step_sizes``):

- all-reduce: ``allreduce_bytes(numel, itemsize, p, c, "ring")``, ``2(p-1)/p n`` when ``p`` divides the
  piece's element count (every chunk but its own in the reduce-scatter half, every chunk but its
  successor's in the all-gather half).
- reduce-scatter of the piece along ``j`` (``sizes[m]``: the part of this piece that member ``m`` keeps):
  every part but its own, ``(sum(sizes) - sizes[c]) itemsize``, the ring's count (it sends every chunk
  but chunk ``c``) and the pairwise exchange's alike; ``(p-1)/p n`` when ``p`` divides the dimension.
- all-gather (``sizes[m]``: member ``m``'s piece): the ring passes on every piece but its successor's,
  ``(sum(sizes) - sizes[(c+1) % p]) itemsize``; ``(p-1) n = ring_bytes("allgather", p n, p)`` for
  equal pieces.
- all-to-all (pairwise exchange; ``sizes[m]``: the part of this piece that member ``m``'s new piece
  holds): every part but its own, ``(sum(sizes) - sizes[c]) itemsize``; ``(p-1)/p n`` when even.
- slice, zeroing, identity: no message.

A multi-axis redistribution is the sum over its steps (``minipar.sharding.plan.cheapest``, or
``minipar.sharding.redistribute.greedy``), each step's ``n`` being the piece's size at that point:
``prod(shape) / prod(degrees of the axes then sharding)`` elements when every cut is even, else the
product of the piece's lengths (``piece_bounds``; ``redistribute_bytes``).

Two-axis exchange (``minipar.sharding.plan.Exchange``): axes ``a`` and ``b`` both sharded before and
after, the ``pa pb`` ranks of their flattened group holding the same block between them before and
after. Each element of a rank's piece lies in exactly one member's new piece; the pairwise exchange
sends every element whose new owner is another member, so a rank holding ``numel`` elements of which
``kept`` lie in its own new piece sends ``(numel - kept) itemsize`` (``exchange_bytes``):
``(q-1)/q n`` for ``[S(i), S(i)] -> [S(j), S(j)]`` (``q = pa pb``, ``kept = numel / q``), ``n`` or 0 for
``[S(0), S(1)] -> [S(1), S(0)]`` (a tile goes whole to the transposed coordinates; the diagonal keeps it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from minipar.checks import counts, index, whole, wholes
from minipar.cost.collectives import allreduce_bytes, ring_bytes

TABLE = {
    ("S", "S"): "all_to_all", ("S", "B"): "allgather", ("S", "P"): "allgather+zero",
    ("B", "S"): "slice", ("B", "B"): "none", ("B", "P"): "zero",
    ("P", "S"): "reduce_scatter", ("P", "B"): "allreduce", ("P", "P"): "none",
}


def collective(src: str, dst: str) -> str:
    """The collective of one step between placements written ``"S(0)"``, ``"B"``, ``"P"`` (``TABLE``;
    ``"none"`` for the same placement)."""
    for name, placement in (("src", src), ("dst", dst)):
        if not isinstance(placement, str) or not re.fullmatch(r"B|P|S\(-?\d+\)", placement):
            raise ValueError(f"collective: {name}={placement!r} is not a placement; write 'S(0)', 'S(1)', ..., "
                             "'B' or 'P'")
    if src == dst:
        return "none"
    return TABLE[(src[0], dst[0])]


def shard_bounds(n: int, p: int, c: int) -> tuple[int, int]:
    """``(start, stop)`` of coordinate ``c``'s piece of ``n`` rows cut over ``p`` ranks: ``ceil(n/p)`` rows
    each, the last pieces shorter or empty (DTensor's rule, module docstring)."""
    wholes("shard_bounds", least=0, n=n)
    whole("shard_bounds", "p", p)
    index("shard_bounds", "c", c, p, "coordinates on the axis")
    size = -(-n // p)
    return min(n, c * size), min(n, (c + 1) * size)


def piece_bounds(shape: Sequence[int], degrees: Sequence[int], coords: Sequence[int],
                 placements: Sequence[str]) -> list[tuple[int, int]]:
    """``(start, stop)`` per dimension of the piece at ``coords`` (one per axis, of ``degrees``) for
    ``placements`` written ``"S(0)"``, ``"B"``, ``"P"``: each axis sharding dimension ``d`` cuts, in axis
    order, the rows the axes before it left (``shard_bounds``)."""
    out = []
    for d, n in enumerate(shape):
        lo, hi = 0, int(n)
        for deg, c, pl in zip(degrees, coords, placements, strict=True):
            if pl == f"S({d})":
                a, b = shard_bounds(hi - lo, deg, c)
                lo, hi = lo + a, lo + b
        out.append((lo, hi))
    return out


def _numel(bounds: Sequence[tuple[int, int]]) -> int:
    return int(np.prod([b - a for a, b in bounds]))


def overlap(one: Sequence[tuple[int, int]], other: Sequence[tuple[int, int]]) -> int:
    """The elements two pieces (``piece_bounds``) have in common."""
    return int(np.prod([max(0, min(b, y) - max(a, x)) for (a, b), (x, y) in zip(one, other, strict=True)]))


def step_sizes(shape: Sequence[int], degrees: Sequence[int], coords: Sequence[int], cur: Sequence[str],
               axis: int, dst: str) -> tuple[int, list[int] | None]:
    """For the step of ``axis`` from ``cur[axis]`` to ``dst``: the elements of this rank's piece before it,
    and the ``sizes`` ``step_bytes`` reads (module docstring; None for a step that sends nothing or
    an all-reduce): every member's piece for an all-gather, the parts of this piece by the member that
    keeps them for a reduce-scatter or an all-to-all."""
    how = collective(cur[axis], dst)
    mine = piece_bounds(shape, degrees, coords, cur)

    def member(m: int, placements: Sequence[str]) -> list[tuple[int, int]]:
        return piece_bounds(shape, degrees, [*coords[:axis], m, *coords[axis + 1:]], placements)

    sizes = None
    if how in ("allgather", "allgather+zero"):
        sizes = [_numel(member(m, cur)) for m in range(degrees[axis])]
    elif how in ("reduce_scatter", "all_to_all"):
        new = [*cur[:axis], dst, *cur[axis + 1:]]
        sizes = [overlap(mine, member(m, new)) for m in range(degrees[axis])]
    return _numel(mine), sizes


def step_bytes(src: str, dst: str, numel: int, itemsize: int, p: int, coord: int,
               sizes: Sequence[int] | None = None) -> int:
    """Bytes one rank sends in one step on an axis of degree ``p``; ``numel`` = its piece's elements
    before the step, ``coord`` its coordinate on the axis, ``sizes`` the ``p`` element counts the step
    moves (``step_sizes``; None: equal pieces, ``p`` dividing the split dimension) (module docstring)."""
    whole("step_bytes", "numel", numel, least=0)
    wholes("step_bytes", itemsize=itemsize, p=p)
    index("step_bytes", "coord", coord, p, "coordinates on the axis")
    n, how = numel * itemsize, collective(src, dst)
    if p == 1 or how in ("none", "slice", "zero"):
        return 0
    if how == "allreduce":
        return allreduce_bytes(numel, itemsize, p, coord, "ring")
    gather = how in ("allgather", "allgather+zero")
    if sizes is None:
        return int(ring_bytes("allgather", p * n, p)) if gather else (p - 1) * n // p
    sizes = counts("step_bytes", "sizes", sizes)
    if len(sizes) != p or (sizes[coord] if gather else sum(sizes)) != numel:
        want = "this rank's being numel" if gather else "adding up to numel"
        raise ValueError(f"step_bytes: sizes={sizes} must give the {p} members' element counts, {want}={numel}")
    return (sum(sizes) - sizes[(coord + 1) % p if gather else coord]) * itemsize


def exchange_bytes(numel: int, kept: int, itemsize: int) -> int:
    """Bytes one rank sends in a two-axis exchange: its piece of ``numel`` elements but the ``kept``
    ones that lie in its own new piece (module docstring)."""
    wholes("exchange_bytes", least=0, numel=numel, kept=kept)
    whole("exchange_bytes", "itemsize", itemsize)
    if kept > numel:
        raise ValueError(f"exchange_bytes: kept={kept} is more than the piece's numel={numel}")
    return (numel - kept) * itemsize


def redistribute_bytes(shape: Sequence[int], itemsize: int, degrees: Sequence[int], coords: Sequence[int],
                       src: Sequence[str], steps: Sequence[tuple[int, str, str]]) -> list[int]:
    """Bytes one rank sends on each axis (a list by axis index) over ``steps`` ``(axis, from, to)``,
    starting from the placements ``src`` (strings, one per axis)."""
    who = "redistribute_bytes"
    counts(who, "shape", shape)
    whole(who, "itemsize", itemsize)
    if not len(degrees) == len(coords) == len(src):
        raise ValueError(f"{who}: degrees={list(degrees)}, coords={list(coords)} and src={list(src)} must have one "
                         "entry per mesh axis")
    cur, out = list(src), [0] * len(src)
    for k, a, b in steps:
        if cur[index(who, "a step's axis", k, len(src), "mesh axes")] != a:
            raise ValueError(f"{who}: the step {(k, a, b)} starts from {a} but axis {k} is {cur[k]} then "
                             f"(placements {cur})")
        numel, sizes = step_sizes(shape, degrees, coords, cur, k, b)
        out[k] += step_bytes(a, b, numel, itemsize, degrees[k], coords[k], sizes)
        cur[k] = b
    return out
