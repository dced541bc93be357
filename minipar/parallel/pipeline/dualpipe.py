"""DualPipeV (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.1, DualPipe; its V-shaped
single-copy variant, Sea AI Lab's "cut-in-half" of DualPipe, in deepseek-ai/DualPipe's
``dualpipe/dualpipev.py`` and in ``torch.distributed.pipelining.ScheduleDualPipeV``).

DualPipe feeds micro-batches from both ends of the pipeline and overlaps, on every rank, the forward
of one micro-batch with the backward of another ("F&B": the MoE all-to-all of one hides behind the
other's compute), at the price of two copies of the parameters. DualPipeV folds it in half: p ranks
hold 2p stages in a V (rank r holds stage a = r going down and stage b = 2p - 1 - r coming back, as
ZB-V), one copy of the parameters, and the same steady state: forward of one chunk overlapped with
the backward of the other.

The orders here equal PyTorch's (``tests/test_dualpipev.py`` compares them action by action). PyTorch
writes an overlapped pair as one ``OVERLAP_F_B`` action whose sub-actions, a forward and a full
backward, run one after the other in its runtime; minipar writes the pair as the two actions, the
forward first, so the order of work on every rank is the same. This runtime has no communication to
hide behind compute, so a pair costs F + B here (``simulate`` and the runtime), the report's F&B
at its worst.

With F, B, W the times of one chunk's forward, full backward and weight-gradient backward, and
m >= 2p (``minipar.cost.pipeline``; derivations in ``docs/formulas.md``, "DualPipeV"):

- run as its order (each pair's forward, then its backward) a flushed step idles (p - 1) F per rank
  when F = I = W, ZB-V's;
- with each pair one unit of time F&B that starts once both its inputs arrived (DeepSeek's runtime:
  ``overlapped_program``; ``simulate.simulate_overlapped``) the busiest rank idles (p - 1)(F&B + B - 3W), the
  DeepSeek-V3 report's DualPipe bubble (Table 2) with PP = 2p stages and DualPipe's README's
  DualPipeV row, exactly when I = F and W <= F;
- every rank keeps 2p + 1 chunk-micro-batches at its peak (the report's PP + 1); one copy of the
  parameters (DualPipe: two).
"""

from __future__ import annotations

from collections import deque

from .lowering import lower
from .schedule import Action, Schedule


def dualpipe_v(p: int, m: int) -> dict[int, list[Action]]:
    """DualPipeV's per-rank orders for p ranks (2p stages in a V) and m >= 2p micro-batches (PyTorch's
    ``ScheduleDualPipeV`` and DeepSeek's ``DualPipeV.step`` refuse fewer). Rank r, with a = r, b = 2p-1-r,
    ``X_s`` the action X of stage s on its next micro-batch, B a full backward, I/W a split one (each
    W is the oldest I's, first in first out), and ``(F_s B_t)`` an overlapped pair:

    1. 2(p - 1 - r) x F_a: the way down;
    2. r + 1 x (F_a, F_b): the V turns on rank p - 1 and chunk b starts coming back;
    3. p - 1 - r x (I_b, W_b, F_b): chunk b's first backwards, zero-bubble style;
    4. m - 2p + r + 1 x ((F_a B_b), (F_b B_a)): the steady state, two overlapped pairs (on rank
       p - 1 the first F_a, B_b are not overlapped, to start the backward sooner; same order);
    5. p - 1 - r x (B_b, (F_b B_a));
    6. r + 1 x (backward_b, backward_a): full backwards, split ones (I) from the middle on: from
       step (r + 1) // 2 on, its b included when r is odd, from its a when r is even;
    7. p - 1 - r x (W, I_a): the held-back W's interleaved with chunk a's last input gradients;
    8. the r + 1 W's left."""
    return {r: order for r, (order, _) in _orders(p, m).items()}


