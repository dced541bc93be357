"""Pipeline schedules as data: the action IR, its compact text form, parsing and printing.

A schedule is a mapping ``{rank: [Action, ...]}``: each rank performs its actions in order, one
after the other. Adding a schedule means writing new lists, never touching an executor (the same
idea as the IR of ``torch.distributed.pipelining``, whose text form this follows).

Compact text ``<stage><op><microbatch>[<arrow><rank>]``, e.g. with ranks = stages:

====================  ==================================================================
``1F3``               stage 1 runs the forward of micro-batch 3
``2B0``               stage 2 runs the backward of micro-batch 0
``2I0``               stage 2 runs the input-gradient half of that backward (zero bubble's B)
``2W0``               stage 2 runs its weight-gradient half, any time after ``2I0``
``1U3``               stage 1 applies its optimizer update after micro-batch 3's backward
                      (asynchronous PipeDream / PipeDream-2BW, ``asynchronous.py``)
``1SEND_F3->2``       stage 1 sends its output activation of micro-batch 3 to rank 2
``2RECV_F3<-1``       stage 2 receives its input activation of micro-batch 3 from rank 1
``2SEND_B3->1``       stage 2 sends the gradient w.r.t. its input of micro-batch 3 to rank 1
``1RECV_B3<-2``       stage 1 receives the gradient w.r.t. its output of micro-batch 3 from rank 2
====================  ==================================================================

A backward is either one ``B`` or an ``I`` and a later ``W`` (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism": the gradient the previous stage waits for first, the weights' gradient when the rank
would otherwise idle); the letters are ``torch.distributed.pipelining``'s, the paper calls I "B".
A ``U`` (update) applies the gradients the stage accumulated since its previous ``U`` with the
stage's own optimizer, inside the step: PipeDream (Narayanan et al. 2019) puts one after every
backward, PipeDream-2BW (Narayanan et al. 2021, ICML) one per m micro-batches; no message goes with it.
The leading number is always the (virtual) stage of the rank that performs the action; the number
after the arrow is a *rank* (the peer), not a stage. With interleaving (Narayanan et al. 2021) rank
r of p holds the virtual stages r, r + p, r + 2p, ..., so ``5F2`` on rank 1 with p = 4 is chunk 1.
``sSEND_Fi->q`` is received by ``(s+1)RECV_Fi<-r`` on rank q; ``sSEND_Bi->q`` by
``(s-1)RECV_Bi<-r``. Only compute actions are written by generators and users; ``lower`` adds the
SEND/RECV actions a runtime executes (see ``lowering.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

COMPUTE_OPS = ("F", "B", "I", "W", "U")  # U: the stage's optimizer update (asynchronous.py)
BACKWARD_OPS = ("B", "I")  # the ops that send a gradient upstream (lowering, validation)
SEND_OPS = ("SEND_F", "SEND_B")
RECV_OPS = ("RECV_F", "RECV_B")
OPS = COMPUTE_OPS + SEND_OPS + RECV_OPS

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|SEND_B|RECV_F|RECV_B|F|B|I|W|U)(\d+)(?:(->|<-)(\d+))?$")


class ScheduleError(ValueError):
    """A schedule that cannot run. ``problems`` lists what is wrong; ``table`` shows where."""

    def __init__(self, message: str, problems: Sequence[str] = (), table: str = "") -> None:
        super().__init__(message)
        self.problems = list(problems)
        self.table = table


@dataclass(frozen=True)
class Action:
    """One step of one rank: a forward/backward of (stage, micro-batch), or a send/receive of one.

    ``peer`` is the other rank of a SEND/RECV (None for compute). Immutable and hashable.
    """

    stage: int
    op: str
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown action op {self.op!r}; use one of {', '.join(OPS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and micro-batch must be >= 0, got stage {self.stage}, "
                             f"micro-batch {self.microbatch}")
        if self.is_compute and self.peer is not None:
            raise ValueError(f"a compute action ({self.stage}{self.op}{self.microbatch}) has no peer")
        if not self.is_compute and (self.peer is None or self.peer < 0):
            raise ValueError(f"{self.stage}{self.op}{self.microbatch} needs a peer rank >= 0, "
                             f"e.g. '{self.stage}{self.op}{self.microbatch}{self._arrow}0'")

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action.parse("1F3")`` / ``Action.parse("1SEND_F3->2")``; inverse of ``str``."""
        m = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: write <stage><op><microbatch>, op one of F, B, I, W, U "
                "(e.g. '1F3', '2B0', '2I0', '2W0', '1U3'), or SEND_F/SEND_B with '->rank' / "
                "RECV_F/RECV_B with '<-rank' "
                "(e.g. '1SEND_F3->2', '2RECV_F3<-1')"
            )
        stage, op, mb, arrow, peer = m.groups()
        if op in COMPUTE_OPS and arrow is not None:
            raise ScheduleError(f"cannot parse action {text!r}: compute actions (F, B, I, W, U) take no peer")
        if op not in COMPUTE_OPS:
            want = "->" if op in SEND_OPS else "<-"
            if arrow != want:
                raise ScheduleError(f"cannot parse action {text!r}: write {op} with '{want}<rank>', "
                                    f"e.g. '{stage}{op}{mb}{want}0'")
        return cls(int(stage), op, int(mb), None if peer is None else int(peer))

    @property
    def _arrow(self) -> str:
        return "->" if self.op in SEND_OPS else "<-"

    def __str__(self) -> str:
        base = f"{self.stage}{self.op}{self.microbatch}"
        return base if self.peer is None else f"{base}{self._arrow}{self.peer}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_send(self) -> bool:
        return self.op in SEND_OPS

    @property
    def is_recv(self) -> bool:
        return self.op in RECV_OPS

    @property
    def key(self) -> tuple[str, int, int]:
        """Identity without the peer: what must occur exactly once in a schedule."""
        return (self.op, self.stage, self.microbatch)

    def counterpart(self, own_rank: int) -> Action:
        """The action on ``self.peer`` that completes this SEND/RECV when ``own_rank`` performs it."""
        if self.is_compute:
            raise ValueError(f"{self} is a compute action and has no counterpart")
        direction = self.op[-1]
        if self.is_send:
            stage = self.stage + 1 if direction == "F" else self.stage - 1
            return Action(stage, "RECV_" + direction, self.microbatch, own_rank)
        stage = self.stage - 1 if direction == "F" else self.stage + 1
        return Action(stage, "SEND_" + direction, self.microbatch, own_rank)


