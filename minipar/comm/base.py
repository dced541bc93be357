"""The communicator interface shared by both backends: point-to-point messages on numpy arrays,
Python objects on a control plane, sub-communicators, and the hooks the collectives are built on.

A backend (``threads.py``, ``mpi.py``) provides four transport methods:
``_post_send(ctx, array, dst, tag, header)`` and ``_post_recv(ctx, src, tag, like, out)`` return a
``Pending`` (``done() -> bool`` makes progress, ``value`` holds the received array), ``_wait``
blocks on a test under the watchdog, and ``_make_split``/``_make_dup`` build sub-communicators.

Messages travel in three contexts so they never match each other: ``P2P`` (the user's ``send``/
``recv``), ``COLL`` (the hand-written collectives) and ``CTL`` (pickled control-plane objects, not
traced). With ``header=True`` a message carries its shape and dtype (one small extra message on
MPI); collectives that know the receive shape send the payload alone (``header=False``).
Every array message is recorded in the trace on the sender and on the receiver, with world ranks
and payload bytes, when it completes: ``t0`` and ``c0`` (wall and CPU time) when it was posted,
``tw``/``cw`` when the rank began to wait for it (``wait()``, or a collective step's wait), ``t1``/``c1``
when it completed, and MPI's matching key (``cid``, the communicator's id, the same on every rank,
and the wire ``tag``): what ``minipar.replay`` needs to replay the run on a modelled network, a
non-blocking transfer overlapping the compute between its post and its wait. Point-to-point calls
may label their message for the trace with keyword-only ``stage``, ``microbatch`` and ``chunk``
(pipeline work): each side's event carries the labels that side passed. Whether a trace records is
looked up once per message, when it is posted; an untraced request carries nothing.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from minipar import trace
from minipar.comm.watchdog import RankState, debug_enabled

if TYPE_CHECKING:
    from minipar.comm.collectives import Communicator

P2P, COLL, CTL = 0, 1, 2
MAX_TAG = 1 << 20  # user tags are 0 <= tag < MAX_TAG
Where = tuple[int | None, int | None, int | None]  # (stage, microbatch, chunk) trace labels
NOWHERE: Where = (None, None, None)


def _where(stage: Any, microbatch: Any, chunk: Any, what: str) -> Where:
    """The trace labels as ints (or None); ``TypeError``/``ValueError`` before anything is sent."""
    out = []
    for name, v in (("stage", stage), ("microbatch", microbatch), ("chunk", chunk)):
        if v is not None and (not isinstance(v, int | np.integer) or isinstance(v, bool)):
            raise TypeError(f"{what}: {name} must be a non-negative int or None, got {v!r}")
        if v is not None and v < 0:
            raise ValueError(f"{what}: {name} must be a non-negative int or None, got {v!r}")
        out.append(None if v is None else int(v))
    return (out[0], out[1], out[2])


def wire_tag(ctx: int, tag: int, kind: int) -> int:
    """Tag on the wire: context, user tag and message kind (0 header, 1 payload, 2 raw payload)."""
    return (ctx << 22) + 3 * tag + kind


class Pending(Protocol):
    value: Any

    def done(self) -> bool: ...


class Done:
    """A pending operation that completed when it was posted."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def done(self) -> bool:
        return True


class Request:
    """Handle of a non-blocking operation: ``test()`` -> finished?, ``wait()`` -> array or None."""

    _note: trace.Message | None = None  # set while a trace records (``PointToPoint._traced``)

    def __init__(self, comm: PointToPoint, pending: Pending, what: str, peers: Sequence[int],
                 on_done: Callable[[Any], Any] | None = None) -> None:
        self._comm, self._pending, self._what, self._peers = comm, pending, what, peers
        self._on_done = on_done
        self._finished = False
        self._value: Any = None

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            value = self._pending.value
            self._value = self._on_done(value) if self._on_done is not None else value
            if self._note is not None:
                self._note.done(value)

    def test(self) -> bool:
        """True once the operation has finished (makes progress, never blocks)."""
        if not self._finished and self._pending.done():
            self._finish()
        return self._finished

    def wait(self) -> Any:
        """Block (under the watchdog) until finished; a receive returns the array, a send None."""
        if self._note is not None:
            self._note.waiting()
        if not self._finished:
            self._comm._wait(self._pending.done, self._what, self._peers)
            self._finish()
            self._comm.state.done(self._what)
        return self._value


