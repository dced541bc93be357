"""3-D tensor parallelism: Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge
Neural Networks" (Colossal-AI's 3-D mode). Activations and weights are split on a ``q x q x q`` cube
of ``p = q^3`` ranks; a linear layer all-gathers its input along one cube axis and its weight along
another, multiplies locally and reduce-scatters the partial output along the third.

- ``layers.py``: the cube (``Cube3D`` over a ``DeviceMesh(comm, pp=q, dp=q, tp=q)``, ``cube_3d``),
  the pieces of an activation (``input_piece``, ``output_piece``), the autograd ops ``GatherInput``
  and ``Matmul3D``, the view with ``k`` and ``n`` exchanged (``Cube3D.swapped``, the next layer's),
  the plane of ranks that share a bias block (``Plane``, ``PieceGrid``, ``plane_piece``) and the
  layer ``Linear3D``.
- ``model.py``: the transformer block: ``LayerNorm3D``, ``Attention3D``, ``MLP3D``, ``Block3D``
  and ``check_block``.

Bytes, parameters and activations per rank, for a linear and for the block: ``minipar.cost.tensor3d``.
"""

from minipar.parallel.tensor.tp3d.layers import (
    Cube3D,
    GatherInput,
    Linear3D,
    Matmul3D,
    PieceGrid,
    Plane,
    check_cube,
    cube_3d,
    input_piece,
    output_piece,
    plane_piece,
)
from minipar.parallel.tensor.tp3d.model import MLP3D, Attention3D, Block3D, LayerNorm3D, check_block

__all__ = ["MLP3D", "Attention3D", "Block3D", "Cube3D", "GatherInput", "LayerNorm3D", "Linear3D", "Matmul3D",
           "PieceGrid", "Plane", "check_block", "check_cube", "cube_3d", "input_piece", "output_piece", "plane_piece"]
