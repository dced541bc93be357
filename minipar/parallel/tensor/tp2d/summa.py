"""SUMMA on a q x q grid of ranks, forward and backward, as one autograd op.

Xu et al. 2021 ("An Efficient 2D Method for Training Super-Large Deep Learning Models", Optimus)
multiply on ``p = q^2`` ranks with SUMMA (van de Geijn & Watts 1997, "SUMMA: Scalable Universal
Matrix Multiplication Algorithm"). ``A`` (``m x k``) and ``B`` (``k x n``) are cut into ``q x q``
blocks; rank ``(i, j)`` holds ``A_ij`` and ``B_ij`` and computes ``C_ij = sum_t A_it B_tj`` in ``q``
steps: at step ``t`` the rank in column ``t`` of each grid row broadcasts its ``A`` block along the
row, the rank in row ``t`` of each grid column broadcasts its ``B`` block down the column, and
every rank adds ``A_it B_tj``. No rank ever holds more than one block of each matrix at a time.

Backward is SUMMA again, in the two transposed forms (Optimus' backward; Colossal-AI's
``Matmul_ABT_2D`` and ``Matmul_ATB_2D``, the authors' implementation), each ``q`` steps of one
broadcast and one reduce:

- ``dA = dC B^T``: ``dA_il = sum_j dC_ij B_lj^T``. At step ``l``, grid row ``l`` broadcasts its
  ``B`` blocks down the columns; rank ``(i, j)`` forms ``dC_ij B_lj^T`` and the ranks of row ``i``
  sum these at rank ``(i, l)`` (a reduce along the row).
- ``dB = A^T dC``: ``dB_lj = sum_i A_il^T dC_ij``. At step ``l``, grid column ``l`` broadcasts its
  ``A`` blocks along the rows; rank ``(i, j)`` forms ``A_il^T dC_ij`` and the ranks of column ``j``
  sum these at rank ``(l, j)`` (a reduce down the column).

The grid is a ``minipar.mesh.DeviceMesh(comm, dp=q, tp=q)``: the grid row ``i`` is the mesh's ``dp``
coordinate and the grid column ``j`` its ``tp`` coordinate, so ``rank = i q + j`` (row-major, as
Optimus and Colossal-AI number their grids). A grid row (the ranks sharing ``i``, where ``A``
travels) is then ``mesh["tp"]`` and a grid column (sharing ``j``, where ``B`` travels) is
``mesh["dp"]``; the rank inside each is ``j`` and ``i``. Reusing the mesh rather than two private
``comm.split`` calls means a trace's messages are told apart by ``mesh.axis_of`` ("tp" = along a
row, "dp" = down a column) and the viewer's mesh figures apply unchanged; the price is that the
axis names are Megatron's, not the grid's, which this class hides behind ``row`` and ``col``.

Bytes per rank (``minipar.cost.tensor2d``): a binomial-tree broadcast on ``q`` ranks sends ``q - 1``
messages in all, so over the ``q`` roots every rank sends ``(q-1)`` blocks of each matrix: forward
``(q-1)(|A_ij| + |B_ij|)``, backward twice that (broadcasts and reduces).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minipar.autograd import Context, Function
from minipar.mesh import DeviceMesh

BROADCAST = "tree"  # binomial tree (comm/tree.py): every message is in the trace
REDUCE = "tree"


def check_square(world: int) -> int:
    """``q`` with ``q * q == world``; ``ValueError`` naming the nearest squares otherwise (raised on
    every rank alike, before any message)."""
    q = math.isqrt(world)
    if q * q != world or world < 1:
        near = " or ".join(str(s) for s in sorted({s for s in (q * q, (q + 1) ** 2) if s >= 4}))
        raise ValueError(f"2-D tensor parallelism runs on a q x q grid; the world has {world} ranks, not a "
                         f"square: launch {near} ranks (mpiexec -n {near.split()[-1]})")
    return q


class Grid2D:
    """This rank's place on the ``q x q`` grid: ``i`` (grid row), ``j`` (grid column), the
    communicator of its grid row (``row``, rank ``j`` inside it) and of its grid column (``col``,
    rank ``i``). Built from a ``DeviceMesh`` with ``dp = tp = q`` (module docstring)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        q, t = mesh.degree("dp"), mesh.degree("tp")
        others = {a: mesh.degree(a) for a in ("pp", "sp") if mesh.degree(a) != 1}
        if q != t or others:
            raise ValueError(f"2-D tensor parallelism needs a mesh with dp = tp = q (the grid's rows and columns) "
                             f"and no other axis; got dp={q}, tp={t}, {others or 'no other axis'}: build "
                             f"DeviceMesh(comm, dp=q, tp=q) or use grid_2d(comm)")
        self.mesh, self.q = mesh, q
        self.i, self.j = mesh.coords["dp"], mesh.coords["tp"]
        self.row, self.col = mesh["tp"], mesh["dp"]
        assert self.row.rank == self.j and self.col.rank == self.i

    def __repr__(self) -> str:
        return f"Grid2D(q={self.q}, i={self.i}, j={self.j})"


