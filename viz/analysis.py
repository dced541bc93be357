"""Numbers the viewer draws, computed from a trace alone (no plotting here).

Every figure, the terminal timeline and the report summary read their numbers from this module,
so the pictures and the tests agree on one definition of each quantity.

Definitions
-----------
- **Kind of a compute span** (``kind_of``): name "F" -> forward; "B" -> backward; the two halves of
  a split backward (zero-bubble schedules, Qi et al. 2024) apart: "I" -> input gradient (what the
  previous stage waits for), "W" -> weight gradient (what nobody waits for); "R" -> recompute (a
  forward run again inside backward, ``minipar.recompute``; inside the B span); "opt" / "step" / "U"
  (a stage's update inside an asynchronous pipeline's step, PipeDream) -> optimizer; anything else
  -> other.
- **Step window** (``window``): from the earliest start to the latest end of any *compute or comm*
  event on any rank, or fault mark (``FAULT_MARKS``: a survivor's wait for a dead rank ends when its
  detector declares it dead). Memory samples and other marks do not stretch it. One window for the whole trace,
  so every rank's bubble is measured against the same step time, as in GPipe's analysis
  (bubble fraction (p-1)/(m+p-1) of the step for GPipe and 1F1B).
- **Busy time of a rank** (``busy``): the length of the union of its compute spans, clipped to
  the window (nested or overlapping spans are counted once).
- **Idle time (bubble) of a rank** (``idle``): window length minus busy time. Time spent only in
  communication counts as idle: the rank is not computing.
- **Bubble fraction of a rank**: idle / window length; the trace's bubble fraction is the mean
  over ranks. ``None`` when the trace has no compute spans (a pure collectives trace).
- **Collective call**: see ``viz.messages.collective_spans`` (messages grouped into calls, sends
  paired with their receives).
- **Formula placement** (``traffic_rows``): a formula sits on the measured category it predicts.
- **Stash counts** (``memory_counts``): memory samples that count micro-batches, not bytes.

Costs: every function is O(E log E) in the number of events E (one sort), except
``traffic_matrix`` which is O(E + P^2) for P ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from minipar.trace import Event, Trace

KINDS = ("forward", "backward", "input gradient", "weight gradient", "recompute", "optimizer", "other")
PIPELINE_KINDS = ("forward", "backward", "input gradient", "weight gradient")  # a stage's work on a micro-batch
ARROWS = {"down": "\u2193", "up": "\u2191"}  # a span's args["direction"] (Chimera) -> its label's arrow
FAULT_MARKS = ("killed", "peer declared dead")  # minipar.comm.faults / detector: they stretch the window
_KIND_BY_NAME = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient", "R": "recompute",
                 "opt": "optimizer",
                 "step": "optimizer", "U": "optimizer"}  # U: a stage's update inside an asynchronous pipeline's step


def kind_of(event: Event) -> str:
    """forward / backward / input gradient / weight gradient / optimizer / other for a compute span
    (by its name)."""
    return _KIND_BY_NAME.get(event.name, "other")


def shows_chunks(trace: Trace) -> bool:
    """True when forward / backward spans (I and W too) carry more than one model chunk (interleaved
    and V schedules);
    other spans' ``chunk`` (Ring Attention's K/V block) is no model chunk."""
    chunks = {e.chunk for e in trace.events if e.kind == "compute" and e.chunk is not None
              and kind_of(e) in PIPELINE_KINDS}
    return len(chunks) > 1 or int(trace.meta.get("v", 1) or 1) > 1


def direction(event: Event) -> str | None:
    """The pipeline direction a span or message belongs to, ``args["direction"]`` (Chimera's two
    pipelines, Li & Hoefler 2021: "down" on ranks 0..p-1, "up" on p-1..0), else None."""
    d = event.args.get("direction")
    return d if d in ARROWS else None


def label(event: Event, with_chunk: bool = False) -> str:
    """Compact label: ``F3`` (forward of micro-batch 3), ``B3.1`` (chunk 1), ``opt``; a span with a
    direction ends in its arrow instead of its chunk, always: ``F0↓``, ``B2↑``."""
    text = event.name
    if event.microbatch is not None:
        text += str(event.microbatch)
    if direction(event):
        text += ARROWS[direction(event)]
    elif with_chunk and event.chunk is not None:
        text += f".{event.chunk}"
    return text


def compute_spans(trace: Trace, rank: int) -> list[Event]:
    """The rank's compute spans sorted by start time."""
    return sorted((e for e in trace.events if e.kind == "compute" and e.rank == rank), key=lambda e: e.t0)


