"""Trace events: what every rank computed, sent and held, and when.

One run writes one trace file. Every rank records its own events into a per-thread recorder
(one thread per rank on the ``threads`` backend, one process per rank under ``mpiexec``); when
``record`` ends, the events are gathered to rank 0, which writes the file whole or not at all.

A lost rank (``minipar.comm.faults``): the gather skips ranks the failure detector declares dead,
and the file's meta names them (``lost_ranks``, world ranks). A killed process cannot send its
events, so while a trace records, ``faults.kill`` first writes the dying rank's events so far to a
side file next to the trace (``spill``: ``<path>.rank<r>.lost``), and rank 0 merges the side files
of the lost ranks. The side file stands in for a per-rank on-disk log (a production tracer flushes
its buffer as it goes): a real SIGKILL from outside loses the rank's events, and its lane is empty.

Event kinds:
- ``compute``: a span of work (``name`` "F", "B", "opt", ...; ``stage``/``microbatch``/``chunk``).
- ``comm``: one message, recorded by its sender and its receiver: ``src``, ``dst``, ``nbytes``,
  ``op`` (the collective it belongs to, or "send"/"recv"), ``algorithm``, ``step``.
- ``memory``: a sample of bytes held under a label (``nbytes``), at ``t0 == t1``.
- ``mark``: a point in time with a name (and ``args``).
- ``transfer``: one copy of a tensor (``name``) between memory tiers (``minipar.tiers``): ``nbytes``,
  ``args = {"src", "dst", "modelled_s"}`` with tiers "cpu", "device", "nvme".

Times are seconds on the machine's monotonic clock while recording, and relative to the earliest
event when saved (``meta["clock"]`` is "wall"; ``minipar.replay`` writes "replay"). Tracing that is
off costs one thread-local lookup per call.

CPU time (format version 2): a compute span also records ``c0``/``c1``, the CPU seconds of the
thread that ran it (``time.thread_time``: a rank's own thread on ``threads``, the process's main
thread under ``mpiexec``), which does not grow while the thread waits for a core, so it means the
same however many ranks share the machine (``compute_sleep``: a sleep charged as CPU time, for a
modelled straggler). A message records the CPU time at its post (``c0``) and
completion (``c1``), and ``tw``/``cw``, the wall and CPU time at which its rank began to wait for it
(absent when it was never waited for, e.g. a send found complete by ``test()``); ``tag`` and ``cid``
(the communicator, the same string on every rank) are MPI's matching key with ``src``/``dst``. An
event recorded by another thread of the rank (a communicator's worker, ``comm/asyncwork.py``) says
which in ``thread`` (1, 2, ...; absent: the rank's own thread). Version-1 traces still load; they
have none of these, so they cannot be replayed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "minipar-trace"
VERSION = 2  # 2: CPU times, waits, matching keys and threads (see the module docstring)
KINDS = ("compute", "comm", "memory", "mark", "transfer")


class TraceError(Exception):
    """A trace file that cannot be read: missing, truncated, corrupt or from a newer format."""


@dataclass
class Event:
    rank: int
    kind: str
    name: str
    t0: float
    t1: float
    src: int | None = None
    dst: int | None = None
    nbytes: int | None = None
    op: str | None = None
    algorithm: str | None = None
    step: int | None = None
    stage: int | None = None
    microbatch: int | None = None
    chunk: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    c0: float | None = None  # CPU seconds of the recording thread at t0 and t1 (version 2)
    c1: float | None = None
    tw: float | None = None  # comm: wall and CPU time at which the rank began to wait for it
    cw: float | None = None
    thread: int | None = None  # the rank's thread that recorded it (None: its own)
    tag: int | None = None  # comm: wire tag (context and tag) and communicator id: the matching key
    cid: str | None = None

    @property
    def duration(self) -> float:
        return self.t1 - self.t0

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


@dataclass
class Trace:
    meta: dict[str, Any]
    events: list[Event]
    version: int = VERSION  # the file format it was read from (saving writes the current one)

    def by_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def select(self, kind: str | None = None, **fields: Any) -> list[Event]:
        """Events of ``kind`` whose attributes equal every given field."""
        return [
            e
            for e in self.events
            if (kind is None or e.kind == kind) and all(getattr(e, k) == v for k, v in fields.items())
        ]

    def bytes_sent(self, rank: int, op: str | None = None) -> int:
        """Bytes that ``rank`` sent (counted once, from the sender's own record)."""
        return sum(
            e.nbytes or 0
            for e in self.events
            if e.kind == "comm" and e.rank == rank and e.src == rank and (op is None or e.op == op)
        )

    @property
    def world_size(self) -> int:
        if "world_size" in self.meta:  # not a scan of every event on each call (viz asks per rank)
            return int(self.meta["world_size"])
        return 1 + max((e.rank for e in self.events), default=0)


class Recorder:
    """Collects one rank's events; ``spill_path``: where ``spill`` writes them if the rank is killed
    while a trace file records (None: nowhere). The thread that made it is the rank's own (lane 0);
    other threads that record into it get lanes 1, 2, ... in the order they first record."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[Event] = []
        self.spill_path: str | None = None
        self._lanes = {threading.get_ident(): 0}
        self._lock = threading.Lock()

    def add(self, kind: str, name: str, t0: float, t1: float, **fields: Any) -> Event:
        ident = threading.get_ident()
        lane = self._lanes.get(ident)
        if lane is None:
            with self._lock:
                lane = self._lanes.setdefault(ident, len(self._lanes))
        ev = Event(self.rank, kind, name, t0, t1, thread=lane or None, **fields)
        self.events.append(ev)
        return ev


_local = threading.local()


def now() -> float:
    return time.perf_counter()


def cpu() -> float:
    """CPU seconds of the calling thread (it does not grow while the thread waits for a core), plus
    the seconds ``compute_sleep`` charged to it."""
    return time.thread_time() + getattr(_local, "charged", 0.0)


def compute_sleep(seconds: float) -> None:
    """Sleep ``seconds`` that stand for compute (a straggler's slower work): the core stays free for
    the other ranks, and the thread's CPU clock (``cpu``) advances by ``seconds``, so the span around
    it lasts that long in a replay too (a plain sleep uses no CPU time: a replay would drop it)."""
    time.sleep(seconds)
    _local.charged = getattr(_local, "charged", 0.0) + seconds


def current() -> Recorder | None:
    """This rank's recorder, or None when tracing is off."""
    return getattr(_local, "recorder", None)


@contextmanager
def recording(rank: int) -> Iterator[Recorder]:
    """Record this rank's events in memory (no file); the recorder is yielded."""
    prev = current()
    rec = Recorder(rank)
    _local.recorder = rec
    try:
        yield rec
    finally:
        _local.recorder = prev


@contextmanager
def bound(rec: Recorder | None) -> Iterator[None]:
    """Record into ``rec``, a rank's recorder, from another thread of the rank (a worker) while the
    block runs; the thread gets its own lane (``Event.thread``)."""
    prev = current()
    _local.recorder = rec
    try:
        yield
    finally:
        _local.recorder = prev


@contextmanager
def span(name: str, kind: str = "compute", **fields: Any) -> Iterator[None]:
    """Record the enclosed block as one span: ``with trace.span("F", stage=1, microbatch=3):``."""
    rec = current()
    if rec is None:
        yield
        return
    t0, c0 = now(), cpu()
    try:
        yield
    finally:
        rec.add(kind, name, t0, now(), c0=c0, c1=cpu(), **fields)


def memory(label: str, nbytes: int, **fields: Any) -> None:
    """Sample ``nbytes`` held under ``label`` on this rank."""
    rec = current()
    if rec is not None:
        t = now()
        rec.add("memory", label, t, t, nbytes=int(nbytes), **fields)


def memory_states(states: Mapping[str, int]) -> None:
    """Sample each of ``states`` (label: bytes held, as a wrapper's ``state_bytes()`` reports its
    parameters, gradients and optimizer state) on this rank, in order."""
    for label, nbytes in states.items():
        memory(label, nbytes)


def mark(name: str, **args: Any) -> None:
    """A point in time worth seeing on the timeline."""
    rec = current()
    if rec is not None:
        t = now()
        rec.add("mark", name, t, t, args=args)


class Message:
    """What a trace keeps of one message until it completes (``minipar.comm`` makes one per message
    while a trace records): posted (``t0``, ``c0``), waited for (``tw``, ``cw``: set by the first wait,
    also one after a ``test()`` completed it), then its event (``done``, on the sender's or the
    receiver's side by ``src``; ``nbytes`` None: the received array's)."""

    __slots__ = ("rec", "src", "dst", "nbytes", "fields", "t0", "c0", "tw", "cw", "event")

    def __init__(self, rec: Recorder, src: int, dst: int, nbytes: int | None, **fields: Any) -> None:
        self.rec, self.src, self.dst, self.nbytes, self.fields = rec, src, dst, nbytes, fields
        self.t0, self.c0 = now(), cpu()
        self.tw: float | None = None
        self.cw: float | None = None
        self.event: Event | None = None

    def waiting(self) -> None:
        if self.tw is None:
            self.tw, self.cw = now(), cpu()
            if self.event is not None:
                self.event.tw, self.event.cw = self.tw, self.cw

    def done(self, value: Any) -> None:
        nbytes = value.nbytes if self.nbytes is None else self.nbytes
        self.event = self.rec.add("comm", "send" if self.src == self.rec.rank else "recv", self.t0, now(),
                                  c0=self.c0, c1=cpu(), tw=self.tw, cw=self.cw, src=self.src, dst=self.dst,
                                  nbytes=int(nbytes), **self.fields)


def spill_path(path: str | os.PathLike[str], rank: int) -> str:
    """The side file of world rank ``rank``'s events, next to the trace at ``path``."""
    return f"{os.fspath(path)}.rank{rank}.lost"


def spill(rec: Recorder) -> None:
    """Write ``rec``'s events so far to its side file (atomically), if a trace file records: what a
    rank about to be killed leaves behind (``faults.kill``), standing in for a per-rank on-disk log."""
    if rec.spill_path is None:
        return
    tmp = f"{rec.spill_path}.tmp"
    with open(tmp, "w") as fh:
        json.dump([e.to_dict() for e in rec.events], fh, default=_jsonable)
    os.replace(tmp, rec.spill_path)


def _unspill(path: str, rank: int) -> list[Event]:
    """A lost rank's spilled events (the side file read and removed); none when it left no file."""
    side = spill_path(path, rank)
    try:
        with open(side) as fh:
            events = [Event(**d) for d in json.load(fh)]
    except (OSError, ValueError, TypeError):  # no side file (killed from outside), or a torn one
        return []
    os.remove(side)
    return events


def _remove_side_files(path: str, ranks: list[int]) -> None:
    """Remove the side files (and half-written ones) that ranks ``ranks`` may have spilled for ``path``."""
    for r in ranks:
        for side in (spill_path(path, r), f"{spill_path(path, r)}.tmp"):
            try:
                os.remove(side)
            except FileNotFoundError:
                pass


@contextmanager
def record(path: str | os.PathLike[str] | None, comm: Any, **meta: Any) -> Iterator[Recorder]:
    """Record every rank's events while the block runs; rank 0 writes one file at ``path``.

    All ranks of ``comm`` (``minipar.comm.world()`` for a whole run; this layer sits below the
    communication layer and does not import it) enter together. If the block raises, nothing is
    written, and the side files of this trace's killed ranks are removed. ``path=None`` records
    without writing (the events stay on the yielded recorder).
    Ranks the failure detector declares dead are skipped by the gather; their spilled events (see
    the module docstring) are merged and ``meta["lost_ranks"]`` names them (rank 0 must survive).
    """
    rank = comm.world_rank if hasattr(comm, "world_rank") else comm.rank
    with recording(rank) as rec:
        if path is not None:
            rec.spill_path = spill_path(path, rank)
            if os.path.exists(rec.spill_path):  # a side file from an earlier run of this path
                os.remove(rec.spill_path)
        try:
            yield rec
        except Exception:  # no trace: nor the side files of its killed ranks (a killed rank's end is no Exception)
            if path is not None:
                _remove_side_files(os.fspath(path), list(getattr(comm, "group_ranks", range(comm.size))))
            raise
    gathered = comm.gather_object([e.to_dict() for e in rec.events], root=0, survivors=True)
    if comm.rank == 0 and path is not None:
        ranks = list(getattr(comm, "group_ranks", range(comm.size)))
        lost = [ranks[i] for i, part in enumerate(gathered) if part is None]
        events = [Event(**d) for part in gathered if part is not None for d in part]
        for r in lost:
            events += _unspill(os.fspath(path), r)
        meta.setdefault("world_size", comm.size)
        meta.setdefault("backend", getattr(comm, "backend", "unknown"))
        meta.setdefault("clock", "wall")
        if lost:
            meta["lost_ranks"] = lost
        save(Trace(meta, events), path)


def save(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write the trace atomically (a temporary file renamed into place; removed if writing fails)."""
    t_base = min((e.t0 for e in trace.events), default=0.0)
    events = []
    for e in sorted(trace.events, key=lambda e: (e.t0, e.rank)):
        d = e.to_dict()
        d["t0"] = e.t0 - t_base
        d["t1"] = e.t1 - t_base
        if e.tw is not None:
            d["tw"] = e.tw - t_base
        events.append(d)
    doc = {"format": FORMAT, "version": VERSION, "meta": trace.meta, "events": events}
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(doc, fh, default=_jsonable)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; raises ``TraceError`` with one clear line when it cannot."""
    path = os.fspath(path)
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a readable trace (truncated or corrupt JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceError(f"{path}: not a minipar trace (no '{FORMAT}' header)")
    version = doc.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise TraceError(
            f"{path}: trace format version {version} is newer than this minipar reads ({VERSION}); "
            "upgrade minipar"
        )
    meta = doc.get("meta", {})
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size", 1), int):
        raise TraceError(f"{path}: malformed trace metadata (a dict with an int world_size expected)")
    try:
        events = [Event(**d) for d in doc["events"]]
    except (KeyError, TypeError) as exc:
        raise TraceError(f"{path}: malformed trace event ({exc})") from None
    for i, e in enumerate(events):
        problem = _event_problem(e)
        if problem:
            raise TraceError(f"{path}: malformed trace event #{i} ({problem})")
    return Trace(dict(meta), events, version)


def has_cpu_times(trace: Trace) -> bool:
    """True when the trace's events carry CPU times (format version 2, recorded by a run)."""
    return trace.version >= 2 and any(e.c0 is not None for e in trace.events if e.kind in ("compute", "comm"))


def _event_problem(e: Event) -> str | None:
    """What is wrong with a loaded event's field types, or None."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if e.kind not in KINDS:
        return f"kind {e.kind!r} is not one of {KINDS}"
    if not isinstance(e.rank, int) or not isinstance(e.name, str) or not (number(e.t0) and number(e.t1)):
        return "rank must be an int, name a string, t0 and t1 numbers"
    for k in ("src", "dst", "nbytes", "step", "stage", "microbatch", "chunk", "thread", "tag"):
        if getattr(e, k) is not None and not isinstance(getattr(e, k), int):
            return f"{k} must be an int, got {getattr(e, k)!r}"
    for k in ("c0", "c1", "tw", "cw"):
        if getattr(e, k) is not None and not number(getattr(e, k)):
            return f"{k} must be a number, got {getattr(e, k)!r}"
    if e.cid is not None and not isinstance(e.cid, str):
        return f"cid must be a string, got {e.cid!r}"
    return None
