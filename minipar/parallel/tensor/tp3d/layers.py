"""A linear layer on a q x q x q cube of ranks (Bian et al. 2021, 3-D tensor parallelism).

``Y = X W`` with ``X`` (``B x K``, ``B`` = rows: the leading axis of the activation), ``W`` (``K x N``,
``minipar.nn.Linear``'s layout). Cut ``B``, ``K`` and ``N`` into ``q`` blocks each; there are ``q^3``
block products ``X_bk W_kn``, one per rank: rank ``(b, k, n)`` of the cube computes ``X_bk W_kn`` and
the ``q`` ranks that share ``(b, n)`` add their products into ``Y_bn = sum_k X_bk W_kn``. This is the
paper's layout (its Sec. 3: ``A`` split over two cube axes, ``B`` over two others, the product summed
along the third), and Colossal-AI's ``Linear3D`` (the authors' implementation), whose input, weight
and output "parallel modes" are the three axes below.

Storage, each piece ``1/q^3`` of the whole:

- ``X_bk`` is used by the ``q`` ranks ``(b, k, *)``; each stores a ``1/q`` slice of its rows: rank
  ``(b, k, n)`` holds rows ``[b B/q + n B/q^2, ... + B/q^2)``, features ``[k K/q, (k+1) K/q)``
  (``input_piece``). Forward all-gathers ``X_bk`` along the ``n`` axis (rows, in rank order).
- ``W_kn`` is used by the ``q`` ranks ``(*, k, n)``; rank ``(b, k, n)`` holds rows
  ``[k K/q + b K/q^2, ... + K/q^2)``, columns ``[n N/q, (n+1) N/q)`` of ``W``, initialised as that
  slice of the single-process ``nn.Linear`` (``Parameter(full_shape=, shard=)``); forward all-gathers
  ``W_kn`` along the ``b`` axis.
- The partial ``X_bk W_kn`` is reduce-scattered along the ``k`` axis: rank ``(b, k, n)`` keeps rows
  ``[b B/q + k B/q^2, ... + B/q^2)`` of ``Y_bn`` (``output_piece``).

Backward is the transposed pattern (Colossal-AI's ``linear_3d`` backward): all-gather ``dY_bn`` along
``k``; ``dX_bk`` partial ``dY_bn W_kn^T`` reduce-scattered along ``n`` (rows, the layout of ``X``'s
piece); ``dW_kn`` partial ``X_bk^T dY_bn`` reduce-scattered along ``b`` (rows, the layout of ``W``'s
piece). The gathered ``X_bk`` and ``W_kn`` are kept from forward. The input's all-gather and its
gradient's reduce-scatter are their own op (``GatherInput``), so layers that read the same input
(attention's ``q``, ``k``, ``v``) gather it once and reduce-scatter the sum of their gradients once.

The output's piece is split like the input's with the roles of the ``k`` and ``n`` axes exchanged:
it is the input piece of the same cube with ``k`` and ``n`` swapped (``Cube3D.swapped``). A second
layer is therefore built on ``cube.swapped()`` and takes the first's output as it is, and its own
output is an input piece of ``cube`` again, so every layer pair (the MLP's ``fc``/``proj``,
attention's ``q``/``proj``) ends in the layout it started from (``model.py``). Colossal-AI does the
same by swapping its input and output parallel groups in a global environment at the end of every
3-D linear's constructor (``swap_in_out_group``); here each layer is handed its view when it is
built.

Bias (optional). ``Y``'s piece on rank ``(b, k, n)`` needs ``b_n``, the ``N/q`` entries of column
block ``n``, on all ``q^2`` ranks ``(*, *, n)`` (the ``Plane``). Each stores a ``1/q^2`` piece of
``b_n`` (entries ``[n N/q + (b q + k) N/q^3, ...)``, ``plane_piece``, so the bias too is ``1/q^3``
per rank; ``N`` a multiple of ``q^3``); forward all-gathers the piece along ``k`` (``N/q^2``
entries) and that along ``b`` (``b_n``); backward reduce-scatters the rows' sum of ``dY``'s piece
along ``b`` and then along ``k``, leaving each rank the gradient of its own piece. Seen from one
output piece this is ``tensor2d``'s bias with the plane as the grid column (``PieceGrid``), so
``tensor2d.AddBias2D`` runs on it unchanged. (Colossal-AI instead keeps ``b_n`` whole on one rank
of each line and broadcasts it; splitting it keeps every parameter at exactly ``1/q^3``.)
Bytes per rank and memory per rank: ``minipar.cost.tensor3d``.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import numpy as np

from minipar.autograd import Context, Function, Tensor
from minipar.comm.collectives import Communicator
from minipar.mesh import DeviceMesh
from minipar.nn import Module, Parameter
from minipar.parallel.tensor.tp2d.layers import AddBias2D, check_width
from minipar.parallel.tensor.tp2d.layers import check_divisible as check_2d

RING = "ring"  # all-gathers and reduce-scatters (comm/ring.py): every message is in the trace


def check_cube(world: int) -> int:
    """``q`` with ``q^3 == world``; ``ValueError`` naming the nearest cubes otherwise (raised on every
    rank alike, before any message)."""
    q = round(world ** (1 / 3)) if world > 0 else 0
    if world < 1 or q ** 3 != world:
        lo = max(int(world ** (1 / 3)), 2) if world > 0 else 2
        near = " or ".join(str(s) for s in sorted({lo ** 3, (lo + 1) ** 3}))
        raise ValueError(f"3-D tensor parallelism runs on a q x q x q cube; the world has {world} ranks, not a "
                         f"cube: launch {near} ranks")
    return q


class Cube3D:
    """This rank's place ``(b, k, n)`` on the ``q x q x q`` cube and the communicators along each
    axis: ``along_b`` (``mesh["pp"]``, rank ``b`` inside it), ``along_k`` (``mesh["dp"]``), ``along_n``
    (``mesh["tp"]``). Built from a ``DeviceMesh`` with ``pp = dp = tp = q`` and ``sp = 1``."""

    def __init__(self, mesh: DeviceMesh) -> None:
        d = {a: mesh.degree(a) for a in ("pp", "dp", "sp", "tp")}
        if not d["pp"] == d["dp"] == d["tp"] or d["sp"] != 1:
            raise ValueError(f"3-D tensor parallelism needs a mesh with pp = dp = tp = q (the cube's axes) and "
                             f"sp = 1; got {d}: build DeviceMesh(comm, pp=q, dp=q, tp=q) or use cube_3d(comm)")
        self.mesh, self.q = mesh, d["tp"]
        self.b, self.k, self.n = mesh.coords["pp"], mesh.coords["dp"], mesh.coords["tp"]
        self.along_b, self.along_k, self.along_n = mesh["pp"], mesh["dp"], mesh["tp"]
        assert (self.along_b.rank, self.along_k.rank, self.along_n.rank) == (self.b, self.k, self.n)
        self.is_swapped = False

    def swapped(self) -> Cube3D:
        """The same cube and communicators with the roles of ``k`` and ``n`` exchanged: the view a
        layer takes its input through when that input is another layer's output (module docstring).
        ``cube.swapped().swapped()`` plays the roles of ``cube``."""
        view = copy.copy(self)
        view.k, view.n, view.along_k, view.along_n = self.n, self.k, self.along_n, self.along_k
        view.is_swapped = not self.is_swapped
        return view

    def output_grid(self) -> PieceGrid:
        """An output piece's neighbours as a ``tensor2d`` grid (``PieceGrid``)."""
        return PieceGrid(self.along_n, Plane(self))

    def __repr__(self) -> str:
        tag = ", swapped" if self.is_swapped else ""
        return f"Cube3D(q={self.q}, b={self.b}, k={self.k}, n={self.n}{tag})"


