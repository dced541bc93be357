"""Differentiable ops on global tensors: each picks its placements by propagation, redistributes its
inputs if it must, computes on the local pieces, and records a backward made of these same ops.

Every op has a rule per mesh axis (``propagate.py``'s format: the placements its inputs must have on
that axis, and the output's placement then), and the shared chooser (``propagate.strategies``) takes
the cheapest legal combination; among equal bytes the one changing fewer inputs' placements, then
rule order (sharded outputs first, then partial, then replicated). Rules, per mesh axis, for an
input of ``n`` dimensions:

- ``matmul`` (``propagate.matmul_rules``): OneFlow's table, batch dimensions split alike.
- ``add``, ``sub``, ``mul`` with broadcasting (``propagate.elementwise_rules``).
- unary ``exp``, ``log``, ``gelu``, ``rsqrt``: ``S(d) -> S(d)``, ``B -> B``; ``scale`` (times a constant)
  is linear and keeps ``P`` too. A nonlinear op of a partial sum is not the sum of the ops: ``P`` is
  reduced first.
- ``sum`` over axes: a kept dimension's split stays (renumbered), a summed one's becomes ``P`` (each
  rank sums its part: OneFlow's reduce rule), ``P -> P``, ``B -> B``. ``mean`` = ``sum`` then ``scale``.
- ``broadcast_to``: a split of a dimension that is not broadcast stays; ``P``, ``B`` stay.
- ``softmax`` and ``logsumexp`` along ``axis``: a split of another dimension stays; the axis itself
  must be whole (``S(axis)`` and ``P`` are gathered or reduced first).
- ``reshape``: ``S(i) -> S(j)`` when the dimensions before ``i`` and before ``j`` hold the same number of
  elements and the cuts fall alike, so a block of ``i`` is a block of ``j`` (``same_runs``: always when
  they divide evenly; ``(b, s, d) S(2) -> (b, s, h, d/h) S(2)`` when the ranks split the heads evenly);
  otherwise the split is gathered first.
  ``P``, ``B`` stay.
- ``transpose``: a split follows its dimension; ``P``, ``B`` stay.
- ``embedding(table, ids)``: ids split by rows and the table whole: output split alike; ids whole and
  the table split by vocabulary rows (``S(0)``): each rank looks up the ids in its range, zeros
  elsewhere: a partial sum (Megatron's vocabulary-parallel embedding); table split by columns: output
  split on its last dimension; both whole: whole.

Backward of each (the engine's rules are in ``autograd.py``): ``matmul``: ``dA = dC B^T``,
``dB = A^T dC`` (batch rows folded in for a 2-D weight); elementwise: the chain rule with
``sum_to`` undoing broadcasting; ``sum`` <-> ``broadcast_to``; ``reshape`` and ``transpose`` invert;
``softmax``: ``y (g - sum(g y))``; ``logsumexp``: ``g softmax(x)``; ``embedding``: each rank adds the
gradient rows of its ids into its piece of the table (a partial sum when the ids are split).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minipar import trace
from minipar.functional import _gelu, _gelu_backward
from minipar.sharding import agree, propagate
from minipar.sharding.autograd import record, whole_sums
from minipar.sharding.placement import Partial, Placement, Replicate, Shard, describe
from minipar.sharding.redistribute import redistribute as _redistribute
from minipar.sharding.tensor import GlobalTensor, local_slices

B, P = Replicate(), Partial()
Rules = list[tuple[tuple[Placement, ...], Placement]]


def piece_shape(shape: Sequence[int], t: GlobalTensor, placements: Sequence[Placement]) -> tuple[int, ...]:
    """The shape of this rank's piece of a ``shape`` tensor over ``t``'s mesh and axes."""
    return tuple(s.stop - s.start for s in local_slices(shape, t.degrees, t.coords, placements))


def _run(name: str, inputs: Sequence[GlobalTensor], out_shape: Sequence[int], rules: Rules,
         local: Callable[..., np.ndarray], backward: Callable[..., Sequence[GlobalTensor | None]],
         valid: Callable[[tuple, tuple], bool] = lambda needed, placed: True) -> GlobalTensor:
    """The cheapest strategy's redistributions, ``local(moved_inputs, out_placements)`` on the pieces,
    and the graph node whose gradient is ``backward(grad, out, *moved_inputs)``; ``valid(needed,
    placed)`` may rule strategies out. In debug mode the ranks first check they run the same op on
    equal layouts (``agree.op``)."""
    agree.op(name, inputs, f"output shape {tuple(out_shape)}")
    found = [s for s in propagate.strategies(inputs, out_shape, rules) if valid(s[0], s[1])]
    if not found:
        raise ValueError(f"{name}: no placement of the output {tuple(out_shape)} is legal on this mesh")
    needed, placed, _ = found[0]
    moved = [redistribute(t, pl, name) for t, pl in zip(inputs, needed, strict=True)]
    t0 = inputs[0]
    piece = np.require(local(moved, placed), requirements="C")  # not ascontiguousarray: 0-d stays 0-d
    out = GlobalTensor(piece, out_shape, t0.mesh, t0.axes, placed, check=False)
    return record(out, moved, lambda g: backward(g, out, *moved))


def _pieces(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """A local function of the pieces' arrays alone, as ``_run`` calls it."""
    return lambda moved, placed: fn(*[m.local for m in moved])


