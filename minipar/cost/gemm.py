"""GEMM efficiency against the matmul's shape: what a micro-batch's matmuls cost on a cluster whose
efficiency is not one number.

``Cluster.efficiency`` is the fraction of the peak a *large* matmul sustains; a smaller or oddly
shaped one runs slower. Two models, chosen by the cluster's fields (neither: every matmul at
``efficiency``, as before):

- ``gemm_sms`` (published GPUs): the tile and wave quantization of NVIDIA's "Matrix Multiplication
  Background User's Guide" (DU-09799-001, Sec. 3.1-3.2). A GEMM's ``m x n`` output is cut into
  ``256 x 128`` thread-block tiles (the guide's largest, most efficient cuBLAS tile), one per SM at
  a time, so the tiles run in waves of ``gemm_sms`` (108 on an A100: the guide's example); the last
  wave and the edge tiles are partly idle. Useful share ``m n batch / (waves x sms x 256 x 128)``,
  ``waves = ceil(tiles / sms)``. A micro-batch of ``b`` sequences has ``m = b s`` rows: more rows,
  more waves, a smaller idle share of the last one; this is what makes a larger micro-batch faster
  per FLOP (Narayanan et al. 2021, Sec. 3.4, Fig. 7: throughput per GPU rises with the micro-batch).
  cuBLAS also picks smaller tiles to fill the last wave, so this bounds the loss from above.
- ``gemm_curve`` (measured: ``minipar calibrate``): points ``(size, relative rate)``, the rate of a
  square matmul of side ``size`` over the largest timed one; a GEMM ``(m, k, n)`` takes the value at
  its equivalent side ``(m k n)^(1/3)``, interpolated linearly in ``log size`` and held flat beyond
  the ends.

The matmuls of one block for one micro-batch on one rank (``block_gemms``; Megatron's layout, ``t``
ranks, Ulysses ``u``): q k v ``(b s/u, h, 3h/t)``, the scores ``b a/(t u)`` batched ``(s, h/a, s)``,
their product with ``V`` ``(s, s, h/a)``, the projection ``(b s/u, h/t, h)``, the MLP ``(b s/u, h,
f/t)`` and ``(b s/u, f/t, h)``; the head ``(b s/u, h, V/t)``. Each has its two backward GEMMs, the
input gradient ``(m, n, k)`` and the weight gradient ``(k, m, n)`` (outputs ``m x k`` and ``k x n``).
Their FLOPs add up to ``ModelSpec.layer_flops`` (``3x`` with the backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from minipar.cost.cluster import Cluster
from minipar.cost.layout import Layout, ModelSpec, check_specs

TILE = (256, 128)  # the guide's largest cuBLAS tile, one per SM at a time on an A100 (Sec. 3.2)
Gemm = tuple[int, int, int, int]  # (batch, m, k, n): batch products of (m, k) @ (k, n)


def block_gemms(model: ModelSpec, layout: Layout) -> list[Gemm]:
    """The forward GEMMs of one block for one micro-batch on one rank (module docstring)."""
    check_specs("block_gemms", model=model, layout=layout)
    s, h, a, f, t, u = model.seq, model.hidden, model.heads, model.ffn, layout.tp, layout.sp
    rows, heads = layout.micro_batch * s // u, layout.micro_batch * a // (t * u)
    return [(1, rows, h, 3 * h // t), (heads, s, h // a, s), (heads, s, s, h // a), (1, rows, h // t, h),
            (1, rows, h, f // t), (1, rows, f // t, h)]


def head_gemm(model: ModelSpec, layout: Layout) -> Gemm:
    """The logits' forward GEMM for one micro-batch on one rank."""
    check_specs("head_gemm", model=model, layout=layout)
    return (1, layout.micro_batch * model.seq // layout.sp, model.hidden, model.vocab // layout.tp)


def wave_efficiency(batch: int, m: int, n: int, sms: int, tile: tuple[int, int] = TILE) -> float:
    """Useful share of the tiles a GEMM with a ``batch x m x n`` output runs in waves of ``sms``."""
    tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    return batch * m * n / (math.ceil(tiles / sms) * sms * tile[0] * tile[1])


def curve_efficiency(m: int, k: int, n: int, curve: Sequence[tuple[float, float]]) -> float:
    """The measured relative rate at the equivalent square side ``(m k n)^(1/3)`` (module docstring)."""
    side = math.log((m * k * n) ** (1 / 3))
    xs = [math.log(size) for size, _ in curve]
    if side <= xs[0]:
        return curve[0][1]
    for (x0, (_, y0)), (x1, (_, y1)) in zip(zip(xs, curve), zip(xs[1:], curve[1:])):
        if side <= x1:
            return y0 + (y1 - y0) * (side - x0) / (x1 - x0)
    return curve[-1][1]


def efficiency(cluster: Cluster, gemm: Gemm) -> float:
    """The fraction of ``cluster.efficiency`` one forward or backward GEMM ``(batch, m, k, n)``
    (output ``batch x m x n``) sustains: the wave model, the measured curve, or 1."""
    batch, m, k, n = gemm
    if cluster.gemm_sms:
        return wave_efficiency(batch, m, n, cluster.gemm_sms)
    if cluster.gemm_curve:
        return curve_efficiency(m, k, n, cluster.gemm_curve)
    return 1.0


def training_seconds(cluster: Cluster, gemm: Gemm) -> tuple[float, float]:
    """Seconds of a GEMM's forward and of its two backward GEMMs (input and weight gradients) on
    ``cluster``: ``2 batch m k n`` FLOPs each at ``peak x efficiency x`` its shape's share."""
    check_specs("training_seconds", cluster=cluster)
    batch, m, k, n = gemm
    rate = cluster.peak_flops * cluster.efficiency
    flops = 2.0 * batch * m * k * n
    forward = flops / (rate * efficiency(cluster, gemm))
    backward = sum(flops / (rate * efficiency(cluster, g)) for g in ((batch, m, n, k), (batch, k, m, n)))
    return forward, backward


def block_seconds(model: ModelSpec, layout: Layout, cluster: Cluster) -> float:
    """Seconds of one block's matmuls for one micro-batch on one rank, forward and backward, with
    the recomputation ``layout.recompute`` asks (full: every forward again; selective: the scores
    and their product with ``V``)."""
    gemms = [training_seconds(cluster, g) for g in block_gemms(model, layout)]
    again = {"none": (), "selective": (1, 2), "full": range(len(gemms))}[layout.recompute]
    return sum(f + b for f, b in gemms) + sum(gemms[i][0] for i in again)
