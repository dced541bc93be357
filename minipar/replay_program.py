"""A recorded trace as the replay's programs (``minipar.replay``): each thread's points (where it
began or ended a span, posted, waited for or completed a message, entered a native collective or
marked a non-blocking job) in the order they happened on it, and the compute between them; which
send each receive matches; how many ranks each communicator joins; where a collective reduces.
docs/formulas.md, section 11, has the rules."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from minipar.comm.base import COLL
from minipar.trace import Event


class ReplayError(ValueError):
    """A trace that cannot be replayed, or a cluster that cannot be read: one line saying why."""


@dataclass
class Point:
    """A place in one thread's program: ``what`` happens to event ``i`` at wall time ``wall``."""

    wall: float
    order: int  # tie-break at equal wall times (see ORDER)
    i: int
    what: str  # begin end post wait done native op anchor0 anchor1
    cpu: float | None = None


ORDER = {"end": 0, "post": 1, "wait": 2, "done": 3, "op": 4, "native": 4, "begin": 5, "anchor0": 6, "anchor1": 6}
ASYNC = ("async posted", "async start", "async end", "async wait")


def is_message(e: Event) -> bool:
    return e.kind == "comm" and e.src is not None and e.dst is not None


def points(events: list[Event]) -> dict[tuple[int, int], list[Point]]:
    """Every thread's points in program order (its events by wall time)."""
    lanes: dict[tuple[int, int], list[Point]] = defaultdict(list)
    for i, e in enumerate(events):
        add = lanes[(e.rank, e.thread or 0)].append
        if e.kind == "compute":
            add(Point(e.t0, ORDER["begin"], i, "begin", e.c0))
            add(Point(e.t1, ORDER["end"], i, "end", e.c1))
        elif is_message(e):
            add(Point(e.t0, ORDER["post"], i, "post", e.c0))
            if e.tw is not None or e.rank == e.dst:  # a receive never waited for: where test() found it
                tw = e.t1 if e.tw is None else e.tw
                cw = e.c1 if e.tw is None else e.cw
                add(Point(tw, ORDER["wait"], i, "wait", cw))
                add(Point(max(tw, e.t1), ORDER["done"], i, "done", max(cw or 0.0, e.c1 or 0.0)))
        elif e.kind == "comm" and e.algorithm == "native":
            add(Point(e.t0, ORDER["native"], i, "native", e.c0))
            add(Point(e.t1, ORDER["done"], i, "done", e.c1))
        elif e.kind == "mark" and e.name in ASYNC:
            add(Point(e.t0, ORDER["op"], i, "op", e.c0))
        else:
            add(Point(e.t0, ORDER["anchor0"], i, "anchor0"))
            if e.t1 != e.t0:
                add(Point(e.t1, ORDER["anchor1"], i, "anchor1"))
    for pts in lanes.values():
        pts.sort(key=lambda p: (p.wall, p.order))
    return lanes


def coll_key(e: Event) -> tuple[Any, ...] | None:
    """The collective call a message belongs to (None: a point-to-point message)."""
    return (e.cid, e.op, e.algorithm) if e.tag is not None and e.tag >> 22 == COLL else None


def program(events: list[Event], pts: list[Point], stats: dict[str, int],
             scale: dict[int, float], host: bool = False) -> list[tuple[str, Any]]:
    """A thread's ops: ``("compute", seconds)`` between its points (module docstring), then the point;
    CPU time inside a span is scaled by the innermost open span's ``scale`` (1 if it has none).
    ``host``: the CPU time outside spans (but not in waits) is compute too."""
    ops: list[tuple[str, Any]] = []
    open_spans: dict[int, bool] = {}  # span index -> has CPU times
    waiting = 0
    prev: Point | None = None
    for p in pts:
        if p.what.startswith("anchor"):
            ops.append(("anchor", p))
            continue
        e = events[p.i]
        if host and prev is not None and not open_spans and not waiting:
            if p.cpu is not None and prev.cpu is not None and p.cpu > prev.cpu:
                ops.append(("compute", p.cpu - prev.cpu))
        elif prev is not None and open_spans and not waiting:
            pe = events[prev.i]
            gap = not host and prev.what == "done" and p.what == "post" and is_message(e) and is_message(pe) \
                and coll_key(e) is not None and coll_key(e) == coll_key(pe) \
                and (e.step or 0) > (pe.step or 0)  # between one call's steps (a new call starts again at 0)
            cpu_ok = all(open_spans.values()) and p.cpu is not None and prev.cpu is not None
            d = (p.cpu - prev.cpu) * scale.get(next(reversed(open_spans)), 1.0) if cpu_ok \
                else (p.wall - prev.wall)  # type: ignore[operator]
            if not gap and d > 0:
                ops.append(("compute", d))
        if p.what == "begin":
            open_spans[p.i] = e.c0 is not None and e.c1 is not None
            stats["spans_without_cpu"] += not open_spans[p.i]
        elif p.what == "end":
            open_spans.pop(p.i, None)
        elif p.what in ("wait", "native"):
            waiting += 1
        elif p.what == "done":
            waiting -= 1
        ops.append((p.what, p))
        prev = p
    return ops


def match_receives(events: list[Event]) -> dict[int, int]:
    """Receive event index -> its send's: MPI's order on (cid, tag, src, dst)."""
    sends: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    recvs: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if is_message(e):
            (sends if e.rank == e.src else recvs)[(e.cid, e.tag, e.src, e.dst)].append(i)
    out = {}
    for key, rs in recvs.items():
        ss = sorted(sends.get(key, []), key=lambda i: events[i].t0)
        for k, r in enumerate(sorted(rs, key=lambda i: events[i].t0)):
            if k >= len(ss):
                e = events[r]
                raise ReplayError(f"rank {e.dst}'s receive #{k} from rank {e.src} ({e.op}, tag {e.tag}) has no "
                                  "matching send in the trace (a lost rank?)")
            out[r] = ss[k]
    return out


def group_sizes(events: list[Event]) -> dict[tuple[str | None, int], int]:
    """(cid, rank) -> how many ranks exchange messages with it on that communicator (its p)."""
    parent: dict[tuple[Any, int], tuple[Any, int]] = {}

    def find(x: tuple[Any, int]) -> tuple[Any, int]:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for e in events:
        if is_message(e):
            parent[find((e.cid, e.src))] = find((e.cid, e.dst))  # type: ignore[arg-type]
    size: dict[tuple[Any, int], int] = defaultdict(int)
    for x in list(parent):
        size[find(x)] += 1
    return {x: size[find(x)] for x in parent}


def reduces(op: str | None, algorithm: str | None, step: int | None, p: int) -> bool:
    """Whether a rank reduces what it receives in this step of a collective on ``p`` ranks."""
    if op == "reduce_scatter" or (op, algorithm) == ("reduce", "tree"):
        return True
    if op != "allreduce" or step is None:
        return False
    if algorithm == "ring":
        return step < p - 1
    if algorithm == "naive":
        return step == 0
    if algorithm == "recursive_doubling":
        pp = 1 << (p.bit_length() - 1)
        return pp == p or step != pp.bit_length()  # not the result sent back to a folded rank
    return False
