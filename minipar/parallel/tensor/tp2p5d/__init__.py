"""2.5-D tensor parallelism: Wang, Xu, Bian and You 2021, "2.5-dimensional distributed model training"
(arXiv 2105.14500, later "Tesseract: Parallelize the Tensor Parallelism Efficiently", ICPP 2022;
Colossal-AI's 2.5-D mode). ``p = d q^2`` ranks form ``d`` stacked ``q x q`` grids.

The design, as the paper's: activations are split ``d q`` ways by rows (batch) and ``q`` ways by
features, weights ``q x q`` and replicated over the depth. Each layer of the stack is then a 2-D
(Optimus / SUMMA) grid working on its ``1/d`` of the batch, so this package adds no product of its
own: ``tensor2d``'s SUMMA, bias, layer norm and attention run on each layer's grid (``Grid2p5D`` is
a ``Grid2D`` for the rank's layer), and the one new collective is the sum of every weight gradient
over the depth, data parallelism over the ``d`` layers.

What this buys over 2-D on the same ``p`` ranks: SUMMA runs ``q = sqrt(p/d)`` steps, not
``sqrt(p)``, broadcasting activation blocks of the same size (``1/p`` of the whole) but weight
blocks ``d`` times larger (``1/q^2``): a rank sends ``(q-1)(|X| + d |W|)/p`` per product against
``(sqrt(p)-1)(|X| + |W|)/p``, less when the activations (batch x sequence rows) outweigh the
weights; the price is ``d`` copies of the weights (``1/q^2`` per rank, not ``1/p``) and the depth's
all-reduce of their gradients.
With ``d = 1`` it is 2-D; with ``q = 1`` it is data parallelism.

- ``grid.py``: the layout: ``Grid2p5D`` over a ``DeviceMesh(comm, pp=d, dp=q, tp=q)`` (why ``pp`` is
  the depth), ``grid_2p5d``, ``check_world`` and ``block_2p5d`` (a rank's block of an activation).
- ``layers.py``: ``DepthAllReduce`` (the depth's gradient sum, from parameter hooks) and
  ``Linear2p5D``, ``MLP2p5D``, ``LayerNorm2p5D``, ``Attention2p5D``, ``Block2p5D``: the 2-D modules on
  the rank's layer with their gradients summed over the depth (``minipar.nn``'s parameter names).

Bytes per rank and memory per rank are in ``minipar.cost.tensor2p5d``.
"""

from minipar.parallel.tensor.tp2p5d.grid import Grid2p5D, as_grid_2p5d, block_2p5d, check_world, grid_2p5d
from minipar.parallel.tensor.tp2p5d.layers import (
    Attention2p5D,
    Block2p5D,
    DepthAllReduce,
    LayerNorm2p5D,
    Linear2p5D,
    MLP2p5D,
)

__all__ = ["Attention2p5D", "Block2p5D", "DepthAllReduce", "Grid2p5D", "LayerNorm2p5D", "Linear2p5D", "MLP2p5D",
           "as_grid_2p5d", "block_2p5d", "check_world", "grid_2p5d"]