class Plane:
    """The ``q^2`` ranks ``(*, *, n)`` of a cube view, which all use feature block ``n`` of an output
    piece, as one group for a vector's pieces: ``allgather`` is a ring along ``k`` then one along
    ``b`` (rank ``(b, k, n)``'s piece is piece ``b q + k`` of the block, ``plane_piece``),
    ``reduce_scatter`` the same rings in the opposite order. A ring of ``q`` pieces of ``m`` numbers
    sends ``(q-1) m`` per rank, so a gather of an ``m``-number piece sends ``(q-1)(m + q m)``."""

    def __init__(self, cube: Cube3D) -> None:
        self.cube = cube

    def allgather(self, piece: np.ndarray, algorithm: str = RING) -> np.ndarray:
        half = self.cube.along_k.allgather(piece, algorithm=algorithm)
        return self.cube.along_b.allgather(half, algorithm=algorithm)

    def reduce_scatter(self, whole: np.ndarray, op: str = "sum", algorithm: str = RING) -> np.ndarray:
        half = self.cube.along_b.reduce_scatter(whole, op=op, algorithm=algorithm)
        return self.cube.along_k.reduce_scatter(half, op=op, algorithm=algorithm)


class PieceGrid(NamedTuple):
    """An output piece of a cube view seen as a block of ``tensor2d``'s grid, so its ops that work on
    one block with a row and a column (``AddBias2D``, ``LayerNorm2DOp``) run on the cube unchanged."""

    row: Communicator  # the q ranks (b, k, *): the same rows, the features split among them (along n)
    col: Plane  # the q^2 ranks (*, *, n) that use the same feature block n