def _orders(p: int, m: int) -> dict[int, tuple[list[Action], list[int]]]:
    """Rank -> (its order, the positions of the forwards that start an overlapped F&B pair)."""
    if m < 2 * p:
        raise ValueError(f"dualpipev needs microbatches >= 2 x stages (m >= 2p, as PyTorch's ScheduleDualPipeV and "
                         f"DeepSeek's DualPipeV): m={m} with p={p}; use microbatches={2 * p} or more")
    return {r: _rank_order(p, m, r) for r in range(p)}


def _rank_order(p: int, m: int, r: int) -> tuple[list[Action], list[int]]:
    a, b = r, 2 * p - 1 - r
    nxt: dict[tuple[int, str], int] = {}  # (stage, "F" | "B") -> its next micro-batch (B counts I's too)
    held: deque[tuple[int, int]] = deque()  # (stage, micro-batch) of I's whose W has not run
    out: list[Action] = []
    pairs: list[int] = []  # where an overlapped pair's forward is

    def run(*steps: tuple[int, str]) -> None:
        for stage, op in steps:
            key = (stage, "F" if op == "F" else "B")
            i = nxt.get(key, 0)
            nxt[key] = i + 1
            out.append(Action(stage, op, i))
            if op == "I":
                held.append((stage, i))

    def weight() -> None:
        if held:  # first in, first out (PyTorch's weight queue, DeepSeek's WeightGradStore)
            stage, i = held.popleft()
            out.append(Action(stage, "W", i))

    run(*[(a, "F")] * (2 * (p - 1 - r)))
    for _ in range(r + 1):
        run((a, "F"), (b, "F"))
    for _ in range(p - 1 - r):
        run((b, "I"))
        weight()
        run((b, "F"))
    for j in range(m - 2 * p + r + 1):
        pairs += [len(out)] * (j > 0 or r < p - 1) + [len(out) + 2]
        run((a, "F"), (b, "B"), (b, "F"), (a, "B"))
    for _ in range(p - 1 - r):
        pairs.append(len(out) + 1)
        run((b, "B"), (b, "F"), (a, "B"))
    split = False
    for k in range(r + 1):
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        run((b, "I" if split else "B"))
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        run((a, "I" if split else "B"))
    for _ in range(p - 1 - r):
        weight()
        run((a, "I"))
    for _ in range(r + 1):
        weight()
    return out, pairs


def overlapped_program(p: int, m: int) -> Schedule:
    """DualPipeV lowered as DeepSeek's ``DualPipeV._forward_backward_chunk`` runs a pair: both inputs
    received (the forward's activation, the backward's gradient) before either computes, both results
    sent after both. ``lower`` would instead put each receive just before its own action and each send
    just after it, so the forward of a pair could start before the gradient of its backward arrived.
    Every rank's compute actions are ``dualpipe_v``'s, in its order; ``Pipeline`` runs this program too."""
    return overlapped_pairs(p, m)[0]


def overlapped_pairs(p: int, m: int) -> tuple[Schedule, set[tuple[int, int]]]:
    """``overlapped_program`` and the (rank, step) of each overlapped pair's forward in it."""
    orders = _orders(p, m)
    sched = Schedule({r: order for r, (order, _) in orders.items()}, kind="dualpipev", stages=p, microbatches=m,
                     chunks=2)
    lowered = lower(sched)
    out: dict[int, list[Action]] = {}
    firsts: set[tuple[int, int]] = set()
    for r, prog in lowered.items():
        segments: list[list[Action]] = []  # one per compute action: [its RECV], the action, [its SEND]
        for a in prog:
            if a.is_recv or (a.is_compute and not (segments and segments[-1][-1].is_recv)):
                segments.append([a])
            else:
                segments[-1].append(a)
        starts = set(orders[r][1])
        merged: list[Action] = []
        k = 0
        while k < len(segments):
            group = segments[k:k + 2] if k in starts else segments[k:k + 1]
            if k in starts:
                firsts.add((r, len(merged) + sum(a.is_recv for seg in group for a in seg)))
            for part in ("recv", "compute", "send"):
                merged += [a for seg in group for a in seg if getattr(a, f"is_{part}")]
            k += len(group)
        out[r] = merged
    return sched.like(out), firsts

