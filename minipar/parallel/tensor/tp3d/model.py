"""The 3-D transformer block (Bian et al. 2021, Sec. 3; Colossal-AI's 3-D layers): layer norm,
attention and MLP with every activation and parameter split ``q^3`` ways on the cube.

Layout. The block's input and output, and every residual sum, are input pieces of the cube
(``layers.input_piece``): rank ``(b, k, n)`` holds batch rows ``[b B/q + n B/q^2, ...)`` (whole
sequences: the leading axis is the batch) and features block ``k``.

How the axes are passed. A ``Linear3D`` built on a cube view maps an input piece of that view to an
output piece, which is the input piece of the view with ``k`` and ``n`` exchanged
(``Cube3D.swapped``). So each pair of linears is one layer on ``cube`` and one on
``cube.swapped()``, and the pair ends in the layout it began with, where the residual adds are
local. Three other ways were possible and are worse: redistributing the output back (an all-to-all
of every activation, which the paper's layout exists to avoid); a ``transposed`` flag on each op
(every op would branch on which axis plays ``k``); or Colossal-AI's global state (each of its 3-D
linears' constructors ends with ``swap_in_out_group()``, exchanging the input and output groups in
a module-level environment, so layers must be built in the order data flows through them, and a
layer built out of that order silently gets the wrong groups). A view object keeps each op written
once in the paper's ``(b, k, n)`` and says, where a layer is built, which physical axis plays which
role; ``Cube3D.swapped`` is an involution, so two linears bring the layout back.

- ``LayerNorm3D``: an input piece's features are split along ``k``, so its ``q`` ranks ``(b, *, n)``
  all-reduce the row sums (mean, then variance). The gain and shift block ``k`` is used by the
  ``q^2`` ranks ``(*, k, *)``; each stores a ``1/q^3`` piece of the whole (``plane_piece`` on the
  swapped view), all-gathered over that plane forward and reduce-scattered backward (one
  Colossal-AI version all-gathers its gain over the same ``q^2`` ranks, its "input x weight" group;
  another keeps the ``1/q`` block on all ``q^2`` and all-reduces the gradient: ``q`` times the
  memory). Seen from one piece this is ``tensor2d``'s layer norm with the line along ``k`` as
  the grid row and the plane as the grid column, so ``LayerNorm2DOp`` runs on ``PieceGrid``
  unchanged: it keeps its input piece and the gathered gain (``d/q`` numbers).
- ``Attention3D``: ``q``, ``k``, ``v`` are ``Linear3D`` on ``cube`` that share one gathered input
  (``GatherInput``: one all-gather forward, one reduce-scatter of the summed gradient backward, as a
  fused ``qkv`` layer would, keeping ``nn.CausalSelfAttention``'s names); their outputs are output
  pieces, rows ``[b B/q + k B/q^2, ...)`` (whole sequences) and features block ``n`` = heads ``[n H/q,
  (n+1) H/q)``, so attention runs locally on ``H/q`` heads with no message; the concatenated heads
  are an input piece of the swapped view, where ``proj`` lives, and its output is back in the
  block's layout.
- ``MLP3D``: ``fc`` on ``cube``, GELU on the local piece, ``proj`` on ``cube.swapped()``.
- ``Block3D``: ``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` (``nn.Block``, same parameter names).

Every parameter is ``1/q^3`` of the whole on every rank, initialised as its slice of the
single-process module's. Bytes and memory per rank: ``minipar.cost.tensor3d``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import functional as F
from minipar.autograd import Tensor
from minipar.mesh import DeviceMesh
from minipar.nn import Module
from minipar.parallel.tensor.tp2d.layers import check_width
from minipar.parallel.tensor.tp2d.model import LayerNorm2DOp
from minipar.parallel.tensor.tp3d.layers import Cube3D, GatherInput, Linear3D, as_cube, plane_piece


def check_block(q: int, d: int, n_heads: int | None = None, d_ff: int | None = None) -> None:
    """Every reason a block (or its layer norm, attention or MLP: leave out what it lacks) of these
    sizes cannot run on a ``q`` cube, in one ``ValueError`` (raised alike on every rank, before any
    message), each saying what to change."""
    cube = q ** 3
    problems = []
    if d % cube:
        problems.append(f"d_model={d} is not a multiple of q^3={cube} (the biases and layer-norm gains are split "
                        "q^3 ways): choose a multiple")
    if d_ff is not None and d_ff % cube:
        problems.append(f"d_ff={d_ff} is not a multiple of q^3={cube} (fc's bias is split q^3 ways): choose a "
                        "multiple")
    if n_heads is not None and n_heads % q:
        problems.append(f"n_heads={n_heads} is not a multiple of q={q} (feature block n holds H/q whole heads): "
                        "choose a multiple")
    if n_heads and d % n_heads:
        problems.append(f"d_model={d} is not a multiple of n_heads={n_heads}: choose heads that divide it")
    if problems:
        raise ValueError("3-D tensor parallelism: " + "; ".join(problems))


class LayerNorm3D(Module):
    """``nn.LayerNorm(d)`` on input pieces of ``mesh``'s cube (module docstring); ``d`` must be a
    multiple of ``q^3``."""

    def __init__(self, d: int, mesh: DeviceMesh | Cube3D, eps: float = 1e-5, dtype: Any = np.float64) -> None:
        cube = as_cube(mesh)
        check_block(cube.q, d)
        # an input piece of cube is an output piece of cube.swapped(): features block k, the plane (*, k, *)
        self.cube, self.d, self.eps, self.grid = cube, d, eps, cube.swapped().output_grid()
        self.weight = plane_piece(d, cube.swapped(), ("ones",), dtype)
        self.bias = plane_piece(d, cube.swapped(), ("zeros",), dtype)

    def forward(self, x: Tensor) -> Tensor:
        check_width(x, self.d // self.cube.q, self.d, self.cube.q, "LayerNorm3D", "input_piece", "piece")
        return LayerNorm2DOp.apply(x, self.weight, self.bias, self.grid, self.d, self.eps)


class Attention3D(Module):
    """``nn.CausalSelfAttention`` on the cube: ``q, k, v`` on ``cube``, local attention over this
    rank's ``n_heads / q`` heads, ``proj`` on ``cube.swapped()`` (module docstring)."""

    def __init__(self, d: int, n_heads: int, mesh: DeviceMesh | Cube3D, dtype: Any = np.float64,
                 causal: bool = True) -> None:
        cube = as_cube(mesh)
        check_block(cube.q, d, n_heads)
        self.local_heads, self.causal = n_heads // cube.q, causal
        self.q = Linear3D(d, d, cube, bias=True, dtype=dtype)
        self.k = Linear3D(d, d, cube, bias=True, dtype=dtype)
        self.v = Linear3D(d, d, cube, bias=True, dtype=dtype)
        self.proj = Linear3D(d, d, cube.swapped(), bias=True, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        xg = GatherInput.apply(x, self.q.cube)  # X_bk once for q, k and v
        heads = F.attention(self.q.gathered(xg), self.k.gathered(xg), self.v.gathered(xg), self.local_heads,
                            self.causal)
        return self.proj(heads)


class MLP3D(Module):
    """``nn.FeedForward`` on the cube: ``fc`` on ``cube``, GELU on the local piece, ``proj`` on
    ``cube.swapped()``; takes and returns input pieces of ``cube``."""

    def __init__(self, d_model: int, d_ff: int, mesh: DeviceMesh | Cube3D, dtype: Any = np.float64) -> None:
        cube = as_cube(mesh)
        check_block(cube.q, d_model, d_ff=d_ff)
        self.fc = Linear3D(d_model, d_ff, cube, bias=True, dtype=dtype)
        self.proj = Linear3D(d_ff, d_model, cube.swapped(), bias=True, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block3D(Module):
    """``nn.Block`` on the ``q x q x q`` cube: pre-norm attention and MLP, residual adds on the local
    pieces; takes and returns input pieces of ``mesh``'s cube."""

    def __init__(self, d: int, n_heads: int, mesh: DeviceMesh | Cube3D, d_ff: int | None = None,
                 dtype: Any = np.float64, causal: bool = True) -> None:
        cube = as_cube(mesh)
        d_ff = d_ff or 4 * d
        check_block(cube.q, d, n_heads, d_ff)
        self.ln1 = LayerNorm3D(d, cube, dtype=dtype)
        self.attn = Attention3D(d, n_heads, cube, dtype=dtype, causal=causal)
        self.ln2 = LayerNorm3D(d, cube, dtype=dtype)
        self.mlp = MLP3D(d, d_ff, cube, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
