"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward split into
``I`` (the input's gradient, which the previous stage waits for; the paper's B) and ``W`` (the
weights' gradient, which nobody waits for), placed where 1F1B would idle.

With F, I, W the times of one stage's (ZB-V: one chunk's) forward, input-gradient and weight-gradient
backward (``minipar.cost.pipeline``; derivations in ``docs/formulas.md``, "Zero bubble"):

=========  =====================  ====================  ============================================
schedule   idle per rank          when                  (chunk-)micro-batches kept until W, rank r
=========  =====================  ====================  ============================================
1F1B       (p - 1)(F + I + W)     m >= p                min(p - r, m)
ZB-H1      (p - 1)(F + I - W)     m >= p, W <= F        min(p, m) (1F1B's most, on every rank)
ZB-V       (p - 1) F              m >= 2p - 1, F=I=W    min(2p, 2m, m + r + 1) chunks (2p: p M_B)
=========  =====================  ====================  ============================================

(idle in one flushed step; the paper's Table 2 for 1F1B and ZB-H1, its Sec. 6 for ZB-V: zero bubble
when F = I = W with 1F1B's peak memory p M_B, M_B one micro-batch's activations of a whole stage, two
chunks here. "Zero" counts the parallelogram: each rank computes without a gap from its first action
to its last, rank r starting r F's late and ending r F's late, so with the optimizer step not
synchronised across stages consecutive steps tile; a flushed step still idles (p - 1) F per rank at
its edges. ZB-H1's first rank has a (p - 1)(F + I - W) gap inside its step, so its steps do not tile.)

``torch.distributed.pipelining`` defines both orders: ``ScheduleZBVZeroBubble`` is ``zb_v``, and
``ScheduleInterleavedZeroBubble`` (the paper's ZB1P) with one stage per rank is ``zb_h1`` (it has no
separate one-chunk ZB-H1 class); tests/test_zero_bubble.py compares them action by action.
"""

from __future__ import annotations

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
