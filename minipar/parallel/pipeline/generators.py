"""Schedule generators: naive model parallelism, GPipe, 1F1B and interleaved 1F1B.

Each returns ``{rank: [Action, ...]}`` of compute actions only (``F``/``B``); ``lower`` adds the
sends and receives. p = number of pipeline ranks, m = micro-batches, v = model chunks per rank.
With F and B the times of one stage's forward and backward (uniform stages, no latency):

========================  =========================  ===========================  ====================
schedule                  step time (makespan)        bubble share of the step     peak stash, rank r
========================  =========================  ===========================  ====================
naive                     m p (F + B)                 (p - 1) / p                  1
GPipe                     (m + p - 1)(F + B)          (p - 1) / (m + p - 1)        m
1F1B (PipeDream-Flush)    (m + p - 1)(F + B)          (p - 1) / (m + p - 1)        p - r
interleaved 1F1B          (v m + p - 1)(F + B)        (p - 1) / (v m + p - 1)      see ``interleaved``
========================  =========================  ===========================  ====================

(For interleaved, F and B are the times of one *chunk*, 1/v of a rank's share of the model, so the
bubble measured against the ideal time, (p - 1)/(v m), is the 1F1B bubble (p - 1)/m divided by v:
Narayanan et al. 2021, section 2.2.2.) Building a schedule costs O(p v m).
"""

from __future__ import annotations

from collections.abc import Callable

from . import dualpipe, zero_bubble
from .schedule import Action, Schedule, bwd, fwd


def naive(p: int, m: int) -> dict[int, list[Action]]:
    """Plain model parallelism: one micro-batch in flight. Every rank runs F then B of micro-batch 0,
    then of 1, ...; rank 0 can start micro-batch i + 1 only after micro-batch i's backward came all
    the way back, so only one rank is ever busy."""
    return {r: [a for i in range(m) for a in (fwd(r, i), bwd(r, i))] for r in range(p)}


def gpipe(p: int, m: int) -> dict[int, list[Action]]:
    """GPipe (Huang et al. 2018): all m forwards, then all m backwards (a pipeline flush).

    Backwards run in micro-batch order 0..m-1, as in Narayanan et al. 2021 (Figure 3) and
    ``torch.distributed.pipelining.ScheduleGPipe``; GPipe's own Figure 2 draws them in reverse,
    which has the same makespan and stash. Every rank stashes all m micro-batches."""
    return {r: [fwd(r, i) for i in range(m)] + [bwd(r, i) for i in range(m)] for r in range(p)}


