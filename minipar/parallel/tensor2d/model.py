"""The 2-D transformer block (Xu et al. 2021, Optimus, Sec. 3): layer norm, attention and MLP with
every activation and parameter split on the q x q grid.

- ``LayerNorm2D``: a row's ``d`` features are spread over the ``q`` ranks of its grid row, so the
  mean and variance are sums all-reduced along the grid row (two all-reduces of one number per local
  row forward, one of two numbers backward: ``sum dxhat`` and ``sum dxhat xhat``). The gain and
  shift are stored and moved like ``Linear2D``'s bias (a ``1/q^2`` piece, all-gathered down the
  column, gradients reduce-scattered).
- ``Attention2D``: ``q``, ``k``, ``v`` and ``proj`` are ``Linear2D``; column block ``j`` of ``q``,
  ``k``, ``v`` is heads ``[j H/q, (j+1) H/q)`` and row block ``i`` is whole sequences (the batch is
  split, not the sequence), so attention runs locally on those heads with no communication, and its
  output block is column block ``j`` of the concatenated heads: ``proj``'s input layout.
- ``Block2D``: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` (``nn.Block``, same parameter names),
  residual adds on the local blocks.

Inputs are ``(batch, seq, d)`` split by ``layers.block``: batch rows block ``i``, features block ``j``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import functional as F
from minipar.autograd import Context, Function, Tensor
from minipar.mesh import DeviceMesh
from minipar.nn import Module
from minipar.parallel.tensor2d.layers import GATHER, MLP2D, AddBias2D, Linear2D, as_grid, check_divisible, vector_piece
from minipar.parallel.tensor2d.summa import Grid2D

REDUCE = "ring"  # the layer norm's row all-reduces


class Normalise2D(Function):
    """``(x - mean) / sqrt(var + eps)`` over features split along the grid row. Keeps ``x``; the
    statistics are recomputed in backward (as ``functional._LayerNorm``), which costs the two forward
    all-reduces again. Call as ``Normalise2D.apply(x, grid, d, eps)``."""

    @staticmethod
    def stats(x: np.ndarray, grid: Grid2D, d: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
        mean = grid.row.allreduce(x.sum(axis=-1, keepdims=True), op="sum", algorithm=REDUCE) / d
        xc = x - mean
        var = grid.row.allreduce((xc * xc).sum(axis=-1, keepdims=True), op="sum", algorithm=REDUCE) / d
        rstd = 1.0 / np.sqrt(var + eps)
        return xc * rstd, rstd

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, grid: Grid2D, d: int, eps: float) -> np.ndarray:
        ctx.grid, ctx.d, ctx.eps = grid, d, eps
        ctx.save_for_backward(x)
        return Normalise2D.stats(x, grid, d, eps)[0]

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray, None, None, None]:
        (x,) = ctx.saved
        xhat, rstd = Normalise2D.stats(x, ctx.grid, ctx.d, ctx.eps)
        local = np.stack([g.sum(axis=-1), (g * xhat).sum(axis=-1)])
        sums = ctx.grid.row.allreduce(local, op="sum", algorithm=REDUCE) / ctx.d
        return rstd * (g - sums[0][..., None] - xhat * sums[1][..., None]), None, None, None


class Scale2D(Function):
    """``X_ij * g_j``: all-gather ``g_j``'s pieces down grid column ``j`` forward; reduce-scatter the
    column's ``sum_rows dY_ij X_ij`` backward. Call as ``Scale2D.apply(x, gain_piece, grid)``."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, piece: np.ndarray, grid: Grid2D) -> np.ndarray:
        gain = grid.col.allgather(piece, algorithm=GATHER)
        ctx.grid, ctx.gain = grid, gain
        ctx.save_for_backward(x)
        return x * gain

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        (x,) = ctx.saved
        partial = (grad * x).reshape(-1, x.shape[-1]).sum(axis=0)
        return grad * ctx.gain, ctx.grid.col.reduce_scatter(partial, op="sum", algorithm=GATHER), None


class LayerNorm2D(Module):
    """``nn.LayerNorm(d)`` on the grid (module docstring); ``d`` must be a multiple of ``q^2``."""

    def __init__(self, d: int, mesh: DeviceMesh | Grid2D, eps: float = 1e-5, dtype: Any = np.float64) -> None:
        grid = as_grid(mesh)
        check_divisible(d, grid.q * grid.q, "d_model", f"choose it as a multiple of q^2={grid.q ** 2} (q={grid.q}; "
                   "the layer norm's gain and shift are split q^2 ways)")
        self.grid, self.d, self.eps = grid, d, eps
        self.weight = vector_piece(d, grid, ("ones",), dtype)
        self.bias = vector_piece(d, grid, ("zeros",), dtype)

    def forward(self, x: Tensor) -> Tensor:
        y = Scale2D.apply(Normalise2D.apply(x, self.grid, self.d, self.eps), self.weight, self.grid)
        return AddBias2D.apply(y, self.bias, self.grid)


class Attention2D(Module):
    """``nn.CausalSelfAttention`` on the grid: 2-D ``q, k, v, proj``, local attention over this grid
    column's ``n_heads / q`` heads (module docstring)."""

    def __init__(self, d: int, n_heads: int, mesh: DeviceMesh | Grid2D, dtype: Any = np.float64,
                 causal: bool = True) -> None:
        grid = as_grid(mesh)
        check_divisible(n_heads, grid.q, "n_heads", f"choose the heads as a multiple of q={grid.q}")
        check_divisible(d, n_heads, "d_model", f"choose it as a multiple of n_heads={n_heads}")
        self.local_heads, self.causal = n_heads // grid.q, causal
        self.q = Linear2D(d, d, grid, dtype=dtype)
        self.k = Linear2D(d, d, grid, dtype=dtype)
        self.v = Linear2D(d, d, grid, dtype=dtype)
        self.proj = Linear2D(d, d, grid, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.attention(self.q(x), self.k(x), self.v(x), self.local_heads, self.causal))


class Block2D(Module):
    """``nn.Block`` on the ``q x q`` grid: pre-norm attention and MLP, residuals on the local blocks."""

    def __init__(self, d: int, n_heads: int, mesh: DeviceMesh | Grid2D, d_ff: int | None = None,
                 dtype: Any = np.float64, causal: bool = True) -> None:
        grid = as_grid(mesh)
        self.ln1 = LayerNorm2D(d, grid, dtype=dtype)
        self.attn = Attention2D(d, n_heads, grid, dtype=dtype, causal=causal)
        self.ln2 = LayerNorm2D(d, grid, dtype=dtype)
        self.mlp = MLP2D(d, d_ff or 4 * d, grid, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
