"""Chimera: two pipelines in opposite directions over the same ranks (Li & Hoefler 2021).

S. Li and T. Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional
Pipelines", SC'21 (arXiv:2107.06925), section 3.1 and its Figure 3 (D = 4 stages). Each of the p
ranks (the paper's workers, p = D) holds two model replicas' stages: stage r of the *down* pipeline
(stages 0..p-1 on ranks 0..p-1) and stage p-1-r of the *up* pipeline (stages on ranks p-1..0).
The N = m micro-batches of a step are split equally: down runs 0..m/2-1, up m/2..m-1, each 1F1B-like;
merged, each direction fills the other's bubbles. Training stays synchronous: after all forwards
and backwards the two replicas of each stage (down stage s on rank s, up stage s on rank p-1-s)
all-reduce their gradients, and both run the same optimizer step, so the replicas stay equal.

The order, as data (``chimera_schedule``), from the paper's time-slot picture with equal slots for a
forward and a backward: in one unit of p micro-batches (p/2 per direction) micro-batch i of a
direction runs its forward at stage s in slot s + 2 i and its backward at stage s in slot
2p - 1 - s + 2 i (the last stage turns it round in the next slot, 1F1B-style). On rank r the down
forwards take slots of r's parity and the up forwards the other parity (p even: p-1-r and r differ
in parity), and the same for the backwards, so the two never want the same slot: the paper's "no
conflict when merging for an even D". p = 4, m = 4 (down 0, 1; up 2, 3; stages of each direction):

========  ==================================================================
rank 0    d0F0  .     d0F1  u3F2  u3B2  u3F3  u3B3  d0B0  .     d0B1
rank 1    .     d1F0  u2F2  d1F1  u2F3  u2B2  d1B0  u2B3  d1B1  .
rank 2    .     u1F2  d2F0  u1F3  d2F1  d2B0  u1B2  d2B1  u1B3  .
rank 3    u0F2  .     u0F3  d3F0  d3B0  d3F1  d3B1  u0B2  .     u0B3
========  ==================================================================

Each rank idles p - 2 slots (p/2 - 1 at each end; 1F1B: 2 (p - 1)), a bubble share of
(p - 2)/(2 m + p - 2) against 1F1B's (p - 1)/(m + p - 1) (the paper's comparison table), and holds
p/2 + 1 + min(r, p-1-r) micro-batches' activations at most on rank r: p/2 + 1 on the end ranks to p
in the middle (the table's [(D/2 + 1) M_a, D M_a]). More micro-batches, m = k p: k such units, unit u
shifted by 2 p u slots, so a unit's first forwards fill the previous unit's end bubbles and the
share stays (p - 2)/(2 m + p - 2) with equal slots. ``simulate_chimera`` plays the order (not the
slots) with any F, B and latency: with B != F the slots no longer line up and each rank idles
(p - 2) max(F, B) + (k - 1)(p - 2)|B - F| (measured; the paper's forward doubling and backward
halving, which recompute, address this and are not done here). Requires p even and m a multiple of p.

``Chimera(comm, model, microbatches)`` builds one ``Pipeline`` per direction (down on ``comm``, up on
a communicator with the ranks reversed, so its pipeline rank i is world rank p-1-i), both from the
model's seed (equal values), and runs the merged order by handing each action of the two lowered
programs to its pipeline (``Pipeline.run``): the runtime knows nothing of Chimera. Traced, the step's
spans and messages say their direction as ``simulate_chimera``'s do: the up pipeline's stages carry
``chunk`` 1 (the runtime's own chunk label), and ``label_step`` adds ``args["direction"]``, the global
micro-batch number (up: + m/2) and, in each rank's ``activations`` samples, both directions' held
micro-batches and bytes (the rank's stash, the simulator's count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minipar import trace as mtrace
from minipar.nn import Parameter
from minipar.optim import Optimizer
from minipar.trace import Event, Trace

from .partition import LayeredModel, split_layers
from .runtime import Pipeline
from .schedule import Action, Schedule, ScheduleError, bwd, fwd
from .simulate import SimResult
from .validate import validate

DOWN, UP = "down", "up"
DIRECTIONS = (DOWN, UP)
Step = tuple[str, Action]  # (direction, action of that direction's pipeline)


def check_config(p: int, m: int) -> None:
    """``ValueError`` naming values that work unless p is even (>= 2) and m a multiple of p."""
    for name, value in (("ranks", p), ("microbatches", m)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"chimera: {name} must be an int, got {value!r}")
    if p < 2 or p % 2:
        good = f"{p - 1} or {p + 1}" if p > 2 else "2"
        raise ValueError(f"chimera needs an even number of ranks p >= 2 (two pipelines in opposite directions, "
                         f"Li & Hoefler 2021 take an even depth D), got p={p}; use p={good}")
    if m < p or m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        good = f"{lo} or {hi}" if lo > 0 else f"{hi}"
        raise ValueError(f"chimera needs microbatches to be a multiple of p={p} (units of p micro-batches, "
                         f"p/2 per direction), got m={m}; use microbatches={good}")


def chimera_schedule(p: int, m: int) -> dict[int, list[Step]]:
    """Rank -> its ordered ``(direction, action)`` list; stages count within each direction (up stage
    s runs on rank p-1-s), micro-batches are global (down 0..m/2-1, up m/2..m-1). Cost O(p m)."""
    check_config(p, m)
    half = p // 2
    out: dict[int, list[Step]] = {}
    for r in range(p):
        slots: dict[int, Step] = {}
        for unit in range(m // p):  # unit u: p micro-batches, its slots shifted by 2 p u
            for direction, stage, first in ((DOWN, r, unit * half), (UP, p - 1 - r, m // 2 + unit * half)):
                for i in range(half):
                    for slot, action in ((stage + 2 * i, fwd(stage, first + i)),
                                         (2 * p - 1 - stage + 2 * i, bwd(stage, first + i))):
                        slot += 2 * p * unit
                        if slot in slots:  # cannot happen for even p (see the module docstring)
                            raise AssertionError(f"chimera: slot {slot} of rank {r} taken twice")
                        slots[slot] = (direction, action)
        out[r] = [slots[t] for t in sorted(slots)]
    return out


def direction_schedules(schedule: dict[int, list[Step]]) -> dict[str, Schedule]:
    """Each direction's own compute schedule, by its pipeline ranks (up: rank i is world rank p-1-i)
    and its own micro-batches 0..m/2-1 (up: global micro-batch minus m/2)."""
    p = len(schedule)
    half = sum(1 for d, a in schedule[0] if d == DOWN and a.op == "F")  # micro-batches per direction
    down = {r: [a for d, a in schedule[r] if d == DOWN] for r in range(p)}
    up = {p - 1 - r: [Action(a.stage, a.op, a.microbatch - half) for d, a in schedule[r] if d == UP]
          for r in range(p)}
    return {DOWN: Schedule(down, kind="chimera-down", stages=p, microbatches=half),
            UP: Schedule(dict(sorted(up.items())), kind="chimera-up", stages=p, microbatches=half)}


def _blocks(program: Sequence[Action]) -> list[list[Action]]:
    """A lowered program cut into one block per compute action: its receives, itself, its sends."""
    blocks: list[list[Action]] = []
    current: list[Action] = []
    for a in program:
        if any(b.is_compute for b in current) and not a.is_send:
            blocks.append(current)
            current = []
        current.append(a)
    return blocks + ([current] if current else [])


def joint_program(schedule: dict[int, list[Step]]) -> dict[int, list[Step]]:
    """World rank -> ``(direction, lowered action)`` in the merged order: each compute action with the
    receives before and the sends after it that its direction's ``lower`` gives (peers and
    micro-batches in that direction's numbering, as its ``Pipeline`` runs them). Both directions are
    validated on their own first (``ScheduleError`` if either cannot run)."""
    p = len(schedule)
    lowered = {d: validate(s) for d, s in direction_schedules(schedule).items()}
    out = {}
    for r in range(p):
        blocks = {DOWN: iter(_blocks(lowered[DOWN][r])), UP: iter(_blocks(lowered[UP][p - 1 - r]))}
        out[r] = [(d, a) for d, _ in schedule[r] for a in next(blocks[d])]
    return out


@dataclass
class ChimeraSim(SimResult):
    """``simulate``'s measures (``SimResult``) over the p ranks; ``program`` holds each rank's joint
    lowered actions and ``joint`` the same with their direction. Trace events: ``chunk`` 0 down, 1 up
    (``args["direction"]``), ``microbatch`` the global number, ``args["action"]`` the action as its
    direction's pipeline runs it (up: micro-batch minus m/2)."""

    joint: dict[int, list[Step]] = field(default_factory=dict)


