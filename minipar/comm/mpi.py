"""The MPI backend: mpi4py's buffer (upper-case) methods on numpy arrays, no pickling on hot paths.

Every wait polls non-blocking requests (``watchdog.poll``): it spins for ``spin`` seconds (1 ms;
MPI progresses only inside MPI calls, so an operation done within it costs what the blocking call
costs), then sleeps between tests, so a rank blocked in communication gives its core back (MPICH
busy-polls inside blocking calls) and a stuck wait ends in ``CommTimeout``. ``MINIPAR_WAIT=bell``
makes the sleeps end early when a peer posts the awaited message or has copied a large one
(``doorbell.py``); ``yield`` pauses with ``os.sched_yield`` (``watchdog.wait_mode``; default ``sleep``).
Under ``mpiexec`` an uncaught exception on any rank (any thread) prints its traceback and calls ``MPI_Abort``: the whole
job exits non-zero instead of hanging; once a peer is dead (``detector.py``) the rank exits by
itself instead (``os._exit``: no ``MPI_Abort`` cutting the other survivors' reports short, no
``MPI_Finalize`` waiting for the dead rank). ``MPI_Init`` and ``MPI_Finalize`` run under deadlines too
(``startup.py``): a rank lost before MPI starts or after its goodbye ends no survivor's job in a hang.

Wire format: with a header, a message is a 16 x int64 header (dtype code, ndim, shape) on tag
``3t``, then the payload bytes on tag ``3t+1``. Header receives are matched in posting order, and
each payload receive is posted in that same order (a per-(source, tag) FIFO), so concurrent
receives from one source never swap payloads. Raw payloads (the collectives, which know the shape)
use tag ``3t+2``. The trace counts payload bytes only.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import ml_dtypes
import numpy as np

from minipar.comm import startup
from minipar.comm.base import Pending, wire_tag
from minipar.comm.collectives import Communicator, scatter_shape
from minipar.comm.detector import Detector, MpiHeartbeat, default_deadline
from minipar.comm.doorbell import RENDEZVOUS, Doorbell, process_bell
from minipar.comm.errors import CommError, CommTimeout, PeerLost
from minipar.comm.ring import chunk_bounds
from minipar.comm.watchdog import PACE, RankState, default_timeout, poll, spin_for, wait_mode

DTYPES = [np.dtype(t) for t in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64",
                                "uint32", "uint16", "uint8", "bool", "complex64", "complex128")] + [
    np.dtype(ml_dtypes.bfloat16)]  # header codes are list positions: new dtypes go at the end
HEADER = 16  # int64 words: dtype code, ndim, up to 14 dims
FORWARD_GRACE = 0.3  # seconds for mpiexec to forward a failing rank's traceback
ABORT_GRACE = 1.0  # seconds a timed-out rank waits before MPI_Abort


def _yield(seconds: float) -> None:
    os.sched_yield()


def under_mpiexec() -> bool:
    """True when this process was started by ``mpiexec`` (MPICH's or Open MPI's)."""
    return any(k in os.environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"))


def _bytes(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1).view(np.uint8)


def encode_header(arr: np.ndarray) -> np.ndarray:
    if arr.dtype not in DTYPES:
        raise TypeError(f"cannot send dtype {arr.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if arr.ndim > HEADER - 2:
        raise ValueError(f"cannot send a {arr.ndim}-d array; at most {HEADER - 2} dims (reshape first)")
    hdr = np.zeros(HEADER, dtype=np.int64)
    hdr[0], hdr[1] = DTYPES.index(arr.dtype), arr.ndim
    hdr[2:2 + arr.ndim] = arr.shape
    return hdr


class _Reqs:
    """Requests done together; a receive with a doorbell rings its sender once it is done (``bell``,
    ``peer``: the sender's world rank), so a sender asleep on its rendezvous send wakes."""

    def __init__(self, reqs: list[Any], value: Any = None, keep: Any = None, bell: Doorbell | None = None,
                 peer: int = -1) -> None:
        self.reqs, self.value, self.keep, self.bell, self.peer = reqs, value, keep, bell, peer
        self.finished = False

    def done(self) -> bool:
        from mpi4py import MPI

        if self.finished:
            return True
        if not MPI.Request.Testall(self.reqs):
            return False
        self.finished = True
        if self.bell is not None:
            self.bell.ring(self.peer)
        return True


class _HeaderRecv:
    """Receive of a message with a header: header first, then the payload in FIFO order."""

    def __init__(self, comm: MpiCommunicator, src: int, tag: int) -> None:
        self.comm, self.src, self.tag = comm, src, tag
        self.hdr = np.empty(HEADER, dtype=np.int64)
        self.hreq = comm.mpicomm.Irecv([self.hdr.view(np.uint8), comm.MPI.BYTE], src, tag)
        self.preq: Any = None
        self.buf: np.ndarray | None = None
        self.value: np.ndarray | None = None
        self.fifo = comm._fifo.setdefault((src, tag), deque())
        self.fifo.append(self)

    def _post_payload(self) -> None:
        dtype, ndim = DTYPES[int(self.hdr[0])], int(self.hdr[1])
        self.buf = np.empty(tuple(int(d) for d in self.hdr[2:2 + ndim]), dtype=dtype)
        self.preq = self.comm.mpicomm.Irecv([_bytes(self.buf), self.comm.MPI.BYTE], self.src, self.tag + 1)

    def done(self) -> bool:
        if self.value is not None:
            return True
        while self.fifo and self.fifo[0].hreq.Test():
            self.fifo.popleft()._post_payload()
        if self.preq is not None and self.preq.Test():
            self.value = self.buf
            bell = self.comm.bell
            if bell is not None and self.buf is not None and self.buf.nbytes >= RENDEZVOUS:
                bell.ring(self.comm.group_ranks[self.src])
        return self.value is not None


class MpiCommunicator(Communicator):
    """A communicator over an mpi4py ``MPI.Comm``. ``spin`` (seconds a wait spins before it sleeps:
    ``watchdog.spin_for`` the ranks on this machine) and ``pace`` (each sleep over the time waited
    so far) tune ``watchdog.poll``; the non-blocking collectives' worker sets 0 and 1/2 on its
    communicator: it shares the cores with the compute it overlaps, and every wake-up of its thread
    preempts that compute."""

    backend = "mpi"

    def __init__(self, mpicomm: Any, state: RankState) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.mpicomm = mpicomm
        world_group = MPI.COMM_WORLD.Get_group()
        group = mpicomm.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(mpicomm.Get_size())), world_group)
        super().__init__(mpicomm.Get_rank(), mpicomm.Get_size(), [int(r) for r in ranks], state)
        self._fifo: dict[tuple[int, int], deque[_HeaderRecv]] = {}
        local = int(os.environ.get("MPI_LOCALNRANKS", "1"))  # Hydra sets it
        self.spin, self.pace = spin_for(local), PACE
        mode = wait_mode(local)
        self.bell = process_bell(self.world_rank) if mode == "bell" else None
        self.rest: Callable[[float], None] = self.bell.wait if self.bell is not None else \
            (_yield if mode == "yield" else time.sleep)

    def _post_send(self, ctx: int, array: np.ndarray, dst: int, tag: int, header: bool) -> Pending:
        MPI, c = self.MPI, self.mpicomm
        arr = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        if not header:
            out = _Reqs([c.Isend([_bytes(arr), MPI.BYTE], dst, wire_tag(ctx, tag, 2))], keep=arr)
        else:
            hdr = encode_header(arr)
            t = wire_tag(ctx, tag, 0)
            out = _Reqs([c.Isend([hdr.view(np.uint8), MPI.BYTE], dst, t),
                         c.Isend([_bytes(arr), MPI.BYTE], dst, t + 1)], keep=(hdr, arr))
        if self.bell is not None:  # wake the receiver: its data is there
            self.bell.ring(self.group_ranks[dst])
        return out

    def _post_recv(self, ctx: int, src: int, tag: int, like: Any, out: np.ndarray | None = None) -> Pending:
        if like is None and out is None:
            return _HeaderRecv(self, src, wire_tag(ctx, tag, 0))
        if out is None or not out.flags.c_contiguous:
            buf = np.empty(*like) if out is None else np.empty(out.shape, out.dtype)
        else:
            buf = out
        req = self.mpicomm.Irecv([_bytes(buf), self.MPI.BYTE], src, wire_tag(ctx, tag, 2))
        big = self.bell is not None and buf.nbytes >= RENDEZVOUS  # the sender waits for our copy
        return _Reqs([req], value=buf, bell=self.bell if big else None, peer=self.group_ranks[src])

    def _wait(self, test: Callable[[], bool], what: str, peers: Iterable[int],
              timeout: float | None = None) -> None:
        def tested() -> bool:
            try:
                return test()
            except self.MPI.Exception as err:
                self._transport_failed(err, what)

        poll(self.state, tested, what, peers, timeout, self.spin, self.pace, self.rest)

    def _transport_failed(self, err: Exception, what: str) -> NoReturn:
        """An MPI call in a wait failed (the world's handler returns errors instead of aborting). A
        peer that dies while MPI reads its memory (MPICH's CMA copy of a large message:
        ``process_vm_readv`` fails) fails the wait before the detector declares it: wait for the
        declaration (at most what the detector needs: twice the deadline and a heartbeat) and raise
        ``PeerLost`` naming the dead rank; with no rank declared, ``CommError`` with MPI's message."""
        det = self.state.detector
        if det is not None:
            end = time.monotonic() + 2 * det.deadline + det.period
            while not det.dead and time.monotonic() < end:
                time.sleep(det.period / 4)
            cause = err.Get_error_string().strip().splitlines()[-1].split(": ", 1)[-1].strip()  # the stack's last
            det.raise_if_lost(f"{what} (MPI: {cause})", [], True)
        raise CommError(f"rank {self.world_rank}: {what}: MPI failed: {err.Get_error_string()}") from err

    def _make_split(self, color: int, members: list[int], index: int) -> Communicator:
        return MpiCommunicator(self.mpicomm.Split(color, index), self.state)

    def _make_dup(self) -> Communicator:
        new, req = self.mpicomm.Idup()
        self._wait(req.Test, "dup", [g for g in self.group_ranks if g != self.world_rank])
        return MpiCommunicator(new, self.state)

    # ---- MPI's own collectives (algorithm="native") ----------------------------------------
    def _native(self, name: str, arr: np.ndarray | None, **kw: Any) -> Any:
        MPI, c, p = self.MPI, self.mpicomm, self.size
        peers = [g for g in self.group_ranks if g != self.world_rank]
        what = f"{name}(native)"

        def run(req: Any) -> None:
            self._wait(req.Test, what, peers)

        mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX}.get(kw.get("op", "sum"))
        if name == "barrier":
            run(c.Ibarrier())
            return None
        if name == "broadcast":
            root = kw["root"]
            hdr = encode_header(arr) if self.rank == root else np.empty(HEADER, dtype=np.int64)
            run(c.Ibcast([hdr.view(np.uint8), MPI.BYTE], root))
            shape = tuple(int(d) for d in hdr[2:2 + int(hdr[1])])
            out = arr.copy() if self.rank == root else np.empty(shape, DTYPES[int(hdr[0])])
            run(c.Ibcast([_bytes(out), MPI.BYTE], root))
            return out
        if name == "all_to_all":
            out = np.empty_like(arr)
            run(c.Ialltoall([_bytes(arr), MPI.BYTE], [_bytes(out), MPI.BYTE]))
            return out
        if name == "allgather":
            row = int(np.prod(arr.shape[1:])) * arr.itemsize
            counts = np.empty(p, dtype=np.int64)
            run(c.Iallgather(np.array([arr.shape[0]], dtype=np.int64), counts))
            out = np.empty((int(counts.sum()), *arr.shape[1:]), dtype=arr.dtype)
            nb = [int(n) * row for n in counts]
            displs = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(int).tolist()
            run(c.Iallgatherv([_bytes(arr), MPI.BYTE], [_bytes(out), (nb, displs), MPI.BYTE]))
            return out
        if name == "allreduce":
            out = np.empty_like(arr)
            run(c.Iallreduce(arr, out, op=mpi_op))
        elif name == "reduce":
            out = np.empty_like(arr) if self.rank == kw["root"] else None
            run(c.Ireduce(arr, out, op=mpi_op, root=kw["root"]))
            if out is None:
                return None
        elif name == "reduce_scatter":
            counts = [b - a for a, b in chunk_bounds(arr.size, p)]
            out = np.empty(counts[self.rank], dtype=arr.dtype)
            run(c.Ireduce_scatter(arr.reshape(-1), out, counts, op=mpi_op))
            out = out.reshape(scatter_shape(arr.shape, p, self.rank))
        else:
            raise ValueError(f"{name}: no native implementation")
        if kw.get("op") == "mean":
            out /= p
        return out


