"""Pipeline parallelism: bubble, stashed micro-batches and the bytes crossing stage boundaries.

Uniform stages, ``p`` ranks, ``m`` micro-batches, ``v`` model chunks per rank (virtual stage
``s = chunk * p + rank`` lives on rank ``s mod p``); derivations in ``docs/formulas.md``:

- ``bubble_fraction``: the idle share of the step. Naive model parallelism ``(p-1)/p``; GPipe
  (Huang et al. 2018) and 1F1B (Narayanan et al. 2021, Sec. 2.2.1) ``(p-1)/(m+p-1)``; interleaved
  1F1B (Sec. 2.2.2) ``(p-1)/(vm+p-1)``.
- ZB-H1 (Qi et al. 2024, Sec. 2.1): the backward split into I and W; ``bubble_time`` (p-1)(F + I - W)
  against 1F1B's (p-1)(F + I + W); every rank keeps ``min(p, m)`` micro-batches until their W, the
  most any 1F1B rank keeps (its first).
- ZB-H2 (Qi et al. 2024, Sec. 2.2, Table 2): 2(p-r)-1 warm-up forwards on rank r (ZB-H1: p-r) and the W's
  held back to the end; with F = I = W and m >= 2p - 1 no rank has a gap between its first and last
  action (the paper's bubble (p-1)(F + I - 2W) = 0), a flushed step idles ``(p-1) F`` per rank at its
  edges (``(p-1) max(F, F + I - 2W)`` for W <= F, I); every rank keeps ``min(2p - 1, m)`` micro-batches
  until their W (the paper's (2p-1) M_B).
- ZB-V (Qi et al. 2024, Sec. 6): two chunks per rank in a V (stages r and 2p-1-r), F, I, W per chunk;
  with F = I = W and m >= 2p - 1 no rank has a gap between its first and last action (the paper's
  zero bubble), a flushed step idles ``(p-1) F`` per rank at its edges; every rank keeps
  ``min(2p, 2m, m + r + 1)`` chunk-micro-batches until their W, 2p = the paper's p M_B, 1F1B's.
- DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 report Sec. 3.2.1 and Table 2, DualPipe's README for the V): ZB-V's
  placement, m >= 2p; run as its order (each overlapped pair's forward then backward) a flushed step idles
  ``(p-1) F`` per rank when F = I = W, ZB-V's; with each pair one unit of time F&B that waits for both
  its inputs (``simulate.simulate_overlapped``) the busiest rank idles ``(p-1)(F&B + B - 3W)``
  (``dualpipe_bubble_time``, the report's formula with PP = 2p stages; exact for F = I, W <= F); every
  rank keeps ``2p + 1`` chunk-micro-batches (the report's PP + 1), one copy of the parameters.
- ``peak_stash``: micro-batches whose activations rank ``r`` holds at once: naive 1, GPipe ``m``,
  1F1B ``min(p - r, m)``, interleaved ``min(2 (p - r - 1) + (v - 1) p + 1, v m)`` chunk-micro-batches
  (Megatron-LM's warm-up count ``2 (p - r - 1) + (v - 1) p`` forwards, plus the one in flight; with
  ``m = p`` every forward is warm-up, ``v m``, as in Megatron-LM before its November 2024 change
  4295be1a6c, which this schedule follows).
- ``send_bytes``: each boundary between stages on different ranks carries ``m`` activations forward
  and ``m`` gradients of the same size backward.
- Chimera (Li & Hoefler 2021, Sec. 3.1; p even, m a multiple of p): two 1F1B pipelines in opposite
  directions over the same ranks. With the paper's equal slots (F = B) each rank idles ``(p - 2) F``
  (``chimera_bubble_time``), a share ``(p - 2)/(2m + p - 2)`` (``chimera_bubble_fraction``), and rank r
  holds ``p/2 + 1 + min(r, p-1-r)`` micro-batches of both directions (``chimera_peak_stash``).
- ``weight_versions``: the weight versions stage r holds at once: PipeDream ``p - r`` (one per
  micro-batch in flight, Narayanan et al. 2019, Sec. 3.3, reached for m >= 2 (p - 1)), PipeDream-2BW
  2 (Narayanan et al. 2021, Sec. 3.1), a synchronous schedule 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral

from minipar.checks import counts, index, number, one_of, whole, wholes

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")
RUNTIME_KINDS = (*SCHEDULES, "chimera", "pipedream", "2bw")  # every schedule the runtime runs


def _check(who: str, kind: str, **sizes: int) -> None:
    """``kind`` has a formula here and every size in ``sizes`` (p, m, v) is a positive whole number."""
    one_of(who, "kind", kind, SCHEDULES)
    wholes(who, **sizes)


def _chimera(who: str, p: int) -> None:
    if whole(who, "p", p) % 2:
        raise ValueError(f"{who}: p={p} must be even (Chimera's two pipelines in opposite directions)")


def bubble_fraction(kind: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of the step for uniform stages with a backward twice a forward (Huang et al. 2018;
    Narayanan et al. 2021); ZB-H1 (m >= p) splits that backward into equal I and W halves:
    ``bubble_time`` over ``m (F + I + W)`` plus it, ``(p-1) / (3m + p - 1)``; ZB-H2 the same share for
    m >= p (its step ends p - 1 after 3m; from m = 2p - 1 on without a gap inside any rank's work); ZB-V
    (F = I = W = 1 per chunk, a rank's work 6m) ``(p-1) / (6m + p - 1)`` for m >= 2p - 1, DualPipeV's order the
    same for m >= 2p (each overlapped pair run as its F then its B). With fewer micro-batches the
    zero-bubble orders leave more gaps, which ``simulate`` measures (refused here)."""
    _check("bubble_fraction", kind, p=p, m=m, v=v)
    if kind == "naive":
        return (p - 1) / p
    least = {"zb-h1": p, "zb-h2": p, "zb-v": 2 * p - 1, "dualpipev": 2 * p}.get(kind, 1)
    if m < least:
        raise ValueError(f"the {kind} bubble formula needs m >= {least} micro-batches (got m={m}); "
                         f"simulate(make_schedule({kind!r}, {p}, {m})) measures it")
    if kind in ("zb-v", "dualpipev"):
        return (p - 1) / (6 * m + p - 1)
    if kind in ("zb-h1", "zb-h2"):
        idle = bubble_time(kind, p, 1.0, 1.0, 1.0)
        return idle / (3 * m + idle)
    return (p - 1) / ((v if kind == "interleaved" else 1) * m + p - 1)