def fwd(stage: int, microbatch: int) -> Action:
    return Action(stage, "F", microbatch)


def bwd(stage: int, microbatch: int) -> Action:
    return Action(stage, "B", microbatch)


def igrad(stage: int, microbatch: int) -> Action:
    """The input-gradient half of a backward (zero bubble's B, PyTorch's I)."""
    return Action(stage, "I", microbatch)


def wgrad(stage: int, microbatch: int) -> Action:
    """The weight-gradient half of a backward (zero bubble's W)."""
    return Action(stage, "W", microbatch)


def update(stage: int, microbatch: int) -> Action:
    """The stage's optimizer update after micro-batch ``microbatch``'s backward (asynchronous schedules)."""
    return Action(stage, "U", microbatch)


class Schedule(dict[int, list[Action]]):
    """``{rank: [Action, ...]}`` plus what made it: ``kind``, ``stages`` (p, the number of ranks),
    ``microbatches`` (m) and ``chunks`` (v, model chunks per rank). A plain dict of this shape works
    wherever a schedule is expected; ``Schedule.of`` fills in the numbers from the actions."""

    def __init__(self, actions: Mapping[int, Sequence[Action]] = (), *, kind: str = "custom",
                 stages: int | None = None, microbatches: int | None = None,
                 chunks: int | None = None) -> None:
        super().__init__({int(r): list(a) for r, a in dict(actions).items()})
        every = [a for acts in self.values() for a in acts]
        n_stages = 1 + max((a.stage for a in every), default=-1)
        self.kind = kind
        self.stages = len(self) if stages is None else stages
        self.microbatches = 1 + max((a.microbatch for a in every), default=-1) if microbatches is None \
            else microbatches
        self.chunks = max(1, n_stages // max(1, self.stages)) if chunks is None else chunks

    @classmethod
    def of(cls, schedule: Mapping[int, Sequence[Action]]) -> Schedule:
        """``schedule`` itself when it is a Schedule, else a Schedule wrapping the plain dict."""
        if isinstance(schedule, Schedule):
            return schedule
        return cls(schedule)

    def like(self, actions: Mapping[int, Sequence[Action]]) -> Schedule:
        """A new schedule with other actions and this one's kind, p, m and v."""
        return Schedule(actions, kind=self.kind, stages=self.stages, microbatches=self.microbatches,
                        chunks=self.chunks)

    @property
    def virtual_stages(self) -> int:
        return 1 + max((a.stage for acts in self.values() for a in acts), default=-1)

    def text(self) -> dict[int, list[str]]:
        return format_schedule(self)

    def __str__(self) -> str:
        return format_table(self)


def parse_schedule(spec: Mapping[int | str, Sequence[str | Action] | str] | Sequence[Sequence[str] | str],
                   kind: str = "custom") -> Schedule:
    """A schedule from text: ``{rank: ["0F0", "0F1", ...]}``, or a list indexed by rank; a rank's
    actions may also be one whitespace/comma-separated string (``"0F0 0F1 0B0 0B1"``). Rank keys
    may be strings of digits (as after a JSON round trip). Ranks must be 0..n-1."""
    items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
    out: dict[int, list[Action]] = {}
    for key, acts in items:
        try:
            rank = int(key)
        except (TypeError, ValueError):
            raise ScheduleError(f"rank key {key!r} is not an integer; key schedules by rank 0..n-1") from None
        if isinstance(acts, str):
            acts = acts.replace(",", " ").split()
        out[rank] = [a if isinstance(a, Action) else Action.parse(a) for a in acts]
    if sorted(out) != list(range(len(out))):
        raise ScheduleError(f"schedule ranks are {sorted(out)}; give every rank 0..{max(out)} "
                            "a list (an empty list for a rank with nothing to do)")
    return Schedule(dict(sorted(out.items())), kind=kind)


def format_schedule(schedule: Mapping[int, Sequence[Action]]) -> dict[int, list[str]]:
    """``{rank: ["0F0", ...]}``: the inverse of ``parse_schedule``."""
    return {int(r): [str(a) for a in acts] for r, acts in sorted(schedule.items())}


def stage_ranks(schedule: Mapping[int, Sequence[Action]]) -> dict[int, set[int]]:
    """Stage -> the ranks whose compute actions name it (one rank each in a valid schedule)."""
    where: dict[int, set[int]] = {}
    for rank, acts in schedule.items():
        for a in acts:
            if a.is_compute:
                where.setdefault(a.stage, set()).add(rank)
    return where


def format_table(schedule: Mapping[int, Sequence[Action]], marks: Mapping[tuple[int, int], str] | None = None,
                 max_rows: int | None = None) -> str:
    """A step-by-rank table: row = step, column = rank. ``marks[(rank, step)]`` is a short prefix
    ("XX", "!!") put before that cell; rows past the last marked step + 2 are elided when the table
    has more than ``max_rows`` rows."""
    marks = dict(marks or {})
    ranks = sorted(schedule)
    cells = {(r, i): (f"{marks[(r, i)]} " if (r, i) in marks else "") + str(a)
             for r in ranks for i, a in enumerate(schedule[r])}
    n_rows = max((len(schedule[r]) for r in ranks), default=0)
    shown = n_rows
    if max_rows is not None and n_rows > max_rows:
        last_marked = max((i for (_, i) in marks), default=-1)
        shown = min(n_rows, max(max_rows, last_marked + 3))
    widths = {r: max([len(f"rank {r}")] + [len(cells.get((r, i), "")) for i in range(shown)]) for r in ranks}
    step_w = max(4, len(str(n_rows)))
    lines = [(f"{'step':>{step_w}} | " + " | ".join(f"{f'rank {r}':<{widths[r]}}" for r in ranks)).rstrip()]
    lines.append("-" * step_w + "-+-" + "-+-".join("-" * widths[r] for r in ranks))
    for i in range(shown):
        row = " | ".join(f"{cells.get((r, i), ''):<{widths[r]}}" for r in ranks)
        lines.append(f"{i:>{step_w}} | {row}".rstrip())
    if shown < n_rows:
        lines.append(f"{'...':>{step_w}} | ({n_rows - shown} more steps)")
    return "\n".join(lines)
