"""The 2-D transformer block (Xu et al. 2021, Optimus, Sec. 3): layer norm, attention and MLP with
every activation and parameter split on the q x q grid.

- ``LayerNorm2D``: a row's ``d`` features are spread over the ``q`` ranks of its grid row, so the
  mean and variance are sums all-reduced along the grid row (two all-reduces of one number per local
  row forward; backward recomputes them and all-reduces two more numbers per row). The gain and
  shift are stored and moved like ``Linear2D``'s bias (a ``1/q^2`` piece, all-gathered down the
  column, gradients reduce-scattered); one op (``LayerNorm2DOp``) keeps only its input and the
  gathered gain.
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
from minipar.parallel.tensor.tp2d.layers import (
    GATHER,
    MLP2D,
    Linear2D,
    as_grid,
    check_divisible,
    check_width,
    vector_piece,
)
from minipar.parallel.tensor.tp2d.summa import Grid2D

REDUCE = "ring"  # the layer norm's row all-reduces


class LayerNorm2DOp(Function):
    """``(x - mean) / sqrt(var + eps) * g_j + b_j`` over features split along the grid row, as one op
    (``functional._LayerNorm`` on the grid). Forward: two row all-reduces (the sum, then the sum of
    squared deviations) and the all-gathers of ``g_j`` and ``b_j`` down the column. Keeps ``x`` and
    the gathered ``g_j``; backward recomputes the statistics (the two all-reduces again), all-reduces
    ``sum gh`` and ``sum gh xhat`` (``gh = dY g_j``) along the row and reduce-scatters the column's
    ``sum_rows dY xhat`` and ``sum_rows dY`` (the pieces' gradients).
    Call as ``LayerNorm2DOp.apply(x, gain_piece, shift_piece, grid, d, eps)``."""

    @staticmethod
    def stats(x: np.ndarray, grid: Grid2D, d: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
        mean = grid.row.allreduce(x.sum(axis=-1, keepdims=True), op="sum", algorithm=REDUCE) / d
        xc = x - mean
        var = grid.row.allreduce((xc * xc).sum(axis=-1, keepdims=True), op="sum", algorithm=REDUCE) / d
        rstd = 1.0 / np.sqrt(var + eps)
        xc *= rstd
        return xc, rstd

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, gain: np.ndarray, shift: np.ndarray, grid: Grid2D, d: int,
                eps: float) -> np.ndarray:
        ctx.grid, ctx.d, ctx.eps = grid, d, eps
        ctx.save_for_backward(x)
        out, _ = LayerNorm2DOp.stats(x, grid, d, eps)
        ctx.gain = grid.col.allgather(gain, algorithm=GATHER)
        out *= ctx.gain
        out += grid.col.allgather(shift, algorithm=GATHER)
        return out

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (x,) = ctx.saved
        grid, n = ctx.grid, x.shape[-1]
        xhat, rstd = LayerNorm2DOp.stats(x, grid, ctx.d, ctx.eps)
        need_gain, need_shift = ctx.needs_input_grad[1:3]  # frozen: no reduce-scatter (alike on every rank)
        d_gain = grid.col.reduce_scatter((g * xhat).reshape(-1, n).sum(axis=0), op="sum",
                                         algorithm=GATHER) if need_gain else None
        d_shift = grid.col.reduce_scatter(g.reshape(-1, n).sum(axis=0), op="sum",
                                          algorithm=GATHER) if need_shift else None
        gh = g * ctx.gain
        sums = grid.row.allreduce(np.stack([gh.sum(axis=-1), (gh * xhat).sum(axis=-1)]), op="sum",
                                  algorithm=REDUCE) / ctx.d
        dx = rstd * (gh - sums[0][..., None] - xhat * sums[1][..., None])
        return dx, d_gain, d_shift, None, None, None


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
        check_width(x, self.d // self.grid.q, self.d, self.grid.q, "LayerNorm2D", "block")  # before the all-reduce
        return LayerNorm2DOp.apply(x, self.weight, self.bias, self.grid, self.d, self.eps)


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