def simulate_chimera(p: int, m: int, forward: float = 1.0, backward: float = 2.0, latency: float = 0.0,
                     schedule: dict[int, list[Step]] | None = None) -> ChimeraSim:
    """Play the joint program with ``simulate``'s timing rules: a compute action starts when its rank
    is free and takes ``forward``/``backward``; a send is posted when the rank reaches it (no rank
    time) and arrives ``latency`` later; a receive ends at max(reached, arrival). Both directions share
    each rank's clock and stash count. ``schedule``: another merged order of the same p and m (default
    ``chimera_schedule(p, m)``). ``ScheduleError`` if the merged order can never finish."""
    if min(forward, backward, latency) < 0:
        raise ValueError(f"durations and latency must be >= 0, got F={forward}, B={backward}, latency={latency}")
    schedule = chimera_schedule(p, m) if schedule is None else schedule
    program = joint_program(schedule)
    shift = {DOWN: 0, UP: sum(1 for d, a in schedule[0] if d == DOWN and a.op == "F")}  # labels: global mb
    world = {DOWN: lambda q: q, UP: lambda q: p - 1 - q}  # a direction's pipeline rank -> world rank
    pos, clock = dict.fromkeys(program, 0), dict.fromkeys(program, 0.0)
    busy, stash, peak = dict.fromkeys(program, 0.0), dict.fromkeys(program, 0), dict.fromkeys(program, 0)
    arrival: dict[tuple[str, int, Action], float] = {}  # (direction, its sending rank, send) -> time
    events = [Event(r, "memory", "activations", 0.0, 0.0, nbytes=0, args={"stashed": 0}) for r in program]
    progress = True
    while progress:
        progress = False
        for r in program:
            while pos[r] < len(program[r]):
                d, a = program[r][pos[r]]
                label = {"stage": a.stage, "microbatch": a.microbatch + shift[d], "chunk": DIRECTIONS.index(d)}
                args = {"action": str(a), "direction": d}
                own, t0 = world[d](r), clock[r]  # this rank in the direction's numbering (its own inverse)
                if a.is_compute:
                    clock[r] = t1 = t0 + (forward if a.op == "F" else backward)
                    busy[r] += t1 - t0
                    stash[r] += 1 if a.op == "F" else -1
                    peak[r] = max(peak[r], stash[r])
                    events.append(Event(r, "compute", a.op, t0, t1, args=args, **label))
                    events.append(Event(r, "memory", "activations", t1, t1, nbytes=stash[r],
                                        args={"stashed": stash[r]}, **label))
                elif a.is_send:
                    arrival[(d, own, a)] = t1 = t0 + latency
                    events.append(Event(r, "comm", "send", t0, t1, src=r, dst=world[d](a.peer), op="send",
                                        args=args, **label))
                else:
                    key = (d, a.peer, a.counterpart(own))
                    if key not in arrival:
                        break
                    clock[r] = t1 = max(t0, arrival[key])
                    events.append(Event(r, "comm", "recv", t0, t1, src=world[d](a.peer), dst=r, op="recv",
                                        args=args, **label))
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} step {pos[r]}: {program[r][pos[r]][0]} {program[r][pos[r]][1]}"
             for r in program if pos[r] < len(program[r])]
    if stuck:
        raise ScheduleError(f"chimera p={p} m={m}: the merged order never finishes: {'; '.join(stuck)}", stuck)
    makespan = max(clock.values())
    idle = {r: makespan - busy[r] for r in program}
    fraction = sum(idle.values()) / (p * makespan) if makespan > 0 else 0.0
    ratio = sum(idle.values()) / sum(busy.values()) if sum(busy.values()) > 0 else 0.0
    meta = {"paradigm": "pipeline", "schedule": "chimera", "p": p, "m": m, "v": 2, "backend": "simulator",
            "world_size": p, "forward": forward, "backward": backward, "latency": latency,
            "activation_unit": "microbatches", "makespan": makespan, "bubble_fraction": fraction,
            "chunk_names": list(DIRECTIONS)}
    flat = Schedule({r: [a for _, a in acts] for r, acts in program.items()}, kind="chimera", stages=p,
                    microbatches=2 * shift[UP], chunks=2)
    return ChimeraSim(makespan, fraction, ratio, idle, busy, peak, Trace(meta, events), flat, joint=program)


