"""Sharding propagation: the rules of a matmul and of elementwise ops, and the cheapest-strategy chooser
every op of ``minipar.sharding.ops`` uses.

OneFlow's SBP signatures of a matmul (Yuan et al. 2021, "OneFlow: Redesign the Distributed Deep
Learning Framework from Scratch"; the seed document's 4x5 by 5x8 example): on ONE mesh axis,
with ``A`` of shape ``(m, k)`` and ``B`` of shape ``(k, n)``, the placements under which each rank's
local ``A_piece @ B_piece`` is its piece of ``C`` with no message are (``matmul_rules``, in this order)::

    A      B      C
    S(0)   B      S(0)    rows of A: rows of C
    B      S(1)   S(1)    columns of B: columns of C
    S(1)   S(0)   P       the contraction dimension split: the products sum to C
    P      B      P       A = sum of pieces: so is C
    B      P      P       B = sum of pieces: so is C
    B      B      B       every rank computes all of C

with, for ``(..., m, k) @ (k, n)`` or batched operands of equal rank, a rule per batch dimension
first (split alone in A, or alike in both). Any other pair is made legal by redistributing one or
both inputs to a rule's pair first (``minipar.sharding.redistribute``); its cost is the bytes of
those redistributions (``minipar.sharding.plan.plan_bytes`` over the cheapest plan's moves).
``matmul_strategies`` lists every legal strategy with its cost; ``ops.matmul`` runs the cheapest. A
rule whose pair cuts a dimension unevenly (``k = 5`` on 2 ranks: 3 + 2) is legal: ``A``, ``B`` and ``C``
cut a shared dimension alike (``tensor.py``), so each local product is still the rank's piece.

Cost, and ties. A strategy's ``bytes`` is the most any one rank of the mesh sends for its
redistributions (every rank computes the same number, so every rank picks the same strategy, with no
message). Equal bytes are broken first by the number of inputs' placements changed (a free slice or
zeroing counts one): an op keeps the layout it is given when that is free, as GSPMD's propagation
carries a sharding through ops, so ``B x B`` stays ``B`` rather than slicing A to rows that the next op
(or the backward) may want whole. Then by the order of the rules (on several axes: the first axis's
rule first, then the next's, lexicographically): sharded outputs first (each rank computes ``1/p`` of
C and nothing needs reducing later), then partial ones, replicated last. So ``S(1) x B`` (all-to-all
A to rows, or slice B to rows: the slice is free) gives ``P``; for the seed's shapes ``P x S(1)``
(all-reduce A or all-gather B: 160 bytes each on 2 ranks, one change each) gives ``S(1)``.

Several mesh axes (2-D meshes). As GSPMD (Xu et al. 2021, "GSPMD: General and Scalable Parallelization
for ML Computation Graphs") does, the rules apply to each axis independently: a strategy is one
rule per axis, and the local matmul is right because it is bilinear (a partial sum on one axis and a
split on another combine). The tile order of ``tensor.py`` agrees: C's dimension 0 is sharded by exactly
the axes sharding A's dimension 0 (rule ``S(0) x B``), in the same order, and the contraction dimension
by the same axes in A and B (rule ``S(1) x S(0)``). The costs of the per-axis choices are not additive
(a piece's size depends on the other axes), so every combination (``rules ^ axes``) is costed as a
whole, except on an axis of degree 1, where any change is free and only the rules keeping the inputs
as they are compete (the same choice, found faster); the bytes of a redistribution are cached by
shapes and placements.

Elementwise ops with numpy broadcasting (``elementwise_rules``): per axis the output is ``S(d)`` when
each input is split along the dimension that becomes ``d`` (replicated where it broadcasts along
``d``), ``P`` from ``P + P`` or ``P - P`` (``P + B`` becomes legal by zeroing the ``B``, free) or from
``P * B`` and ``B * P`` (a product of two sums is not the sum of the products, so ``P * P`` is
redistributed first), ``B`` from ``B, B``. The same chooser costs and orders them.

Refused, with ``ValueError`` on every rank before any message: a matmul of other ranks or unequal
batch dimensions, inner dimensions that differ, shapes that do not broadcast, inputs on different
meshes or axes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from minipar.mesh import MeshShape
from minipar.sharding import agree
from minipar.sharding.placement import Partial, Placement, Replicate, Shard, describe
from minipar.sharding.plan import cheapest, plan_bytes
from minipar.sharding.tensor import GlobalTensor, check_layout

B, P = Replicate(), Partial()

Strategy = tuple[Any, ...]  # (placements needed per input..., output placements, bytes)


def check_matmul(a: GlobalTensor, b: GlobalTensor) -> tuple[int, ...]:
    """The output shape of ``a @ b``: ``(..., m, k) @ (k, n)``, or ``(..., m, k) @ (..., k, n)`` with equal
    batch dimensions; ``ValueError`` otherwise, or for tensors on different meshes or axes."""
    ra, rb = len(a.shape), len(b.shape)
    if ra < 2 or rb < 2 or (rb > 2 and (ra != rb or a.shape[:-2] != b.shape[:-2])):
        raise ValueError(f"matmul: (..., m, k) @ (k, n) or equal batch dimensions only, got shapes {a.shape} "
                         f"and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape} ({a.shape[-1]} != {b.shape[-2]})")
    agree.check_same("matmul", a, b)
    return (*a.shape[:-1], b.shape[-1])


def matmul_rules(ra: int, rb: int) -> list[tuple[tuple[Placement, ...], Placement]]:
    """The table of the module docstring for ``(..., m, k) @ (k, n)`` (``rb = 2``) or batched operands
    of equal rank: a batch or row dimension of A split alone (a 2-D B) or with B's same batch
    dimension gives that dimension of C; then columns, contraction, partial and replicated."""
    r = ra
    out = [((Shard(d), Shard(d) if rb > 2 else B), Shard(d)) for d in range(r - 2)]
    out += [((Shard(ra - 2), B), Shard(r - 2)), ((B, Shard(rb - 1)), Shard(r - 1)),
            ((Shard(ra - 1), Shard(rb - 2)), P), ((P, B), P), ((B, P), P), ((B, B), B)]
    return out


@functools.lru_cache(maxsize=4096)
def _most_bytes(shape: tuple[int, ...], itemsize: int, degrees: tuple[int, ...], src: tuple[Placement, ...],
                dst: tuple[Placement, ...]) -> tuple[int, ...]:
    """The bytes each rank sends for ``src -> dst`` (the cheapest plan, the one ``redistribute`` runs),
    one entry per combination of coordinates."""
    return plan_bytes(shape, itemsize, degrees, src, cheapest(shape, itemsize, degrees, src, dst)[0])


@functools.lru_cache(maxsize=4096)
def _legal(shape: tuple[int, ...], mesh: MeshShape, axes: tuple[str, ...], placements: tuple[Placement, ...]) -> bool:
    try:
        check_layout(shape, axes, placements)
    except ValueError:
        return False
    return True


def _axis_rules(inputs: Sequence[GlobalTensor], k: int, rules: Sequence[tuple[tuple[Placement, ...], Placement]]
                ) -> Sequence[tuple[tuple[Placement, ...], Placement]]:
    """The rules worth trying on axis ``k``: all of them, or on an axis of degree 1 those that change no
    input's placement there (if any do)."""
    if inputs[0].degrees[k] > 1:
        return rules
    keep = [r for r in rules if all(t.placements[k] == p for t, p in zip(inputs, r[0], strict=True))]
    return keep or rules


