"""FP8 matmuls in Megatron's column- and row-parallel linears (``minipar.fp8`` for the formats,
scales and recipes), equal bit for bit to the single-process ``nn.Linear`` with the same recipe
(fp32 models; ``minipar.fp8`` says when float64 sums round).

Why they are equal: every rank casts its operands with the single-process scales (a sharded
tensor's amax is all-reduced, op max, over the tensor-parallel group under ``DelayedScaling``, as
Transformer Engine does; under ``BlockScaling`` each block lies in one shard) and the GEMMs' sums of
FP8 products are exact in float64 (``minipar.fp8``), so however they are split and summed, the
result rounded once to the model's dtype is the same number:

- column parallel, ``Y_r = X W_r``: ``W_r`` and ``dY_r`` are shards (amaxes all-reduced), ``X``
  whole. ``dX = sum_r dY_r W_r^T`` is summed in float64 by ``f``'s all-reduce (or the sequence
  reduce-scatter) and rounded after it (``Cast``).
- row parallel, ``Y = sum_r X_r W_r``: ``X_r`` and ``W_r`` are shards, ``dY`` whole. The partial
  sums leave the region (``g`` or the reduce-scatter) in float64 and are rounded after it; bias and
  residual are added in the model's dtype, as ``nn.Linear``'s bias and the block's residual.

The cost: ``f``/``g`` carry float64 numbers where an fp32 model's plain layers carry fp32 (twice the
bytes: the price of exact sums in this emulation; hardware reduces bf16 or fp32 outputs), and one
all-reduce of one number per sharded tensor per step under ``DelayedScaling``. The linears are not
fused with the region's entry and exit here (``layers.ColumnParallelMatmul``): each runs as
``Fp8Matmul`` between ``f`` (or the sequence all-gather) and ``g`` (or the reduce-scatter).
Fused q, k, v: their three ``dX`` are summed in float64 and rounded once here, each rounded then
summed in ``nn``; the GPT's weight gradients still agree exactly (``tests/test_fp8.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import fp8
from minipar.autograd import Context, Function, Tensor
from minipar.functional import _AddBias, concat
from minipar.parallel.tensor.comm_ops import ALGORITHM, exit_region, f


class sp_gather(Function):  # Korthikanti et al.'s ``g`` on its own
    """All-gather the sequence shards (axis 0) forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any) -> np.ndarray:
        ctx.comm = comm
        return comm.allgather(x, algorithm=ALGORITHM)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        return ctx.comm.reduce_scatter(grad, op="sum", algorithm=ALGORITHM), None


def column(x: Tensor, linears: list[Any]) -> Tensor:
    """``[lin(x) for lin in linears]`` concatenated on the last axis, each an FP8 GEMM on its own
    ``lin.fp8``; the region is entered once, in float64 so that ``dX``'s all-reduce sums exactly."""
    first = linears[0]
    comm, dtype = first.comm, x.dtype
    wide = fp8.Cast.apply(x, np.float64)
    whole = sp_gather.apply(wide, comm) if first.sequence_parallel else f.apply(wide, comm)
    outs = []
    for lin in linears:
        y = fp8.Fp8Matmul.apply(whole, lin.weight, lin.fp8, (None, comm, comm), dtype)
        outs.append(_AddBias.apply(y, lin.bias) if lin.bias is not None else y)
    return outs[0] if len(outs) == 1 else concat(outs, axis=-1)


def row(lin: Any, x: Tensor, residual: Tensor | None) -> Tensor:
    """``g(X_r W_r) + b + residual`` with an FP8 GEMM: partial sums in float64 through ``g`` (or the
    reduce-scatter), rounded once to ``x``'s dtype after it."""
    partial = fp8.Fp8Matmul.apply(x, lin.weight, lin.fp8, (lin.comm, lin.comm, None), np.float64)
    y = fp8.Cast.apply(exit_region(partial, lin.comm, lin.sequence_parallel), x.dtype)
    if lin.bias is not None:
        y = _AddBias.apply(y, lin.bias)
    return y + residual if residual is not None else y