def window(trace: Trace) -> tuple[float, float]:
    """(start, end) of the step: extent of all compute and comm events (and fault marks); (0, 0) if
    there are none."""
    spans = [e for e in trace.events if e.kind in ("compute", "comm") or (e.kind == "mark" and e.name in FAULT_MARKS)]
    if not spans:
        return 0.0, 0.0
    return min(e.t0 for e in spans), max(e.t1 for e in spans)


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi] (sweep over sorted starts)."""
    total = 0.0
    cur_a = cur_b = None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def busy(trace: Trace, rank: int) -> float:
    """Time the rank spent computing inside the step window (union of its compute spans)."""
    lo, hi = window(trace)
    return union_length([(e.t0, e.t1) for e in compute_spans(trace, rank)], lo, hi)


def idle(trace: Trace, rank: int) -> float:
    """Bubble of the rank: window length minus its busy time (see the module docstring)."""
    lo, hi = window(trace)
    return (hi - lo) - busy(trace, rank)


def bubble_fractions(trace: Trace) -> list[float] | None:
    """Idle / window length per rank, or None when the trace has no compute spans."""
    lo, hi = window(trace)
    p = trace.world_size
    spans: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    for e in trace.events:
        if e.kind == "compute" and 0 <= e.rank < p:
            spans[e.rank].append((e.t0, e.t1))
    if hi <= lo or not any(spans):
        return None
    return [((hi - lo) - union_length(s, lo, hi)) / (hi - lo) for s in spans]


def sends(trace: Trace) -> list[Event]:
    """Message events as recorded by their sender (each message counted once)."""
    return [e for e in trace.events if e.kind == "comm" and e.src is not None and e.rank == e.src]


def traffic_matrix(trace: Trace) -> list[list[int]]:
    """``m[src][dst]`` = bytes ``src`` sent to ``dst`` over the whole trace."""
    p = trace.world_size
    m = [[0] * p for _ in range(p)]
    for e in sends(trace):
        if e.dst is not None and 0 <= e.src < p and 0 <= e.dst < p:
            m[e.src][e.dst] += e.nbytes or 0
    return m


def op_key(event: Event) -> str:
    """``"allreduce/ring"`` when the message names its algorithm, else just the op."""
    op = event.op or event.name
    return f"{op}/{event.algorithm}" if event.algorithm else op


def sent_by_op(events: Iterable[Event], rank: int) -> Counter:
    """Bytes ``rank`` sent among ``events`` (one rank's recording, or a whole trace's), by op: counted
    once, from the sender's own record (as ``Trace.bytes_sent``)."""
    out: Counter = Counter()
    for e in events:
        if e.kind == "comm" and e.rank == rank and e.src == rank:
            out[e.op] += e.nbytes or 0
    return out


def bytes_by_op(trace: Trace) -> dict[str, list[int]]:
    """Bytes sent per rank, for each ``op/algorithm`` key (insertion order = first seen)."""
    out: dict[str, list[int]] = {}
    p = trace.world_size
    for e in sends(trace):
        row = out.setdefault(op_key(e), [0] * p)
        if 0 <= e.rank < p:
            row[e.rank] += e.nbytes or 0
    return out


def is_simulated(trace: Trace) -> bool:
    """True for a schedule played by the pipeline simulator (``backend`` "simulator", or a
    ``schedule`` the lessons name "... (simulated)"): its times are predictions, its messages
    carry no payload unless asked."""
    return trace.meta.get("backend") == "simulator" or "(simulated)" in str(trace.meta.get("schedule") or "")


