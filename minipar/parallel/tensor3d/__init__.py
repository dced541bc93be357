"""3-D tensor parallelism: Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge
Neural Networks" (Colossal-AI's 3-D mode). Activations and weights are split on a ``q x q x q`` cube
of ``p = q^3`` ranks; a linear layer all-gathers its input along one cube axis and its weight along
another, multiplies locally and reduce-scatters the partial output along the third.

- ``layers.py``: the cube (``Cube3D`` over a ``DeviceMesh(comm, pp=q, dp=q, tp=q)``, ``cube_3d``), the
  pieces of an activation (``input_piece``, ``output_piece``), the autograd op ``Matmul3D``, the
  bias ``AddBias3D`` and the layer ``Linear3D``.

Bytes per rank and parameters per rank are in ``minipar.cost.tensor3d``.
"""

from minipar.parallel.tensor3d.layers import (
    AddBias3D,
    Cube3D,
    Linear3D,
    Matmul3D,
    check_cube,
    cube_3d,
    input_piece,
    output_piece,
)

__all__ = ["AddBias3D", "Cube3D", "Linear3D", "Matmul3D", "check_cube", "cube_3d", "input_piece", "output_piece"]
