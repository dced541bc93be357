"""FSDP2 as placements: PyTorch's ``fully_shard`` (the per-parameter FSDP of PyTorch 2.4 and later,
"FSDP2"), where every parameter is a DTensor sharded on dimension 0 over the data-parallel mesh axis,
against FSDP1's flat padded buffer per unit (``fsdp.py``; Zhao et al. 2023).

``fully_shard(module, mesh)`` makes every parameter of ``module`` a ``minipar.sharding.GlobalTensor``
placed ``[Shard(0)]`` on the mesh's ``dp`` axis: rank ``c`` keeps rows ``shard_bounds(rows, N, c)`` of
it, ``ceil(rows/N)`` rows each, the last ones shorter or empty where ``N`` does not divide them (a
bias of 5 on 2 ranks: 3 and 2 elements; no padding is kept or sent). The units, their hooks and
their order are FSDP1's (``transformer_units``; ``FullyShardedDataParallel`` runs them): before a
unit computes, each of its parameters is all-gathered, ``[Shard(0)] -> [Replicate()]`` (the ring
passes the unequal pieces as they are; the next unit's are prefetched on the communicator's
background thread); after its backward each gradient, a partial sum over the ranks, is
redistributed ``[Partial()] -> [Shard(0)]`` (``minipar.sharding.redistribute``: a reduce-scatter, or
for unequal pieces one pairwise exchange sending the same bytes). AdamW then runs on each rank's
pieces, so a step equals one process's on the global batch, as FSDP1's does.

Bytes per rank per step (``cost.zero.fsdp2_traffic_bytes``): per parameter of ``n`` elements and
pieces ``s_0 .. s_{N-1}``, two all-gathers (forward, and backward after resharding) of
``n - s_{c+1}`` elements each and one reduce-scatter of ``n - s_c``. When ``N`` divides every first
dimension this is FSDP1's ``3 (N-1)/N Psi`` with no padding; otherwise FSDP1 sends its padding and
FSDP2 the unequal pieces. Memory per rank: the pieces (parameters, gradients, two AdamW moments)
plus the gathered units in flight, the current one and the prefetched one. A checkpoint of FSDP2 is
one array per parameter and rank, its rows (``checkpoint_shapes``); FSDP1's is one flat padded
shard per unit and rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar.autograd import Tensor
from minipar.comm import Request
from minipar.mesh import DeviceMesh
from minipar.nn import Module, Parameter, init_values
from minipar.parallel.zero.fsdp import ALGORITHM, FullyShardedDataParallel, Policy, transformer_units
from minipar.sharding import GlobalTensor, Partial, Shard, redistribute
from minipar.sharding.tensor import local_slices

AXIS = "dp"


class ParamUnit:
    """One FSDP2 unit: a ``[Shard(0)]`` piece per parameter, gathered parameter by parameter while it
    computes (the interface of ``fsdp.Unit``)."""

    def __init__(self, index: int, name: str, named: list[tuple[str, Parameter]], mesh: DeviceMesh, seed: int) -> None:
        self.index, self.name, self.mesh, self.comm = index, name, mesh, mesh[AXIS]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.shapes = [tuple(p.data.shape) for p in self.params]
        self.pieces: list[Tensor] = []
        for n, p, shape in zip(self.names, self.params, self.shapes, strict=True):
            rows = local_slices(shape, (self.comm.size,), (self.comm.rank,), (Shard(0),))
            if p.data.size > 0 and not any(p.data.strides):  # built under nn.deferred(): draw the piece alone
                piece = init_values(seed, n, shape, p.init, rows).astype(p.dtype)
            else:  # built whole: keep this rank's rows, let the rest go
                piece = p.data[rows].copy()
            self.pieces.append(Tensor(piece))
        self.full: list[np.ndarray] | None = None
        self.pending: list[Request] | None = None
        self.ready: set[int] = set()
        self.reduced = False
        self.reshard()

    @property
    def shards(self) -> list[Tensor]:
        """What AdamW updates on this rank: every parameter's piece."""
        return self.pieces

    def placed(self) -> list[GlobalTensor]:
        """The pieces as global tensors ``[Shard(0)]`` over the ``dp`` axis."""
        return [GlobalTensor(t.data, shape, self.mesh, (AXIS,), [Shard(0)], check=False)
                for t, shape in zip(self.pieces, self.shapes, strict=True)]

    @property
    def gathered_bytes(self) -> int:
        """Bytes of whole parameters beside the pieces: gathered, or on their way."""
        whole = sum(int(np.prod(s)) * t.data.itemsize for s, t in zip(self.shapes, self.pieces, strict=True))
        return whole if (self.full is not None and self.comm.size > 1) or self.pending is not None else 0

    def prefetch(self) -> None:
        """Start every parameter's all-gather (its rows, unequal lengths allowed) in the background."""
        if self.full is None and self.pending is None and self.comm.size > 1:
            self.pending = [self.comm.iallgather(t.data, algorithm=ALGORITHM) for t in self.pieces]

    def unshard(self) -> None:
        """Every parameter whole (``[Shard(0)] -> [Replicate()]``), waiting for a prefetch."""
        if self.full is not None:
            return
        if self.comm.size == 1:
            self.full = [t.data for t in self.pieces]
        else:
            self.prefetch()
            assert self.pending is not None
            self.full, self.pending = [r.wait() for r in self.pending], None
        for p, whole, shape in zip(self.params, self.full, self.shapes, strict=True):
            p.data = whole.reshape(shape)

    def reshard(self) -> None:
        """Free the whole parameters (an empty array until the next ``unshard``, as ``fsdp.Unit``)."""
        for p in self.params:
            p.data = np.empty(0, dtype=p.dtype)
        self.full = None

    def discard(self) -> None:
        if self.pending is not None:
            for r in self.pending:
                r.wait()
            self.pending = None
        self.reshard()

    def reduce_scatter(self) -> None:
        """Each gradient averaged over the ranks, ``[Partial()] -> [Shard(0)]``: this rank keeps its rows."""
        for t, p, shape in zip(self.pieces, self.params, self.shapes, strict=True):
            g = GlobalTensor(p.grad / self.comm.size, shape, self.mesh, (AXIS,), [Partial()], check=False)
            mine = redistribute(g, [Shard(0)]).local
            t.grad = mine if t.grad is None else t.grad + mine
            p.grad = None
        self.ready.clear()
        self.reduced = True


