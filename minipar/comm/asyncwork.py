"""Non-blocking collectives: one FIFO background thread per communicator.

``comm.iallreduce(x)`` queues the collective for a worker thread that runs it on a ``dup()`` of the
communicator (a separate message space), with the calling rank's trace recorder bound in the
worker, so its messages appear in the trace like any others. Every rank must start its non-blocking
collectives in the same order (they run one after another in that order). ``Request.wait()``
re-raises an error the collective raised (``CommTimeout`` included) in the caller.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

from minipar import trace
from minipar.comm.base import Request

if TYPE_CHECKING:
    from minipar.comm.collectives import Communicator


class Future:
    """Result slot of one queued collective (the ``Pending`` of its ``Request``)."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.event = threading.Event()

    def done(self) -> bool:
        if not self.event.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True


class Worker:
    """Runs queued collectives of one communicator on its duplicate, in submission order."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        if hasattr(comm, "spin"):  # mpi: sleep between tests, never spin; the compute this overlaps
            comm.spin = 0.0  # needs the cores (and the GIL)
        self.queue: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"minipar-async-{comm.world_rank}",
                                       daemon=True)
        self.thread.start()

    def submit(self, owner: Communicator, name: str, arr: Any, kw: dict[str, Any]) -> Request:
        fut = Future()
        self.queue.put((fut, name, arr, kw, trace.current()))
        peers = [g for g in owner.group_ranks if g != owner.world_rank]
        # The worker's own watchdog ends a stuck collective; the caller waits a little longer.
        return _AsyncRequest(owner, fut, f"i{name}({kw.get('algorithm')})", peers)

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fut, name, arr, kw, rec = item
            trace._local.recorder = rec
            try:
                fut.value = getattr(self.comm, name)(arr, **kw)
            except BaseException as exc:  # handed to the caller's wait()
                fut.error = exc
            finally:
                trace._local.recorder = None
                fut.event.set()
                self.comm._notify()

    def close(self) -> None:
        self.queue.put(None)
        self.comm.close()


class _AsyncRequest(Request):
    def wait(self) -> Any:
        if not self._finished:
            self._comm._wait(self._pending.done, self._what, self._peers, timeout=2 * self._comm.timeout + 5)
            self._finish()
        return self._value
