"""Flat, padded shards: the layout ZeRO and FSDP share (DeepSpeed's contiguous partitions, FSDP's
``FlatParameter``, Zhao et al. 2023, Sec. 3.2.1).

A group of parameters (a ZeRO bucket, an FSDP unit) is flattened in order and concatenated into one
1-D buffer of ``numel`` elements, zero-padded at the end to ``L``, a multiple of N; rank r owns
elements ``[r L/N, (r+1) L/N)``. Gradients and optimizer state use the same layout, so a rank's
shard of each is one contiguous array and one collective moves a whole group::

    params  |---- w0 ----|-- b0 --|------ w1 ------|pad|
    rank    |    0     |    1     |    2     |    3     |     N = 4, L = 4 x L/N

Padding costs at most N - 1 elements per group and makes every all-gather and reduce-scatter one
of N equal blocks. A shard may cut a parameter anywhere, even mid-row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from minipar.nn import Parameter, init_values


@dataclass(frozen=True)
class FlatLayout:
    """Where each of ``names`` (of ``shapes``) sits in a flat buffer padded for ``world`` ranks."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    world: int  # N

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]

    @property
    def offsets(self) -> list[int]:
        return [int(o) for o in np.cumsum([0, *self.sizes])[:-1]]

    @property
    def numel(self) -> int:
        """Elements of the parameters, unpadded."""
        return sum(self.sizes)

    @property
    def padded(self) -> int:
        """L: ``numel`` rounded up to a multiple of N."""
        return -(-self.numel // self.world) * self.world

    @property
    def shard_size(self) -> int:
        return self.padded // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s elements ``[lo, hi)`` of the padded buffer."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> Iterator[tuple[int, int, int]]:
        """The parameters inside rank ``rank``'s shard: ``(index, start, stop)`` of each one's flat
        elements, in order (the padding after the last is not a parameter)."""
        lo, hi = self.shard_range(rank)
        for i, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                yield i, a - offset, b - offset

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Each parameter's shape as a view of the padded (or unpadded) ``flat`` buffer."""
        return [flat[o:o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes, strict=True)]

    def described(self) -> list[list]:
        """``[[name, shape], ...]``: what a checkpoint needs to cut the flat buffer back into parameters."""
        return [[n, list(s)] for n, s in zip(self.names, self.shapes, strict=True)]

    def flatten(self, arrays: Sequence[np.ndarray | None], dtype: np.dtype | type = np.float64) -> np.ndarray:
        """One padded buffer of ``arrays`` in order (None: zeros, a parameter without gradient)."""
        flat = np.zeros(self.padded, dtype=dtype)
        for view, a in zip(self.views(flat), arrays, strict=True):
            if a is not None:
                view[...] = a
        return flat


def layout_of(named: Sequence[tuple[str, Parameter]], world: int) -> FlatLayout:
    """The layout of ``named`` parameters (full names, in order) over ``world`` ranks, in the shapes
    this rank holds them: a tensor-parallel slice (ZeRO over the data-parallel ranks of a mesh) is
    flattened as the slice, a whole parameter (and a deferred one) in its full shape."""
    return FlatLayout(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), world)


def init_shard(layout: FlatLayout, params: Sequence[Parameter], rank: int, seed: int,
               dtype: np.dtype | type = np.float64) -> np.ndarray:
    """Rank ``rank``'s shard of the initial values, generated from ``(seed, name, full shape)``
    alone (``nn.init_values``) straight into the shard: the whole rows of each parameter piece are
    drawn in place, the partial rows at its two ends one row at a time, so no rank ever holds more
    of the model than its shard and two rows."""
    shard = np.zeros(layout.shard_size, dtype=dtype)
    lo = layout.shard_range(rank)[0]
    for i, a, b in layout.pieces(rank):
        shape, name, init = layout.shapes[i], layout.names[i], params[i].init
        full, cut = params[i].full_shape, params[i].shard or tuple(slice(0, n) for n in shape)

        def rows(r0: int, r1: int, full=full, cut=cut) -> tuple[slice, ...]:
            """Rows ``r0:r1`` of the piece this rank holds (a tensor-parallel slice of ``full``, or all)."""
            start = cut[0].indices(full[0])[0]
            return (slice(start + r0, start + r1), *cut[1:])

        at = layout.offsets[i] - lo  # where the parameter's element 0 would sit in the shard
        if len(shape) <= 1:  # a vector: its piece is one slice
            shard[at + a:at + b] = init_values(seed, name, full, init, rows(a, b))
            continue
        row = int(np.prod(shape[1:], dtype=np.int64))
        first, last = -(-a // row), b // row  # the whole rows inside [a, b)
        for r in {a // row, (b - 1) // row} - set(range(first, last)):  # partial rows at the ends
            lo_r, hi_r = max(a, r * row), min(b, (r + 1) * row)
            values = init_values(seed, name, full, init, rows(r, r + 1)).reshape(-1)
            shard[at + lo_r:at + hi_r] = values[lo_r - r * row:hi_r - r * row]
        if first < last:
            whole = shard[at + first * row:at + last * row].reshape(last - first, *shape[1:])
            if whole.dtype == np.float64:  # drawn in place
                init_values(seed, name, full, init, rows(first, last), whole)
            else:
                whole[...] = init_values(seed, name, full, init, rows(first, last))
    return shard