class FullyShard(FullyShardedDataParallel):
    """FSDP2 over ``mesh``'s ``dp`` axis (``fully_shard``); per step as FSDP1: ``loss = model.loss(...)``
    on this rank's rows, ``fsdp.backward(loss)``, ``fsdp.step()``."""

    def __init__(self, module: Module, mesh: DeviceMesh, policy: Policy = transformer_units, **kwargs: Any) -> None:
        degrees = {a: d for a, d in mesh.shape.degrees().items() if d > 1}
        if set(degrees) - {AXIS}:
            raise ValueError(f"fully_shard: the mesh {degrees} has axes other than {AXIS!r}; this FSDP2 shards over "
                             f"all the ranks: make the mesh with DeviceMesh(comm, {AXIS}=N)")
        extra = sorted(set(kwargs) & {"precision", "shard_group", "reduce_dtype", "loss_scale"})
        if extra:
            raise ValueError(f"fully_shard: {extra} are FullyShardedDataParallel's (flat units); FSDP2 here runs "
                             "float64 on one dp axis")
        self.mesh = mesh
        super().__init__(module, mesh[AXIS], policy, **kwargs)

    def _make_units(self, wrapped: list[tuple[str, Module]], seed: int, wire: np.dtype) -> list[Any]:
        return [ParamUnit(i, name, list(m.named_parameters(name + ".")), self.mesh, seed)
                for i, (name, m) in enumerate(wrapped)]

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter whole (an all-gather each: for tests)."""
        return {n: g.to_global() for u in self.units for n, g in zip(u.names, u.placed(), strict=True)}

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """What this rank would write: one array per parameter, its rows."""
        return {n: t.data.shape for u in self.units for n, t in zip(u.names, u.pieces, strict=True)}

    def save_checkpoint(self, directory: str) -> None:
        raise ValueError("fully_shard: checkpoints are written by FullyShardedDataParallel (flat shards); save "
                         "full_state_dict() or use FSDP1 to resume")

    load_checkpoint = save_checkpoint


def fully_shard(module: Module, mesh: DeviceMesh, policy: Policy = transformer_units, **kwargs: Any) -> FullyShard:
    """FSDP2 of ``module`` over ``mesh``'s ``dp`` axis: every parameter a ``[Shard(0)]`` global tensor
    (uneven where its first dimension does not divide); ``kwargs`` as ``FullyShardedDataParallel``'s
    (``reshard_after_forward``, ``prefetch``, ``lr``, ``weight_decay``, ...)."""
    return FullyShard(module, mesh, policy, **kwargs)
