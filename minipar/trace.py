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
event when saved. Tracing that is off costs one thread-local lookup per call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "minipar-trace"
VERSION = 1
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

    @property
    def duration(self) -> float:
        return self.t1 - self.t0

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


@dataclass
class Trace:
    meta: dict[str, Any]
    events: list[Event]

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
        return int(self.meta.get("world_size", 1 + max((e.rank for e in self.events), default=0)))


class Recorder:
    """Collects one rank's events; ``spill_path``: where ``spill`` writes them if the rank is killed
    while a trace file records (None: nowhere)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[Event] = []
        self.spill_path: str | None = None

    def add(self, kind: str, name: str, t0: float, t1: float, **fields: Any) -> Event:
        ev = Event(self.rank, kind, name, t0, t1, **fields)
        self.events.append(ev)
        return ev


_local = threading.local()


def now() -> float:
    return time.perf_counter()


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
def span(name: str, kind: str = "compute", **fields: Any) -> Iterator[None]:
    """Record the enclosed block as one span: ``with trace.span("F", stage=1, microbatch=3):``."""
    rec = current()
    if rec is None:
        yield
        return
    t0 = now()
    try:
        yield
    finally:
        rec.add(kind, name, t0, now(), **fields)


def memory(label: str, nbytes: int, **fields: Any) -> None:
    """Sample ``nbytes`` held under ``label`` on this rank."""
    rec = current()
    if rec is not None:
        t = now()
        rec.add("memory", label, t, t, nbytes=int(nbytes), **fields)


def mark(name: str, **args: Any) -> None:
    """A point in time worth seeing on the timeline."""
    rec = current()
    if rec is not None:
        t = now()
        rec.add("mark", name, t, t, args=args)


def message(
    src: int, dst: int, nbytes: int, t0: float, t1: float, op: str, algorithm: str | None = None,
    step: int | None = None, **fields: Any,
) -> None:
    """Record one message on this rank (sender or receiver side)."""
    rec = current()
    if rec is not None:
        direction = "send" if src == rec.rank else "recv"
        rec.add("comm", direction, t0, t1, src=src, dst=dst, nbytes=int(nbytes), op=op,
                algorithm=algorithm, step=step, **fields)


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
def record(path: str | os.PathLike[str] | None, comm: Any = None, **meta: Any) -> Iterator[Recorder]:
    """Record every rank's events while the block runs; rank 0 writes one file at ``path``.

    All ranks of ``comm`` (the world when None) enter together. If the block raises, nothing is
    written, and the side files of this trace's killed ranks are removed. ``path=None`` records
    without writing (the events stay on the yielded recorder).
    Ranks the failure detector declares dead are skipped by the gather; their spilled events (see
    the module docstring) are merged and ``meta["lost_ranks"]`` names them (rank 0 must survive).
    """
    if comm is None:
        from minipar.comm import world

        comm = world()
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
    return Trace(dict(meta), events)


def _event_problem(e: Event) -> str | None:
    """What is wrong with a loaded event's field types, or None."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if e.kind not in KINDS:
        return f"kind {e.kind!r} is not one of {KINDS}"
    if not isinstance(e.rank, int) or not isinstance(e.name, str) or not (number(e.t0) and number(e.t1)):
        return "rank must be an int, name a string, t0 and t1 numbers"
    for k in ("src", "dst", "nbytes", "step", "stage", "microbatch", "chunk"):
        if getattr(e, k) is not None and not isinstance(getattr(e, k), int):
            return f"{k} must be an int, got {getattr(e, k)!r}"
    return None


def to_chrome(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Export to Chrome-trace JSON (open in https://ui.perfetto.dev or chrome://tracing).

    Each rank is a process (``pid`` = rank, named "rank r"), so its memory samples are its own
    counters. Spans ("X" events) must nest on a thread or Perfetto drops them, and a rank's messages
    overlap each other and its compute; so the spans are packed first-fit into as many threads as
    needed ("main", then "overlap 1", ...), each holding properly nested spans. Times are whole
    nanoseconds, written in microseconds.
    """
    ns = [(round(e.t0 * 1e9), max(round(e.t1 * 1e9), round(e.t0 * 1e9))) for e in trace.events]
    spans = [i for i, e in enumerate(trace.events) if e.kind in ("compute", "comm", "transfer")]
    lane = _nest_lanes([(trace.events[i].rank, *ns[i], i) for i in spans])
    out: list[dict[str, Any]] = []
    for i, e in enumerate(trace.events):
        base = {"pid": e.rank, "tid": lane.get(i, 0), "ts": ns[i][0] / 1e3, "cat": e.kind}
        extra = {k: v for k, v in e.to_dict().items() if k not in ("rank", "kind", "name", "t0", "t1")}
        if e.kind == "memory":
            out.append({**base, "ph": "C", "name": e.name, "args": {"bytes": e.nbytes}})
        elif e.kind == "mark":
            out.append({**base, "ph": "i", "s": "t", "name": e.name, "args": extra})
        else:
            label = e.name if e.microbatch is None else f"{e.name}{e.microbatch}"
            if e.kind == "comm":
                label = f"{e.op}:{e.name} {e.src}->{e.dst}"
            elif e.kind == "transfer":
                label = f"{e.args.get('src')}->{e.args.get('dst')} {e.name}"
            out.append({**base, "ph": "X", "name": label, "dur": (ns[i][1] - ns[i][0]) / 1e3, "args": extra})
    ranks = sorted({e.rank for e in trace.events} | set(range(trace.world_size)))
    for r in ranks:
        out.append({"ph": "M", "pid": r, "name": "process_name", "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "pid": r, "name": "process_sort_index", "args": {"sort_index": r}})
        for t in sorted({lane[i] for i in spans if trace.events[i].rank == r} | {0}):
            name = "main" if t == 0 else f"overlap {t}"
            out.append({"ph": "M", "pid": r, "tid": t, "name": "thread_name", "args": {"name": name}})
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms", "metadata": trace.meta}, fh,
                  default=_jsonable)
    os.replace(tmp, path)


def _nest_lanes(spans: list[tuple[int, int, int, int]]) -> dict[int, int]:
    """``{index: lane}`` for ``(rank, start, end, index)`` spans: first fit, by start (longest
    first on ties), into the lowest lane of the rank where the span starts after or nests inside
    what is open there. O(S L) for S spans and L lanes."""
    stacks: dict[int, list[list[int]]] = {}
    lane: dict[int, int] = {}
    for rank, a, b, i in sorted(spans, key=lambda s: (s[0], s[1], -s[2])):
        lanes = stacks.setdefault(rank, [])
        for k, open_ends in enumerate([*lanes, []]):
            while open_ends and open_ends[-1] <= a:
                open_ends.pop()
            if not open_ends or b <= open_ends[-1]:
                if k == len(lanes):
                    lanes.append(open_ends)
                open_ends.append(b)
                lane[i] = k
                break
    return lane