def redistribute(t: GlobalTensor, placements: Sequence[Placement], why: str = "") -> GlobalTensor:
    """``minipar.sharding.redistribute`` on the graph: its backward passes the gradient on as it is.
    While a trace records, a ``redistribute`` mark names the op that needed it (``why``), the shape and
    both placements (what a lesson lists; nothing is computed otherwise)."""
    placements = tuple(placements)
    if placements == t.placements:
        return t
    if trace.current() is not None:
        trace.mark("redistribute", op=why, shape=list(t.shape), src=describe(t.placements), dst=describe(placements))
    out = record(_redistribute(t, placements), (t,), lambda g: (g,))
    out.passes_gradient = out.backward_fn is not None  # autograd: its gradient goes on to t as it arrives
    return out


def whole(x: GlobalTensor, axis: int) -> GlobalTensor:
    """``x`` with ``axis`` whole and no partial sum on any rank (a reduced, gathered copy if needed): the
    input of an op that normalises along ``axis`` (layer norm)."""
    axis %= len(x.shape)
    return redistribute(x, tuple(B if p == Shard(axis) else p for p in whole_sums(x.placements)), "whole rows")


def constant(value: Any, like: GlobalTensor) -> GlobalTensor:
    """A replicated global tensor of ``value`` (every rank holds it whole) on ``like``'s mesh and axes."""
    arr = np.asarray(value, dtype=like.local.dtype)
    return GlobalTensor(arr, arr.shape, like.mesh, like.axes, [B] * len(like.axes))


def _lift(x: Any, like: GlobalTensor) -> GlobalTensor:
    return x if isinstance(x, GlobalTensor) else constant(x, like)


# ---- matmul and elementwise ---------------------------------------------------------------------------------
def matmul(a: GlobalTensor, b: GlobalTensor) -> GlobalTensor:
    """``a @ b``: ``(..., m, k) @ (k, n)`` or with equal batch dimensions ``(..., m, k) @ (..., k, n)``."""
    out_shape = propagate.check_matmul(a, b)

    def backward(g: GlobalTensor, out: GlobalTensor, a2: GlobalTensor, b2: GlobalTensor) -> tuple:
        ga = matmul(g, swap_last(b2)) if a2.requires_grad else None
        gb = None
        if b2.requires_grad and len(b2.shape) == 2 < len(a2.shape):  # a weight: sum over the batch rows
            gb = weight_gradient(a2, g)
        elif b2.requires_grad:
            gb = matmul(swap_last(a2), g)
        return ga, gb

    rules = propagate.matmul_rules(len(a.shape), len(b.shape))
    return _run("matmul", [a, b], out_shape, rules, _pieces(np.matmul), backward)


def weight_gradient(a: GlobalTensor, g: GlobalTensor) -> GlobalTensor:
    """``dW = sum over the rows of a^T g`` for ``a (..., m, k) @ W (k, n)``. When no leading dimension but
    the first is split, the rows fold into one matrix for free (``(rows, k)^T (rows, n)``); otherwise
    (a sequence split, say) a batched product summed over the batch: a split contraction gives a
    partial sum, no message (folding would first move both operands)."""
    lead = [p.dim for t in (a, g) for p in t.placements if isinstance(p, Shard) and p.dim < len(t.shape) - 1]
    if all(d == 0 for d in lead):
        return matmul(swap_last(reshape(a, (-1, a.shape[-1]))), reshape(g, (-1, g.shape[-1])))
    return sum(matmul(swap_last(a), g), tuple(range(len(a.shape) - 2)))


def sum_to(g: GlobalTensor, shape: Sequence[int]) -> GlobalTensor:
    """``g`` summed down to ``shape`` (undoing numpy broadcasting)."""
    shape = tuple(shape)
    lead = len(g.shape) - len(shape)
    if lead:
        g = sum(g, tuple(range(lead)))
    ones = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return sum(g, ones, keepdims=True) if ones else g


