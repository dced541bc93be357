"""2-D parallel layers (Xu et al. 2021, Optimus): a linear layer and the transformer MLP on a q x q grid.

Layout. An activation ``X`` of shape ``(batch, ..., features)`` is split on the grid like a matrix:
rank ``(i, j)`` holds batch rows ``[i b/q, (i+1) b/q)`` and features ``[j h/q, (j+1) h/q)``
(``block``). The weight ``W`` (``in x out``, ``minipar.nn.Linear``'s layout) likewise: rank ``(i,
j)`` holds ``W_ij``, rows ``[i in/q, ...)`` and columns ``[j out/q, ...)``, one ``q^2``-th of it,
initialised as that slice of the single-process ``nn.Linear`` (``Parameter(full_shape=, shard=)``).
``Y = X W`` by SUMMA (``summa.Summa``) comes out in the same layout as ``X``, so layers stack with
no redistribution: ``fc``, GELU (elementwise, on the local block) and ``proj`` make the 2-D MLP.

Bias. ``Y_ij`` needs ``b_j``, the ``out/q`` entries of column block ``j``, on all ``q`` ranks of grid
column ``j``. As the authors' implementation (Colossal-AI's ``Linear2D`` and ``add_bias_2d``) does,
each of those ranks stores a ``1/q`` piece of ``b_j`` (rank ``(i, j)``: entries
``[j out/q + i out/q^2, ...)``), so the bias too is split ``q^2`` ways; forward all-gathers ``b_j``
down the column, backward reduce-scatters the column's partial sums of ``dY`` (each rank's rows
contribute ``sum_rows dY_ij``), leaving each rank the gradient of its own piece.

Memory per rank: ``(in out + out) / q^2`` parameters. Bytes per rank: ``minipar.cost.tensor2d``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import functional as F
from minipar.autograd import Context, Function, Tensor
from minipar.mesh import DeviceMesh
from minipar.nn import Module, Parameter
from minipar.parallel.tensor.tp2d.summa import Grid2D, Summa

GATHER = "ring"  # the bias's all-gather and reduce-scatter (comm/ring.py)


def as_grid(mesh: DeviceMesh | Grid2D) -> Grid2D:
    """The grid of a ``DeviceMesh(comm, dp=q, tp=q)`` (a ``Grid2D`` passes through)."""
    return mesh if isinstance(mesh, Grid2D) else Grid2D(mesh)


def check_divisible(n: int, by: int, what: str, fix: str, who: str = "2-D tensor parallelism") -> None:
    """``ValueError`` naming ``what`` and the ``fix`` unless ``by`` divides ``n`` (no message is sent)."""
    if n % by:
        raise ValueError(f"{who}: {what}={n} is not a multiple of {by}; {fix}")


def check_width(x: Tensor, width: int, of: int, q: int, who: str, split_with: str, unit: str = "block") -> None:
    """``ValueError`` (before any message) unless this rank's input ``unit`` ``x`` has ``width`` features,
    its share of ``of`` features on ``q``."""
    if x.shape[-1] != width:
        raise ValueError(f"{who}: this rank's input {unit} has {x.shape[-1]} features; a {unit} of {of} features "
                         f"on q={q} has {width} (split it with {split_with}())")


def block(x: np.ndarray, grid: Grid2D) -> np.ndarray:
    """Rank ``(i, j)``'s block of a whole activation: batch rows (axis 0) block ``i``, features (last
    axis) block ``j``. Refuses (before any message) a batch or width not divisible by ``q``."""
    q = grid.q
    check_divisible(x.shape[0], q, "batch", f"choose the batch as a multiple of q={q}")
    check_divisible(x.shape[-1], q, "features", f"choose the width as a multiple of q={q}")
    r, c = x.shape[0] // q, x.shape[-1] // q
    return np.ascontiguousarray(x[grid.i * r:(grid.i + 1) * r, ..., grid.j * c:(grid.j + 1) * c])


def vector_piece(n: int, grid: Grid2D, init: tuple, dtype: Any) -> Parameter:
    """Rank ``(i, j)``'s ``1/q^2`` piece of a length-``n`` vector that grid column ``j`` uses as its
    block ``[j n/q, (j+1) n/q)``: entries ``[j n/q + i n/q^2, ...)`` (a bias, a layer norm's gain)."""
    m = n // (grid.q * grid.q)
    lo = grid.j * grid.q * m + grid.i * m
    return Parameter((m,), init, dtype, full_shape=(n,), shard=(slice(lo, lo + m),))


class AddBias2D(Function):
    """``Y_ij + b_j``: all-gather ``b_j``'s ``q`` pieces down grid column ``j`` forward; reduce-scatter
    the column's ``sum_rows dY_ij`` backward (each rank keeps its piece's gradient). Adds into ``y``'s
    own array, as ``functional.linear``'s bias does: only for a fresh product nothing else holds
    (``Summa``'s output). Call as ``AddBias2D.apply(y, bias_piece, grid)``."""

    @staticmethod
    def forward(ctx: Context, y: np.ndarray, piece: np.ndarray, grid: Grid2D) -> np.ndarray:
        ctx.grid = grid
        y += grid.col.allgather(piece, algorithm=GATHER)
        return y

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        if not ctx.needs_input_grad[1]:  # a frozen bias: nothing to reduce (the same on every rank)
            return grad, None, None
        partial = grad.reshape(-1, grad.shape[-1]).sum(axis=0)
        return grad, ctx.grid.col.reduce_scatter(partial, op="sum", algorithm=GATHER), None


class Linear2D(Module):
    """``Y = X W + b`` on the ``q x q`` grid of ``mesh`` (a ``DeviceMesh(comm, dp=q, tp=q)`` or a
    ``Grid2D``): this rank holds ``W_ij`` (``in/q x out/q``) and a ``1/q^2`` piece of ``b`` (module
    docstring); ``forward`` takes and returns blocks (``block``). ``in_features`` must be a multiple
    of ``q`` and ``out_features`` of ``q`` (``q^2`` with a bias); refused when built, before any
    message. Parameter names and initialisation are ``nn.Linear``'s."""

    def __init__(self, in_features: int, out_features: int, mesh: DeviceMesh | Grid2D, bias: bool = True,
                 dtype: Any = np.float64) -> None:
        grid = as_grid(mesh)
        q, i, j = grid.q, grid.i, grid.j
        check_divisible(in_features, q, "in_features", f"choose it as a multiple of q={q}")
        why = "; the bias is split q^2 ways" if bias else ""
        check_divisible(out_features, q * q if bias else q, "out_features",
                   f"choose it as a multiple of {q * q if bias else q} (q={q}{why})")
        self.grid, self.in_features, self.out_features = grid, in_features, out_features
        k, n = in_features // q, out_features // q
        bound = 1.0 / np.sqrt(in_features)  # the full fan-in, as nn.Linear
        self.weight = Parameter((k, n), ("uniform", bound), dtype, full_shape=(in_features, out_features),
                                shard=(slice(i * k, (i + 1) * k), slice(j * n, (j + 1) * n)))
        self.bias = vector_piece(out_features, grid, ("uniform", bound), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        check_width(x, self.in_features // self.grid.q, self.in_features, self.grid.q, "Linear2D", "block")
        y = Summa.apply(x, self.weight, self.grid)
        return AddBias2D.apply(y, self.bias, self.grid) if self.bias is not None else y


class MLP2D(Module):
    """The transformer MLP ``proj(gelu(fc(x)))`` (``nn.FeedForward``, same parameter names) with 2-D
    linears; the hidden activation stays split on the grid (GELU works on the local block)."""

    def __init__(self, d_model: int, d_ff: int, mesh: DeviceMesh | Grid2D, dtype: Any = np.float64) -> None:
        grid = as_grid(mesh)
        self.fc = Linear2D(d_model, d_ff, grid, dtype=dtype)
        self.proj = Linear2D(d_ff, d_model, grid, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))