def grid_2d(comm: Any) -> Grid2D:
    """The ``q x q`` grid of ``comm``'s ranks; a world that is not a square is refused on every rank
    before the mesh sends its first message."""
    q = check_square(comm.size)
    return Grid2D(DeviceMesh(comm, dp=q, tp=q))


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def summa_ab(a: np.ndarray, b: np.ndarray, grid: Grid2D) -> np.ndarray:
    """``C_ij = sum_t A_it B_tj``: ``q`` steps of a row broadcast of ``A`` and a column broadcast of ``B``."""
    c = np.zeros((*a.shape[:-1], b.shape[-1]), dtype=np.result_type(a, b))
    for t in range(grid.q):
        a_t = grid.row.broadcast(a if grid.j == t else None, root=t, algorithm=BROADCAST)
        b_t = grid.col.broadcast(b if grid.i == t else None, root=t, algorithm=BROADCAST)
        c += a_t @ b_t
    return c


def summa_abt(dc: np.ndarray, b: np.ndarray, grid: Grid2D) -> np.ndarray:
    """``dA_ij = sum_t dC_it B_jt^T``: at step ``l`` a column broadcast of ``B_lj`` and a row reduce of
    ``dC_ij B_lj^T`` to rank ``(i, l)``."""
    out = None
    for t in range(grid.q):
        b_t = grid.col.broadcast(b if grid.i == t else None, root=t, algorithm=BROADCAST)
        part = grid.row.reduce(dc @ b_t.T, root=t, op="sum", algorithm=REDUCE)
        if grid.j == t:
            out = part
    assert out is not None
    return out


def summa_atb(a: np.ndarray, dc: np.ndarray, grid: Grid2D) -> np.ndarray:
    """``dB_ij = sum_t A_ti^T dC_tj``: at step ``l`` a row broadcast of ``A_il`` and a column reduce of
    ``A_il^T dC_ij`` to rank ``(l, j)``."""
    out = None
    for t in range(grid.q):
        a_t = grid.row.broadcast(a if grid.j == t else None, root=t, algorithm=BROADCAST)
        part = grid.col.reduce(_rows(a_t).T @ _rows(dc), root=t, op="sum", algorithm=REDUCE)
        if grid.i == t:
            out = part
    assert out is not None
    return out


class Summa(Function):
    """``C = A B`` on the grid, forward and backward by SUMMA (module docstring). ``a``: this rank's
    block ``A_ij`` (leading axes are rows of ``A``); ``b``: ``B_ij``. Keeps ``A_ij`` and ``B_ij`` for
    backward; a gradient nobody asked for (``needs_input_grad``) is neither computed nor sent, so
    every rank must ask for the same ones. Call as ``Summa.apply(a, b, grid)``."""

    @staticmethod
    def forward(ctx: Context, a: np.ndarray, b: np.ndarray, grid: Grid2D) -> np.ndarray:
        ctx.grid = grid
        ctx.save_for_backward(a, b)
        return summa_ab(a, b, grid)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None, None]:
        a, b = ctx.saved
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        da = summa_abt(grad, b, ctx.grid) if need_a else None
        db = summa_atb(a, grad, ctx.grid) if need_b else None
        return da, db, None
