"""Validator: reject a schedule that cannot run, before anything is sent, and show where it sticks.

Checks, on the schedule as written:

1. every stage lives on exactly one rank (all of its actions are on that rank);
2. every (stage, micro-batch) has exactly one forward and one backward (a ``B``, or an ``I`` and a
   ``W``), and no action repeats;
3. on each rank a backward comes after its own forward, a ``W`` after its ``I``, a ``U`` (the stage's
   optimizer update) after the backward of its micro-batch (its ``B``, or its ``W``); with any ``U``,
   every stage's last gradient is followed by a ``U`` (none is left unapplied);
4. for a schedule that already has SEND/RECV actions: every send names the rank of the next
   (forward) or previous (backward) stage, a rank only sends/receives for its own stages, and every
   send has its receive on the peer.

Then the lowered program (``lowering.py``) runs through a symbolic executor: each rank advances
through its list while the head action's inputs are there: a forward of stage s needs the forward of
s - 1 (in memory on the same rank, else its ``RECV_F``), a backward (B or I) of s needs its own
forward and the backward of s + 1, a W its I, a U its B (or W), a send needs the compute that
produced its tensor, and a receive needs its send to have been posted on the peer. With
``sends="eager"`` (the runtime contract: non-blocking ``isend``) a send never blocks; with
``sends="rendezvous"`` a send and its receive must be at the head of both ranks at once, as with an
unbuffered blocking ``MPI_Ssend``: this shows why Megatron-LM fuses "send forward, receive backward"
into one batched exchange. A rank that cannot advance while no rank can is stuck for ever: the
error's step-by-rank table marks its head action ``XX`` and says what it waits for. Cost: O(p +
number of actions) per round, at most one round per action.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .lowering import lower_with_index
from .schedule import (
    BACKWARD_OPS,
    COMPUTE_OPS,
    RECV_OPS,
    SEND_OPS,
    Action,
    Schedule,
    ScheduleError,
    format_table,
    parse_schedule,
    stage_ranks,
)

SENDS = ("eager", "rendezvous")
_MAX_LISTED = 8


@dataclass(frozen=True)
class Stuck:
    """A rank's first action that can never proceed, and what it waits for."""

    rank: int
    step: int
    action: Action
    waits_for: str

    def __str__(self) -> str:
        return f"rank {self.rank} step {self.step}: {self.action} can never proceed: {self.waits_for}"


def as_schedule(schedule: Mapping[int, Sequence[Action | str]] | Sequence[Sequence[str] | str]) -> Schedule:
    """A Schedule from a Schedule, a ``{rank: [Action or str]}`` mapping or a list indexed by rank."""
    return schedule if isinstance(schedule, Schedule) else parse_schedule(schedule)


