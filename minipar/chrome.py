"""Chrome-trace export of a minipar trace (``minipar view TRACE --chrome out.json``), for Perfetto."""

from __future__ import annotations

import json
import os
from typing import Any

from minipar.trace import Trace, _jsonable


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