def elementwise(op: str, x: Any, y: Any) -> GlobalTensor:
    like = x if isinstance(x, GlobalTensor) else y
    x, y = _lift(x, like), _lift(y, like)
    shape = propagate.check_elementwise(op, x, y)

    def backward(g: GlobalTensor, out: GlobalTensor, x2: GlobalTensor, y2: GlobalTensor) -> tuple:
        gx = gy = None
        if x2.requires_grad:
            gx = sum_to(mul(g, y2) if op == "mul" else g, x2.shape)
        if y2.requires_grad:
            gy = sum_to(mul(g, x2) if op == "mul" else scale(g, -1.0) if op == "sub" else g, y2.shape)
        return gx, gy

    rules = propagate.elementwise_rules(op, [x.shape, y.shape], shape)
    return _run(op, [x, y], shape, rules, _pieces(propagate.OPS[op]), backward)


def add(x: Any, y: Any) -> GlobalTensor:
    return elementwise("add", x, y)


def sub(x: Any, y: Any) -> GlobalTensor:
    return elementwise("sub", x, y)


def mul(x: Any, y: Any) -> GlobalTensor:
    return elementwise("mul", x, y)


# ---- unary -----------------------------------------------------------------------------------------------
def _per_dim(n: int, extra: Rules) -> Rules:
    return [((Shard(d),), Shard(d)) for d in range(n)] + extra + [((B,), B)]


UNARY: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "exp": (np.exp, lambda x, y: y),
    "log": (np.log, lambda x, y: 1.0 / x),
    "gelu": (_gelu, lambda x, y: _gelu_backward(x, np.ones_like(x))),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), lambda x, y: -0.5 * y / x),
}


def unary(name: str, x: GlobalTensor) -> GlobalTensor:
    """``exp``, ``log``, ``gelu`` or ``rsqrt`` of ``x``, elementwise."""
    fn, slope = UNARY[name]

    def backward(g: GlobalTensor, out: GlobalTensor, x2: GlobalTensor) -> tuple:
        d = GlobalTensor(slope(x2.local, out.local), x2.shape, x2.mesh, x2.axes, x2.placements, check=False)
        return (mul(g, d),)

    return _run(name, [x], x.shape, _per_dim(len(x.shape), []), _pieces(fn), backward)


def gelu(x: GlobalTensor) -> GlobalTensor:
    return unary("gelu", x)


def scale(x: GlobalTensor, c: float) -> GlobalTensor:
    """``c x`` for a number ``c``: linear, so a partial sum stays one."""
    return _run("scale", [x], x.shape, _per_dim(len(x.shape), [((P,), P)]), _pieces(lambda a: a * c),
                lambda g, out, x2: (scale(g, c),))


# ---- reductions and broadcasting ---------------------------------------------------------------------------
def _axes(axis: int | Sequence[int] | None, n: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(n))
    return tuple(sorted({a % n for a in np.atleast_1d(axis).tolist()}))


