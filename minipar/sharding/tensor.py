"""``GlobalTensor``: a numpy array of a global shape laid out over some axes of a ``DeviceMesh``.

A tensor names the mesh ``axes`` its placements refer to, in order (``("dp", "tp")``), and one
placement per axis. Each rank holds only its piece (``local``):

- along a dimension ``d`` sharded by the axes ``a_1 < ... < a_m`` (in the order of ``axes``), axis
  ``a_1`` cuts the ``shape[d]`` rows into ``d_1`` pieces, ``a_2`` cuts the piece of coordinate ``c_1``
  into ``d_2``, and so on (``c_i`` the rank's coordinate, ``d_i`` the degree of ``a_i``): the first axis
  splits into the largest blocks, the next splits each of those (DTensor's and GSPMD's order of
  tiles). When the degrees divide, the piece is block ``((c_1 d_2 + c_2) d_3 + c_3) ...`` of
  ``shape[d] / (d_1 ... d_m)`` rows;
- a cut that does not divide is uneven as in PyTorch DTensor: ``ceil(n/p)`` rows per piece, the last
  ones shorter, possibly empty (5 rows on 2 ranks: 3, 2; 4 rows on 3 ranks: 2, 2, 0;
  ``cost.sharding.shard_bounds``);
- along ``Partial`` axes the pieces add up to the tensor; along ``Replicate`` axes they are equal.

A placement list that does not match the axes raises ``ValueError``. The checks depend only on the
arguments every rank passes alike, so every rank raises the same message before any message is sent. Whether they
did pass the same is checked when a caller makes a tensor: ranks holding another mesh, shape or
placements all raise one ``ValueError`` naming them (``agree.py``; one small untraced collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from minipar.cost.sharding import piece_bounds
from minipar.mesh import AXES, DeviceMesh
from minipar.sharding import agree
from minipar.sharding.placement import Partial, Placement, Replicate, Shard, describe


def check_layout(shape: Sequence[int], axes: Sequence[str], placements: Sequence[Any]) -> None:
    """``ValueError`` unless ``placements`` give one valid placement per named mesh axis (any sizes: a
    cut that does not divide is uneven, module docstring)."""
    axes, placements = tuple(axes), tuple(placements)
    bad = [a for a in axes if a not in AXES]
    if bad or not axes:
        raise ValueError(f"sharding: unknown mesh axes {bad or list(axes)}; name one or more of {AXES}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"sharding: axes {axes} name an axis twice; give each mesh axis once")
    if len(placements) != len(axes):
        raise ValueError(f"sharding: {len(placements)} placements {describe(placements)} for {len(axes)} mesh "
                         f"axes {axes}; give one placement per axis")
    for p in placements:
        if not isinstance(p, Shard | Replicate | Partial):
            raise ValueError(f"sharding: {p!r} is not a placement; use Shard(dim), Replicate() or Partial()")
        if isinstance(p, Shard) and p.dim >= len(shape):
            raise ValueError(f"sharding: {p} in {describe(placements)} names dimension {p.dim} but the tensor "
                             f"of shape {tuple(shape)} has {len(shape)}")


def local_slices(shape: Sequence[int], degrees: Sequence[int], coords: Sequence[int],
                 placements: Sequence[Placement]) -> tuple[slice, ...]:
    """The global index of the piece held at ``coords`` (one per axis, with the axes' ``degrees``):
    ``cost.sharding.piece_bounds``, uneven cuts included."""
    return tuple(slice(a, b) for a, b in piece_bounds(shape, degrees, coords, [str(p) for p in placements]))


class GlobalTensor:
    """This rank's piece of a tensor of global ``shape`` over ``mesh``'s ``axes`` with ``placements``
    (one per axis). ``local`` must have the piece's shape (module docstring). ``t.backward(grad=None)``
    (``engine.backward``) and ``t.to_global()`` (``redistribute.to_global``) are bound by the package's
    ``__init__``: their code sits in the layers above this one.

    Every rank of the mesh makes the tensor with equal arguments, and checks it (``agree.tensor``: one
    small untraced collective). The ops' results and gradients pass ``check=False``: their layout
    follows from checked inputs on every rank alike (in debug mode each op is checked instead)."""

    def __init__(self, local: np.ndarray, shape: Sequence[int], mesh: DeviceMesh, axes: Sequence[str],
                 placements: Sequence[Placement], *, check: bool = True) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.mesh, self.axes, self.placements = mesh, tuple(axes), tuple(placements)
        check_layout(self.shape, self.axes, self.placements)
        if check:
            agree.tensor(self)  # one small control-plane collective: every rank holds this layout (agree.py)
        want = tuple(s.stop - s.start for s in local_slices(self.shape, self.degrees, self.coords, self.placements))
        local = np.asarray(local)
        if local.shape != want:
            raise ValueError(f"sharding: a piece of shape {local.shape} for a {self.shape} tensor placed "
                             f"{describe(self.placements)} over {self.axes}; each rank's piece has shape {want}")
        self.local = local
        self.requires_grad, self.grad = False, None  # autograd (``minipar.sharding.autograd``)
        self.parents: tuple[GlobalTensor, ...] = ()
        self.backward_fn: Any = None
        self.passes_gradient = False  # a redistribution's output (autograd.py)

    def requires_grad_(self, flag: bool = True) -> GlobalTensor:
        """Make this (leaf) tensor one whose gradient ``backward`` accumulates into ``.grad``."""
        self.requires_grad = flag
        return self

    @classmethod
    def zeros(cls, shape: Sequence[int], mesh: DeviceMesh, axes: Sequence[str], placements: Sequence[Placement],
              dtype: Any = np.float64) -> GlobalTensor:
        """Zeros of ``shape`` laid out as ``placements``: each rank allocates its piece only."""
        check_layout(shape, axes, placements)
        sl = local_slices(shape, [mesh.degree(a) for a in axes], [mesh.coords[a] for a in axes], placements)
        return cls(np.zeros(tuple(s.stop - s.start for s in sl), dtype=dtype), shape, mesh, axes, placements)

    @classmethod
    def empty_like(cls, t: GlobalTensor, placements: Sequence[Placement]) -> GlobalTensor:
        """Zeros of ``t``'s shape, mesh and axes laid out as ``placements`` (each rank's piece only)."""
        return cls.zeros(t.shape, t.mesh, t.axes, placements, t.local.dtype)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(self.mesh.degree(a) for a in self.axes)

    @property
    def coords(self) -> tuple[int, ...]:
        return tuple(self.mesh.coords[a] for a in self.axes)

    @classmethod
    def from_global(cls, array: np.ndarray, mesh: DeviceMesh, axes: Sequence[str],
                    placements: Sequence[Placement]) -> GlobalTensor:
        """For tests and examples: every rank passes the WHOLE array and keeps only its piece (no
        message). Along a ``Partial`` axis coordinate 0 keeps the values and the others hold zeros."""
        array = np.asarray(array)
        axes, placements = tuple(axes), tuple(placements)
        check_layout(array.shape, axes, placements)
        coords = tuple(mesh.coords[a] for a in axes)
        degrees = tuple(mesh.degree(a) for a in axes)
        piece = array[local_slices(array.shape, degrees, coords, placements)].copy()
        if any(isinstance(p, Partial) and c != 0 for p, c in zip(placements, coords, strict=True)):
            piece = np.zeros_like(piece)
        return cls(piece, array.shape, mesh, axes, placements)

    def __repr__(self) -> str:
        return (f"GlobalTensor(shape={self.shape}, axes={self.axes}, placements={describe(self.placements)}, "
                f"local shape={self.local.shape})")
