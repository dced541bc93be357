"""Simulator: play a schedule with given action durations and message latency, and write its trace.

Each rank runs its (lowered, validated) program in order. A compute action starts when the rank is
free (its inputs arrived through the preceding RECV, or are in memory); a SEND is posted when the
rank reaches it, takes no rank time (non-blocking, the runtime contract in ``lowering.py``) and
arrives ``latency`` later; a RECV ends at max(when the rank reaches it, arrival). Times are
computed in one pass over an order the symbolic executor found (each receive after its send), so
the cost is that of ``validate``: O(number of actions) per round.

Measures (uniform stages, F/B per action, zero latency: see ``generators.py`` for the formulas):

- ``makespan``: end of the last action; ``busy[r]``: compute time of rank r; ``idle[r]`` =
  makespan - busy[r] (the rank's bubble, including time spent waiting in receives).
- ``bubble_fraction``: the mean over ranks of idle / makespan, the share of the step lost to the
  bubble: (p - 1)/(m + p - 1) for GPipe and 1F1B, (p - 1)/(v m + p - 1) for interleaved.
- ``bubble_ratio``: total idle / total busy, the paper's bubble time over ideal time
  (Narayanan et al. 2021, eq. in 2.2.1/2.2.2): (p - 1)/m for GPipe and 1F1B, (p - 1)/(v m)
  interleaved, i.e. exactly the 1F1B ratio divided by v.
- ``peak_stash[r]``: the most (stage, micro-batch) pairs whose forward had ended and backward had
  not, on rank r: m for GPipe, p - r for 1F1B. A split backward holds its activations until its W
  (what the W needs is most of them: Qi et al. 2024 count a micro-batch's memory until W).
- ``peak_versions[s]``: with ``U`` actions (a stage's optimizer update, ``asynchronous.py``), the most
  weight versions stage s holds at once: an update keeps the version it replaces while a pending
  micro-batch uses it, the micro-batch's last use releases it (PipeDream: p - r, 2BW: 2).

The trace has the format of a real run (``minipar.trace``): compute events "F"/"B"/"I"/"W" with stage,
micro-batch and chunk; one comm event per message on the sender ("send", from posting to arrival)
and on the receiver ("recv", from reaching the RECV to its end), ``op`` "send"/"recv",
``args["carries"]`` "activation"/"gradient"; memory events labelled "activations" whose ``nbytes``
is the number of stashed micro-batches (unit in ``meta["activation_unit"]``; scale with
``activation_bytes``); meta paradigm "pipeline", schedule, p, m, v, backend "simulator".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minipar.checks import number
from minipar.trace import Event, Trace, save

from . import dualpipe
from .asynchronous import has_updates, peak_versions
from .schedule import Action, Schedule
from .validate import as_schedule, counterpart_key, validate_and_order


@dataclass
class SimResult:
    """What ``simulate`` measured; see the module docstring for each field."""

    makespan: float
    bubble_fraction: float
    bubble_ratio: float
    idle: dict[int, float]
    busy: dict[int, float]
    peak_stash: dict[int, int]
    trace: Trace
    program: Schedule
    peak_versions: dict[int, int] = field(default_factory=dict)  # stage -> weight versions (schedules with U)


def _per_stage(name: str, value: float | Sequence[float], n_stages: int) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * n_stages
    else:
        values = [float(x) for x in value]  # type: ignore[union-attr]
        if len(values) != n_stages:
            raise ValueError(f"{name} has {len(values)} durations but the schedule has {n_stages} stages; "
                             f"give one number, or one per (virtual) stage")
    if any(x < 0 or x != x for x in values):
        raise ValueError(f"{name} durations must be >= 0, got {values}")
    return values


def simulate(schedule: Mapping[int, Sequence[Action | str]] | Sequence[Sequence[str] | str],
             forward: float | Sequence[float] = 1.0, backward: float | Sequence[float] = 2.0,
             latency: float = 0.0, trace_path: str | os.PathLike[str] | None = None,
             activation_bytes: int = 1, message_bytes: int = 0,
             weight: float | Sequence[float] | None = None, update: float | Sequence[float] = 0.0,
             durations: Mapping[tuple[int, int], float] | None = None) -> SimResult:
    """Simulate ``schedule`` (validated first: raises ``ScheduleError`` if it cannot run).

    ``forward``/``backward``: time of one action, one number or a list per (virtual) stage.
    ``weight``: the part of ``backward`` that computes the weights' gradient: a ``W`` takes it, an
    ``I`` the rest (``backward - weight``), a ``B`` all of it; default half (a linear layer's two
    backward GEMMs cost the same: Qi et al. 2024 Sec. 2 count T_B = T_W for them).
    ``latency``: time from posting a send to its arrival. ``activation_bytes``: bytes per stashed
    micro-batch in the memory events (1 = count micro-batches). ``message_bytes``: ``nbytes`` of
    each comm event. ``update``: time of a ``U`` (a stage's optimizer update), default 0.
    ``durations``: ``{(rank, step of the lowered program): time}`` for single compute actions whose
    time differs from their op's (DualPipeV's overlapped F&B pairs, ``simulate_overlapped``).
    Writes the trace to ``trace_path`` when given."""
    sched = as_schedule(schedule)
    program, order = validate_and_order(sched)  # the order validation found: every receive after its send
    n_stages = program.virtual_stages
    fwd = _per_stage("forward", forward, n_stages)
    bwd = _per_stage("backward", backward, n_stages)
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0, got {latency}")
    wgt = [b / 2 for b in bwd] if weight is None else _per_stage("weight", weight, n_stages)
    if any(w > b for w, b in zip(wgt, bwd, strict=True)):
        raise ValueError(f"weight {wgt} must not exceed backward {bwd}: it is a part of it")
    duration = {"F": fwd, "B": bwd, "I": [b - w for b, w in zip(bwd, wgt, strict=True)], "W": wgt,
                "U": _per_stage("update", update, n_stages)}
    chunk_of = {}
    for acts in program.values():
        held = sorted({a.stage for a in acts if a.is_compute})
        chunk_of.update({s: c for c, s in enumerate(held)})
    clock = dict.fromkeys(program, 0.0)
    busy = dict.fromkeys(program, 0.0)
    stash = dict.fromkeys(program, 0)
    peak = dict.fromkeys(program, 0)
    arrival: dict[tuple[int, str, int, int, int | None], float] = {}  # (rank, op, stage, mb, peer) of a send
    events = [Event(r, "memory", "activations", 0.0, 0.0, nbytes=0, args={"stashed": 0}) for r in program]
    names = {r: [str(a) for a in acts] for r, acts in program.items()}  # once per action: events and meta
    for r, i in order:
        a, text = program[r][i], names[r][i]
        where = {"stage": a.stage, "microbatch": a.microbatch, "chunk": chunk_of.get(a.stage, 0)}
        if a.is_compute:
            t0 = clock[r]
            t1 = t0 + (duration[a.op][a.stage] if durations is None else durations.get((r, i), duration[a.op][a.stage]))
            clock[r] = t1
            busy[r] += t1 - t0
            events.append(Event(r, "compute", a.op, t0, t1, args={"action": text}, **where))
            stash[r] += {"F": 1, "B": -1, "I": 0, "W": -1, "U": 0}[a.op]  # kept until the weights' gradient
            peak[r] = max(peak[r], stash[r])
            events.append(Event(r, "memory", "activations", t1, t1, nbytes=stash[r] * activation_bytes,
                                args={"stashed": stash[r]}, **where))
            continue
        carries = "activation" if a.op.endswith("F") else "gradient"
        if a.is_send:
            t0 = clock[r]
            arrival[(r, a.op, a.stage, a.microbatch, a.peer)] = t1 = t0 + latency
            src, dst, name = r, a.peer, "send"
        else:
            t0 = clock[r]
            t1 = max(t0, arrival[counterpart_key(a, r)])
            clock[r] = t1
            src, dst, name = a.peer, r, "recv"
        events.append(Event(r, "comm", name, t0, t1, src=src, dst=dst, nbytes=message_bytes, op=name,
                            args={"carries": carries, "action": text}, **where))
    makespan = max(clock.values(), default=0.0)
    idle = {r: makespan - busy[r] for r in program}
    total_busy = sum(busy.values())
    fraction = sum(idle.values()) / (len(program) * makespan) if makespan > 0 else 0.0
    ratio = sum(idle.values()) / total_busy if total_busy > 0 else 0.0
    meta = {
        "paradigm": "pipeline", "schedule": sched.kind, "p": len(program), "m": sched.microbatches,
        "v": sched.chunks, "backend": "simulator", "world_size": len(program), "forward": fwd,
        "backward": bwd, "weight": wgt, "latency": latency, "activation_unit": "microbatches" if activation_bytes == 1
        else f"{activation_bytes} bytes per micro-batch", "makespan": makespan, "bubble_fraction": fraction,
        "actions": {str(r): names[r] for r in program},
    }
    trace = Trace(meta, events)
    if trace_path is not None:
        save(trace, trace_path)
    versions = peak_versions(program, "stash") if has_updates(program) else {}
    return SimResult(makespan, fraction, ratio, idle, busy, peak, trace, program, versions)


def simulate_overlapped(p: int, m: int, forward: float, backward: float, weight: float, overlap: float,
                        **options: Any) -> SimResult:
    """``simulate`` DualPipeV's ``dualpipe.overlapped_program`` with each overlapped pair taking ``overlap`` (the
    report's F&B: between max(F, B), full overlap, and F + B, none) and every other action its own time
    (F, B, I = B - W, W of one chunk). ``options`` go to ``simulate`` (latency, trace_path, ...)."""
    for name, value in (("forward", forward), ("backward", backward), ("weight", weight), ("overlap", overlap)):
        number("simulate_overlapped", name, value)
    if not max(forward, backward) <= overlap <= forward + backward:
        raise ValueError(f"simulate_overlapped: overlap={overlap} (an overlapped forward and backward) must "
                         f"lie between max(F, B) = {max(forward, backward)} and F + B = {forward + backward}")
    program, firsts = dualpipe.overlapped_pairs(p, m)
    durations = dict.fromkeys(firsts, overlap - backward)  # then the B: the pair ends F&B after it began
    return simulate(program, forward, backward, weight=weight, durations=durations, **options)