class Chimera:
    """This rank's two stages (down stage r, up stage p-1-r) and the merged Chimera order.

    ``optimizer``: a factory ``params -> Optimizer`` (one per replica, run after the gradients'
    all-reduce; e.g. ``lambda ps: SGD(ps, lr=0.1)``), or None to only accumulate gradients.
    ``layers``: layer counts per stage, as for ``Pipeline``. Every rank constructs it with the same
    arguments; p, m and the layers are checked before any message. ``step(x, y)`` trains on one
    global batch: the first half of its samples go down, the second half up."""

    def __init__(self, comm: Any, model: LayeredModel, microbatches: int, layers: Sequence[int] | None = None,
                 optimizer: Callable[[list[Parameter]], Optimizer] | None = None) -> None:
        p, r = comm.size, comm.rank
        check_config(p, microbatches)
        try:
            split_layers(model.n_layers, p, layers)
        except ValueError as exc:
            raise ValueError(f"chimera ({p} ranks, one stage of each direction per rank): {exc}") from None
        self.comm, self.microbatches = comm, microbatches
        self.schedule = chimera_schedule(p, microbatches)
        self.program: list[Step] = joint_program(self.schedule)[r]
        directions = direction_schedules(self.schedule)
        self.down = Pipeline(comm, model, directions[DOWN], layers=layers)
        self.up = Pipeline(comm.split(0, key=p - 1 - r), model, directions[UP], layers=layers)
        self.up.chunk_of = dict.fromkeys(self.up.chunk_of, DIRECTIONS.index(UP))  # trace label only
        self.pair = comm.split(min(r, p - 1 - r))  # the replicas of this rank's two stages: r and p-1-r
        self.optimizers = [] if optimizer is None else [optimizer(self.down.parameters()),
                                                        optimizer(self.up.parameters())]
        self.peak_stash = 0
        self.microbatch_losses: list[float] = []

    @property
    def pipelines(self) -> dict[str, Pipeline]:
        return {DOWN: self.down, UP: self.up}

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """Both directions' forwards and backwards in the merged order, the replicas' gradient
        all-reduce (their mean: the global-batch mean gradient), then the optimizers. Returns the
        global-batch mean loss on every rank."""
        n, m = len(x), self.microbatches
        if len(y) != n or n % m:
            lo, hi = (n // m) * m, (n // m + 1) * m
            sizes = f"{lo} or {hi}" if lo else f"{hi}"
            raise ValueError(f"chimera: x has {n} samples and y {len(y)}; pass matching x and y with a batch "
                             f"divisible by m={m} (e.g. {sizes})")
        half, rec = n // 2, mtrace.current()
        marks: list[tuple[int, str]] = []  # (index of the recorder's next event, whose events follow)
        pipes, self.peak_stash = self.pipelines, 0
        for direction in DIRECTIONS:
            marks += [(len(rec.events), direction)] if rec is not None else []
            pipes[direction].begin(*((x[:half], y[:half]) if direction == DOWN else (x[half:], y[half:])))
        for direction, action in self.program:
            marks += [(len(rec.events), direction)] if rec is not None else []
            pipes[direction].run([action])
            self.peak_stash = max(self.peak_stash, self.down.stashed + self.up.stashed)
        losses = [self.down.finish(), self.up.finish()]
        if rec is not None:
            label_step(rec.events, marks, m // 2)
        self.microbatch_losses = self.down.microbatch_losses + self.up.microbatch_losses
        self._average_gradients()
        if self.optimizers:
            with mtrace.span("opt"):  # both replicas' updates, as Pipeline's "opt" span
                for opt in self.optimizers:
                    opt.step()
        return (losses[0] + losses[1]) / 2

    def _average_gradients(self) -> None:
        """Sum each stage's gradients over its two replicas (one all-reduce of this rank's two stages,
        ordered by parameter name on both ranks of the pair), halve: each replica's gradient is the
        mean over its own m/2 micro-batches, so the half-sum is the mean over all m."""
        params = dict(self.down.named_parameters()) | dict(self.up.named_parameters())
        names = sorted(params)
        flat = np.concatenate([(params[k].grad if params[k].grad is not None else np.zeros_like(params[k].data))
                               .ravel() for k in names])
        total = self.pair.allreduce(flat, "sum") / 2
        offset = 0
        for k in names:
            size = params[k].data.size
            params[k].grad = total[offset:offset + size].reshape(params[k].data.shape).copy()
            offset += size


def label_step(events: list[Event], marks: Sequence[tuple[int, str]], half: int) -> None:
    """Label one traced ``Chimera.step`` on one rank like ``simulate_chimera``'s trace (in place):
    ``events`` is the rank's recorder from ``marks[0][0]`` on, ``marks`` the (index, direction) at
    which each pipeline's ``begin`` and each action's events start. Spans and messages with a stage
    (their ``chunk`` is the direction: up's pipeline labels its stages 1) get ``args["direction"]``
    and the global micro-batch (up: + ``half``); each ``activations`` sample, taken by one direction's
    pipeline, becomes the rank's: its held micro-batches and bytes plus the other direction's last."""
    last = {d: (0, 0) for d in DIRECTIONS}  # direction -> its last sample (stashed, bytes)
    ends = [i for i, _ in marks[1:]] + [len(events)]
    for (lo, direction), hi in zip(marks, ends, strict=True):
        for e in events[lo:hi]:
            if e.kind == "memory" and e.name == "activations":
                last[direction] = (int(e.args["stashed"]), int(e.nbytes or 0))
                e.args = {**e.args, "stashed": sum(n for n, _ in last.values()), "direction": direction}
                e.nbytes = sum(b for _, b in last.values())
    for e in events[marks[0][0]:] if marks else []:
        if e.kind in ("compute", "comm") and e.stage is not None and e.chunk in (0, 1):
            e.args = {**e.args, "direction": DIRECTIONS[e.chunk]}
            e.microbatch = None if e.microbatch is None else e.microbatch + half * e.chunk
