"""2.5-D layers (Wang et al. 2021, Tesseract): each layer of the stack runs the 2-D layer on its own
``q x q`` grid; the ``d`` layers hold the same weights and sum their gradients over the depth.

Forward. Layer ``k`` of the stack holds rows ``[k b/d, (k+1) b/d)`` of every activation, split on
its grid as ``tensor2d`` splits a whole batch (``grid.block_2p5d``), and the same ``1/q^2`` piece of
every weight and bias as the ranks ``(i, j)`` of the other layers (``Parameter(full_shape=,
shard=)`` slices of the single-process module, the same slice on every layer). So a 2.5-D layer IS
the 2-D layer on a ``Grid2p5D`` (which is a ``Grid2D`` for layer ``k``): ``Linear2p5D`` is
``tensor2d.Linear2D`` on it, SUMMA's broadcasts and reduces stay inside the layer, and no activation
crosses the depth. This is the paper's layout as the authors' Colossal-AI documents it (``X`` in ``d
q x q`` blocks, reshaped into ``d`` layers of ``q x q``; the weight in ``q x q`` blocks; SUMMA on
each layer), and Colossal-AI's ``Linear2p5D`` keeps a ``[in/q, out/q]`` weight on every rank
whatever the depth.

Backward. Within a layer SUMMA's backward gives each rank ``dW_ij`` summed over its layer's rows;
the whole gradient sums the ``d`` layers' (``dW = sum_k X_k^T dY_k``): an all-reduce (sum) of every
parameter piece over the depth (``mesh["pp"]``), as data parallelism over the ``d`` layers does, so
each copy takes the same optimizer step. ``DepthAllReduce`` does it from a hook on each parameter
(fired when its gradient is complete, as DDP's hooks; ``minipar.parallel.ddp``) with one blocking
ring all-reduce per parameter and no buckets: data parallelism over the depth in its naive form
(DDP's buckets would cut the messages, not the bytes). It sums rather than averages: each rank's
loss is its share of the one loss (``sum_r loss_r = loss``), so the sum is that loss's gradient. To
accumulate over several backward passes, run all but the last with ``depth_allreduce.sync = False``
(the hook would otherwise sum the earlier, already summed part again), as DDP's ``no_sync``.

Memory per rank: ``1/q^2`` of every parameter (the whole, ``d`` copies over the ranks) and ``1/(d
q^2)`` of every activation kept for backward (plus, per layer norm, its gathered gain, ``d_model/q``
numbers, as in 2-D). Bytes per rank: ``minipar.cost.tensor2p5d``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar.autograd import Tensor
from minipar.mesh import DeviceMesh
from minipar.nn import Module
from minipar.parallel.tensor.tp2d import MLP2D, Attention2D, Block2D, LayerNorm2D, Linear2D
from minipar.parallel.tensor.tp2p5d.grid import Grid2p5D, as_grid_2p5d

ALLREDUCE = "ring"  # the depth's gradient all-reduce (comm/ring.py): every message is in the trace


class DepthAllReduce:
    """Sum every parameter gradient of ``module`` over the depth (``grid.depth``) as soon as it is
    complete (a hook per parameter; module docstring). Every rank of the depth fires the hooks in the
    same order (their graphs are alike), so the blocking all-reduces match. Nothing is sent on a
    depth of 1. ``sync = False``: gradients accumulate on this layer only (DDP's ``no_sync``); the
    next backward with ``sync = True`` sums the total."""

    def __init__(self, module: Module, grid: Grid2p5D) -> None:
        self.comm, self.sync = grid.depth, True
        self.handles = [p.register_hook(self._on_grad_ready) for p in module.parameters()] if grid.d > 1 else []

    def _on_grad_ready(self, p: Tensor) -> None:
        if self.sync:
            p.grad = self.comm.allreduce(p.grad, op="sum", algorithm=ALLREDUCE)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Linear2p5D(Linear2D):
    """``Y = X W + b`` on ``d`` stacked ``q x q`` grids (``mesh``: a ``DeviceMesh(comm, pp=d, dp=q,
    tp=q)`` or a ``Grid2p5D``): ``tensor2d.Linear2D`` on this rank's layer, gradients summed over the
    depth. Takes and returns ``grid.block_2p5d`` blocks; same parameter names, shapes per rank and
    refusals as ``Linear2D``."""

    def __init__(self, in_features: int, out_features: int, mesh: DeviceMesh | Grid2p5D, bias: bool = True,
                 dtype: Any = np.float64) -> None:
        grid = as_grid_2p5d(mesh)
        super().__init__(in_features, out_features, grid, bias, dtype)
        self.depth_allreduce = DepthAllReduce(self, grid)


class MLP2p5D(MLP2D):
    """``nn.FeedForward`` (``proj(gelu(fc(x)))``) on the stacked grids: ``tensor2d.MLP2D`` on this
    rank's layer, gradients summed over the depth."""

    def __init__(self, d_model: int, d_ff: int, mesh: DeviceMesh | Grid2p5D, dtype: Any = np.float64) -> None:
        grid = as_grid_2p5d(mesh)
        super().__init__(d_model, d_ff, grid, dtype)
        self.depth_allreduce = DepthAllReduce(self, grid)


class LayerNorm2p5D(LayerNorm2D):
    """``nn.LayerNorm(d)`` on the stacked grids: ``tensor2d.LayerNorm2D`` on this rank's layer (the
    statistics of a row need only its grid row), gain and shift gradients summed over the depth."""

    def __init__(self, d: int, mesh: DeviceMesh | Grid2p5D, eps: float = 1e-5, dtype: Any = np.float64) -> None:
        grid = as_grid_2p5d(mesh)
        super().__init__(d, grid, eps, dtype)
        self.depth_allreduce = DepthAllReduce(self, grid)


class Attention2p5D(Attention2D):
    """``nn.CausalSelfAttention`` on the stacked grids: ``tensor2d.Attention2D`` on this rank's layer
    (whole sequences per grid row, heads per grid column: attention is local), gradients summed over
    the depth."""

    def __init__(self, d: int, n_heads: int, mesh: DeviceMesh | Grid2p5D, dtype: Any = np.float64,
                 causal: bool = True) -> None:
        grid = as_grid_2p5d(mesh)
        super().__init__(d, n_heads, grid, dtype, causal)
        self.depth_allreduce = DepthAllReduce(self, grid)


class Block2p5D(Block2D):
    """``nn.Block`` on the stacked grids: ``tensor2d.Block2D`` on this rank's layer (its layer norms,
    attention and MLP are the 2-D ones), every gradient summed over the depth once complete."""

    def __init__(self, d: int, n_heads: int, mesh: DeviceMesh | Grid2p5D, d_ff: int | None = None,
                 dtype: Any = np.float64, causal: bool = True) -> None:
        grid = as_grid_2p5d(mesh)
        super().__init__(d, n_heads, grid, d_ff, dtype, causal)
        self.depth_allreduce = DepthAllReduce(self, grid)