_world: MpiCommunicator | None = None
_lock = threading.Lock()


def _peer_died() -> bool:
    det = _world.state.detector if _world is not None else None
    return det is not None and bool(det.dead)


def _abort_hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    fault = issubclass(exc_type, PeerLost) or _peer_died()
    sys.stdout.flush()
    sys.stderr.write(f"[minipar] rank {rank}: uncaught exception; "
                     + ("a peer is dead: exiting\n" if fault else "aborting the MPI job\n")
                     + "".join(traceback.format_exception(exc_type, exc, tb)))  # one write: all or nothing
    sys.stderr.flush()
    if fault:  # every survivor detects the death itself; MPI_Abort would cut their reports short, and
        time.sleep(FORWARD_GRACE)  # MPI_Finalize would wait for the dead rank for ever
        os._exit(1)
    folder = os.environ.get("MINIPAR_ELASTIC_STATUS")  # minipar run --elastic: torn down, not lost
    if folder:
        with open(os.path.join(folder, f"aborted{rank}"), "w"):
            pass
    # mpiexec forwards a rank's output asynchronously and Abort kills its forwarder: give it a moment
    # (seen: the traceback lost, only the first line delivered); ranks timing out at the same moment
    # print their view too
    time.sleep(ABORT_GRACE if issubclass(exc_type, CommTimeout) else FORWARD_GRACE)
    MPI.COMM_WORLD.Abort(1)


