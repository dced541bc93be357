"""The pieces of PatrickStar's chunk manager (``chunks.py``; Fang et al. 2021, Sec. 4-5): the tensor
states, a parameter's slot, a chunk, packing in registration order, and the N-rank communication
groups (``Groups``, mixed into ``ChunkManager``): chunk ``g N + r`` of group ``g`` is owned by rank
``r``; a group is gathered (the owned chunk up, then a ring all-gather), evicted (the owned chunk down,
the others freed) and its gradients reduce-scattered (averaged over the ranks) as a unit.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np

from minipar import trace
from minipar.comm import Communicator
from minipar.nn import Parameter
from minipar.tiers import Tiers

ALGORITHM = "ring"  # hand-written collectives: every message is in the trace


class State(Enum):
    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_FWD = "hold after forward"
    HOLD_AFTER_BWD = "hold after backward"


class Slot:
    """One parameter's place: its chunk, offset and state, and its master copy on the CPU."""

    def __init__(self, index: int, name: str, param: Parameter, chunk: int, offset: int) -> None:
        self.index, self.name, self.param, self.chunk, self.offset = index, name, param, chunk, offset
        self.shape, self.numel = param.shape, param.size
        self.state = State.FREE
        self.master: np.ndarray | None = None  # a view of the chunk's master array

    def view(self, flat: np.ndarray) -> np.ndarray:
        return flat[self.offset:self.offset + self.numel].reshape(self.shape)


class Chunk:
    """``size`` elements; its payload is on the device (``device``) or on the CPU (``cpu``)."""

    def __init__(self, index: int, size: int, dtype: Any, owned: bool = True, master_dtype: Any = None) -> None:
        self.index, self.size, self.dtype, self.owned = index, size, np.dtype(dtype), owned
        self.name = f"chunk{index}"
        self.slots: list[Slot] = []
        self.cpu: np.ndarray | None = np.zeros(size, dtype) if owned else None
        self.device: np.ndarray | None = None
        master_dtype = dtype if master_dtype is None else master_dtype  # float32 under mixed precision
        self.master = np.zeros(size, master_dtype) if owned else None  # the CPU's master copy of the parameters

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def payload(self) -> np.ndarray | None:
        return self.device if self.device is not None else self.cpu

    def point(self) -> None:
        """Every tensor's ``.data`` a view of wherever the payload is now (empty when it is nowhere:
        a chunk another rank owns, not gathered)."""
        for s in self.slots:
            s.param.data = s.view(self.payload) if self.payload is not None else np.empty(0, self.dtype)

    def computing(self) -> bool:
        return any(s.state is State.COMPUTE for s in self.slots)


def pack(named: list[tuple[str, Parameter]], chunk_size: int) -> list[list[tuple[str, Parameter, int]]]:
    """Registration order into chunks of ``chunk_size`` elements: (name, parameter, offset) per chunk."""
    chunks: list[list[tuple[str, Parameter, int]]] = []
    used = chunk_size
    for name, p in named:
        if used + p.size > chunk_size:
            chunks.append([])
            used = 0
        chunks[-1].append((name, p, used))
        used += p.size
    return chunks