def _measured(trace: Trace, key: str, sent: list[Event]) -> list[int]:
    """Bytes sent per rank by the messages a formula key names (see ``measured_vs_formula``)."""
    p = trace.world_size
    per_rank = [0] * p
    for e in sent:
        if (op_key(e) == key or (e.op or e.name) == key) and 0 <= e.rank < p:
            per_rank[e.rank] += e.nbytes or 0
    return per_rank


def measured_vs_formula(trace: Trace) -> list[tuple[str, list[int], float]]:
    """For each key of ``meta["expected_bytes"]``: (key, measured bytes sent per rank, formula).

    A key ``"op/algorithm"`` matches messages of that op and algorithm; a bare ``"op"`` matches the
    op under any algorithm. Measured bytes are totals over the trace, as are the formula's. The
    scalar form says every rank sends that many bytes (or gives the mean over ranks); when ranks
    differ, ``meta["expected_bytes_by_rank"]`` (``formula_by_rank``) says it per rank.
    """
    expected = trace.meta.get("expected_bytes") or {}
    sent = sends(trace)
    return [(str(key), _measured(trace, str(key), sent), float(value)) for key, value in expected.items()]


def formula_by_rank(trace: Trace) -> list[tuple[str, list[int], list[float]]]:
    """For each key of ``meta["expected_bytes_by_rank"]`` (``{key: [bytes rank 0 sends, rank 1, ...]}``,
    one number per rank, for formulas whose ranks differ: the naive all-reduce's root, parameter-server
    hubs, a pipeline's first and last stages): (key, measured bytes sent per rank, formula per rank).
    Keys match messages as in ``measured_vs_formula``. Raises ``ValueError`` naming the key when a
    value is not one number per rank of the trace.
    """
    expected = trace.meta.get("expected_bytes_by_rank") or {}
    if not isinstance(expected, dict):
        raise ValueError("trace meta expected_bytes_by_rank must map 'op' or 'op/algorithm' to a list of "
                         f"bytes per rank, got {type(expected).__name__}")
    p = trace.world_size
    sent = sends(trace)
    rows = []
    for key, values in expected.items():
        ok = isinstance(values, list | tuple) and len(values) == p and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        if not ok:
            raise ValueError(f"trace meta expected_bytes_by_rank[{key!r}] must be a list of {p} numbers "
                             f"(bytes per rank of this {p}-rank trace), got {values!r}")
        rows.append((str(key), _measured(trace, str(key), sent), [float(v) for v in values]))
    return rows


def traffic_rows(trace: Trace) -> list[tuple[str, list[int], list[float] | None]]:
    """The bars of the traffic chart: (category, measured bytes sent per rank, formula per rank or
    None). Categories are the measured ``op/algorithm`` keys (``bytes_by_op``); a formula sits on
    the category it predicts: its own key, or, for a bare ``"op"`` key, the one measured
    ``"op/algorithm"`` of that op. A formula matching none or several gets a category of its own
    (measured = every message of the op). ``expected_bytes_by_rank`` wins over the scalar
    ``expected_bytes``, which holds for every rank."""
    p = trace.world_size
    measured = bytes_by_op(trace)
    formulas: dict[str, list[float]] = {str(k): [float(v)] * p for k, v in
                                        (trace.meta.get("expected_bytes") or {}).items()}
    formulas.update({k: f for k, _, f in formula_by_rank(trace)})
    rows: dict[str, tuple[list[int], list[float] | None]] = {k: (v, None) for k, v in measured.items()}
    sent = sends(trace)
    for key, values in formulas.items():
        matches = [k for k in measured if k == key] or [k for k in measured if k.split("/")[0] == key]
        cat = matches[0] if len(matches) == 1 else key
        rows[cat] = (rows[cat][0] if cat in rows else _measured(trace, key, sent), values)
    return [(k, got, f) for k, (got, f) in rows.items()]


def memory_counts(trace: Trace) -> bool:
    """True when memory samples count stashed micro-batches, not bytes: the simulator's default
    (``meta["activation_unit"] == "microbatches"``), or every sample's ``nbytes`` equal to its
    ``args["stashed"]``."""
    if trace.meta.get("activation_unit") == "microbatches":
        return True
    samples = [e for e in trace.events if e.kind == "memory"]
    return bool(samples) and all("stashed" in e.args and e.nbytes == e.args["stashed"] for e in samples)


