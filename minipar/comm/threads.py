"""The in-process backend: every rank is a thread of one Python process (for Jupyter and tests).

Messages are numpy arrays copied into a shared mailbox at send time (so a send completes at once
and the sender may reuse its buffer); a receive takes the oldest matching message, matching in the
order receives were posted, like MPI. Ranks block on one condition variable, so a waiting rank
costs no CPU, and the watchdog's deadline and the launch's abort flag are checked on every wake-up.
The failure detector (``detector.py``) reads a shared heartbeat table; ``faults.kill`` silences a rank.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from minipar.comm.base import Done, Lazy, Pending, wire_tag
from minipar.comm.collectives import Communicator
from minipar.comm.detector import Detector, TableHeartbeat, default_deadline
from minipar.comm.errors import Aborted
from minipar.comm.watchdog import RankState

Key = tuple[tuple[Any, ...], int, int, int]  # (context id, src, dst, wire tag)


class _Recv:
    def __init__(self) -> None:
        self.value: Any = None
        self.matched = False

    def done(self) -> bool:
        return self.matched


class World:
    """State shared by the ranks of one ``launch``: mailboxes, rendezvous slots, the abort flag."""

    def __init__(self, size: int, timeout: float, deadline: float | None = None) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.unclaimed: dict[Key, deque[np.ndarray]] = {}
        self.posted: dict[Key, deque[_Recv]] = {}
        self.slots: dict[Any, dict[int, Any]] = {}
        self.failure: str | None = None
        self.states = [RankState(r, timeout) for r in range(size)]
        self.comms: list[ThreadsCommunicator] = []  # every communicator made, to close their workers
        for st in self.states:
            st.abort = lambda: self.failure
        self.heartbeat: TableHeartbeat | None = None
        dl = default_deadline(timeout, deadline)
        if size > 1 and dl is not None:
            for st in self.states:
                st.detector = Detector(st.world_rank, [r for r in range(size) if r != st.world_rank], dl)
                st.detector.on_death = self.wake
            self.heartbeat = TableHeartbeat([st.detector for st in self.states])

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def abort(self, reason: str) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = reason
            self.cond.notify_all()

    def deliver(self, key: Key, data: np.ndarray) -> None:
        with self.cond:
            waiting = self.posted.get(key)
            if waiting:
                rec = waiting.popleft()
                rec.value, rec.matched = data, True
            else:
                self.unclaimed.setdefault(key, deque()).append(data)
            self.cond.notify_all()

    def post(self, key: Key) -> _Recv:
        rec = _Recv()
        with self.cond:
            box = self.unclaimed.get(key)
            if box:
                rec.value, rec.matched = box.popleft(), True
            else:
                self.posted.setdefault(key, deque()).append(rec)
        return rec


class ThreadsCommunicator(Communicator):
    """A communicator whose ranks are threads sharing a ``World``."""

    backend = "threads"

    def __init__(self, world: World, ctx: tuple[Any, ...], rank: int, group_ranks: list[int]) -> None:
        super().__init__(rank, len(group_ranks), group_ranks, world.states[group_ranks[rank]])
        self.world = world
        self.ctx = ctx
        world.comms.append(self)
        self._exchanges = 0

    def _key(self, ctx: int, src: int, dst: int, tag: int, kind: int) -> Key:
        return (self.ctx, src, dst, wire_tag(ctx, tag, kind))

    def _post_send(self, ctx: int, array: np.ndarray, dst: int, tag: int, header: bool) -> Pending:
        self.world.deliver(self._key(ctx, self.rank, dst, tag, 1), np.array(array, copy=True))
        return Done()

    def _post_recv(self, ctx: int, src: int, tag: int, like: Any, out: np.ndarray | None = None) -> Pending:
        rec = self.world.post(self._key(ctx, src, self.rank, tag, 1))
        if out is None:
            return rec
        return _Into(rec, out)

    def _notify(self) -> None:
        with self.world.cond:
            self.world.cond.notify_all()

    def _wait(self, test: Callable[[], bool], what: str, peers: Iterable[int],
              timeout: float | None = None) -> None:
        if test():
            return
        start = time.monotonic()
        limit = self.state.timeout if timeout is None else timeout
        cond = self.world.cond
        with cond:
            while not test():
                if self.world.failure is not None:
                    raise Aborted(f"rank {self.world_rank}: {what} abandoned: {self.world.failure}")
                det = self.state.detector
                if det is not None and det.dead:
                    det.raise_if_lost(what, peers, self.state.fail_fast)
                waited = time.monotonic() - start
                if waited >= limit:
                    raise self.state.timeout_error(what, peers, waited)
                cond.wait(min(limit - waited, 0.5))

    def _rendezvous(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` by rank (shared references: do not modify them)."""
        key = (self.ctx, "x", self._exchanges)
        self._exchanges += 1
        with self.world.cond:
            slot = self.world.slots.setdefault(key, {})
            slot[self.rank] = value
            self.world.cond.notify_all()
        missing = lambda: [g for r, g in enumerate(self.group_ranks) if r not in slot]  # noqa: E731
        self._wait(lambda: len(slot) >= self.size, what, Lazy(missing))
        out = [slot[r] for r in range(self.size)]
        with self.world.cond:
            slot.setdefault("read", 0)
            slot["read"] += 1
            if slot["read"] == self.size:
                del self.world.slots[key]
        return out

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` by rank (shared-memory rendezvous; other ranks' objects are copied)."""
        out = self._rendezvous(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), "allgather_object")
        return [obj if r == self.rank else pickle.loads(b) for r, b in enumerate(out)]

    def _exchange_arrays(self, arr: np.ndarray | None) -> list[Any]:
        return self._rendezvous(arr, "native collective")

    def _make_split(self, color: int, members: list[int], index: int) -> Communicator:
        ctx = (*self.ctx, "s", self._children, color)
        return ThreadsCommunicator(self.world, ctx, index, [self.group_ranks[m] for m in members])

    def _make_dup(self) -> Communicator:
        return ThreadsCommunicator(self.world, (*self.ctx, "d", self._children), self.rank, self.group_ranks)


class _Into:
    """A receive whose result is copied into a caller's buffer."""

    def __init__(self, rec: _Recv, out: np.ndarray) -> None:
        self.rec, self.out, self.value = rec, out, None

    def done(self) -> bool:
        if self.value is None and self.rec.matched:
            self.out[...] = self.rec.value.reshape(self.out.shape)
            self.value = self.out
        return self.value is not None


def make_world(world_size: int, timeout: float,
               deadline: float | None = None) -> tuple[World, list[ThreadsCommunicator]]:
    world = World(world_size, timeout, deadline)
    comms = [ThreadsCommunicator(world, (), r, list(range(world_size))) for r in range(world_size)]
    return world, comms