def _thread_hook(args: Any) -> None:
    if args.exc_type is SystemExit:
        return
    _abort_hook(args.exc_type, args.exc_value, args.exc_traceback)


_exit_status = [0]  # the status sys.exit was last asked for (the os._exit fallback keeps it)


def _exit(status: object = None) -> NoReturn:
    """``sys.exit``, remembering the status it will exit with (None: 0, an int: itself, anything else
    is printed and exits 1), for ``_at_exit``'s fallback. A bare ``raise SystemExit(n)`` is not seen."""
    _exit_status[0] = 0 if status is None else status if isinstance(status, int) else 1
    raise SystemExit(status)


def _at_exit(beat: MpiHeartbeat | None, finalize: bool, limit: float) -> None:
    """At exit, after the atexit handlers registered later: say goodbye to the peers, then
    ``MPI_Finalize`` (under ``limit`` seconds, ``startup.finalize``) unless a peer died (it would wait
    for the dead one for ever). When this module imported mpi4py it turned mpi4py's own finalization
    off (``finalize``), so with a dead peer the process simply exits: its status (``sys.exit(n)``,
    ``raise SystemExit(n)``, an error) and its buffered files are kept. When the script imported mpi4py
    first, mpi4py finalizes after this handler, and a dead peer leaves only ``os._exit``, with the
    status ``sys.exit`` was asked for."""
    if beat is not None:
        beat.stop()
    dead = beat is not None and bool(beat.detector.dead)
    if finalize:
        from mpi4py import MPI

        if not dead and not MPI.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            startup.finalize(limit, _exit_status[0], MPI.COMM_WORLD.Get_rank())
        return
    if dead:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def mpi_world(timeout: float | None = None, deadline: float | None = None) -> MpiCommunicator:
    """The MPI world communicator (cached); installs the abort-on-uncaught-exception hooks and, with
    more than one rank, the failure detector (``detector.py``; ``deadline``: seconds)."""
    global _world
    with _lock:
        if _world is None:
            finalize = "mpi4py.MPI" not in sys.modules  # then _at_exit finalizes, not mpi4py
            timeout_ = default_timeout(timeout)
            dl = default_deadline(timeout_, deadline)
            watch = startup.init_mpi(dl, timeout_) if finalize else None  # mpi4py's finalize off too
            from mpi4py import MPI

            # errors come back as MPI.Exception (MPI's default aborts the job): a wait turns the one a
            # dying peer causes into PeerLost (``_transport_failed``); split and dup communicators inherit it
            MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
            state = RankState(MPI.COMM_WORLD.Get_rank(), timeout_)
            _world = MpiCommunicator(MPI.COMM_WORLD, state)
            sys.excepthook = _abort_hook
            threading.excepthook = _thread_hook
            beat = None
            if _world.size > 1 and dl is not None:
                # hydra signals the survivors of a dead rank with SIGUSR1, whose default action kills
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)
                peers = [r for r in range(_world.size) if r != _world.rank]
                state.detector = Detector(_world.rank, peers, dl)
                where, rank = startup.folder(), _world.rank
                beat = MpiHeartbeat(MPI.COMM_WORLD, state.detector,
                                    lambda test: poll(state, test, "the failure detector's start-up (dup)", peers),
                                    lambda dead: startup.note_declared(where, rank, dead))
            if watch is not None:
                watch.done()  # from here on the detector watches the peers
            sys.exit = _exit  # the status, for the os._exit of a finalize past its limit or a dead peer
            atexit.register(_at_exit, beat, finalize, 2 * dl if dl is not None else state.timeout)
        else:
            if timeout is not None:
                _world.state.timeout = default_timeout(timeout)
            if _world.state.detector is not None and (timeout is not None or deadline is not None):
                _world.state.detector.deadline = default_deadline(_world.state.timeout, deadline) or \
                    _world.state.detector.deadline
        return _world