def cube_3d(comm: Any) -> Cube3D:
    """The ``q x q x q`` cube of ``comm``'s ranks; a world that is not a cube is refused on every rank
    before the mesh sends its first message."""
    q = check_cube(comm.size)
    return Cube3D(DeviceMesh(comm, pp=q, dp=q, tp=q))


def as_cube(mesh: DeviceMesh | Cube3D) -> Cube3D:
    return mesh if isinstance(mesh, Cube3D) else Cube3D(mesh)


def check_divisible(n: int, by: int, what: str, fix: str) -> None:
    """``tensor2d``'s check, named for 3-D tensor parallelism."""
    check_2d(n, by, what, fix, who="3-D tensor parallelism")


def _piece(x: np.ndarray, cube: Cube3D, row_block: int, sub: int, col_block: int) -> np.ndarray:
    q = cube.q
    check_divisible(x.shape[0], q * q, "batch", f"choose the leading axis as a multiple of q^2={q * q}")
    check_divisible(x.shape[-1], q, "features", f"choose the width as a multiple of q={q}")
    r, c = x.shape[0] // (q * q), x.shape[-1] // q
    lo = (row_block * q + sub) * r
    return np.ascontiguousarray(x[lo:lo + r, ..., col_block * c:(col_block + 1) * c])


def input_piece(x: np.ndarray, cube: Cube3D) -> np.ndarray:
    """Rank ``(b, k, n)``'s piece of a whole input: rows ``[b B/q + n B/q^2, ...)`` of axis 0, features
    (last axis) block ``k``. Refuses a leading axis not divisible by ``q^2`` or a width by ``q``."""
    return _piece(x, cube, cube.b, cube.n, cube.k)


def output_piece(y: np.ndarray, cube: Cube3D) -> np.ndarray:
    """Rank ``(b, k, n)``'s piece of a whole output: rows ``[b B/q + k B/q^2, ...)``, features block ``n``."""
    return _piece(y, cube, cube.b, cube.k, cube.n)


def plane_piece(size: int, cube: Cube3D, init: tuple, dtype: Any) -> Parameter:
    """Rank ``(b, k, n)``'s ``1/q^3`` piece of a length-``size`` vector of which the ``Plane``
    ``(*, *, n)`` uses block ``n`` (a bias, a layer norm's gain): entries ``[n size/q + (b q + k)
    size/q^3, ...)``, initialised as that slice of the whole (``Parameter(full_shape=, shard=)``)."""
    m, q = size // cube.q ** 3, cube.q
    lo = cube.n * q * q * m + (cube.b * q + cube.k) * m
    return Parameter((m,), init, dtype, full_shape=(size,), shard=(slice(lo, lo + m),))


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


