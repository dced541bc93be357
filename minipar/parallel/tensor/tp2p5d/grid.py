"""The 2.5-D layout: ``d`` stacked ``q x q`` grids on ``p = d q^2`` ranks (Wang et al. 2021, Tesseract).

Rank ``(k, i, j)``: depth (layer of the stack) ``k``, grid row ``i``, grid column ``j``. The ranks
are a ``minipar.mesh.DeviceMesh(comm, pp=d, dp=q, tp=q)``: ``k`` is the ``pp`` coordinate, ``i`` the
``dp`` and ``j`` the ``tp`` one, so ``rank = k q^2 + i q + j``, the numbering of Colossal-AI's
2.5-D mode (the authors' implementation: its row group is ``tp_rank % q``, its depth group
``tp_rank // q^2``). Inside one layer ``k`` the grid is exactly ``tensor2d``'s: its rows are
``mesh["tp"]``, its columns ``mesh["dp"]``, so ``tensor2d``'s SUMMA and layers run on it unchanged;
the depth (the ``d`` ranks sharing ``(i, j)``) is ``mesh["pp"]``.

Why ``pp`` for the depth: the grid must keep ``tensor2d``'s ``dp``/``tp`` (its rows travel on
``tp``, its columns on ``dp``; the trace's ``axis_of`` and the viewer's mesh figures then read a
2.5-D trace's in-layer traffic like a 2-D one), which leaves ``pp`` or ``sp`` for the depth. ``pp``
is the slowest axis: the depth carries the least frequent traffic (one gradient all-reduce per
parameter per step, as data parallelism does), so its ranks are the farthest apart (across nodes)
and each layer's ``q^2`` ranks, which talk in every product, are consecutive. ``sp`` would
interleave the layers inside a grid row. The price: the trace labels the depth's all-reduces ``pp``
(it is no pipeline), which ``Grid2p5D`` hides behind ``depth``.

An activation (batch rows, ..., features) is split ``d q`` ways by rows and ``q`` ways by features
(``block_2p5d``): layer ``k`` takes rows ``[k b/d, (k+1) b/d)`` and splits them on its grid as
``tensor2d.block`` does (row block ``i``, feature block ``j``), so rank ``(k, i, j)`` holds row
block ``k q + i`` of ``d q``: the paper's (and Colossal-AI's) ``X`` in ``d q`` rows and ``q`` columns.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minipar.mesh import DeviceMesh
from minipar.parallel.tensor.tp2d import Grid2D, block
from minipar.parallel.tensor.tp2d.layers import check_divisible

WHO = "2.5-D tensor parallelism"


def check_world(world: int, depth: int) -> int:
    """``q`` with ``depth * q^2 == world``; ``ValueError`` naming what to launch otherwise (raised on
    every rank alike, before any message)."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"{WHO}: the depth d must be an int >= 1, got {depth!r}")
    q = math.isqrt(world // depth) if world >= depth else 0
    if world < 1 or depth * q * q != world:
        near = sorted({depth * s * s for s in (q, q + 1) if s >= 2})
        raise ValueError(f"{WHO} runs on d q^2 ranks (d={depth} stacked q x q grids); the world has {world} "
                         f"ranks, not {depth} x a square: launch {' or '.join(map(str, near))} ranks "
                         f"(mpiexec -n {near[-1]}), or choose a depth d with world / d a square")
    return q


class Grid2p5D(Grid2D):
    """This rank's place ``(k, i, j)`` on ``d`` stacked ``q x q`` grids: ``tensor2d.Grid2D``'s ``q``,
    ``i``, ``j``, ``row`` (``mesh["tp"]``) and ``col`` (``mesh["dp"]``) for its own layer ``k``, so
    every ``tensor2d`` product and layer takes it as its grid, plus ``d``, ``k`` and ``depth``
    (``mesh["pp"]``, the ``d`` ranks sharing ``(i, j)``, rank ``k`` inside it). Built from a
    ``DeviceMesh(comm, pp=d, dp=q, tp=q)`` (module docstring); ``Grid2D.__init__`` is not called, as it
    refuses a mesh with a ``pp`` axis (a single grid has none)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        q, t, sp = mesh.degree("dp"), mesh.degree("tp"), mesh.degree("sp")
        if q != t or sp != 1:
            raise ValueError(f"{WHO} needs a mesh with pp = d (the depth) and dp = tp = q (each layer's grid), "
                             f"no sp; got pp={mesh.degree('pp')}, dp={q}, tp={t}, sp={sp}: build "
                             f"DeviceMesh(comm, pp=d, dp=q, tp=q) or use grid_2p5d(comm, d)")
        self.mesh, self.q, self.d = mesh, q, mesh.degree("pp")
        self.k, self.i, self.j = mesh.coords["pp"], mesh.coords["dp"], mesh.coords["tp"]
        self.row, self.col, self.depth = mesh["tp"], mesh["dp"], mesh["pp"]
        assert self.row.rank == self.j and self.col.rank == self.i and self.depth.rank == self.k

    def __repr__(self) -> str:
        return f"Grid2p5D(d={self.d}, q={self.q}, k={self.k}, i={self.i}, j={self.j})"


def grid_2p5d(comm: Any, depth: int) -> Grid2p5D:
    """``depth`` stacked ``q x q`` grids of ``comm``'s ranks; a world that is not ``depth`` times a
    square is refused on every rank before the mesh sends its first message."""
    q = check_world(comm.size, depth)
    return Grid2p5D(DeviceMesh(comm, pp=depth, dp=q, tp=q))


def as_grid_2p5d(mesh: DeviceMesh | Grid2p5D) -> Grid2p5D:
    """The stacked grids of a ``DeviceMesh(comm, pp=d, dp=q, tp=q)`` (a ``Grid2p5D`` passes through)."""
    return mesh if isinstance(mesh, Grid2p5D) else Grid2p5D(mesh)


def block_2p5d(x: np.ndarray, grid: Grid2p5D) -> np.ndarray:
    """Rank ``(k, i, j)``'s block of a whole activation: rows (axis 0) block ``k q + i`` of ``d q``,
    features (last axis) block ``j`` of ``q`` (module docstring). Refuses (before any message) a batch
    not divisible by ``d q`` or a width not divisible by ``q``."""
    dq = grid.d * grid.q
    check_divisible(x.shape[-1], grid.q, "features", f"choose the width as a multiple of q={grid.q}", WHO)
    check_divisible(x.shape[0], dq, "batch", f"choose the batch as a multiple of d q = {dq} (d={grid.d}, "
                    f"q={grid.q}: rows are split d q ways)", WHO)
    r = x.shape[0] // grid.d
    return block(x[grid.k * r:(grid.k + 1) * r], grid)