def traced_steps(trace: Trace) -> int | None:
    """How many training steps the trace covers (``meta["steps"]``) when more than one, else None: its
    totals (time, bytes) are then over that many steps."""
    steps = trace.meta.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 1 else None


def stash_unit(trace: Trace) -> str:
    """What one stashed item of a stash count (``memory_counts``) is: "micro-batches", or for a schedule of
    v > 1 model chunks per rank (``meta["v"]``, interleaved) "chunk micro-batches (1/v of a micro-batch's
    activations on the rank each)": each forward of a micro-batch on one chunk stashes one, and a chunk
    holds 1/v of the rank's layers."""
    v = int(trace.meta.get("v", 1) or 1)
    return "micro-batches" if v <= 1 else f"chunk micro-batches (1/{v} of a micro-batch's activations on the rank each)"


def fmt_memory(trace: Trace, n: float) -> str:
    """Bytes (``fmt_bytes``), or "4 micro-batches" / "1 micro-batch" when the trace counts a stash
    (``memory_counts``)."""
    if memory_counts(trace):
        return f"{n:.0f} micro-batch" + ("" if n == 1 else "es")
    return fmt_bytes(n)


@dataclass
class MemorySeries:
    """Bytes held on one rank: ``times`` and, per label, the value at each time (step function)."""

    rank: int
    times: list[float]
    by_label: dict[str, list[int]]

    @property
    def total(self) -> list[int]:
        return [sum(vals[i] for vals in self.by_label.values()) for i in range(len(self.times))]

    @property
    def peak(self) -> int:
        return max(self.total, default=0)


def memory_series(trace: Trace, rank: int) -> MemorySeries:
    """Each label holds its latest sample's bytes until the next sample of that label."""
    samples = sorted((e for e in trace.events if e.kind == "memory" and e.rank == rank), key=lambda e: e.t0)
    labels = list(dict.fromkeys(e.name for e in samples))
    current = dict.fromkeys(labels, 0)
    times: list[float] = []
    by_label: dict[str, list[int]] = {lab: [] for lab in labels}
    for e in samples:
        current[e.name] = e.nbytes or 0
        if times and times[-1] == e.t0:  # several labels sampled at one instant: keep the last state
            for lab in labels:
                by_label[lab][-1] = current[lab]
            continue
        times.append(e.t0)
        for lab in labels:
            by_label[lab].append(current[lab])
    return MemorySeries(rank, times, by_label)


def summary(trace: Trace) -> dict[str, Any]:
    """The report's summary row: world size, paradigm, step time, bubble, bytes, peak memory."""
    lo, hi = window(trace)
    fractions = bubble_fractions(trace)
    p = trace.world_size
    return {
        "paradigm": trace.meta.get("paradigm", "?"),
        "backend": trace.meta.get("backend", "?"),
        "world_size": p,
        "schedule": trace.meta.get("schedule"),
        "step_time": float(trace.meta.get("step_time", hi - lo)),
        "bubble_fraction": None if fractions is None else sum(fractions) / len(fractions),
        "bubble_per_rank": fractions,
        "bytes_moved": sum(e.nbytes or 0 for e in sends(trace)),
        "peak_memory": [memory_series(trace, r).peak for r in range(p)],
    }


def time_unit(trace: Trace) -> str:
    """``meta["time_unit"]``; else "units" for the pipeline simulator (times in forward-passes) or "s"."""
    unit = trace.meta.get("time_unit")
    if unit:
        return str(unit)
    return "units" if trace.meta.get("backend") == "simulator" else "s"


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_time(t: float, unit: str = "s") -> str:
    """Seconds with an SI prefix ('1.25 ms'); other units (e.g. simulator 'units') as plain numbers."""
    if unit != "s":
        return f"{t:.3g} {unit}"
    for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(t) >= scale or name == "µs":
            return f"{t / scale:.3g} {name}"
    return f"{t:.3g} s"