def _owners(sched: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    return {s: min(rs) for s, rs in stage_ranks(sched).items()}


def check_structure(sched: Schedule, index: Mapping[tuple[int, int], int] | None = None,
                    ) -> tuple[list[str], dict[tuple[int, int], str]]:
    """Checks 1-4 of the module docstring: (problems, {(rank, step): note}). Steps are positions in
    ``sched``, or ``index[(rank, position)]`` (positions in the lowered program) when given."""

    def at(r: int, i: int) -> int:
        return i if index is None else index[(r, i)]

    problems: list[str] = []
    marks: dict[tuple[int, int], str] = {}
    n_ranks = len(sched)
    for s, ranks in sorted(stage_ranks(sched).items()):
        if len(ranks) > 1:
            problems.append(f"stage {s} runs on ranks {sorted(ranks)}; "
                            "put all of a stage's actions on one rank")
            for r in sorted(ranks)[1:]:
                for i, a in enumerate(sched[r]):
                    if a.is_compute and a.stage == s:
                        marks.setdefault((r, at(r, i)), f"stage {s} also runs on rank {min(ranks)}")
    owner = _owners(sched)
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, acts in sched.items():
        for i, a in enumerate(acts):
            if a.key in seen:
                r0, i0 = seen[a.key]
                marks.setdefault((r, at(r, i)), f"repeats {a} of rank {r0} step {i0}")
                problems.append(f"rank {r} step {at(r, i)}: {a} appears twice (also rank {r0} step {i0}); "
                                "each action runs exactly once")
            else:
                seen[a.key] = (r, at(r, i))
    n_stages, n_mb = sched.virtual_stages, 1 + max((a.microbatch for acts in sched.values() for a in acts),
                                                   default=-1)
    missing = [f"{s}{op}{i}" for s in range(n_stages) for i in range(n_mb) for op in ("F", "B")
               if (op, s, i) not in seen and (op == "F" or not {("I", s, i), ("W", s, i)} & seen.keys())]
    missing += [f"{s}{op}{i}" for s in range(n_stages) for i in range(n_mb) for op, other in (("I", "W"), ("W", "I"))
                if (op, s, i) not in seen and (other, s, i) in seen]
    for s, i in sorted({(s, i) for (op, s, i) in seen if op == "B"} & {(s, i) for (op, s, i) in seen if op == "I"}):
        problems.append(f"stage {s} micro-batch {i} has both a B and an I/W pair; a backward is one B, or an I "
                        "and a W")
    if missing:
        shown = ", ".join(missing[:_MAX_LISTED]) + (f" and {len(missing) - _MAX_LISTED} more"
                                                     if len(missing) > _MAX_LISTED else "")
        problems.append(f"missing {shown}: every stage 0..{n_stages - 1} runs a forward and a backward (B, or I "
                        f"and W) of every micro-batch 0..{n_mb - 1}")
    for r, acts in sched.items():
        pos = {a.key: i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            if a.op == "W" and pos.get(("I", a.stage, a.microbatch), -1) > i:
                j = at(r, pos[("I", a.stage, a.microbatch)])
                marks.setdefault((r, at(r, i)), f"before its I (step {j})")
                problems.append(f"rank {r} step {at(r, i)}: {a} comes before {a.stage}I{a.microbatch} (step {j}); "
                                "the weights' gradient needs the gradient of the layer outputs the I computes")
            if a.op in BACKWARD_OPS and pos.get(("F", a.stage, a.microbatch), -1) > i:
                j = at(r, pos[("F", a.stage, a.microbatch)])
                marks.setdefault((r, at(r, i)), f"before its forward (step {j})")
                problems.append(f"rank {r} step {at(r, i)}: {a} comes before its forward "
                                f"{a.stage}F{a.microbatch} (step {j}); "
                                "a backward needs its forward's activations")
            if a.is_compute:
                continue
            note = _comm_problem(sched, r, a, owner, n_ranks, n_stages)
            if note:
                marks.setdefault((r, at(r, i)), note)
                problems.append(f"rank {r} step {at(r, i)}: {a} {note}")
    for r, i, note in _update_problems(sched):
        marks.setdefault((r, at(r, i)), note)
        problems.append(f"rank {r} step {at(r, i)}: {sched[r][i]} {note}")
    return problems, marks


def _update_problems(sched: Schedule) -> list[tuple[int, int, str]]:
    """(rank, position, note) of ``U`` actions (the stage's optimizer update, ``asynchronous.py``) before
    the backward of their micro-batch, and of a stage's last gradient never applied by a ``U``."""
    if not any(a.op == "U" for acts in sched.values() for a in acts):
        return []
    out = []
    after = {s: sorted(a.microbatch for acts in sched.values() for a in acts if a.op == "U" and a.stage == s)
             for s in range(sched.virtual_stages)}
    first_stage, flagged = after.get(0, []), set()
    for r, acts in sched.items():  # loss_scales divides each group's gradient by the group's size
        for i, a in enumerate(acts):
            if a.op == "U" and after[a.stage] != first_stage and a.stage not in flagged:
                flagged.add(a.stage)
                out.append((r, i, f"begins stage {a.stage}'s updates after micro-batches {after[a.stage]}, stage 0's "
                                  f"after {first_stage}; every stage updates after the same micro-batches"))
    for r, acts in sched.items():
        done_at = {(a.stage, a.microbatch): i for i, a in enumerate(acts) if a.op in ("B", "W")}
        last_u: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.op == "U":
                last_u[a.stage] = i
                if done_at.get((a.stage, a.microbatch), len(acts)) > i:
                    out.append((r, i, f"comes before the backward of micro-batch {a.microbatch} "
                                      f"({a.stage}B{a.microbatch} or {a.stage}W{a.microbatch}); an update applies it"))
        groups: dict[int, list[int]] = {}  # stage -> the micro-batches whose gradient the next U applies
        for i, a in enumerate(acts):
            if a.op in ("B", "W"):
                groups.setdefault(a.stage, []).append(a.microbatch)
            elif a.op == "U":
                got = sorted(groups.pop(a.stage, []))
                first = min(got, default=a.microbatch)
                if got != list(range(first, a.microbatch + 1)):
                    out.append((r, i, f"applies the gradients of micro-batches {got}; an update applies a contiguous "
                                      f"run ending at its own micro-batch ({first}..{a.microbatch}), in order"))
        last_grad: dict[int, int] = {}
        for (s, _), i in done_at.items():
            last_grad[s] = max(i, last_grad.get(s, -1))
        for s, i in sorted(last_grad.items()):
            if i > last_u.get(s, -1):
                out.append((r, i, f"is the last gradient of stage {s} but no {s}U<microbatch> follows it; "
                                  "with asynchronous updates every gradient is applied by a U (or drop all U)"))
    return out


def _comm_problem(sched: Schedule, r: int, a: Action, owner: dict[int, int], n_ranks: int,
                  n_stages: int) -> str | None:
    if owner.get(a.stage, r) != r:
        return f"is for stage {a.stage}, which runs on rank {owner[a.stage]}"
    other = a.stage + (1 if a.op in ("SEND_F", "RECV_B") else -1)
    if not 0 <= other < n_stages:
        return f"has no stage {other} to talk to (stages are 0..{n_stages - 1})"
    if a.peer is None or not 0 <= a.peer < n_ranks:
        return f"names rank {a.peer}, which does not exist (ranks 0..{n_ranks - 1})"
    if other in owner and owner[other] != a.peer:
        return f"names rank {a.peer}, but stage {other} runs on rank {owner[other]}"
    if a.is_send and a.counterpart(r) not in sched[a.peer]:
        return f"is never received (rank {a.peer} has no {a.counterpart(r)})"
    return None


def backward_ops(sched: Mapping[int, Sequence[Action]]) -> dict[tuple[int, int], str]:
    """(stage, micro-batch) -> the op of its gradient-sending backward: "B", or "I" (then a W follows)."""
    return {(a.stage, a.microbatch): a.op for acts in sched.values() for a in acts if a.op in BACKWARD_OPS}


def _local_needs(a: Action, rank: int, owner: dict[int, int], n_stages: int,
                 grad_op: Mapping[tuple[int, int], str]) -> list[Action]:
    """What must already be done on ``rank`` before ``a`` runs there."""
    s, i = a.stage, a.microbatch
    if a.op == "F":
        if s == 0:
            return []
        return [Action(s - 1, "F", i)] if owner.get(s - 1) == rank else \
            [Action(s, "RECV_F", i, owner.get(s - 1, 0))]
    if a.op in BACKWARD_OPS:
        need = [Action(s, "F", i)]
        if s < n_stages - 1:
            need.append(Action(s + 1, grad_op.get((s + 1, i), "B"), i) if owner.get(s + 1) == rank else
                        Action(s, "RECV_B", i, owner.get(s + 1, 0)))
        return need
    if a.op == "W":
        return [Action(s, "I", i)]
    if a.op == "U":  # the update applies this micro-batch's gradient
        return [Action(s, "W" if grad_op.get((s, i)) == "I" else "B", i)]
    if a.is_send:
        return [Action(s, "F" if a.op == "SEND_F" else grad_op.get((s, i), "B"), i)]
    return []


def _need_keys(a: Action, rank: int, owner: dict[int, int], n_stages: int,
               grad_op: Mapping[tuple[int, int], str]) -> tuple[tuple[str, int, int], ...]:
    """The keys of ``_local_needs(a, ...)``, built without ``Action`` objects (``execute``'s inner loop)."""
    s, i, op = a.stage, a.microbatch, a.op
    if op == "F":
        if s == 0:
            return ()
        return (("F", s - 1, i),) if owner.get(s - 1) == rank else (("RECV_F", s, i),)
    if op in BACKWARD_OPS:
        if s < n_stages - 1:
            return ("F", s, i), ((grad_op.get((s + 1, i), "B"), s + 1, i) if owner.get(s + 1) == rank else
                                 ("RECV_B", s, i))
        return (("F", s, i),)
    if op == "W":
        return (("I", s, i),)
    if op == "U":
        return (("W" if grad_op.get((s, i)) == "I" else "B", s, i),)
    if op in SEND_OPS:
        return (("F" if op == "SEND_F" else grad_op.get((s, i), "B"), s, i),)
    return ()


def counterpart_key(a: Action, own_rank: int) -> tuple[int, str, int, int, int]:
    """``(a.peer, *a.counterpart(own_rank) as op, stage, micro-batch, peer)``, without building it."""
    d = a.op[-1]
    if a.op in SEND_OPS:
        return a.peer, "RECV_" + d, a.stage + 1 if d == "F" else a.stage - 1, a.microbatch, own_rank
    return a.peer, "SEND_" + d, a.stage - 1 if d == "F" else a.stage + 1, a.microbatch, own_rank


def execute(lowered: Schedule, sends: str = "eager") -> tuple[list[tuple[int, int]], list[Stuck]]:
    """Run the lowered program symbolically. Returns the (rank, step) pairs in an order in which they
    can all complete (every receive after its send), and the ranks stuck for ever (empty if none)."""
    if sends not in SENDS:
        raise ValueError(f"sends must be one of {SENDS}, got {sends!r}")
    owner, n_stages, grad_op = _owners(lowered), lowered.virtual_stages, backward_ops(lowered)
    ranks = sorted(lowered)
    pos = dict.fromkeys(ranks, 0)
    done: dict[int, set[tuple[str, int, int]]] = {r: set() for r in ranks}
    posted: set[tuple[int, str, int, int, int | None]] = set()  # (rank, op, stage, micro-batch, peer) of sends
    order: list[tuple[int, int]] = []

    def head(r: int) -> Action | None:
        return lowered[r][pos[r]] if r in pos and pos[r] < len(lowered[r]) else None

    def inputs_ready(r: int, a: Action) -> bool:
        got = done[r]
        return all(k in got for k in _need_keys(a, r, owner, n_stages, grad_op))

    def advance(r: int) -> None:
        a = lowered[r][pos[r]]
        done[r].add((a.op, a.stage, a.microbatch))
        if a.op in SEND_OPS:
            posted.add((r, a.op, a.stage, a.microbatch, a.peer))
        order.append((r, pos[r]))
        pos[r] += 1

    progress = True
    while progress:
        progress = False
        for r in ranks:
            while (a := head(r)) is not None and inputs_ready(r, a):
                if a.op in RECV_OPS and sends == "eager":
                    if counterpart_key(a, r) not in posted:
                        break
                elif a.op not in COMPUTE_OPS and sends == "rendezvous":
                    c = a.counterpart(r)
                    if head(a.peer) != c or not inputs_ready(a.peer, c):
                        break
                    first, second = (r, a.peer) if a.is_send else (a.peer, r)
                    advance(first)
                    advance(second)
                    progress = True
                    continue
                advance(r)
                progress = True
    stuck = [Stuck(r, pos[r], a, _why(lowered, r, a, pos, done, owner, n_stages, grad_op))
             for r in ranks if (a := head(r)) is not None]
    return order, stuck


def _why(lowered: Schedule, r: int, a: Action, pos: dict[int, int], done: dict[int, set],
         owner: dict[int, int], n_stages: int, grad_op: Mapping[tuple[int, int], str]) -> str:
    """What the stuck head action ``a`` of rank ``r`` waits for, in words."""
    for need in _local_needs(a, r, owner, n_stages, grad_op):
        if need.key in done[r]:
            continue
        later = [j for j, b in enumerate(lowered[r]) if b.key == need.key]
        if later:
            return f"waits for {need} on this rank, which comes later (step {later[0]})"
        return f"waits for {need}, which rank {r} never runs"
    q, c = a.peer, a.counterpart(r)
    if q not in pos:
        return f"waits for rank {q}, which does not exist"
    where = [j for j, b in enumerate(lowered[q]) if b == c]
    if not where:
        return f"waits for {c} on rank {q}, which rank {q} never runs"
    qhead = lowered[q][pos[q]] if pos[q] < len(lowered[q]) else None
    state = f"rank {q} is stuck at step {pos[q]} ({qhead})" if qhead is not None else f"rank {q} finished"
    if a.is_send:
        return f"waits for rank {q} to reach {c} (step {where[0]}), but {state}"
    return f"waits for {c} from rank {q} (its step {where[0]}), but {state}"


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "es" if word.endswith("h") else "s")


def validate(schedule: Mapping[int, Sequence[Action | str]] | Sequence[Sequence[str] | str],
             sends: str = "eager") -> Schedule:
    """Check ``schedule`` (compute-only or already lowered) and return the lowered program.

    Raises ``ScheduleError`` as ``validate_and_order`` does."""
    return validate_and_order(schedule, sends)[0]


def validate_and_order(schedule: Mapping[int, Sequence[Action | str]] | Sequence[Sequence[str] | str],
                       sends: str = "eager") -> tuple[Schedule, list[tuple[int, int]]]:
    """``validate``, and the (rank, step) order ``execute`` found for the lowered program (every receive
    after its send): the simulator plays it without executing the program a second time.

    Raises ``ScheduleError`` listing every problem, with a step-by-rank table of the lowered program
    in which ``XX`` marks the first action of each rank that can never proceed and ``!!`` marks
    actions named in the problems."""
    sched = as_schedule(schedule)
    if not any(sched.values()):
        raise ScheduleError("the schedule has no actions; give each rank its list, e.g. {0: ['0F0', '0B0']}")
    header = f"invalid pipeline schedule (kind {sched.kind!r}, {_n(len(sched), 'rank')}, " \
             f"{_n(sched.virtual_stages, 'stage')}, {_n(sched.microbatches, 'micro-batch')})"
    try:
        lowered, index = lower_with_index(sched)
    except ScheduleError as exc:
        problems, marks = check_structure(sched)
        problems.append(str(exc))
        table = format_table(sched, dict.fromkeys(marks, "!!"), max_rows=40)
        raise ScheduleError("\n".join([header + ":", *(f"  - {p}" for p in problems), "", table]),
                            problems, table) from None
    problems, marks = check_structure(sched, index)
    order, stuck = execute(lowered, sends)
    if not problems and not stuck:
        return lowered, order
    problems += [str(s) for s in stuck]
    cell_marks = dict.fromkeys(marks, "!!") | {(s.rank, s.step): "XX" for s in stuck}
    table = format_table(lowered, cell_marks, max_rows=40)
    steps = "(steps count the lowered program below)" if lowered != sched else ""
    text = "\n".join([f"{header}: {steps}".rstrip(), *(f"  - {p}" for p in problems), "",
                      "step-by-rank program (XX = can never proceed, !! = problem above):", table])
    raise ScheduleError(text, problems, table)