def bubble_time(kind: str, p: int, forward: float, input_grad: float, weight_grad: float) -> float:
    """Idle time of every rank in one step, for 1F1B and ZB-H1 with the backward split into the
    input-gradient part ``I`` and the weight-gradient part ``W`` (Qi et al. 2024, Table 2; m >= p):
    1F1B ``(p-1)(F + I + W)``, ZB-H1 ``(p-1)(F + I - W)``: the W's fill the cool-down. ZB-H2 (Sec. 2.2,
    m >= 2p - 1, W <= F and W <= I): ``(p-1) max(F, F + I - 2W)``: rank r starts r F's late (the first
    forward reaching it) and, when F + I > 2W, waits (p-1)(F + I - 2W) in all inside its work (the
    paper's ZB-H2 bubble, 0 when F = I = W); the larger of the two is every rank's idle (held against
    the simulator for random costs in tests/test_zb_h2.py). ZB-V (Sec. 6; F, I, W of one chunk,
    m >= 2p - 1) only for F = I = W, where it is ``(p-1) F``: rank r waits r F's for the first
    micro-batch and ends r F's after rank 0, with no gap in between (other costs leave gaps in this
    fixed order that have no closed form here: simulate them). DualPipeV run as its order (each overlapped
    pair's forward, then its backward; m >= 2p) the same, ``(p-1) F`` for F = I = W
    (``dualpipe_bubble_time`` for the pairs overlapped)."""
    one_of("bubble_time", "kind", kind, ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"))
    whole("bubble_time", "p", p)
    for name, value in (("forward", forward), ("input_grad", input_grad), ("weight_grad", weight_grad)):
        number("bubble_time", name, value)
    if kind in ("zb-v", "dualpipev"):
        if not (math.isclose(forward, input_grad) and math.isclose(forward, weight_grad)):
            raise ValueError(f"{kind}'s bubble has a formula for F = I = W only, got F {forward}, I {input_grad}, "
                             f"W {weight_grad}; simulate(make_schedule({kind!r}, p, m), forward=F, backward=I + W, "
                             "weight=W) gives it for any costs")
        return (p - 1) * forward
    if kind in ("zb-h1", "zb-h2") and weight_grad > min(forward, input_grad):
        raise ValueError(f"{kind.upper()}'s bubble formula holds for W <= F and W <= I (the paper's T_W < T_F < T_B), "
                         f"got F {forward}, I {input_grad}, W {weight_grad}; simulate it for other costs")
    if kind == "zb-h2":
        return (p - 1) * max(forward, forward + input_grad - 2 * weight_grad)
    sign = 1 if kind == "1f1b" else -1
    return (p - 1) * (forward + input_grad + sign * weight_grad)


def dualpipe_bubble_time(p: int, forward: float, backward: float, weight: float, overlap: float) -> float:
    """DualPipeV's idle time on its busiest rank in one step, ``(p-1)(F&B + B - 3W)``: the DeepSeek-V3
    report's DualPipe bubble (Table 2, with PP = 2p stages; DualPipe's README gives DualPipeV the same),
    F, B, W one chunk's forward, full backward and weight-gradient backward, ``overlap`` = F&B the time
    of an overlapped forward-and-backward pair, between max(F, B) and F + B. It equals
    ``simulate.simulate_overlapped``'s largest idle exactly when a chunk's forward equals its
    input-gradient backward (F = B - W) and W <= F (the report's setting; tests/test_dualpipev.py);
    other costs are refused (simulate them)."""
    whole("dualpipe_bubble_time", "p", p)
    for name, value in (("forward", forward), ("backward", backward), ("weight", weight), ("overlap", overlap)):
        number("dualpipe_bubble_time", name, value)
    if not (math.isclose(forward, backward - weight) and weight <= forward
            and max(forward, backward) <= overlap <= forward + backward):
        raise ValueError(f"dualpipe_bubble_time: the formula holds for F = B - W, W <= F and max(F, B) <= F&B <= "
                         f"F + B, got F {forward}, B {backward}, W {weight}, F&B {overlap}; "
                         "simulate.simulate_overlapped(p, m, F, B, W, F&B) gives it for any costs")
    return (p - 1) * (overlap + backward - 3 * weight)


def peak_stash(kind: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Micro-batches (interleaved, ZB-V, DualPipeV: chunk-micro-batches) stashed at once on ``rank``."""
    _check("peak_stash", kind, p=p, m=m, v=v)
    index("peak_stash", "rank", rank, p, "ranks")
    if kind == "dualpipev":  # the report's PP + 1: 2p - 1 forwards of chunk a, then F_b, then a pair's F
        if m < 2 * p:
            raise ValueError(f"peak_stash: dualpipev needs m >= 2p = {2 * p} micro-batches, got m={m}")
        return 2 * p + 1
    if kind == "zb-v":  # its two chunks whatever v says; 2p (m >= 2p - 1) = p whole stages = 1F1B's first rank
        return min(2 * p, 2 * m, m + rank + 1)
    if kind == "interleaved":  # m == p: every forward runs first (Megatron-LM's "all warm-up")
        return v * m if m == p else min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)
    return {"naive": 1, "gpipe": m, "1f1b": min(p - rank, m), "zb-h1": min(p, m), "zb-h2": min(2 * p - 1, m)}[kind]


def chimera_peak_stash(p: int, rank: int) -> int:
    """Chimera's micro-batches held at once on ``rank`` (both directions): down's p/2 plus up's, mirrored,
    ``p/2 + 1 + min(r, p-1-r)``: from p/2 + 1 on the end ranks to p in the middle (the paper's
    [(D/2 + 1) M_a, D M_a])."""
    _chimera("chimera_peak_stash", p)
    index("chimera_peak_stash", "rank", rank, p, "ranks")
    return p // 2 + 1 + min(rank, p - 1 - rank)


def stash_peaks(kind: str, p: int, m: int) -> list[int]:
    """``peak_stash`` of every rank for any schedule the runtime runs with one chunk per rank (ZB-V: its
    two): Chimera both directions' (``chimera_peak_stash``), PipeDream and PipeDream-2BW (``"2bw"``)
    1F1B's, whose order they keep."""
    one_of("stash_peaks", "kind", kind, RUNTIME_KINDS)
    if kind == "chimera":
        return [chimera_peak_stash(p, r) for r in range(p)]
    return [peak_stash("1f1b" if kind in ("pipedream", "2bw") else kind, p, m, r) for r in range(p)]


def chimera_bubble_time(p: int, forward: float, backward: float) -> float:
    """Chimera's idle time per rank in one step, ``(p - 2) F``, with the paper's equal slots (F = B);
    other costs no longer line the slots up and have no closed form here (``simulate_chimera`` them)."""
    _chimera("chimera_bubble_time", p)
    number("chimera_bubble_time", "forward", forward)
    number("chimera_bubble_time", "backward", backward)
    if not math.isclose(forward, backward):
        raise ValueError(f"Chimera's bubble has a formula for F = B only (Li & Hoefler 2021, equal slots), got "
                         f"F {forward}, B {backward}; simulate_chimera(p, m, F, B) gives it for any costs")
    return (p - 2) * forward


def chimera_bubble_fraction(p: int, m: int) -> float:
    """Chimera's idle share of the step with equal slots, ``(p - 2)/(2m + p - 2)`` (1F1B: (p-1)/(m+p-1))."""
    _chimera("chimera_bubble_fraction", p)
    whole("chimera_bubble_fraction", "m", m)
    return (p - 2) / (2 * m + p - 2)


def weight_versions(kind: str, p: int, rank: int) -> int:
    """Weight versions stage ``rank`` holds at once: PipeDream ``p - r``, PipeDream-2BW (``"2bw"``) 2,
    every synchronous schedule 1."""
    one_of("weight_versions", "kind", kind, RUNTIME_KINDS)
    index("weight_versions", "rank", rank, whole("weight_versions", "p", p), "ranks")
    return p - rank if kind == "pipedream" else 2 if kind == "2bw" else 1


def bubble_formula(kind: str) -> str:
    """The bubble formula as text, for printing next to its value."""
    _check("bubble_formula", kind)
    return {"naive": "(p-1)/p", "gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
            "interleaved": "(p-1)/(v m+p-1)", "zb-h1": "(p-1)/(3m+p-1)",
            "zb-h2": "(p-1)/(3m+p-1)", "zb-v": "(p-1)/(6m+p-1)", "dualpipev": "(p-1)/(6m+p-1)"}[kind]


def stage_owner(p: int, v: int = 1, kind: str = "interleaved") -> list[int]:
    """Rank of each virtual stage: stage ``s`` on rank ``s mod p`` (``p v`` stages, interleaved), or
    ZB-V's V (``kind="zb-v"`` or ``"dualpipev"``, 2p stages): stage ``s`` on rank ``s`` for ``s < p``, else
    ``2p - 1 - s``."""
    one_of("stage_owner", "kind", kind, ("interleaved", "zb-v", "dualpipev"))
    wholes("stage_owner", p=p, v=v)
    if kind in ("zb-v", "dualpipev"):
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def send_bytes(owner: Sequence[int], m: int, boundary_bytes: int | Sequence[int]) -> list[int]:
    """Bytes each rank sends in one step. ``owner[s]``: rank of stage s; ``boundary_bytes``: one
    micro-batch's activation across each of the ``S - 1`` boundaries (one int for all). A boundary
    between two ranks carries ``m`` activations (sent by the earlier stage's rank) and ``m``
    gradients (sent by the later one's). For ``p`` ranks in a line (v = 1) and ``A`` bytes: the
    first and the last rank send ``m A``, the others ``2 m A``."""
    counts("send_bytes", "owner", owner)
    whole("send_bytes", "m", m)
    n = len(owner) - 1
    sizes = [boundary_bytes] * n if isinstance(boundary_bytes, Integral) else list(boundary_bytes)
    if len(sizes) != n or any(not isinstance(b, Integral) or b < 0 for b in sizes):
        raise ValueError(f"pipeline: boundary_bytes needs one non-negative int per stage boundary "
                         f"({n} for {len(owner)} stages) or one int for all, got {boundary_bytes!r}")
    out = [0] * (max(owner) + 1)
    for s, size in enumerate(sizes):
        if owner[s] != owner[s + 1]:
            out[owner[s]] += m * int(size)
            out[owner[s + 1]] += m * int(size)
    return out