def sum(x: GlobalTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> GlobalTensor:  # noqa: A001
    """``x.sum(axis, keepdims)``: a summed dimension's split becomes a partial sum."""
    n, axes = len(x.shape), _axes(axis, len(x.shape))
    kept = [d for d in range(n) if d not in axes]
    shape = tuple(1 if d in axes else x.shape[d] for d in range(n)) if keepdims else tuple(x.shape[d] for d in kept)
    rules: Rules = [((Shard(d),), Shard(d if keepdims else kept.index(d))) for d in kept]
    rules += [((Shard(d),), P) for d in axes] + [((P,), P), ((B,), B)]

    def backward(g: GlobalTensor, out: GlobalTensor, x2: GlobalTensor) -> tuple:
        return (broadcast_to(reshape(g, tuple(1 if d in axes else x2.shape[d] for d in range(n))), x2.shape),)

    return _run("sum", [x], shape, rules, _pieces(lambda a: a.sum(axis=axes, keepdims=keepdims)), backward)


def mean(x: GlobalTensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> GlobalTensor:
    axes = _axes(axis, len(x.shape))
    return scale(sum(x, axes, keepdims), 1.0 / float(np.prod([x.shape[a] for a in axes])))


def broadcast_to(x: GlobalTensor, shape: Sequence[int]) -> GlobalTensor:
    """``np.broadcast_to(x, shape)`` (a copy on each rank)."""
    shape = tuple(shape)
    lead = len(shape) - len(x.shape)
    rules: Rules = [((Shard(d),), Shard(d + lead)) for d in range(len(x.shape)) if x.shape[d] == shape[d + lead]]
    rules += [((P,), P), ((B,), B)]

    def local(moved: list[GlobalTensor], placed: tuple[Placement, ...]) -> np.ndarray:
        return np.broadcast_to(moved[0].local, piece_shape(shape, x, placed)).copy()

    return _run("broadcast_to", [x], shape, rules, local, lambda g, out, x2: (sum_to(g, x2.shape),))


# ---- softmax, logsumexp ------------------------------------------------------------------------------------
def _along(x: GlobalTensor, axis: int, keep: bool) -> Rules:
    n = len(x.shape)
    return [((Shard(d),), Shard(d if keep or d < axis else d - 1)) for d in range(n) if d != axis] + [((B,), B)]


def _softmax(a: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax(x: GlobalTensor, axis: int = -1) -> GlobalTensor:
    """Softmax along ``axis``, which must be whole on every rank (its split is gathered first)."""
    axis %= len(x.shape)

    def backward(g: GlobalTensor, out: GlobalTensor, x2: GlobalTensor) -> tuple:
        return (mul(out, sub(g, sum(mul(g, out), axis, keepdims=True))),)

    return _run("softmax", [x], x.shape, _along(x, axis, True), _pieces(lambda a: _softmax(a, axis)), backward)


def logsumexp(x: GlobalTensor, axis: int = -1) -> GlobalTensor:
    """``log(sum(exp(x), axis))``, the axis whole on every rank, with the row maximum subtracted."""
    axis %= len(x.shape)
    shape = tuple(n for d, n in enumerate(x.shape) if d != axis)

    @_pieces
    def local(a: np.ndarray) -> np.ndarray:
        m = a.max(axis=axis, keepdims=True)
        return (np.log(np.exp(a - m).sum(axis=axis, keepdims=True)) + m).squeeze(axis)

    def backward(g: GlobalTensor, out: GlobalTensor, x2: GlobalTensor) -> tuple:
        p = GlobalTensor(_softmax(x2.local, axis), x2.shape, x2.mesh, x2.axes, x2.placements, check=False)
        return (mul(broadcast_to(reshape(g, tuple(1 if d == axis else n for d, n in enumerate(x2.shape))),
                                 x2.shape), p),)

    return _run("logsumexp", [x], shape, _along(x, axis, False), local, backward)


# ---- reshape and transpose ---------------------------------------------------------------------------------
def _resolve(shape: Sequence[int], size: int) -> tuple[int, ...]:
    shape = list(shape)
    if -1 in shape:
        shape[shape.index(-1)] = size // int(-np.prod(shape))
    if int(np.prod(shape)) != size:
        raise ValueError(f"reshape: cannot reshape {size} elements into {tuple(shape)}")
    return tuple(shape)


def reshape(x: GlobalTensor, shape: Sequence[int]) -> GlobalTensor:
    """``x.reshape(shape)`` (rules in the module docstring)."""
    shape = _resolve(shape, int(np.prod(x.shape)))
    rules: Rules = []
    for i in range(len(x.shape)):
        lead = int(np.prod(x.shape[:i]))
        j = next((j for j in range(len(shape)) if int(np.prod(shape[:j])) == lead and shape[j] > 1), None)
        if j is not None:  # block c of dimension i is the same run of elements as block c of dimension j
            rules.append(((Shard(i),), Shard(j)))
    rules += [((P,), P), ((B,), B)]

    def local(moved: list[GlobalTensor], placed: tuple[Placement, ...]) -> np.ndarray:
        return moved[0].local.reshape(piece_shape(shape, x, placed))

    return _run("reshape", [x], shape, rules, local, lambda g, out, x2: (reshape(g, x2.shape),),
                lambda needed, placed: same_runs(x.shape, shape, x.degrees, needed[0], placed))


@functools.lru_cache(maxsize=4096)
def same_runs(shape: tuple[int, ...], new: tuple[int, ...], degrees: tuple[int, ...],
              placements: tuple[Placement, ...], new_placements: tuple[Placement, ...]) -> bool:
    """Whether every rank's piece of a ``shape`` tensor laid out as ``placements`` is, element for element
    in order, its piece of the reshaped (``new``) tensor laid out as ``new_placements``: a block of a
    split dimension is a block of the new one when the cuts fall alike (always when they divide evenly;
    a cut of 3 heads of 4 columns over 2 ranks, 2 + 1 heads, is not one of 12 columns, 6 + 6)."""
    flat = np.arange(int(np.prod(shape)))
    return all(np.array_equal(flat.reshape(shape)[local_slices(shape, degrees, c, placements)].ravel(),
                              flat.reshape(new)[local_slices(new, degrees, c, new_placements)].ravel())
               for c in itertools.product(*[range(d) for d in degrees]))


def transpose(x: GlobalTensor, perm: Sequence[int]) -> GlobalTensor:
    """``x.transpose(perm)``."""
    perm = tuple(int(p) % len(x.shape) for p in perm)
    if sorted(perm) != list(range(len(x.shape))):
        raise ValueError(f"transpose: {perm} is not a permutation of the {len(x.shape)} dimensions")
    shape = tuple(x.shape[p] for p in perm)
    rules: Rules = [((Shard(p),), Shard(j)) for j, p in enumerate(perm)] + [((P,), P), ((B,), B)]
    inv = tuple(int(i) for i in np.argsort(perm))
    return _run("transpose", [x], shape, rules, _pieces(lambda a: a.transpose(perm)),
                lambda g, out, x2: (transpose(g, inv),))


def swap_last(x: GlobalTensor) -> GlobalTensor:
    n = len(x.shape)
    return transpose(x, (*range(n - 2), n - 1, n - 2))


# ---- embedding -------------------------------------------------------------------------------------------
def _rows_of(t: GlobalTensor, placements: Sequence[Placement]) -> tuple[int, int]:
    s = local_slices(t.shape, t.degrees, t.coords, placements)[0]
    return s.start, s.stop


def embedding(table: GlobalTensor, ids: GlobalTensor) -> GlobalTensor:
    """``table[ids]`` for integer ``ids``, a global tensor on the same mesh and axes (rules in the module
    docstring). Ids out of range are refused on every rank before any message of the lookup: replicated
    ids are checked by each rank alike; split ones by each rank on its piece, the ranks then agreeing
    by a one-number all-reduce (the only message, and only when the ids are split)."""
    agree.check_same("embedding", table, ids)
    rows, width = table.shape
    n = len(ids.shape)
    if not np.issubdtype(ids.local.dtype, np.integer) or any(isinstance(p, Partial) for p in ids.placements):
        raise ValueError(f"embedding: ids must be integers, split or replicated (not partial), got "
                         f"{ids.local.dtype} placed {describe(ids.placements)}")
    bad = int(bool(ids.local.size) and (ids.local.min() < 0 or ids.local.max() >= rows))
    if any(isinstance(p, Shard) for p in ids.placements):  # pieces differ: agree before raising (8 bytes)
        bad = int(ids.mesh.comm.allreduce(np.array([bad]), op="max", algorithm="native")[0])
    if bad:
        raise ValueError(f"embedding: ids must be integers in [0, {rows}) for a table of {rows} rows")
    shape = (*ids.shape, width)
    rules: Rules = [((Shard(d), B), Shard(d)) for d in range(n)]
    rules += [((B, Shard(1)), Shard(n)), ((B, Shard(0)), P), ((B, B), B)]

    def local(moved: list[GlobalTensor], placed: tuple[Placement, ...]) -> np.ndarray:
        i, w = moved[0].local, moved[1].local
        lo, hi = _rows_of(table, moved[1].placements)
        mine = (i >= lo) & (i < hi)
        out = w[np.where(mine, i - lo, 0)]
        out[~mine] = 0.0
        return out

    def backward(g: GlobalTensor, out: GlobalTensor, i2: GlobalTensor, w2: GlobalTensor) -> tuple:
        # dy: split like the output; whole where the output is partial; a whole output's as it comes (B or P)
        need = tuple(B if isinstance(po, Partial) or (isinstance(po, Replicate) and isinstance(pg, Shard)) else
                     pg if isinstance(po, Replicate) else po
                     for po, pg in zip(out.placements, g.placements, strict=True))
        g = redistribute(g, need)
        lo, hi = _rows_of(w2, w2.placements)
        mine = (i2.local >= lo) & (i2.local < hi)
        gw = np.zeros_like(w2.local)
        np.add.at(gw, i2.local[mine] - lo, g.local[mine])
        place = tuple(P if isinstance(pi, Shard) else pw if isinstance(pw, Shard) else pg
                      for pi, pw, pg in zip(i2.placements, w2.placements, need, strict=True))
        return None, GlobalTensor(gw, w2.shape, w2.mesh, w2.axes, place, check=False)

    return _run("embedding", [ids, table], shape, rules, local, backward)
