"""Asynchronous pipelines: PipeDream's weight stashing and PipeDream-2BW's double buffer, as ``U`` actions.

A ``U`` action (``"1U3"``, ``schedule.py``) applies, with the stage's own optimizer, the gradients the
stage accumulated since its previous ``U``, *inside* the step: the next forwards of that stage already
see the new weights while older micro-batches are still in flight. The runtime stays schedule-agnostic:
its ``_U`` calls ``WeightVersions.update`` and its F/B/I/W run inside ``WeightVersions.use``, which puts
the right weight version in place. Version k of a stage = its weights after k of its updates in the
step (0 = the weights the step started with).

PipeDream (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP, Sec. 3.3): 1F1B (``one_f_one_b``'s order: rank r runs p - 1 - r warm-up forwards) with a ``U``
after every backward. **Weight stashing**: a micro-batch's backward on a stage uses the version its
forward used there. In 1F1B, before the forward of micro-batch i on stage r the stage has run the
backwards (and updates) of micro-batches 0 .. i - (p - r), so

    forward and backward of i on stage r use version max(0, i - (p - 1 - r)); its gradient is applied
    to version i, making version i + 1:  W_r(i+1) = W_r(i) - lr grad_r f(W_0(i-p+1), ..., W_{p-1}(i))

(the paper's W(t+1) = W(t) - v grad f(W_1(t-n+1), ..., W_n(t)) with n = p stages numbered from 1), a
staleness of p - 1 - r updates. The micro-batches in flight on stage r right after its update for
micro-batch j are j + 1 .. j + p - 1 - r, each on its own version, so the stage holds up to p - r
versions (p - r - 1 stashed + the current one): p on the first stage, 1 on the last, reached once
j >= p - 2 - r and j + p - 1 - r < m, i.e. for m >= 2 (p - 1 - r). A version is copied only when an
update would overwrite weights a pending micro-batch still needs (copy on write: the stashed arrays
are the old ones, the update writes into a fresh copy). **Vertical sync** (Sec. 3.3): every stage
uses, for micro-batch i, the version stage 0 used, max(0, i - (p - 1)) (``W(t+1) = W(t) - v grad
f(W(t-p+1))``); a stage keeps the versions its future forwards will need. Here the version a
micro-batch saw at stage 0 is known from the schedule, so it is not sent along with the activations.
Without stashing (``weights="none"``) forward and backward use whatever weights are current: the
backward of micro-batch i on stage r reads version i while its forward ran on max(0, i - (p - 1 - r)):
the mismatch weight stashing exists to prevent (Sec. 3.3, "naive pipelining").

PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training", ICML,
Sec. 3.1): gradients accumulated over ``per_update`` = a >= p micro-batches (the paper's m >= d), one
``U`` per a micro-batches; micro-batch i (of update group t = i // a) uses version max(t - 1, 0) for
forward and backward on every stage (the paper: max(floor((k - 1)/m) - 1, 0) for the 1-indexed k), so

    W(t+1) = W(t) - lr grad f(W(t-1))     (a delay of exactly one update),

and each stage holds at most two versions (the one in-flight micro-batches use and the newest).

**One step drains.** ``Pipeline.step`` runs its m micro-batches and waits for the last backward, so
version 0 of every step is the weights the step starts with, and the first micro-batches of a step
see them fresh (no staleness), as after the papers' start-up; the papers' pipelines never drain, so
their steady state (the staleness above) holds here from the (p - 1 - r)-th micro-batch of each step
on. With one 2BW group per step (m = a) the step would be plain 1F1B: 2BW therefore needs m >= 2a.
What a ``U`` schedule means is set by its ``kind`` ("2bw": the double buffer; else PipeDream's
stashing), and hand-written ``U`` schedules must update every stage after the same micro-batches
(``loss_scales`` divides by the group's size).

``weights``: "stash" (PipeDream's stashing; for a "2bw" schedule its double buffer), "vertical"
(PipeDream with vertical sync), "none" (no stashing). Cost per action: O(parameters of the stage)
for a swap, one copy of the stage's parameters per stashed version.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from minipar import trace

from .generators import one_f_one_b
from .schedule import Action, Schedule, update

WEIGHTS = ("stash", "vertical", "none")


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got p={p}, m={m}")


def _one_f_one_b_with_updates(p: int, m: int, after: Callable[[int], bool]) -> dict[int, list[Action]]:
    """``one_f_one_b`` (p - 1 - r warm-up forwards on rank r) with ``rU i`` right after ``rB i`` when ``after(i)``."""
    return {r: [x for a in acts for x in ([a, update(r, a.microbatch)] if a.op == "B" and after(a.microbatch)
                                         else [a])]
            for r, acts in one_f_one_b(p, m).items()}


def pipedream(p: int, m: int) -> Schedule:
    """PipeDream (Narayanan et al. 2019, Sec. 3.2-3.3): 1F1B with an update after every backward.

    Needs m >= p: the startup phase admits p micro-batches (the paper's NOAM for one stage per
    machine) before the first backward; with fewer the pipeline never reaches its steady state."""
    _check(p, m)
    if m < p:
        raise ValueError(f"PipeDream needs microbatches >= stages to fill its pipeline (p={p} micro-batches in "
                         f"flight on the first stage): m={m} with p={p}; use microbatches={p} or more "
                         f"(every stage r reaches its p - r weight versions from m = {2 * (p - 1)} on)")
    return Schedule(_one_f_one_b_with_updates(p, m, lambda i: True), kind="pipedream", stages=p, microbatches=m)


def pipedream_2bw(p: int, m: int, per_update: int | None = None) -> Schedule:
    """PipeDream-2BW (Narayanan et al. 2021, ICML, Sec. 3.1): 1F1B over m micro-batches, a ``U`` after
    every ``per_update`` = a of them (gradient accumulation; default a = p, the paper's m = d), each
    group using the weights of two updates ago (``asynchronous`` module docstring).

    Needs a >= p (the paper's m >= d: the version a group uses must exist when its first forward runs;
    in this order, where stage 0 has run the backwards of 0 .. k - p before forward k, a = p - 1 would
    just do, as ``versions_used`` finds for a hand-written schedule) and m a multiple of a, at least 2a
    (with one group per step the step is synchronous 1F1B)."""
    _check(p, m)
    a = p if per_update is None else per_update
    if a < p:
        raise ValueError(f"PipeDream-2BW needs per_update >= stages (the paper's m >= d): per_update={a} with "
                         f"p={p}; use per_update={p} or more")
    if m < 2 * a:
        raise ValueError(f"PipeDream-2BW with one group of per_update={a} micro-batches per step is synchronous "
                         f"1F1B (a step drains: the delay of one update never shows): m={m}; use microbatches="
                         f"{2 * a} or more")
    if m % a:
        lo, hi = (m // a) * a, (m // a + 1) * a
        hint = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(f"PipeDream-2BW updates every per_update={a} micro-batches: m={m} is not a multiple of "
                         f"{a}; use microbatches={hint}")
    return Schedule(_one_f_one_b_with_updates(p, m, lambda i: (i + 1) % a == 0), kind="2bw", stages=p,
                    microbatches=m)


def has_updates(schedule: Mapping[int, Sequence[Action]]) -> bool:
    return any(a.op == "U" for acts in schedule.values() for a in acts)


def versions_used(program: Schedule, weights: str = "stash") -> dict[tuple[int, int], int]:
    """(stage, micro-batch) -> the weight version its forward (and, stashed, its backward) uses.

    "none"/"stash": the stage's updates done before the forward (for a "2bw" schedule with "stash": the
    update group two back, max(t - 1, 0)); "vertical": what stage 0 used. Raises ``ValueError`` when a
    version would be needed before the stage made it."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    latest: dict[tuple[int, int], int] = {}
    groups: dict[int, list[int]] = {}  # stage -> micro-batches of its U's, in order
    for acts in program.values():
        done: Counter[int] = Counter()
        for a in acts:
            if a.op == "U":
                done[a.stage] += 1
                groups.setdefault(a.stage, []).append(a.microbatch)
            elif a.op == "F":
                latest[(a.stage, a.microbatch)] = done[a.stage]
    if weights == "vertical" and program.kind == "2bw":
        raise ValueError("vertical sync is PipeDream's; PipeDream-2BW's versions are already the same on every "
                         "stage: use weights='stash' (or 'none')")
    if weights == "vertical":
        uses = {(s, i): latest[(0, i)] for (s, i) in latest}
    elif weights == "stash" and program.kind == "2bw":
        uses = {(s, i): max(sum(k < i for k in groups.get(s, [])) - 1, 0) for (s, i) in latest}
    else:
        uses = dict(latest)
    late = [(s, i) for (s, i), v in uses.items() if v > latest[(s, i)]]
    if late:
        s, i = min(late)
        raise ValueError(f"stage {s} would run micro-batch {i}'s forward on weight version {uses[(s, i)]} before "
                         f"making it (it has {latest[(s, i)]} updates by then); put fewer micro-batches in flight "
                         "or update earlier")
    return uses