class Groups:
    """Communication groups of ``world`` consecutive chunks; the manager provides ``chunks``, ``world``,
    ``rank``, ``comm``, ``tiers``, ``reduced`` (the groups reduce-scattered this iteration), ``_up``, ``_down``."""

    chunks: list[Chunk]
    world: int
    rank: int
    comm: Communicator | None
    tiers: Tiers
    reduced: set[int]

    def _up(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def _down(self, chunk: Chunk) -> None:
        raise NotImplementedError

    @property
    def n_groups(self) -> int:
        return len(self.chunks) // self.world

    def group(self, g: int) -> list[Chunk]:
        """Communication group ``g``: chunks ``g N .. g N + N - 1``; this rank owns the ``rank``-th."""
        return self.chunks[g * self.world:(g + 1) * self.world]

    def _resident(self, g: int) -> bool:
        return any(c.device is not None for c in self.group(g))

    def _evictable(self, g: int) -> bool:
        """Resident, no tensor COMPUTE, and (N > 1) not holding gradients that still await their reduce-scatter."""
        chunks = self.group(g)
        if not self._resident(g) or any(c.computing() for c in chunks):
            return False
        return self.world == 1 or g in self.reduced or not any(
            s.state is State.HOLD_AFTER_BWD for c in chunks for s in c.slots)

    def _gather(self, g: int) -> None:
        """The owned chunk up, then the group all-gathered onto the device (N > 1)."""
        chunks = self.group(g)
        own = chunks[self.rank]
        self._up(own)
        if self.world == 1:
            return
        whole = self.comm.allgather(own.device, algorithm=ALGORITHM)
        for j, chunk in enumerate(chunks):
            if chunk is not own:
                chunk.device = self.tiers.empty(chunk.name, chunk.size, chunk.dtype)
                chunk.device[...] = whole[j * chunk.size:(j + 1) * chunk.size]
                chunk.point()

    def _evict(self, g: int) -> None:
        """The owned chunk down (a transfer); the others freed (another rank owns them)."""
        for chunk in self.group(g):
            if chunk.device is not None:
                self._off_device(chunk)

    def _off_device(self, chunk: Chunk) -> None:
        """An owned chunk down to the CPU (a transfer), another rank's freed."""
        if chunk.owned:
            self._down(chunk)
        else:
            self._release(chunk)

    def _release(self, chunk: Chunk) -> None:
        self.tiers.free(chunk.name)
        chunk.device = None
        chunk.point()

    def _reduce_scatter(self, g: int) -> None:
        """The group's gradient chunks averaged over the ranks; this rank keeps its owned chunk's."""
        chunks = self.group(g)
        flat = np.concatenate([c.device for c in chunks]) / self.world  # before the sum, as FSDP
        chunks[self.rank].device[...] = self.comm.reduce_scatter(flat, op="sum", algorithm=ALGORITHM)
        for chunk in chunks:
            if not chunk.owned:
                self._release(chunk)
        self.reduced.add(g)


class LossScaling:
    """Mixed precision's dynamic loss scaling for the manager (``minipar.parallel.zero.precision``'s rule);
    the manager provides ``chunks``, ``world``, ``comm``, ``mixed``, ``loss_scale``, ``clean_steps``,
    ``skipped``, ``growth_interval``."""

    chunks: list[Chunk]
    world: int
    comm: Communicator | None
    mixed: bool
    loss_scale: float
    clean_steps: int
    skipped: int
    growth_interval: int

    def _grad(self, s: Slot) -> np.ndarray:
        """``s``'s gradient in its chunk on the CPU; mixed: ``fp32(g) / S``, unscaled into the master's precision."""
        g = s.view(self.chunks[s.chunk].cpu)
        return g.astype(np.float32) / np.float32(self.loss_scale) if self.mixed else g

    def _overflow(self, grads: list[np.ndarray]) -> bool:
        """Dynamic loss scaling (``minipar.parallel.zero.precision``): inf or nan on any rank (one
        all-reduce when N > 1) halves the scale; ``growth_interval`` clean steps in a row double it."""
        bad = float(any(not np.isfinite(g).all() for g in grads))
        if self.world > 1:
            bad = self.comm.allreduce(np.array([bad]), op="sum", algorithm=ALGORITHM)[0]
        if bad > 0:
            self.loss_scale, self.clean_steps, self.skipped = self.loss_scale / 2, 0, self.skipped + 1
            trace.mark("overflow: step skipped", loss_scale=self.loss_scale)
            return True
        self.clean_steps += 1
        self.loss_scale *= 2 if self.clean_steps % self.growth_interval == 0 else 1
        return False
