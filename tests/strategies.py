"""Composable hypothesis strategies shared by the tests (in the style of minitorch's): arrays and shapes
for autograd, and every paradigm's configurations (``<paradigm>_configs``) with ``mpi_jobs`` for mpiexec."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minipar.cost import ALLREDUCE_ALGORITHMS
from minipar.parallel.pipeline import KINDS
from minipar.parallel.pipeline.generators import FIXED_CHUNKS

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SCALE = 10 if THOROUGH else 1


def budget(n: int) -> settings:
    """``@budget(n)``: this test runs ``n`` drawn examples by default and ``10 n`` under the thorough profile.

    For an ``mpiexec`` property, ``n`` counts jobs; each job runs a list of drawn configurations.
    """
    return settings(max_examples=n * SCALE)


def thorough_only(why: str) -> pytest.MarkDecorator:
    """Mark a long demonstration that repeats what default-profile tests prove: ``make thorough`` runs it,
    ``make test`` reports it skipped with ``why`` (the tests that cover it there)."""
    return pytest.mark.skipif(not THOROUGH, reason=f"long demonstration, run by make thorough: {why}")


def shapes(min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 5) -> st.SearchStrategy:
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


@st.composite
def broadcastable_pair(draw: st.DrawFn, max_dims: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast together (either side may have 1s or fewer leading dims)."""
    shapes_ = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=max_dims, min_side=1, max_side=4))
    return shapes_.input_shapes


def arrays(shape: tuple[int, ...], low: float = -2.0, high: float = 2.0, dtype: type = np.float64) -> st.SearchStrategy:
    """Arrays with well-scaled finite values (central differences stay accurate)."""
    def make(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).uniform(low, high, size=shape).astype(dtype)

    return st.integers(0, 2**32 - 1).map(make)


def array(draw: st.DrawFn, shape: tuple[int, ...], **kw: float) -> np.ndarray:
    return draw(arrays(shape, **kw))


@st.composite
def matmul_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(a, b) shapes for batched matmul with broadcasting over leading dims."""
    n, k, m = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    batch = draw(st.sampled_from([(), (2,), (3, 1), (1, 2)]))
    other = draw(st.sampled_from([(), batch[-1:] if batch else ()]))
    return (*batch, n, k), (*other, k, m)


# ---- paradigm configurations ------------------------------------------------------------------------
# Valid by construction (multiples, not filters): every draw is a configuration the paradigm accepts.
# An mpiexec property draws ``mpi_jobs``: a world size and a list of configurations for it, all run in
# one job (``minipar.testing.run_each``), so the start-up cost is paid once per job. Hypothesis tries
# the simplest draw first, so ``budget(1)`` on such a property means the simplest job (p = 2, minimal
# configurations) beside its ``@example`` jobs; the thorough profile adds random jobs.


def mpi_jobs(configs: Callable[[int], st.SearchStrategy], worlds: tuple[int, int] = (2, 4), min_size: int = 2,
             max_size: int = 3) -> st.SearchStrategy:
    """``(world size, [configurations for that world])``: one ``mpiexec`` job."""
    return st.integers(*worlds).flatmap(
        lambda p: st.tuples(st.just(p), st.lists(configs(p), min_size=min_size, max_size=max_size)))


@st.composite
def ddp_configs(draw: st.DrawFn, world: int) -> dict:
    """One DDP run on ``world`` ranks: an MLP or a tiny GPT, a bucket cap (one bucket per parameter up
    to one for the whole model), any all-reduce algorithm, gradient accumulation; the global batch is
    a multiple of ``world x accumulation``."""
    acc = draw(st.integers(1, 3))
    return {"model": draw(st.sampled_from(["mlp", "gpt"])), "seed": draw(st.integers(0, 10_000)),
            "cap": draw(st.sampled_from([64, 400, 2048, 1 << 20])),
            "algorithm": draw(st.sampled_from(ALLREDUCE_ALGORITHMS)),
            "accumulation": acc, "batch": world * acc * draw(st.integers(1, 2)),
            "opt": draw(st.sampled_from(["adamw", "sgd"]))}


@st.composite
def pipeline_configs(draw: st.DrawFn, p: int | None = None, kind: str | None = None) -> dict:
    """One pipeline run on ``p`` ranks (2-4 when not given): a schedule kind, ``m`` micro-batches (a
    multiple of ``p`` for interleaved, with ``v`` = 2-3 chunks; zb-v: its ``v`` = 2, any m; dualpipev: v = 2,
    m = 2p..3p), 1-2 layers
    per stage (given or split by the runtime), an MLP (``widths``) or a tiny GPT, seed and optimizer."""
    p = draw(st.integers(2, 4)) if p is None else p
    kind = draw(st.sampled_from(KINDS)) if kind is None else kind
    v = draw(st.integers(2, 3)) if kind == "interleaved" else FIXED_CHUNKS.get(kind, 1)
    m = p * draw(st.integers(1, 2)) if kind == "interleaved" else draw(st.integers(1, 2 * p))
    m = draw(st.integers(2 * p, 3 * p)) if kind == "dualpipev" else m  # it needs m >= 2p
    counts = draw(st.lists(st.integers(1, 2), min_size=p * v, max_size=p * v))
    return {"kind": kind, "m": m, "v": v, "model": draw(st.sampled_from(["mlp", "gpt"])), "counts": counts,
            "given_counts": draw(st.booleans()), "mb_size": draw(st.integers(1, 2)),
            "widths": draw(st.lists(st.integers(1, 4), min_size=2 * p * v + 1, max_size=2 * p * v + 1)),
            "seed": draw(st.integers(0, 1000)), "opt": draw(st.sampled_from(["adamw", "sgd"]))}


@st.composite
def tp_configs(draw: st.DrawFn, t: int | None = None, max_t: int = 4) -> dict:
    """A GPT and batch that ``t`` (1..max_t when not given) divides: heads, d_ff, vocabulary, and the
    sequence under sequence parallelism."""
    t = draw(st.integers(1, max_t)) if t is None else t
    sp = draw(st.booleans())
    heads = t * draw(st.integers(1, 2))
    seq = t * draw(st.integers(1, 2)) if sp else draw(st.integers(1, 5))
    return {"t": t, "sp": sp, "heads": heads, "d": heads * draw(st.sampled_from([2, 3])),
            "ff": t * draw(st.integers(1, 3)), "vocab": t * draw(st.integers(2, 4)), "seq": seq,
            "batch": draw(st.integers(1, 2)), "layers": draw(st.integers(1, 2)),
            "seed": draw(st.integers(0, 2**16)), "opt": draw(st.sampled_from(["adamw", "sgd"]))}


@st.composite
def ps_configs(draw: st.DrawFn, world: int) -> dict:
    """A synchronous parameter-server run on ``world`` ranks: 1..world-1 servers (the rest workers),
    steps, seed, server optimizer. The tests' global batch of 12 divides over 1-3 workers."""
    return {"n_servers": draw(st.integers(1, world - 1)), "steps": draw(st.integers(1, 4)),
            "seed": draw(st.integers(0, 1000)), "opt": draw(st.sampled_from(["sgd", "adamw"]))}