class VersionLedger:
    """Which weight versions each stage must hold: a version stays while a forward or backward (B or W)
    that ``uses`` it is pending. Shared by the runtime (``WeightVersions``) and ``peak_versions``."""

    def __init__(self, uses: Mapping[tuple[int, int], int], stages: Sequence[int]) -> None:
        self.uses = dict(uses)
        self.current = dict.fromkeys(stages, 0)
        self.need = {s: Counter() for s in stages}
        for (s, _), v in self.uses.items():
            if s in self.need:
                self.need[s][v] += 2  # its forward and its backward
        self.kept: dict[int, set[int]] = {s: set() for s in stages}
        self.peak = dict.fromkeys(stages, 1)

    def alive(self, s: int) -> int:
        return len(self.kept[s]) + 1

    def release(self, s: int, v: int) -> None:
        self.need[s][v] -= 1
        if self.need[s][v] == 0:
            self.kept[s].discard(v)

    def updated(self, s: int) -> bool:
        """Count an update of stage s; True when the version it replaces must be kept."""
        keep = self.need[s][self.current[s]] > 0
        if keep:
            self.kept[s].add(self.current[s])
        self.current[s] += 1
        self.peak[s] = max(self.peak[s], self.alive(s))
        return keep


def peak_versions(program: Schedule, weights: str = "stash") -> dict[int, int]:
    """Stage -> the most weight versions it holds at once (stashed + current), replaying the schedule."""
    uses = versions_used(program, weights)
    ledger = VersionLedger(uses, sorted({s for s, _ in uses}))
    grad_ends = {(a.stage, a.microbatch) for acts in program.values() for a in acts if a.op == "W"}
    for acts in program.values():
        for a in acts:
            if a.op == "U":
                ledger.updated(a.stage)
            elif a.op == "F" or a.op == ("W" if (a.stage, a.microbatch) in grad_ends else "B"):
                ledger.release(a.stage, uses[(a.stage, a.microbatch)])
    return ledger.peak if weights != "none" else dict.fromkeys(ledger.peak, 1)


