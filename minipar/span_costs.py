"""What a replayed compute span costs (``minipar.replay``): the median CPU time of the repeats of its
work, pooled with the same run's earlier steps.

A time-shared core inflates single spans' CPU time (a resumed process finds its caches holding
another's): on 4 ranks over 2 cores one stage's identical forwards measured 3.5-6.3 ms in one run of
lesson 02, and since a pipeline's step is a longest path through its spans, such noise only ever
lengthens a replay. Spans that repeat the same work (``_work``) therefore cost the median of their CPU
times (``replay(costs="median")``, the default). SimGrid's time-independent traces record volumes
(instructions) for the same reason; this machine's virtual CPUs have no performance counters, and
the median of the repeats stands in for the volume. docs/formulas.md, section 11, rule 1.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from minipar.trace import Event, Trace, load

COSTS = ("median", "cpu")  # what a compute span lasts (``replay``'s ``costs``)
REPEAT_ARGS = ("iteration", "action")  # span args that number a repeat of the same work, not the work


def _work(e: Event) -> tuple[Any, ...]:
    """What identifies a compute span's work: its rank, thread, name, stage, chunk, step and args but
    those that number a repeat (``REPEAT_ARGS``; the micro-batch is not part of it either)."""
    args = tuple(sorted((k, repr(v)) for k, v in e.args.items() if k not in REPEAT_ARGS))
    return (e.rank, e.thread, e.name, e.stage, e.chunk, e.step, args)


def _cpu(e: Event) -> float | None:
    """A compute span's CPU time, or None (no CPU times, or none spent)."""
    if e.kind != "compute" or e.c0 is None or e.c1 is None or e.c1 <= e.c0:
        return None
    return e.c1 - e.c0


def median_scales(events: list[Event], samples: Sequence[Trace] = ()) -> dict[int, float]:
    """Event index -> median / own CPU time, for the compute spans whose work repeats (``_work``) in
    ``events`` or in ``samples`` (the same run's earlier steps, ``earlier_steps``): scaled by it, every
    repeat of the same work costs the median of their CPU times."""
    groups: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for e in [*events, *(e for t in samples for e in t.events)]:
        c = _cpu(e)
        if c is not None:
            groups[_work(e)].append(c)
    scale: dict[int, float] = {}
    for i, e in enumerate(events):
        c = _cpu(e)
        if c is not None and len(repeats := groups[_work(e)]) > 1:
            scale[i] = statistics.median(repeats) / c
    return scale


def earlier_steps(path: str | os.PathLike[str], trace: Trace) -> list[Trace]:
    """The traces of the same run's earlier steps that ``trace`` (read from ``path``) lists in
    ``meta["earlier_steps"]`` (file names beside it; lessons 02 and 08 record the steps before the
    last one so): a replay pools their spans into its medians. A listed file that is gone is skipped."""
    folder = os.path.dirname(os.fspath(path))
    names = trace.meta.get("earlier_steps") or []
    return [load(os.path.join(folder, n)) for n in names if os.path.exists(os.path.join(folder, n))]