class Lazy:
    """An iterable evaluated only when the watchdog formats its message (e.g. the peers still
    missing at the deadline)."""

    def __init__(self, fn: Callable[[], list[int]]) -> None:
        self.fn = fn

    def __iter__(self) -> Any:
        return iter(self.fn())


def as_array(array: Any, what: str) -> np.ndarray:
    """The argument as a C-contiguous numpy array, or a ``TypeError`` saying what to pass."""
    if not isinstance(array, np.ndarray | np.generic | int | float | list | tuple):
        raise TypeError(f"{what} takes a numpy array, got {type(array).__name__}")
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.dtype == object:
        raise TypeError(f"{what} takes a numeric numpy array, got dtype=object; use the *_object methods")
    return arr


class PointToPoint(ABC):
    """A group of ranks that exchange messages. See the package docstring for the full API.

    Attributes: ``rank`` (0..size-1 in this group), ``size``, ``world_rank`` (this rank in the
    world; trace events always use world ranks), ``backend`` ("threads" | "mpi"), ``group_ranks``
    (world ranks of the members, by rank), ``timeout`` (watchdog seconds), ``debug`` (mismatch checks).
    """

    backend = "abstract"

    def __init__(self, rank: int, size: int, group_ranks: Sequence[int], state: RankState) -> None:
        self.rank = rank
        self.size = size
        self.group_ranks = list(group_ranks)
        self.world_rank = self.group_ranks[rank]
        self.state = state
        self.debug = debug_enabled()
        self._children = 0  # split/dup calls so far: all ranks make them in the same order
        self.cid = "w"  # this communicator's id in traces, equal on its ranks: "w", a child "w.3", ...
        self._async: Any = None  # background worker for non-blocking collectives (asyncwork.py)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self.rank}/{self.size} world_rank {self.world_rank} "
                f"group {self.group_ranks}>")

    @property
    def timeout(self) -> float:
        return self.state.timeout

    # ---- transport, provided by the backend -------------------------------------------------
    @abstractmethod
    def _post_send(self, ctx: int, array: np.ndarray, dst: int, tag: int, header: bool) -> Pending:
        """Start sending ``array`` to ``dst`` on context ``ctx`` (with its shape if ``header``)."""

    @abstractmethod
    def _post_recv(self, ctx: int, src: int, tag: int, like: tuple[tuple[int, ...], np.dtype] | None,
                   out: np.ndarray | None = None) -> Pending:
        """Start receiving from ``src``: shape from the header when ``like`` and ``out`` are None."""

    @abstractmethod
    def _wait(self, test: Callable[[], bool], what: str, peers: Iterable[int],
              timeout: float | None = None) -> None:
        """Block until ``test()`` is True; ``CommTimeout`` naming ``what`` and ``peers`` after the timeout."""

    def _notify(self) -> None:  # noqa: B027 -- optional hook, a no-op unless the backend sleeps on a condition
        """Wake this rank's waits (the threads backend waits on a condition variable)."""

    @abstractmethod
    def _make_split(self, color: int, members: list[int], index: int) -> Communicator:
        """The new communicator of parent ranks ``members``, this rank being ``members[index]``."""

    @abstractmethod
    def _make_dup(self) -> Communicator:
        """A communicator of the same ranks with its own message space."""

    def close(self) -> None:
        """Stop this communicator's background worker (if non-blocking collectives started one)."""
        if self._async is not None:
            self._async.close()
            self._async = None

    # ---- helpers ----------------------------------------------------------------------------
    def _check_peer(self, peer: int, what: str) -> None:
        if not isinstance(peer, int | np.integer) or not 0 <= peer < self.size:
            raise ValueError(f"{what}: rank {peer!r} is not in this communicator of size {self.size}")
        if peer == self.rank:
            raise ValueError(f"{what}: rank {peer} is this rank; a rank cannot message itself")

    def _check_tag(self, tag: int, what: str) -> None:
        if not isinstance(tag, int | np.integer) or not 0 <= tag < MAX_TAG:
            raise ValueError(f"{what}: tag must be an int in [0, {MAX_TAG}), got {tag!r}")

    def _note_for(self, src: int, dst: int, nbytes: int | None, wire: int, op: str, algorithm: str | None,
              step: int | None, where: Where) -> trace.Message | None:
        """A message's ``trace.Message`` when a trace records, else None (the one thread-local lookup it costs)."""
        rec = trace.current()
        if rec is None:
            return None
        return trace.Message(rec, self.group_ranks[src], self.group_ranks[dst], nbytes, op=op, algorithm=algorithm,
                             step=step, stage=where[0], microbatch=where[1], chunk=where[2], tag=wire, cid=self.cid)

    # ---- point to point on arrays -----------------------------------------------------------
    # ``stage``, ``microbatch``, ``chunk`` (keyword-only, optional): labels recorded on this side's
    # trace event of the message (e.g. the pipeline stage the activation leaves or enters).
    def isend(self, array: np.ndarray, dst: int, tag: int = 0, *, op: str = "send",
              algorithm: str | None = None, step: int | None = None, stage: int | None = None,
              microbatch: int | None = None, chunk: int | None = None) -> Request:
        """Start sending ``array`` (shape and dtype travel with it) to rank ``dst``."""
        return self._p2p_send(array, dst, tag, op, algorithm, step, stage, microbatch, chunk)

    def irecv(self, src: int, tag: int = 0, *, op: str = "send", algorithm: str | None = None,
              step: int | None = None, stage: int | None = None, microbatch: int | None = None,
              chunk: int | None = None) -> Request:
        """Start receiving an array from rank ``src``; ``wait()`` returns it."""
        return self._p2p_recv(src, tag, op, algorithm, step, stage, microbatch, chunk)

    def send(self, array: np.ndarray, dst: int, tag: int = 0, *, op: str = "send",
             algorithm: str | None = None, step: int | None = None, stage: int | None = None,
             microbatch: int | None = None, chunk: int | None = None) -> None:
        """Send ``array`` to rank ``dst`` and wait until its buffer may be reused."""
        self._p2p_send(array, dst, tag, op, algorithm, step, stage, microbatch, chunk).wait()

    def recv(self, src: int, tag: int = 0, *, op: str = "send", algorithm: str | None = None,
             step: int | None = None, stage: int | None = None, microbatch: int | None = None,
             chunk: int | None = None) -> np.ndarray:
        """Receive an array (any shape and dtype) from rank ``src``."""
        return self._p2p_recv(src, tag, op, algorithm, step, stage, microbatch, chunk).wait()

    def sendrecv(self, array: np.ndarray, dst: int, src: int, sendtag: int = 0, recvtag: int = 0, *,
                 op: str = "send", algorithm: str | None = None, step: int | None = None,
                 stage: int | None = None, microbatch: int | None = None,
                 chunk: int | None = None) -> np.ndarray:
        """Send to ``dst`` and receive from ``src`` at the same time (no deadlock in a ring); the
        labels go on this rank's events of both messages."""
        rreq = self._p2p_recv(src, recvtag, op, algorithm, step, stage, microbatch, chunk)
        sreq = self._p2p_send(array, dst, sendtag, op, algorithm, step, stage, microbatch, chunk)
        out = rreq.wait()
        sreq.wait()
        return out

    def _p2p_send(self, array: Any, dst: int, tag: int, op: str, algorithm: str | None, step: int | None,
                  stage: Any, microbatch: Any, chunk: Any) -> Request:
        arr = as_array(array, "send")
        self._check_peer(dst, "send")
        self._check_tag(tag, "send")
        where = NOWHERE if stage is None and microbatch is None and chunk is None else \
            _where(stage, microbatch, chunk, "send")
        return self._isend(P2P, arr, dst, tag, True, op, algorithm, step, where)

    def _p2p_recv(self, src: int, tag: int, op: str, algorithm: str | None, step: int | None,
                  stage: Any, microbatch: Any, chunk: Any) -> Request:
        self._check_peer(src, "recv")
        self._check_tag(tag, "recv")
        where = NOWHERE if stage is None and microbatch is None and chunk is None else \
            _where(stage, microbatch, chunk, "recv")
        return self._irecv(P2P, src, tag, None, None, op, algorithm, step, where)

    def _isend(self, ctx: int, arr: np.ndarray, dst: int, tag: int, header: bool, op: str,
               algorithm: str | None, step: int | None, where: Where = NOWHERE) -> Request:
        note = self._note_for(self.rank, dst, arr.nbytes, wire_tag(ctx, tag, 0), op, algorithm, step, where)
        pending = self._post_send(ctx, arr, dst, tag, header)
        req = Request(self, pending, f"{op} to rank {self.group_ranks[dst]}", [self.group_ranks[dst]])
        req._note = note
        return req

    def _irecv(self, ctx: int, src: int, tag: int, like: tuple[tuple[int, ...], np.dtype] | None,
               out: np.ndarray | None, op: str, algorithm: str | None, step: int | None,
               where: Where = NOWHERE) -> Request:
        note = self._note_for(src, self.rank, None, wire_tag(ctx, tag, 0), op, algorithm, step, where)
        pending = self._post_recv(ctx, src, tag, like, out)
        req = Request(self, pending, f"{op} from rank {self.group_ranks[src]}", [self.group_ranks[src]])
        req._note = note
        return req

    def _step(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, Any]], op: str,
              algorithm: str | None, step: int | None, header: bool = False) -> list[np.ndarray]:
        """One step of a collective: post ``recvs`` ``(src, like_or_out)``, then ``sends`` ``(dst,
        array)``, wait for all. ``like_or_out`` is a ``(shape, dtype)`` pair, an array to receive
        into, or None when ``header`` is True (the message says its shape)."""
        rreqs = []
        for src, spec in recvs:
            out = spec if isinstance(spec, np.ndarray) else None
            like = None if header else ((out.shape, out.dtype) if out is not None else spec)
            rreqs.append(self._irecv(COLL, src, 0, like, out, op, algorithm, step))
        sreqs = [self._isend(COLL, arr, dst, 0, header, op, algorithm, step) for dst, arr in sends]
        self._await(rreqs + sreqs, f"{op}({algorithm}) step {step}")
        return [r._value for r in rreqs]

    def _await(self, reqs: Sequence[Request], what: str) -> None:
        """Wait for all of ``reqs`` (a collective's step; the trace notes when the wait began)."""
        for r in reqs:
            if r._note is not None:
                r._note.waiting()
        peers = Lazy(lambda: [p for r in reqs if not r._pending.done() for p in r._peers])
        self._wait(lambda: all([r._pending.done() for r in reqs]), what, peers)
        for r in reqs:
            r._finish()

    # ---- Python objects on the control plane (pickled, not traced) --------------------------
    def _send_obj(self, ctx: int, obj: Any, dst: int, tag: int) -> Pending:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        return self._post_send(ctx, data, dst, tag, True)

    def _recv_obj(self, ctx: int, src: int, tag: int, what: str) -> Any:
        pending = self._post_recv(ctx, src, tag, None, None)
        self._wait(pending.done, what, [self.group_ranks[src]])
        return pickle.loads(pending.value.tobytes())

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a small picklable object (control plane: not traced)."""
        self._check_peer(dst, "send_object")
        self._check_tag(tag, "send_object")
        pending = self._send_obj(CTL, obj, dst, tag + 1)
        self._wait(pending.done, f"send_object to rank {self.group_ranks[dst]}", [self.group_ranks[dst]])

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """Receive an object sent with ``send_object``."""
        self._check_peer(src, "recv_object")
        self._check_tag(tag, "recv_object")
        return self._recv_obj(CTL, src, tag + 1, f"recv_object from rank {self.group_ranks[src]}")

    def gather_object(self, obj: Any, root: int = 0, survivors: bool = False) -> list[Any] | None:
        """Every rank's ``obj`` as a list by rank on ``root``; None elsewhere (linear, tag 0 of CTL).
        ``survivors``: ranks the failure detector declares dead before their object arrives are
        skipped (None in the list) instead of raising ``PeerLost`` (e.g. a trace after a lost worker)."""
        self._check_root(root, "gather_object")
        det = self.state.detector if survivors else None
        dead = (lambda r: self.group_ranks[r] in det.dead) if det is not None else (lambda r: False)
        fail_fast = self.state.fail_fast
        self.state.fail_fast = fail_fast and det is None
        try:
            if self.rank != root:
                pending = self._send_obj(CTL, obj, root, 0)
                self._wait(pending.done, "gather_object (send to root)", [self.group_ranks[root]])
                return None
            out: list[Any] = [None] * self.size
            out[root] = obj
            pendings = {r: self._post_recv(CTL, r, 0, None, None) for r in range(self.size) if r != root}
            self._wait(lambda: all([p.done() or dead(r) for r, p in pendings.items()]), "gather_object (root)",
                       Lazy(lambda: [self.group_ranks[r] for r, p in pendings.items() if not p.done() and not dead(r)]))
        finally:
            self.state.fail_fast = fail_fast
        for r, p in pendings.items():
            out[r] = pickle.loads(p.value.tobytes()) if p.done() else None
        return out

    def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank (linear sends from root)."""
        self._check_root(root, "broadcast_object")
        if self.rank == root:
            pendings = [self._send_obj(CTL, obj, r, 0) for r in range(self.size) if r != root]
            self._wait(lambda: all([p.done() for p in pendings]), "broadcast_object (root)",
                       [g for g in self.group_ranks if g != self.world_rank])
            return obj
        return self._recv_obj(CTL, root, 0, "broadcast_object")

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` as a list by rank, on every rank."""
        return self.broadcast_object(self.gather_object(obj, root=0), root=0)

    def _check_root(self, root: int, what: str) -> None:
        if not isinstance(root, int | np.integer) or not 0 <= root < self.size:
            raise ValueError(f"{what}: root={root!r} is not a rank of this communicator (size {self.size})")

    # ---- sub-communicators ------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> Communicator:
        """Split into groups of equal ``color``, ranked by ``(key, rank)``; called by every rank
        (like ``MPI_Comm_split``). Returns this rank's new communicator."""
        if not isinstance(color, int | np.integer) or color < 0:
            raise ValueError(f"split: color must be a non-negative int, got {color!r}")
        key = self.rank if key is None else int(key)
        table = self.allgather_object((int(color), key))
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        ranks = [r for _, r in members]
        self._children += 1
        child = self._make_split(int(color), ranks, ranks.index(self.rank))
        child.cid = f"{self.cid}.{self._children}"
        return child

    def dup(self) -> Communicator:
        """A communicator with the same ranks and a separate message space (call on every rank)."""
        self._children += 1
        child = self._make_dup()
        child.cid = f"{self.cid}.{self._children}"
        return child
