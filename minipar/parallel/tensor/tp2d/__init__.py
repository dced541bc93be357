"""2-D tensor parallelism: Xu et al. 2021, "An Efficient 2D Method for Training Super-Large Deep
Learning Models" (Optimus, Colossal-AI's 2-D mode), built on SUMMA (van de Geijn & Watts 1997).
Weights and activations are split on a ``q x q`` grid of ``p = q^2`` ranks; every parameter and
activation is ``1/q^2`` of the single-process one.

- ``summa.py``: the grid (``Grid2D`` over a ``DeviceMesh(comm, dp=q, tp=q)``, ``grid_2d``), the
  SUMMA products ``A B``, ``A B^T``, ``A^T B`` and ``Summa``, the autograd op whose backward is SUMMA.
- ``layers.py``: ``block`` (a rank's block of an activation), ``AddBias2D``, ``Linear2D`` and the
  2-D transformer MLP ``MLP2D``.
- ``model.py``: ``LayerNorm2D`` (statistics all-reduced along the grid row), ``Attention2D`` (heads
  split over grid columns, attention local) and the transformer block ``Block2D``.

Bytes per rank and memory per rank are in ``minipar.cost.tensor2d``.
"""

from minipar.parallel.tensor.tp2d.layers import MLP2D, AddBias2D, Linear2D, block, vector_piece
from minipar.parallel.tensor.tp2d.model import Attention2D, Block2D, LayerNorm2D, LayerNorm2DOp
from minipar.parallel.tensor.tp2d.summa import Grid2D, Summa, check_square, grid_2d, summa_ab, summa_abt, summa_atb

__all__ = ["AddBias2D", "Attention2D", "Block2D", "Grid2D", "LayerNorm2D", "LayerNorm2DOp", "Linear2D", "MLP2D",
           "Summa", "block", "check_square", "grid_2d", "summa_ab", "summa_abt", "summa_atb",
           "vector_piece"]