SP_WORLDS = (1, 2, 3, 4)  # 3: an odd ring (a block passes through every other rank)


def sp_grid(method: str, p: int, ulysses: int) -> tuple[int, int]:
    """(P_u, P_r) of ``method`` on ``p`` ranks; ``ulysses`` (a divisor of ``p``) is used by "hybrid"."""
    return {"ulysses": (p, 1), "ring": (1, p)}.get(method, (ulysses, p // ulysses))


@st.composite
def sp_configs(draw: st.DrawFn, p: int | None = None, method: str | None = None) -> dict:
    """A sequence-parallel GPT and batch on ``p`` ranks (1-4 when not given): ``method``
    (Ulysses P_u = P, ring P_r = P, or a hybrid grid P_u x P_r: 1x4, 2x2, 4x1, 1x3, 3x1, 1x2, 2x1, 1x1), the
    degrees the hybrid constructor is told (``given``: P_u, P_r or both), heads a multiple of P_u,
    head size 1-4, a sequence (<= 16) that is a multiple of P and, zigzag, of 2 P_r; causal or not.
    Not d_model = 1: a 1-wide layer norm outputs its bias, so the model is a constant whose exactly-zero
    gradients (rounded differently by each side) AdamW magnifies by lr / eps at every step."""
    p = draw(st.sampled_from(SP_WORLDS)) if p is None else p
    method = draw(st.sampled_from(["ulysses", "ring", "hybrid"])) if method is None else method
    pu, pr = sp_grid(method, p, draw(st.sampled_from([u for u in SP_WORLDS if p % u == 0])))
    zigzag = draw(st.booleans())
    unit = np.lcm(p, 2 * pr) if zigzag else p
    heads = pu * draw(st.integers(1, 2))
    d = heads * draw(st.integers(2 if heads == 1 else 1, 4))  # d_model >= 2: see the docstring
    return {"p": p, "method": method, "pu": pu, "pr": pr, "given": draw(st.sampled_from(["ulysses", "ring", "both"])),
            "zigzag": zigzag, "causal": draw(st.booleans()), "seq": int(unit) * draw(st.integers(1, 16 // unit)),
            "heads": heads, "d": d, "ff": draw(st.sampled_from([None, d, 2 * d])), "vocab": draw(st.integers(2, 8)),
            "batch": draw(st.integers(1, 2)), "layers": draw(st.integers(1, 2)), "seed": draw(st.integers(0, 2**16))}


def sp_jobs(min_size: int = 2, max_size: int = 3) -> st.SearchStrategy:
    """``mpi_jobs`` for sequence parallelism: 2 or 4 ranks, the world sizes ``sp_configs`` draws that need
    more than one process."""
    return st.sampled_from([2, 4]).flatmap(
        lambda p: st.tuples(st.just(p), st.lists(sp_configs(p), min_size=min_size, max_size=max_size)))


ZERO_MODES = ("stage1", "stage2", "fsdp")


@st.composite
def zero_configs(draw: st.DrawFn, world: int | None = None) -> dict:
    """A ZeRO / FSDP run on ``world`` ranks (1-4 when not given): stage 1, 2 or FSDP (reshard after
    forward, prefetch, built under ``nn.deferred()`` or whole, each on or off), a bucket cap for the
    stages (one or a few parameters per bucket up to one bucket), a tiny GPT whose d_model (2-9, odd
    ones too) rarely makes a group a multiple of N, so padding is the rule; global batch a multiple of
    N; 2-3 AdamW steps. d_model >= 2: see ``sp_configs``."""
    world = draw(st.integers(1, 4)) if world is None else world
    mode = draw(st.sampled_from(ZERO_MODES))
    fsdp = mode == "fsdp"
    heads = draw(st.integers(1, 3))
    return {"mode": mode, "world": world, "cap": draw(st.sampled_from([200, 700, 2000, 1 << 20])) if not fsdp else 0,
            "reshard": draw(st.booleans()) if fsdp else True, "prefetch": draw(st.booleans()) if fsdp else True,
            "deferred": draw(st.booleans()) if fsdp else False, "vocab": draw(st.integers(2, 7)),
            "seq": draw(st.integers(1, 4)), "d": heads * draw(st.integers(2 if heads == 1 else 1, 3)), "heads": heads,
            "layers": draw(st.integers(1, 2)), "batch": world * draw(st.integers(1, 2)),
            "steps": draw(st.integers(2, 3)), "seed": draw(st.integers(0, 2**16))}


def _factor(draw: st.DrawFn, n: int, axes: tuple[str, ...]) -> dict[str, int]:
    """Degrees for ``axes`` whose product is ``n`` (each drawn among the divisors left)."""
    out = {}
    for a in axes[:-1]:
        out[a] = draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0]))
        n //= out[a]
    out[axes[-1]] = n
    return out


@st.composite
def hybrid_configs(draw: st.DrawFn, world: int) -> dict:
    """One ``HybridGPT`` run on ``world`` ranks: every mesh whose product is ``world`` (tensor or
    sequence parallelism per stage, not both), a schedule (interleaved when the blocks allow two
    chunks per rank), Megatron-SP on or off, a sequence-parallel method, DDP or ZeRO-1 on dp x sp.
    Heads, widths, vocabulary and sequence are multiples of tp and sp by construction."""
    inner = draw(st.sampled_from(["tp", "sp"]))
    degrees = _factor(draw, world, ("pp", "dp", inner))
    t, s, pp = degrees.get("tp", 1), degrees.get("sp", 1), degrees["pp"]
    split = t * s
    heads = split * draw(st.integers(1, 2))
    d = heads * draw(st.sampled_from([2, 4]))
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "naive", "interleaved"] if pp > 1 else ["1f1b", "gpipe"]))
    chunks = 2 if schedule == "interleaved" else 1
    m = draw(st.sampled_from([pp, 2 * pp])) if schedule == "interleaved" else draw(st.integers(1, 3))
    layers = pp * chunks + draw(st.integers(0, 1))
    method = draw(st.sampled_from(["ulysses", "ring", "hybrid"])) if s > 1 else "ulysses"
    if method == "hybrid" and s < 4:
        method = "ring"
    return {"degrees": degrees, "vocab": split * draw(st.integers(3, 5)), "seq": 2 * split, "d": d, "heads": heads,
            "layers": layers, "batch": degrees["dp"] * m * draw(st.integers(1, 2)), "schedule": schedule,
            "microbatches": m, "chunks": chunks, "sequence_parallel": t > 1 and draw(st.booleans()),
            "sp_method": method, "ulysses": 2 if method == "hybrid" else None,
            "zero_stage": draw(st.sampled_from([0, 1])), "seed": draw(st.integers(0, 2**16)),
            "zigzag": s > 1 and draw(st.booleans())}
