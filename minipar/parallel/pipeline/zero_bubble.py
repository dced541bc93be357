"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward split into
``I`` (the input's gradient, which the previous stage waits for; the paper's B) and ``W`` (the
weights' gradient, which nobody waits for), placed where 1F1B would idle.

With F, I, W the times of one stage's forward, input-gradient and weight-gradient backward, for
m >= p micro-batches (the paper's Table 2; ``minipar.cost.pipeline.bubble_time``):

=========  =====================  ================================
schedule   bubble per rank        micro-batches kept, rank r
=========  =====================  ================================
1F1B       (p - 1)(F + I + W)     p - r
ZB-H1      (p - 1)(F + I - W)     p (1F1B's most, on every rank)
=========  =====================  ================================
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