def loss_scales(program: Schedule) -> dict[int, float]:
    """Micro-batch -> 1 / (micro-batches in its update group at the last stage): each update applies the
    mean gradient of its group (PipeDream: each micro-batch alone; 2BW: the mean over a)."""
    last = program.virtual_stages - 1
    ends = sorted(a.microbatch for acts in program.values() for a in acts if a.op == "U" and a.stage == last)
    out, start = {}, 0
    for end in ends:
        out.update(dict.fromkeys(range(start, end + 1), 1.0 / (end + 1 - start)))
        start = end + 1
    return out


class WeightVersions:
    """The runtime hook: this rank's stages' weight versions and optimizers for a schedule with ``U``.

    ``stages``: stage -> module (``parameters()``); ``make_optimizer(params)``: one optimizer per stage.
    After a step, ``seen[(stage, mb)] = [forward version, backward version, version the gradient was
    applied to]`` and ``peak_versions[stage]`` (versions held at once, measured on the arrays); the
    trace gets "weight_versions" memory samples. Gradients are cleared by each update, so the
    pipeline's ``grads()`` after a step are zeros."""

    def __init__(self, program: Schedule, stages: Mapping[int, Any], make_optimizer: Callable[[list], Any],
                 weights: str = "stash") -> None:
        self.program, self.weights = program, weights
        self.uses = {k: v for k, v in versions_used(program, weights).items() if k[0] in stages}
        self.params = {s: list(m.parameters()) for s, m in stages.items()}
        self.optimizers = {s: make_optimizer(ps) for s, ps in self.params.items() if ps}
        self.scale = loss_scales(program)
        self.split = {(a.stage, a.microbatch) for acts in program.values() for a in acts if a.op == "W"}
        self.begin_step()

    def begin_step(self) -> None:
        self.ledger = VersionLedger(self.uses, sorted(self.params))
        self.arrays: dict[int, dict[int, list[np.ndarray]]] = {s: {} for s in self.params}
        self.seen: dict[tuple[int, int], list[int]] = {}
        self.group: dict[int, list[int]] = {s: [] for s in self.params}
        self.peak_versions = dict.fromkeys(self.params, 1)

    def loss_scale(self, mb: int) -> float:
        return self.scale[mb]

    @contextmanager
    def use(self, a: Action) -> Iterator[None]:
        """Run F/B/I/W of ``a`` on the weight version its micro-batch uses (the current one without stashing)."""
        s, i = a.stage, a.microbatch
        current = self.ledger.current[s]
        v = current if self.weights == "none" else self.uses[(s, i)]
        params = self.params[s]
        held = [p.data for p in params]
        if v != current:
            for p, arr in zip(params, self.arrays[s][v], strict=True):
                p.data = arr
        try:
            yield
        finally:
            for p, arr in zip(params, held, strict=True):
                p.data = arr
        seen = self.seen.setdefault((s, i), [v, -1, -1])
        if a.op != "F":
            seen[1] = v
        if a.op == "F" or a.op == ("W" if (s, i) in self.split else "B"):
            if a.op != "F":
                self.group[s].append(i)
            self.ledger.release(s, self.uses[(s, i)])
            gone = set(self.arrays[s]) - self.ledger.kept[s]
            for version in gone:
                del self.arrays[s][version]
            if gone:
                self._show(s)

    def update(self, a: Action) -> None:
        """``sU i``: the stage's optimizer on its accumulated gradients; the replaced version is kept
        (its arrays; the update writes into a copy) while a pending micro-batch still uses it."""
        s = a.stage
        params = self.params[s]
        if self.ledger.updated(s) and self.weights != "none":
            self.arrays[s][self.ledger.current[s] - 1] = [p.data for p in params]
            for p in params:
                p.data = p.data.copy()
        if s in self.optimizers:
            self.optimizers[s].step()
        for p in params:
            p.grad = None
        for i in self.group[s]:
            self.seen[(s, i)][2] = self.ledger.current[s] - 1
        self.group[s] = []
        self.peak_versions[s] = max(self.peak_versions[s], self._show(s))

    def _show(self, s: int) -> int:
        """Versions stage s holds now; a "weight_versions" memory sample (bytes of the stashed copies)."""
        alive = self.ledger.alive(s) if self.weights != "none" else 1
        if trace.current() is not None:
            stashed = sum(x.nbytes for arrs in self.arrays[s].values() for x in arrs)
            trace.memory("weight_versions", stashed, stage=s, args={"versions": alive})
        return alive
