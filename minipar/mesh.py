"""A named device mesh: the world's ranks as a grid with one axis per kind of parallelism.

Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", Sec. 3) composes pipeline (p), tensor (t) and data (d) parallelism on
``p x t x d`` GPUs; context/sequence parallelism adds an axis. Here the grid is ``arange(world)``
reshaped to ``AXES = (pp, dp, sp, tp)``, the last axis varying fastest::

    rank = ((pp_i * dp + dp_i) * sp + sp_i) * tp + tp_i

Tensor parallelism is innermost, as Megatron-LM places it: its all-reduces run in every layer, so
its ``t`` ranks are consecutive and share a node's fast links. Sequence parallelism comes next (its
all-to-alls or ring hops run in every layer too), then data parallelism (one gradient reduction per
step), and pipeline parallelism outermost (point-to-point activations only, the cheapest traffic to
send across nodes). This is Megatron-LM's default order ``tp-cp-dp-pp`` (``cp`` = its context
parallelism) and picotron's ``arange(world).view(dp, pp, cp, tp)`` with dp and pp swapped.

Each rank gets its coordinates and one sub-communicator per axis: the ranks that differ from it in
that coordinate alone (``mesh["tp"]``). Methods that reduce over two axes at once (gradients of a
model replicated over both ``dp`` and ``sp``) ask for the pair (``mesh.group("dp", "sp")``). Every
group is built with ``comm.split``, on every rank, in the same order, when the mesh is made. A message
between two ranks of one group differs in that group's coordinates only, so a trace's traffic can be
told apart by axis (``axis_of``) with nothing but the mesh's shape, which ``meta()`` puts in the trace.

A mesh whose degrees do not multiply to the world size is refused on every rank before any message,
naming the product and the world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar.comm import Communicator

AXES = ("pp", "dp", "sp", "tp")  # slowest to fastest varying
PAIRS = (("dp", "sp"),)  # axis pairs a method reduces over (built with the mesh)


@dataclass(frozen=True)
class MeshShape:
    """The degrees of a mesh, without any communicator: coordinates and groups as arithmetic."""

    pp: int = 1
    dp: int = 1
    sp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        bad = {a: d for a, d in self.degrees().items() if not isinstance(d, int | np.integer) or d < 1}
        if bad:
            raise ValueError(f"mesh: every degree must be a positive int, got {bad}")

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def size(self) -> int:
        return int(np.prod(list(self.degrees().values())))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.degrees().values())

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of world rank ``rank``."""
        return dict(zip(AXES, (int(i) for i in np.unravel_index(rank, self.shape)), strict=True))

    def rank_of(self, **coords: int) -> int:
        """The world rank at ``coords`` (missing axes: 0)."""
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise ValueError(f"mesh: no axis {unknown}; the axes are {AXES}")
        return int(np.ravel_multi_index(tuple(coords.get(a, 0) for a in AXES), self.shape))

    def group(self, rank: int, *axes: str) -> list[int]:
        """World ranks of ``rank``'s group along ``axes``: those equal to it in every other coordinate,
        in the order of the grid (so a group's rank ``i`` is its ``i``-th member)."""
        self._check_axes(axes)
        mine = self.coords(rank)
        return [r for r in range(self.size)
                if all(c == mine[a] for a, c in self.coords(r).items() if a not in axes)]

    def axis_of(self, a: int, b: int) -> str:
        """The axes in which world ranks ``a`` and ``b`` differ, joined by ``+`` (``"tp"``,
        ``"dp+sp"``); ``""`` for a rank and itself."""
        ca, cb = self.coords(a), self.coords(b)
        return "+".join(ax for ax in AXES if ca[ax] != cb[ax])

    def meta(self) -> dict[str, Any]:
        """For a trace's metadata: ``{"axes": [...], "shape": [...]}``; the viewer rebuilds the
        coordinates from it (``np.unravel_index``)."""
        return {"axes": list(AXES), "shape": list(self.shape)}

    def _check_axes(self, axes: Sequence[str]) -> None:
        unknown = sorted(set(axes) - set(AXES))
        if unknown or not axes:
            raise ValueError(f"mesh: unknown axes {unknown or list(axes)}; name one or more of {AXES}")

    def __str__(self) -> str:
        return "-".join(f"{a.upper()}({d})" for a, d in self.degrees().items())


def check_mesh(shape: MeshShape, world: int) -> None:
    """``ValueError`` (the same on every rank, before any message) unless the degrees multiply to
    ``world``."""
    if shape.size != world:
        product = " x ".join(f"{a}={d}" for a, d in shape.degrees().items() if d > 1) or "1"
        raise ValueError(f"mesh: {product} = {shape.size} ranks but the world has {world}; "
                         f"launch mpiexec -n {shape.size}, or choose degrees whose product is {world}")


class DeviceMesh:
    """The ranks of ``comm`` as a ``pp x dp x sp x tp`` grid (module docstring), with a
    sub-communicator per axis (``mesh["dp"]``) and per pair in ``PAIRS`` (``mesh.group("dp",
    "sp")``). Every rank builds it with the same degrees; unnamed axes have degree 1::

        mesh = DeviceMesh(comm, dp=2, pp=2, tp=2)
        mesh["tp"].allreduce(x)      # over the 2 ranks that differ from this one in tp only
        mesh.coords                  # {"pp": 1, "dp": 0, "sp": 0, "tp": 1}
    """

    def __init__(self, comm: Communicator, dp: int = 1, pp: int = 1, tp: int = 1, sp: int = 1) -> None:
        self.shape = MeshShape(pp=pp, dp=dp, sp=sp, tp=tp)
        check_mesh(self.shape, comm.size)
        self.comm, self.rank = comm, comm.rank
        self.coords = self.shape.coords(comm.rank)
        self._groups: dict[tuple[str, ...], Communicator] = {}
        for axes in [(a,) for a in AXES] + [tuple(p) for p in PAIRS]:
            color = self.shape.rank_of(**{a: c for a, c in self.coords.items() if a not in axes})
            self._groups[axes] = comm.split(color, key=comm.rank)

    def __getitem__(self, axis: str) -> Communicator:
        return self.group(axis)

    def group(self, *axes: str) -> Communicator:
        """The sub-communicator over ``axes`` (one axis, or a pair in ``PAIRS``, in grid order)."""
        self.shape._check_axes(axes)
        key = tuple(a for a in AXES if a in axes)
        if key not in self._groups:
            raise ValueError(f"mesh: no communicator over {key}; the mesh builds one per axis and {PAIRS}")
        return self._groups[key]

    def degree(self, axis: str) -> int:
        return self.shape.degrees()[axis]

    def meta(self) -> dict[str, Any]:
        return self.shape.meta()

    def __str__(self) -> str:  # picotron's TP(2)-CP(1)-PP(2)-DP(2)-Rank(5)
        where = ", ".join(f"{a} {c}" for a, c in self.coords.items())
        return f"{self.shape}-Rank({self.rank}: {where})"
