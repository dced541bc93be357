"""Non-blocking collectives: one FIFO background thread per communicator.

``comm.iallreduce(x)`` queues the collective for a worker thread that runs it on a ``dup()`` of the
communicator (a separate message space), with the calling rank's trace recorder bound in the
worker, so its messages appear in the trace like any others. Every rank must start its non-blocking
collectives in the same order (they run one after another in that order). ``Request.wait()``
re-raises an error the collective raised (``CommTimeout`` included) in the caller.

The worker shares the rank's cores with the compute it overlaps, and every wake-up of its thread
preempts that compute. So on MPI its waits never spin and sleep half the time waited so far
(``watchdog.poll`` with ``spin=0, pace=1/2``): measured with DDP on 2 busy cores, 30-77 preemptions
of the compute thread per backward instead of 140-150 with a pace of 1/8, the GIL never blocking
it (no voluntary switch of the compute thread during backward). Once the rank waits for a job
(``Request.wait``: nothing of its own left to compute) and each rank has a core (``spin_for``), the
worker tests without pausing until that wait ends: DDP on 2 ranks, quiet, step 8.0 -> 6.4 ms (a
job's two ring steps had woken late from their paced sleeps, 0.6-1 ms a job).

Traced, the caller's thread records a mark "async posted" where it queues a job and "async wait"
where it waits for it, and the worker "async start" and "async end" around it (``args``: ``cid`` of
the worker's communicator and ``job``, its number there; ``c0``: the thread's CPU time), so
``minipar.replay`` can start each job no earlier than it was posted and hold the caller's wait
until the job is done. ``job_mark`` writes one such mark (ZeRO-Offload's delayed CPU step uses
it too, with ``cid`` "cpu adam").

``iallreduce_in_place(comm, buf)`` is the same for a buffer the caller hands over: no copy of the
input for the ring, which reduces ``buf`` itself (DDP's buckets: fresh buffers every step would cost a
page fault per 4 KiB page while backward runs, see ``minipar.parallel.ddp``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from minipar import trace
from minipar.comm import ring
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
        self.hurry = threading.Event()  # set while the rank waits for a job: no compute left to preempt
        if hasattr(comm, "spin"):  # mpi: never spin and wake up seldom; the compute this overlaps needs
            if comm.spin > 0:  # the cores (measured: 30 instead of 140 preemptions a step); once the rank
                pause = comm.rest  # waits, and each rank has a core (spin_for), test without pausing
                comm.rest = lambda seconds: None if self.hurry.is_set() else pause(seconds)
            comm.spin, comm.pace = 0.0, 0.5
        self.queue: queue.Queue[Any] = queue.Queue()
        self.jobs = 0  # jobs queued so far (their numbers in the trace's async marks)
        self.thread = threading.Thread(target=self._loop, name=f"minipar-async-{comm.world_rank}",
                                       daemon=True)
        self.thread.start()

    def submit(self, owner: Communicator, name: str, arr: Any, kw: dict[str, Any]) -> Request:
        """Queue ``name(arr, **kw)`` on the duplicate communicator."""
        return self.submit_call(owner, f"i{name}({kw.get('algorithm')})",
                                lambda c: getattr(c, name)(arr, **kw))

    def submit_call(self, owner: Communicator, what: str, fn: Callable[[Communicator], Any]) -> Request:
        """Queue ``fn(duplicate communicator)``; ``wait()`` returns its result."""
        fut, rec, job = Future(), trace.current(), {"cid": self.comm.cid, "job": self.jobs}
        self.jobs += 1
        job_mark(rec, "async posted", job)
        self.queue.put((fut, fn, rec, job))
        peers = [g for g in owner.group_ranks if g != owner.world_rank]
        req = _AsyncRequest(owner, fut, what, peers)
        req._job = (rec, job) if rec is not None else None
        return req

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fut, fn, rec, job = item
            trace._local.recorder = rec
            job_mark(rec, "async start", job)
            try:
                fut.value = fn(self.comm)
            except BaseException as exc:  # handed to the caller's wait()
                fut.error = exc
            finally:
                job_mark(rec, "async end", job)
                trace._local.recorder = None
                fut.event.set()
                self.comm._notify()
            item = fut = fn = rec = None  # keep nothing of this job (an FSDP unit's gathered buffer)

    def close(self) -> None:
        self.queue.put(None)
        self.comm.close()


def job_mark(rec: trace.Recorder | None, name: str, job: dict[str, Any]) -> None:
    """An async mark (module docstring) on the calling thread, when a trace records; also what
    ``ZeroOffload``'s CPU AdamW thread marks with DPU, so a replay overlaps it as a job."""
    if rec is not None:
        t = trace.now()
        rec.add("mark", name, t, t, c0=trace.cpu(), args=dict(job))


class _AsyncRequest(Request):
    _job: tuple[trace.Recorder, dict[str, Any]] | None = None

    def wait(self) -> Any:
        """Sleep on the future's event until the worker is done (no polling: a caller spinning on
        the GIL would stall the worker it waits for), then re-raise the collective's error. The
        worker's own watchdog ends a stuck collective; the caller waits a little longer."""
        if self._job is not None:
            job_mark(self._job[0], "async wait", self._job[1])
            self._job = None
        if not self._finished:
            limit = 2 * self._comm.timeout + 5
            worker = self._comm._async
            if worker is not None:
                worker.hurry.set()
            try:
                if not self._pending.event.wait(limit):
                    raise self._comm.state.timeout_error(self._what, self._peers, limit)
            finally:
                if worker is not None:
                    worker.hurry.clear()
            self._pending.done()
            self._finish()
            self._pending.value = None  # the result lives on in this request alone
        return self._value


def iallreduce_in_place(comm: Communicator, buf: np.ndarray, op: str = "sum", algorithm: str = "ring") -> Request:
    """``comm.iallreduce(buf, op, algorithm)`` for a 1-D buffer the caller hands over, not copied;
    the caller must not touch ``buf`` before ``wait()``, which returns the reduction. The ring
    reduces ``buf`` itself (reduce-scatter, then all-gather, in place) and returns it; the other
    algorithms reduce a copy (the threads backend's native reads every rank's input array directly)
    and return a new array."""
    comm._check("allreduce", algorithm, buf, op)
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"iallreduce_in_place: needs a contiguous 1-d buffer, got shape {buf.shape}")

    def run(c: Communicator) -> np.ndarray:
        if c.size == 1 or algorithm != "ring":
            return c.allreduce(buf.copy(), op=op, algorithm=algorithm)
        c._enter("allreduce", algorithm=algorithm, op=op, shape=buf.shape, dtype=str(buf.dtype))

        def in_place() -> None:
            ring.ring_reduce_scatter(c, buf, op, "allreduce", "ring", 0)
            ring.ring_allgather_chunks(c, buf, "allreduce", "ring", c.size - 1)
        c._run("allreduce", algorithm, in_place)
        return buf

    if comm._async is None:
        comm._async = Worker(comm.dup())
    return comm._async.submit_call(comm, f"iallreduce({algorithm}, in place)", run)