def strategies(inputs: Sequence[GlobalTensor], out_shape: Sequence[int],
               rules: Sequence[tuple[tuple[Placement, ...], Placement]]) -> list[Strategy]:
    """Every legal combination of one rule ``(input placements, output placement)`` per mesh axis, as
    ``(needed placements by input, output placements, bytes)``, cheapest first; among equal bytes the
    one changing fewer inputs' placements (a free slice or zeroing counts), then ``rules`` order
    (lexicographic over the axes). ``bytes``: the most one rank sends for the redistributions."""
    t0 = inputs[0]
    mesh, axes, out_shape = t0.mesh.shape, t0.axes, tuple(out_shape)
    out = []
    for per_axis in itertools.product(*[_axis_rules(inputs, k, rules) for k in range(len(axes))]):
        needed = tuple(tuple(r[0][i] for r in per_axis) for i in range(len(inputs)))
        placed = tuple(r[1] for r in per_axis)
        if not all(_legal(t.shape, mesh, axes, pl) for t, pl in zip(inputs, needed, strict=True)):
            continue
        if not _legal(out_shape, mesh, axes, placed):
            continue
        sent = [_most_bytes(t.shape, t.local.itemsize, t.degrees, t.placements, pl)
                for t, pl in zip(inputs, needed, strict=True)]
        moves = sum(a != b for t, pl in zip(inputs, needed, strict=True) for a, b in zip(t.placements, pl, strict=True))
        out.append((needed, placed, max(sum(per_rank) for per_rank in zip(*sent, strict=True)), moves))
    out.sort(key=lambda s: (s[2], s[3]))  # stable: rules order among equal costs and moves
    return [s[:3] for s in out]