def one_f_one_b(p: int, m: int) -> dict[int, list[Action]]:
    """1F1B with flush (PipeDream-Flush, Narayanan et al. 2021 section 2.2.1; DAPPLE).

    Rank r runs min(p - 1 - r, m) warm-up forwards, then alternates one forward and one backward
    (steady state), then runs the remaining backwards (cool-down). At most p - r micro-batches are
    stashed on rank r instead of GPipe's m; the bubble is the same."""
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [fwd(r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [fwd(r, warm + i), bwd(r, i)]
        acts += [bwd(r, i) for i in range(m - warm, m)]
        out[r] = acts
    return out


def interleaved(p: int, m: int, v: int) -> dict[int, list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021 section 2.2.2), in Megatron-LM's order
    (``forward_backward_pipelining_with_interleaving``).

    Rank r holds chunks c = 0..v-1, i.e. virtual stages c p + r. It walks v m "virtual
    micro-batches" k: micro-batches go through the chunks in groups of p, so forward k is chunk
    (k mod p v) // p on micro-batch (k // p v) p + k mod p, and backward k uses the chunks in reverse
    (v - 1 - that chunk). Warm-up: min(2 (p - r - 1) + (v - 1) p, v m) forwards, or all v m of them
    when m == p (Megatron-LM before its November 2024 change 4295be1a6c then runs all forwards, then
    all backwards); steady state: forward k + warm-up then backward k; cool-down: the remaining
    backwards. Requires m % p == 0.
    With v = 1 Megatron runs plain 1F1B, and so does this.

    Peak stash on rank r: min(2 (p - r - 1) + (v - 1) p + 1, v m) (chunk, micro-batch) pairs (v m
    when m == p), each holding a chunk's activations (1/v of a rank's share): the price of the
    smaller bubble."""
    if v == 1:
        return one_f_one_b(p, m)
    total = v * m

    def virtual(k: int, forward: bool) -> Action:
        in_group = k % (p * v)
        chunk = in_group // p
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return Action(chunk * p + r, "F" if forward else "B", mb)

    out = {}
    for r in range(p):
        warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [virtual(k, True) for k in range(warm)]
        for k in range(total - warm):
            acts += [virtual(k + warm, True), virtual(k, False)]
        acts += [virtual(k, False) for k in range(total - warm, total)]
        out[r] = acts
    return out


# kind -> generator(p, m, v): a new schedule is a function and one entry here (its own checks raise
# ValueError inside it, saying what to change)
GENERATORS: dict[str, Callable[[int, int, int], dict[int, list[Action]]]] = {
    "naive": lambda p, m, v: naive(p, m),
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": lambda p, m, v: interleaved(p, m, v),
    "zb-h1": lambda p, m, v: zero_bubble.zb_h1(p, m),
    "zb-h2": lambda p, m, v: zero_bubble.zb_h2(p, m),
    "zb-v": lambda p, m, v: zero_bubble.zb_v(p, m),
    "dualpipev": lambda p, m, v: dualpipe.dualpipe_v(p, m),
}
KINDS = tuple(GENERATORS)
CHUNKED = ("interleaved",)  # kinds that take chunks=v > 1
FIXED_CHUNKS = {"zb-v": 2, "dualpipev": 2}  # kinds whose placement fixes v (chunks=1, the default, means that v)


def _check_int(name: str, value: object, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}; {hint}")
    return value


def make_schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """``{rank: [action, ...]}`` for ``kind`` in ``KINDS`` ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", ...).

    ``stages`` is the number of pipeline ranks p, ``microbatches`` is m, ``chunks`` is v (model
    chunks per rank: interleaved; zb-v and dualpipev have 2, given 1 or 2). Bad configurations raise ``ValueError``
    saying what to change.
    """
    kind_l = kind.lower() if isinstance(kind, str) else kind
    if kind_l not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; use one of {', '.join(KINDS)}")
    p = _check_int("stages", stages, "pass the number of pipeline ranks")
    m = _check_int("microbatches", microbatches, "pass the number of micro-batches per step")
    v = _check_int("chunks", chunks, "pass the number of model chunks per rank")
    if p < 1:
        raise ValueError(f"stages must be >= 1, got {p}; a pipeline needs at least one rank")
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m}; split the batch into at least one micro-batch")
    if v < 1:
        raise ValueError(f"chunks must be >= 1, got {v}; each rank holds at least one model chunk")
    if kind_l in FIXED_CHUNKS:
        if v not in (1, FIXED_CHUNKS[kind_l]):
            raise ValueError(f"{kind!r} places exactly {FIXED_CHUNKS[kind_l]} model chunks on every rank, got "
                             f"chunks={v}; use chunks={FIXED_CHUNKS[kind_l]} (or leave the default)")
        v = FIXED_CHUNKS[kind_l]
    elif kind_l not in CHUNKED and v != 1:
        raise ValueError(f"chunks={v} only applies to the {', '.join(map(repr, CHUNKED))} schedule; use chunks=1 "
                         f"with {kind!r}, or kind='interleaved'")
    if kind_l == "interleaved" and m % p != 0:
        lo, hi = (m // p) * p, (m // p + 1) * p
        hint = f"{lo} or {hi}" if lo > 0 else f"{hi}"
        raise ValueError(f"interleaved 1F1B needs microbatches to be a multiple of stages: m={m} with "
                         f"p={p}; use microbatches={hint}")
    acts = GENERATORS[kind_l](p, m, v)
    return Schedule(acts, kind=kind_l, stages=p, microbatches=m, chunks=v)