class GatherInput(Function):
    """``X_bk`` from the input pieces: all-gather along ``n`` forward (rows, in rank order), reduce-scatter
    the gradient along ``n`` backward, so ``dX_bk``'s partial sums from every product that used the
    gathered block (``q``, ``k`` and ``v`` share one) are added before the one reduce-scatter. Bytes:
    ``(q-1) B K/q^3`` each way. Call as ``GatherInput.apply(x, cube)``."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, cube: Cube3D) -> np.ndarray:
        ctx.cube = cube
        return cube.along_n.allgather(x, algorithm=RING)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        return ctx.cube.along_n.reduce_scatter(np.ascontiguousarray(grad), op="sum", algorithm=RING), None


class Matmul3D(Function):
    """``Y = X W`` on the cube (module docstring) from the gathered ``X_bk`` (``GatherInput``) and this
    rank's weight piece ``w``; returns its output piece. Backward returns ``X_bk``'s partial gradient
    ``dY_bn W_kn^T`` (``GatherInput`` reduce-scatters it). A gradient nobody asked for is neither
    computed nor sent (every rank must ask for the same ones). Call as ``Matmul3D.apply(xg, w, cube)``."""

    @staticmethod
    def forward(ctx: Context, xg: np.ndarray, w: np.ndarray, cube: Cube3D) -> np.ndarray:
        wg = cube.along_b.allgather(w, algorithm=RING)  # W_kn
        ctx.cube = cube
        ctx.save_for_backward(xg, wg)
        return cube.along_k.reduce_scatter(xg @ wg, op="sum", algorithm=RING)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None, None]:
        xg, wg = ctx.saved
        cube = ctx.cube
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return None, None, None
        dy = cube.along_k.allgather(np.ascontiguousarray(grad), algorithm=RING)  # dY_bn
        dw = cube.along_b.reduce_scatter(_rows(xg).T @ _rows(dy), op="sum", algorithm=RING) if need_w else None
        return (dy @ wg.T if need_x else None), dw, None


class Linear3D(Module):
    """``Y = X W`` on the ``q x q x q`` cube of ``mesh`` (a ``DeviceMesh(comm, pp=q, dp=q, tp=q)`` or a
    ``Cube3D``): this rank holds ``W``'s piece (``in/q^2 x out/q``, module docstring); ``forward``
    takes an ``input_piece`` and returns an ``output_piece``. ``in_features`` must be a multiple of
    ``q^2`` and ``out_features`` of ``q`` (``q^3`` with a bias); refused when built, before any
    message. Parameter names and initialisation are ``nn.Linear``'s."""

    def __init__(self, in_features: int, out_features: int, mesh: DeviceMesh | Cube3D, bias: bool = False,
                 dtype: Any = np.float64) -> None:
        cube = as_cube(mesh)
        q = cube.q
        check_divisible(in_features, q * q, "in_features", f"choose it as a multiple of q^2={q * q}")
        by = q ** 3 if bias else q
        why = " (the bias is split q^3 ways)" if bias else ""
        check_divisible(out_features, by, "out_features", f"choose it as a multiple of {by}{why}")
        self.cube, self.in_features, self.out_features = cube, in_features, out_features
        k, n = in_features // (q * q), out_features // q
        lo = (cube.k * q + cube.b) * k
        bound = 1.0 / np.sqrt(in_features)  # the full fan-in, as nn.Linear
        self.weight = Parameter((k, n), ("uniform", bound), dtype, full_shape=(in_features, out_features),
                                shard=(slice(lo, lo + k), slice(cube.n * n, (cube.n + 1) * n)))
        self.bias = plane_piece(out_features, cube, ("uniform", bound), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        check_width(x, self.in_features // self.cube.q, self.in_features, self.cube.q, "Linear3D", "input_piece",
                    "piece")
        return self.gathered(GatherInput.apply(x, self.cube))

    def gathered(self, xg: Tensor) -> Tensor:
        """The layer on an input already gathered along ``n`` (``GatherInput``), which several layers
        of the same input can share."""
        y = Matmul3D.apply(xg, self.weight, self.cube)
        return AddBias2D.apply(y, self.bias, self.cube.output_grid()) if self.bias is not None else y
