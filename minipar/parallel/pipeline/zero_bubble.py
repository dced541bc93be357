"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward split into
``I`` (the input's gradient, which the previous stage waits for; the paper's B) and ``W`` (the
weights' gradient, which nobody waits for), placed where 1F1B would idle.

With F, I, W the times of one stage's (ZB-V: one chunk's) forward, input-gradient and weight-gradient
backward (``minipar.cost.pipeline``; derivations in ``docs/formulas.md``, "Zero bubble"):

=========  =========================  =================  ==========================================
schedule   idle per rank              when               (chunk-)micro-batches kept until W, rank r
=========  =========================  =================  ==========================================
1F1B       (p - 1)(F + I + W)         m >= p             min(p - r, m)
ZB-H1      (p - 1)(F + I - W)         m >= p, W <= F     min(p, m) (1F1B's most, on every rank)
ZB-H2      (p - 1) max(F, F + I - 2W) m >= 2p - 1, W<=F  min(2p - 1, m) (the paper's (2p - 1) M_B)
ZB-V       (p - 1) F                  m >= 2p - 1, F=I=W min(2p, 2m, m + r + 1) chunks (2p: p M_B)
=========  =========================  =================  ==========================================

(idle in one flushed step; the paper's Table 2 for 1F1B and ZB-H1, its Sec. 6 for ZB-V: zero bubble
when F = I = W with 1F1B's peak memory p M_B, M_B one micro-batch's activations of a whole stage, two
chunks here. "Zero" counts the parallelogram: each rank computes without a gap from its first action
to its last, rank r starting r F's late and ending r F's late, so with the optimizer step not
synchronised across stages consecutive steps tile; a flushed step still idles (p - 1) F per rank at
its edges. ZB-H1's first rank has a (p - 1)(F + I - W) gap inside its step, so its steps do not tile.
ZB-H2 (Sec. 2.2) is the parallelogram bought with memory, p - 1 more warm-up forwards on the first
rank than ZB-H1: its waits inside a rank's work add up to (p - 1)(F + I - 2W) at most, 0 when F = I = W.)

``torch.distributed.pipelining`` defines both orders: ``ScheduleZBVZeroBubble`` is ``zb_v``, and
``ScheduleInterleavedZeroBubble`` (the paper's ZB1P) with one stage per rank is ``zb_h1`` (it has no
separate one-chunk ZB-H1 class); tests/test_zero_bubble.py compares them action by action.
"""

from __future__ import annotations

import heapq

from .schedule import Action


def zb_h1(p: int, m: int) -> dict[int, list[Action]]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2.1, Figure 3 top): 1F1B's
    order of forwards and input-gradient backwards (``I``: p - 1 - r warm-up forwards on rank r), with
    each weight-gradient ``W`` started late enough that every rank keeps p micro-batches in flight
    (1F1B's first rank's peak): rank r runs, for x = 0, 1, ..., m + p - 2,

        F_x,  I_{x - (p - 1 - r)},  W_{x - (p - 1)}       (each when its index is in 0..m-1)

    so W of micro-batch i runs right after I of micro-batch i + r, and the last r W's fill the
    cool-down, where 1F1B idles. With F, I, W the times of one stage's forward, input-gradient and
    weight-gradient backward, the bubble per rank is (p - 1)(F + I - W), against 1F1B's (p - 1)(F +
    I + W) (the paper's Table 2): about a third of it when F = I = W."""
    out = {}
    for r in range(p):
        acts = []
        for x in range(m + p - 1):
            for op, i in (("F", x), ("I", x - (p - 1 - r)), ("W", x - (p - 1))):
                if 0 <= i < m:
                    acts.append(Action(r, op, i))
        out[r] = acts
    return out


def zb_v(p: int, m: int) -> dict[int, list[Action]]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 6 and its ZB-V figure), in the order of
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble``.

    Two chunks per rank in a V: rank r holds stage a = r (going down) and stage b = 2p - 1 - r (coming
    back up), so stages p - 1 and p meet on rank p - 1 and hand over in memory, and rank 0 holds the
    first stage and the last (the loss). The order is built for n = max(m, 2p - 1) micro-batches and
    the actions of micro-batches >= m are then dropped (removing whole micro-batches removes waits
    only, so the order stays runnable for any m >= 1; from m = 2p - 1 on it is the paper's
    parallelogram). Rank r runs, with X_s[i..j] the action X of stage s on micro-batches i..j in turn:

    - warm-up: F_a[0 .. 2(p-r)-2]; then r pairs F_b[k], F_a[2(p-r)-1+k]; then p - r triples
      F_b[r+k], I_b[k], W_b[k] (k counting from 0): stage b's first backwards start once the V has
      turned;
    - steady state, j = 0 .. n-p-1: F_a[2p-r-1+j] (while < n), I_a[j], W_a[j], F_b[p+j], I_b[p-r+j],
      W_b[p-r+j]: one micro-batch through both chunks, each backward's W right after its I;
    - cool-down: r pairs I_a[n-p+k], I_b[n-r+k]; then p - r pairs I_a[n-p+r+k], W_a[n-p+k]; then the
      remaining W_b[n-r .. n-1] and W_a[n-r .. n-1], which fill what would be the flush's bubble.

    Rank r keeps min(2p, 2m, m + r + 1) chunk-micro-batches between F and W at most: 2p = p whole
    stages' worth, 1F1B's first rank (the paper's p M_B). With F = I = W per chunk and m >= 2p - 1
    no rank has a gap between its first and its last action."""
    n = max(m, 2 * p - 1)
    out = {}
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        # warm-up: chunk a's forwards fill the V's way down, then chunk b's start coming back
        order = [(a, "F", i) for i in range(2 * (p - r) - 1)]
        for k in range(r):
            order += [(b, "F", k), (a, "F", 2 * (p - r) - 1 + k)]
        for k in range(p - r):
            order += [(b, "F", r + k), (b, "I", k), (b, "W", k)]
        # steady state: F, I, W on chunk a, then on chunk b
        for j in range(n - p):
            order += [(a, "F", 2 * p - r - 1 + j)] if 2 * p - r - 1 + j < n else []
            order += [(a, "I", j), (a, "W", j), (b, "F", p + j), (b, "I", p - r + j), (b, "W", p - r + j)]
        # cool-down: the last input gradients, then the held-back weight gradients
        for k in range(r):
            order += [(a, "I", n - p + k), (b, "I", n - r + k)]
        for k in range(p - r):
            order += [(a, "I", n - p + r + k), (a, "W", n - p + k)]
        order += [(b, "W", i) for i in range(n - r, n)] + [(a, "W", i) for i in range(n - r, n)]
        out[r] = [Action(s, op, i) for s, op, i in order if i < m]  # micro-batches past m dropped
    return out


def zb_h2(p: int, m: int) -> dict[int, list[Action]]:
    """ZB-H2 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2.2 and Figure 3 bottom): more
    warm-up forwards than ZB-H1 fill the bubble before the first input gradient, and the W's held back
    fill the cool-down, so the step becomes a parallelogram: with F = I = W and m >= 2p - 1 no rank has
    a gap between its first action and its last (the paper's zero bubble), at the cost of 2p - 1
    micro-batches kept until their W on every rank (the paper's (2p - 1) M_B, against 1F1B's p M_B).

    The order is the one every rank follows when it plays the step in unit time (F = I = W = 1) and,
    whenever it is free, takes the first of these that it can run (the authors' hand-made order,
    ``Graph.manual_order`` in sail-sg/zero-bubble-pipeline-parallelism, is such a list schedule too):

    1. ``I`` of its oldest micro-batch without one, once the next stage's ``I`` of it has ended (the
       last stage: once its own ``F`` has);
    2. ``F`` of the next micro-batch, once the previous stage's ``F`` of it has ended, if fewer than
       2p - 1 micro-batches wait for their ``W``;
    3. ``W`` of its oldest micro-batch whose ``I`` has run.

    Rank r thus runs min(2(p - r) - 1, m) forwards before its first I (ZB-H1: p - r), then I's
    alternating with F's and, once 2p - 1 micro-batches are held, with W's; the W's left over fill
    the end. Any m >= 1 gives a runnable order; below m = 2p - 1 the first rank cannot fill its
    warm-up and each rank's order has gaps (2p - 1 - m units at most, measured by ``simulate``)."""
    cap = 2 * p - 1
    f_end: list[list[int]] = [[] for _ in range(p)]  # f_end[r][k]: when F of micro-batch k ended on rank r
    i_end: list[list[int]] = [[] for _ in range(p)]
    done_w = [0] * p
    out: dict[int, list[Action]] = {r: [] for r in range(p)}
    awake = [(0, r) for r in range(p)]  # (time, rank): the rank is free then; a rank that must wait sleeps
    queued = set(awake)  # until a neighbour's F or I ends, which wakes it
    while awake:
        t, r = heapq.heappop(awake)
        nf, ni = len(f_end[r]), len(i_end[r])
        if ni < nf and f_end[r][ni] <= t and (r == p - 1 or (len(i_end[r + 1]) > ni and i_end[r + 1][ni] <= t)):
            op, k, wake = "I", ni, r - 1
            i_end[r].append(t + 1)
        elif nf < m and nf - done_w[r] < cap and (r == 0 or (len(f_end[r - 1]) > nf and f_end[r - 1][nf] <= t)):
            op, k, wake = "F", nf, r + 1
            f_end[r].append(t + 1)
        elif done_w[r] < ni:
            op, k, wake = "W", done_w[r], -1
            done_w[r] += 1
        else:
            continue
        out[r].append(Action(r, op, k))
        for q in (r, wake) if 0 <= wake < p else (r,):
            if (t + 1, q) not in queued:
                queued.add((t + 1, q))
                heapq.heappush(awake, (t + 1, q))
    return out