def matmul_strategies(a: GlobalTensor, b: GlobalTensor) -> list[Strategy]:
    """Every legal strategy ``(a_needed, b_needed, c_placements, bytes)`` (placements one per axis),
    cheapest first, ties as the module docstring says. ``bytes``: the most one rank sends."""
    shape = check_matmul(a, b)
    found = strategies([a, b], shape, matmul_rules(len(a.shape), len(b.shape)))
    return [(pa, pb, pc, n) for (pa, pb), pc, n in found]


# ---- elementwise add and mul with numpy broadcasting ------------------------------------------------------
OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply}


def check_elementwise(op: str, x: GlobalTensor, y: GlobalTensor) -> tuple[int, ...]:
    """The broadcast output shape; ``ValueError`` for an unknown op, shapes numpy cannot broadcast, or
    tensors on different meshes or axes."""
    if op not in OPS:
        raise ValueError(f"elementwise: op must be one of {sorted(OPS)}, got {op!r}")
    try:
        shape = tuple(int(n) for n in np.broadcast_shapes(x.shape, y.shape))
    except ValueError:
        raise ValueError(f"elementwise {op}: shapes {x.shape} and {y.shape} do not broadcast") from None
    agree.check_same(f"elementwise {op}", x, y)
    return shape


def elementwise_rules(op: str, shapes: Sequence[Sequence[int]], out_shape: Sequence[int]
                      ) -> list[tuple[tuple[Placement, ...], Placement]]:
    """Per mesh axis, in tie-break order: output ``S(d)`` from each input split along the dimension that
    becomes ``d`` (``B`` where the input broadcasts along ``d``: it has no such dimension or size 1 there);
    ``P`` from ``P + P`` (add) or ``P * B``, ``B * P`` (mul: a product of two sums is not the sum of the
    products, so ``P * P`` is redistributed first); ``B`` from ``B, B``."""
    rules: list[tuple[tuple[Placement, ...], Placement]] = []
    for d in range(len(out_shape)):
        ins = []
        for sh in shapes:
            di = d - (len(out_shape) - len(sh))
            ins.append(Shard(di) if di >= 0 and sh[di] != 1 else B)
        if any(p != B for p in ins):  # a dimension of 1 everywhere: no input holds a piece of it
            rules.append((tuple(ins), Shard(d)))
    rules += [((P, B), P), ((B, P), P)] if op == "mul" else [((P, P), P)]
    return [*rules, ((B, B), B)]


def elementwise_strategies(op: str, x: GlobalTensor, y: GlobalTensor) -> list[Strategy]:
    """``(x_needed, y_needed, out_placements, bytes)``, cheapest first (as ``matmul_strategies``)."""
    shape = check_elementwise(op, x, y)
    found = strategies([x, y], shape, elementwise_rules(op, [x.shape, y.shape], shape))
    return [(px, py, pc, n) for (px, py), pc, n in found]


def table_row(a: GlobalTensor, b: GlobalTensor) -> str:
    """One line for a lesson's table: ``A x B -> needs A' x B' -> C, bytes``."""
    pa, pb, pc, n = matmul_strategies(a, b)[0]
    return (f"{describe(a.placements)} x {describe(b.placements)} -> needs {describe(pa)} x {describe(pb)} "
            f"-> {describe(pc)}, {n} bytes")
