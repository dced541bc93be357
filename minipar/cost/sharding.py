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

Bytes one rank sends, from ``minipar.cost.collectives`` (ring algorithms, pairwise all-to-all):

- all-reduce: ``allreduce_bytes(numel, itemsize, p, c, "ring")``, ``2(p-1)/p n`` when ``p`` divides the
  piece's element count (every chunk but its own in the reduce-scatter half, every chunk but its
  successor's in the all-gather half).
- reduce-scatter of the piece along ``j``: ``(p-1)/p n`` (``ring_bytes``): the split dimension is
  divisible by ``p`` (uneven splits are refused), so the ``p`` chunks are equal and the rank sends all
  but its own.
- all-gather: the result has ``p n`` bytes; the ring passes on ``p - 1`` pieces of ``n``:
  ``(p-1) n = ring_bytes("allgather", p n, p)``.
- all-to-all (pairwise exchange): the piece is cut into ``p`` blocks of ``n/p`` along ``j``, one kept,
  ``p - 1`` sent: ``(p-1)/p n``.
- slice, zeroing, identity: no message.

A multi-axis redistribution is the sum over its steps (``minipar.sharding.plan.cheapest``, or
``minipar.sharding.redistribute.greedy``), each step's ``n`` being the piece's size at that point:
``prod(shape) / prod(degrees of the axes then sharding)`` elements (``redistribute_bytes``).

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


def step_bytes(src: str, dst: str, numel: int, itemsize: int, p: int, coord: int) -> int:
    """Bytes one rank sends in one step on an axis of degree ``p``; ``numel`` = its piece's elements
    before the step, ``coord`` its coordinate on the axis (module docstring)."""
    whole("step_bytes", "numel", numel, least=0)
    wholes("step_bytes", itemsize=itemsize, p=p)
    index("step_bytes", "coord", coord, p, "coordinates on the axis")
    n, how = numel * itemsize, collective(src, dst)
    if p == 1 or how in ("none", "slice", "zero"):
        return 0
    if how == "allreduce":
        return allreduce_bytes(numel, itemsize, p, coord, "ring")
    if how == "reduce_scatter":
        return int(ring_bytes("reduce_scatter", n, p))
    if how in ("allgather", "allgather+zero"):
        return int(ring_bytes("allgather", p * n, p))
    return (p - 1) * n // p  # all-to-all


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
        parts = int(np.prod([d for d, p in zip(degrees, cur, strict=True) if p.startswith("S")]))
        numel = int(np.prod(shape)) // parts
        out[k] += step_bytes(a, b, numel, itemsize, degrees[k], coords[k])
        cur[k] = b
    return out
