"""Messages as a reader sees them, computed from a trace alone: each rank's comm events grouped
into one span per collective call (``collective_spans``), and each send paired with its receive
(``pair_messages``). The report's timeline and the terminal timeline both draw from here.

- **Collective call** (``collective_spans``): a rank's run of comm events of one op and algorithm
  whose steps never go back; one span per call, with the bytes the rank sent and received in it. A
  collective's messages name its algorithm (ring, naive, native, ...); a message without one is
  point-to-point (send, recv, a parameter server's push and pull, Ring Attention's K/V pass) and is
  a span of its own, however its steps count.
- **A call inside a compute span** (``inside_compute``): the rank's own thread was in it, waiting,
  after one of its compute spans began and before it ended, and computed nothing else meanwhile, so
  the computation waited in it (tensor parallelism's all-reduces inside F, ZeRO-1's collectives inside
  opt): drawn inside that span, not beside it as an overlap. A collective on the rank's own thread is
  waited in from its first message to its last; a point-to-point message only when the rank began to
  wait for it (``tw``) in the first half of its flight (a blocking receive; a send posted and left to
  finish is not). A call on a communicator's worker thread (``Event.thread``: DDP's bucket all-reduces,
  FSDP's prefetched all-gathers), one a compute span started or ended during (Ring Attention's K/V
  pass under its score blocks) or one posted as a span began (a pipeline's send, which a replay
  places at the next span's start) runs beside the computation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar.trace import Event, Trace
from viz.analysis import sends


@dataclass
class CommSpan:
    """One collective call (or one point-to-point message) as one rank saw it: the rank's comm
    events from the call's first step to its last. ``sent`` / ``received``: bytes this rank sent /
    received in it; ``hidden``: bytes of events without a peer (``native``: MPI's own messages)."""

    rank: int
    op: str
    algorithm: str | None
    events: list[Event]

    @property
    def t0(self) -> float:
        return min(e.t0 for e in self.events)

    @property
    def t1(self) -> float:
        return max(e.t1 for e in self.events)

    @property
    def key(self) -> str:
        return f"{self.op}/{self.algorithm}" if self.algorithm else self.op

    @property
    def title(self) -> str:
        """``"allreduce ring"``, ``"send"``: op and algorithm as a reader says them."""
        return f"{self.op} {self.algorithm}" if self.algorithm else self.op

    @property
    def steps(self) -> list[int]:
        return sorted({e.step for e in self.events if e.step is not None})

    @property
    def sent(self) -> int:
        return sum(e.nbytes or 0 for e in self.events if e.src is not None and e.src == self.rank)

    @property
    def received(self) -> int:
        return sum(e.nbytes or 0 for e in self.events
                   if e.dst is not None and e.dst == self.rank and e.src != self.rank)

    @property
    def hidden(self) -> int:
        return sum(e.nbytes or 0 for e in self.events if e.src is None and e.dst is None)


def collective_spans(trace: Trace) -> list[CommSpan]:
    """Group each rank's comm events into one span per collective call.

    A rank's comm events, in time order, belong to one call while they keep the same op and
    algorithm and their ``step`` does not go back (a ring all-reduce: steps 0..2(p-1)-1, a send and
    a receive each); a step lower than the last one, another op or algorithm, an event without a
    step (a ``native`` collective) or without an algorithm (a point-to-point message: op "send" or
    "recv" as the rank saw it, "push", "pull", "ring_kv", ...) starts a new span. Limitation: one-step
    collectives of the same op and algorithm called back to back merge into one span.
    Cost: O(E log E).
    """
    spans: list[CommSpan] = []
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in trace.events:
        if e.kind == "comm":
            by_rank[e.rank].append(e)
    for rank in sorted(by_rank):
        cur: CommSpan | None = None
        for e in sorted(by_rank[rank], key=lambda e: e.t0):
            op = e.name if e.op in ("send", "recv", None) else e.op  # a p2p receive is a "recv"
            last = cur.events[-1].step if cur is not None else None
            if (cur is None or e.step is None or last is None or e.step < last or e.algorithm is None
                    or (op, e.algorithm) != (cur.op, cur.algorithm)):
                cur = CommSpan(rank, op, e.algorithm, [])
                spans.append(cur)
            cur.events.append(e)
    return spans


def inside_compute(trace: Trace, spans: Sequence[CommSpan]) -> list[bool]:
    """For each span (``collective_spans``): True when its rank's own thread recorded all of its
    messages after one of that thread's compute spans began and before it ended, waited in them (a
    collective, or a point-to-point message waited for from the first half of its flight on), and no
    other compute span of the thread began or ended between the call's first and last message (module
    docstring). Cost: O(S C) for S calls and C compute spans of a rank, vectorised over C."""
    own: dict[int, list[Event]] = defaultdict(list)
    for e in trace.events:
        if e.kind == "compute" and not e.thread:
            own[e.rank].append(e)
    bounds = {r: (np.array([e.t0 for e in es]), np.array([e.t1 for e in es])) for r, es in own.items()}
    out = []
    for span in spans:
        if span.rank not in bounds or any(e.thread for e in span.events) or not _waited(span):
            out.append(False)
            continue
        starts, ends = bounds[span.rank]
        t0, t1 = span.t0, span.t1
        overlaps = (starts < t1) & (ends > t0)
        encloses = (starts < t0) & (ends >= t1) & overlaps  # a message at a span's start or edge is not in it
        out.append(bool(encloses.any() and not (overlaps & ~encloses).any()))
    return out


def _waited(span: CommSpan) -> bool:
    """Whether the rank waited in the call: a collective (it has an algorithm) from start to end; a
    point-to-point message when the rank began to wait for it (``tw``) in the first half of its flight."""
    return span.algorithm is not None or all(e.tw is not None and e.tw <= (e.t0 + e.t1) / 2 for e in span.events)


def _pair_op(event: Event) -> str | None:
    """Point-to-point records say "send" on one side and "recv" on the other: pair them as one."""
    return "p2p" if event.op in ("send", "recv", None) else event.op


def pair_messages(trace: Trace) -> list[tuple[Event, Event | None]]:
    """Match each send to its receive: the k-th message src->dst of an op pairs with the k-th
    receive on dst from src of that op (MPI's non-overtaking order). Unmatched sends get None."""
    queues: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    for e in sorted(trace.events, key=lambda e: e.t0):
        if e.kind == "comm" and e.dst is not None and e.rank == e.dst and e.src != e.dst:
            queues[(e.src, e.dst, _pair_op(e))].append(e)
    pos: dict[tuple[Any, ...], int] = defaultdict(int)
    out: list[tuple[Event, Event | None]] = []
    for s in sorted(sends(trace), key=lambda e: e.t0):
        key = (s.src, s.dst, _pair_op(s))
        q = queues.get(key, [])
        out.append((s, q[pos[key]] if pos[key] < len(q) else None))
        pos[key] += 1
    return out
