"""Lowering: turn a compute-only schedule into the program a runtime executes, with SEND/RECV.

For every forward ``sFi`` whose previous stage lives on another rank, a ``sRECV_Fi<-q`` is put just
before it; when the next stage lives on another rank, a ``sSEND_Fi->q`` just after it. Backwards
mirror this with gradients (``RECV_B`` before, ``SEND_B`` after; an ``I`` like a ``B``, a ``W`` or a
``U`` (the stage's optimizer update) with no message). Stages on the same rank (p = 1,
or hand-written layouts) hand tensors over in memory and need no messages.

Contract for the runtime executor (and what ``validate`` checks against):

- ``SEND`` posts a non-blocking send (``isend``) of the tensor just computed and moves on; the
  runtime waits for its outstanding sends before the optimizer step and before reusing a buffer.
- ``RECV`` blocks until the matching message has arrived; its data is the input of the next
  compute action of that stage and micro-batch.
- Messages are matched by (kind, stage, micro-batch), e.g. a tag built from them, so two
  messages in flight between the same ranks never get confused.

A compute-only schedule of p ranks, S stages and m micro-batches lowers in O(S m) to at most
2 (S - 1) m extra actions; a schedule that already has SEND/RECV actions is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .schedule import Action, Schedule, ScheduleError, stage_ranks


def is_lowered(schedule: Mapping[int, Sequence[Action]]) -> bool:
    """True when the schedule already contains SEND/RECV actions."""
    return any(not a.is_compute for acts in schedule.values() for a in acts)


def lower_with_index(schedule: Mapping[int, Sequence[Action]]) -> tuple[Schedule, dict[tuple[int, int], int]]:
    """``lower`` plus where each original action landed: ``{(rank, step): lowered step}``."""
    sched = Schedule.of(schedule)
    if is_lowered(sched):
        return sched.like(sched), {(r, i): i for r, acts in sched.items() for i in range(len(acts))}
    where = stage_ranks(sched)
    n_stages = sched.virtual_stages
    owner: dict[int, int] = {}
    for s in range(n_stages):
        ranks = where.get(s, set())
        if len(ranks) != 1:
            detail = "no rank runs it" if not ranks else f"ranks {sorted(ranks)} all run it"
            raise ScheduleError(f"cannot lower: stage {s} must live on exactly one rank ({detail})")
        owner[s] = next(iter(ranks))
    out: dict[int, list[Action]] = {}
    index: dict[tuple[int, int], int] = {}
    for rank, acts in sched.items():
        prog: list[Action] = []
        for i, a in enumerate(acts):
            s, mb = a.stage, a.microbatch
            prev_remote = s > 0 and owner[s - 1] != rank
            next_remote = s < n_stages - 1 and owner[s + 1] != rank
            if a.op == "F":
                if prev_remote:
                    prog.append(Action(s, "RECV_F", mb, owner[s - 1]))
                index[(rank, i)] = len(prog)
                prog.append(a)
                if next_remote:
                    prog.append(Action(s, "SEND_F", mb, owner[s + 1]))
            elif a.op in ("W", "U"):  # the weights' gradient, the stage's update: nothing to send or receive
                index[(rank, i)] = len(prog)
                prog.append(a)
            else:  # B, or I: the backward that sends the input's gradient upstream
                if next_remote:
                    prog.append(Action(s, "RECV_B", mb, owner[s + 1]))
                index[(rank, i)] = len(prog)
                prog.append(a)
                if prev_remote:
                    prog.append(Action(s, "SEND_B", mb, owner[s - 1]))
        out[rank] = prog
    return sched.like(out), index


def lower(schedule: Mapping[int, Sequence[Action]]) -> Schedule:
    """The schedule with SEND/RECV actions inserted (see the module docstring for the semantics)."""
    return lower_with_index(schedule)[0]
