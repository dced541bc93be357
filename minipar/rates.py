"""What a rank's compute costs on this machine, in the terms ``minipar.cost.perf`` charges it: FLOP/s
on a GPT's matmul shapes, ``gamma`` for its memory-bound work, the per-op overhead, and the
optimizer's per-tensor and per-byte costs (``minipar.cost.overhead``). ``minipar calibrate``
(``calibrate.measure``) measures them in wall-clock time with every rank busy; ``compute_rates``
in each thread's CPU time, the terms in which a replay (``minipar.replay``) charges a span.

    rates = measure_rates(comm, gpt, repeats, clock="cpu")   # collective: medians over every rank

- FLOP/s: the matmuls of one block and the head of the GPT ``gpt`` (``gpt_matmul_shapes``), timed.
- Per-op overhead and gamma: minipar's hybrid GPT (``parallel.hybrid.HybridGPT`` on a one-rank mesh,
  the code perf's counts describe) traced forward and backward at two sizes, the given GPT and
  ``TINY`` (the same layers, every width 1-2), the CPU (or wall) time of its F and B spans (a replay
  charges spans, not the Python between them). Each size's time less its matmuls' (its FLOPs at the
  rate measured on its own shapes) is ``N op_seconds + B gamma / 3`` with ``N`` its autograd ops
  (``overhead.stage_ops``, the same at both sizes) and ``B`` the bytes ``perf.memory_traffic_bytes``
  counts: a line in ``B / N`` whose intercept is ``op_seconds`` and whose slope is ``gamma / 3``
  (``fit_overheads``). At ``TINY`` the time is almost all overhead: that separates the two.
- Optimizer: ``AdamW.step`` over ``OPT_SMALL`` (many tiny tensors) and ``OPT_LARGE`` (a few large
  ones): per tensor, ``tensor_seconds + 32 n optimizer_gamma`` for ``n`` float64 numbers (parameter,
  gradient, two moments): a line in ``32 n`` (``fit_optimizer``).

For a replay of a recorded run (lesson 8): ``message_overhead`` measures the CPU a replay charges a
collective call and each of its message steps, and ``replay_cluster`` puts both and ``compute_rates``
on a network's links: one cluster for ``perf.predict`` and ``minipar.replay`` alike.

Every fit is ``fit_line``: least squares on relative errors, a negative intercept or slope refitted
as 0. Repetitions start after one warm-up; medians over repetitions and ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from minipar import trace
from minipar.cost.cluster import Cluster, Link
from minipar.cost.overhead import stage_ops
from minipar.cost.perf import Layout, ModelSpec, memory_traffic_bytes

GPT = {"batch": 4, "seq": 64, "d_model": 128, "heads": 4, "layers": 4, "vocab": 256}  # a small GPT (per rank)
TINY = {"batch": 1, "seq": 2, "d_model": 2, "heads": 1, "vocab": 2, "d_ff": 2}  # every width 1-2: overhead only
OPT_SMALL, OPT_LARGE = (64, 8), (4, 2**15)  # (tensors, float64 numbers each) of the optimizer's two timings
MESSAGE_REPEATS = 4  # traced steps of each model message_overhead replays
RATE_REPEATS = 20  # timings of each of compute_rates' measurements per rank, for replay_cluster
STATE_BYTES = 32  # float64 AdamW: parameter, gradient, two moments (perf: w + w + K, K = 2w)
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` minimising ``sum(((a + b x) - y) / y)^2`` (relative errors), exact on data on a line.
    A negative intercept (noise) is refitted with ``a = 0``, a negative slope with ``b = 0``. Needs
    at least 2 different ``x`` and finite ``y > 0``."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"fit_line: x and y must be two lists of equal length, got {xs.shape} and {ys.shape}")
    if len(np.unique(xs)) < 2:
        raise ValueError(f"fit_line needs at least 2 different x, got {sorted(set(xs.tolist()))}")
    if not (np.all(np.isfinite(ys)) and np.all(ys > 0) and np.all(xs >= 0)):
        raise ValueError("fit_line: y must be finite and > 0, x >= 0")
    w = 1 / ys**2
    sw, sx, sxx, sy, sxy = w.sum(), (w * xs).sum(), (w * xs * xs).sum(), (w * ys).sum(), (w * xs * ys).sum()
    det = sw * sxx - sx * sx
    a, b = (sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det
    if a < 0:
        a, b = 0.0, sxy / sxx
    if b < 0:
        a, b = sy / sw, 0.0
    return float(a), float(b)


def fit_overheads(ops: float, traffic: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(op_seconds, gamma)`` with ``seconds[k] = ops x op_seconds + traffic[k] x gamma / 3`` (the
    matmuls' time already taken out) over sizes ``k`` that run the same ``ops``."""
    op_seconds, slope = fit_line([b / ops for b in traffic], [t / ops for t in seconds])
    return op_seconds, 3 * slope


def fit_optimizer(tensors: Sequence[int], numbers: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``(tensor_seconds, optimizer_gamma)`` with ``seconds[k] = tensors[k] (tensor_seconds +
    STATE_BYTES numbers[k] optimizer_gamma)``: AdamW over ``tensors[k]`` tensors of ``numbers[k]``."""
    return fit_line([STATE_BYTES * n for n in numbers], [t / k for t, k in zip(seconds, tensors, strict=True)])


def gpt_matmul_shapes(tokens: int, d_model: int, vocab: int, d_ff: int | None = None) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of every matmul of one transformer block and the vocabulary head, forward
    (``x (m,k) @ w (k,n)``) and backward (``dy @ w.T`` and ``x.T @ dy``), for ``tokens`` rows; MLP
    width ``d_ff`` (``4 d_model`` by default)."""
    h, f = d_model, d_ff or 4 * d_model
    forward = [(tokens, h, h)] * 4 + [(tokens, h, f), (tokens, f, h), (tokens, h, vocab)]
    out = []
    for m, k, n in forward:
        out += [(m, k, n), (m, n, k), (k, m, n)]
    return out


def matmul_flops(shapes: Sequence[tuple[int, int, int]]) -> int:
    """Floating-point operations of the matmuls ``(m, k, n)``: ``2 m k n`` each."""
    return sum(2 * m * k * n for m, k, n in shapes)


def median_times(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """``repeats`` timings of ``fn`` on ``clock`` after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def pooled_median(comm: Any, samples: Sequence[float]) -> float:
    """Median of every rank's samples together (on every rank)."""
    return float(np.median(np.concatenate([np.asarray(s) for s in comm.allgather_object(list(samples))])))


def matmul_times(shapes: Sequence[tuple[int, int, int]], repeats: int, seed: int,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds per pass over ``shapes`` (float64, operands made once)."""
    rng = np.random.default_rng(seed)
    pairs = [(rng.standard_normal((m, k)), rng.standard_normal((k, n))) for m, k, n in shapes]

    def once() -> None:
        for a, b in pairs:
            a @ b

    return median_times(once, repeats, clock)


def gpt_spec(gpt: dict[str, int]) -> tuple[ModelSpec, Layout]:
    """The ``ModelSpec`` and ``Layout`` (float64, one micro-batch, one rank) of the GPT shape ``gpt``."""
    model = ModelSpec(layers=gpt["layers"], hidden=gpt["d_model"], heads=gpt["heads"], seq=gpt["seq"],
                      vocab=gpt["vocab"], ffn=gpt.get("d_ff"), bytes_per_number=8)
    return model, Layout(micro_batch=gpt["batch"], global_batch=gpt["batch"])


def step_span_times(one: Any, gpt: dict[str, int], repeats: int, clock: str, seed: int = 0) -> list[float]:
    """Seconds in the F and B spans of one traced forward and backward of ``HybridGPT`` on the
    one-rank communicator ``one`` (CPU or wall time of the spans), ``repeats`` times after a warm-up."""
    from minipar.mesh import DeviceMesh
    from minipar.parallel.hybrid import HybridGPT

    model = HybridGPT(DeviceMesh(one, pp=1, dp=1, sp=1, tp=1), gpt["vocab"], gpt["seq"], gpt["d_model"],
                      gpt["heads"], gpt["layers"], gpt.get("d_ff"), seed=seed)
    idx = np.random.default_rng(seed).integers(0, gpt["vocab"], (gpt["batch"], gpt["seq"]))
    out = []
    for _ in range(repeats + 1):
        with trace.recording(one.rank) as rec:
            model.forward_backward(idx, np.roll(idx, -1, axis=1))
        spans = [e for e in rec.events if e.kind == "compute" and e.name in ("F", "B")]
        out.append(sum((e.c1 - e.c0) if clock == "cpu" else e.duration for e in spans))  # type: ignore[operator]
    return out[1:]


def optimizer_times(tensors: int, numbers: int, repeats: int, clock: Callable[[], float]) -> list[float]:
    """Seconds of one ``AdamW.step`` over ``tensors`` float64 tensors of ``numbers`` numbers each."""
    from minipar.autograd import Tensor
    from minipar.optim import AdamW

    params = [Tensor(np.full(numbers, 0.5), requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = np.full(numbers, 1e-3)
    return median_times(AdamW(params, lr=1e-3).step, repeats, clock)


def add_gamma(repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per byte of ``np.add`` on 1 MiB arrays: a floor for gamma."""
    x, y = np.ones(2**17), np.ones(2**17)
    return float(np.median(median_times(lambda: np.add(x, y, out=x), repeats, clock))) / x.nbytes


@dataclass(frozen=True)
class Rates:
    """What ``measure_rates`` found (seconds, FLOP/s), and the raw times its fits used."""

    flops: float  # FLOP/s on the GPT's matmul shapes
    gamma: float  # seconds per byte of memory-bound work (perf charges gamma / 3 a byte moved)
    op_seconds: float  # per autograd op, forward and backward
    tensor_seconds: float  # per parameter tensor per optimizer step
    optimizer_gamma: float  # per byte of parameters, gradients and moments the optimizer streams
    step_seconds: tuple[float, float]  # the hybrid GPT's F and B spans at TINY and at the GPT shape
    optimizer_seconds: tuple[float, float]  # AdamW over OPT_SMALL and OPT_LARGE


def measure_rates(comm: Any, gpt: dict[str, int] | None = None, repeats: int = 10, clock: str = "cpu") -> Rates:
    """Every rank of ``comm`` times at once (collective); medians over repetitions and ranks, on
    every rank (module docstring). ``clock``: "cpu" (each thread's CPU time) or "wall"."""
    gpt = gpt or GPT
    tick, one = CLOCKS[clock], comm.split(comm.rank)
    sizes = ({**TINY, "layers": gpt["layers"]}, gpt)
    comm.barrier()
    steps, matmuls, traffic = [], [], []
    for g in sizes:
        model, layout = gpt_spec(g)
        shapes = gpt_matmul_shapes(g["batch"] * g["seq"], g["d_model"], g["vocab"], g.get("d_ff"))
        rate = matmul_flops(shapes) / pooled_median(comm, matmul_times(shapes, repeats, comm.rank, tick))
        steps.append(pooled_median(comm, step_span_times(one, g, repeats, clock, seed=comm.rank)))
        matmuls.append(model.step_flops(g["batch"]) / rate)
        traffic.append(model.layers * memory_traffic_bytes(model, layout))
    ops = stage_ops([gpt["layers"]], False)[0]
    # the matmuls' share comes from a rate timed apart, so on a loaded machine a step can come out shorter
    # than it: such a size is floored at a microsecond, read as "no overhead measurable here"
    rest = [max(t - mm, 1e-6) for t, mm in zip(steps, matmuls, strict=True)]
    op_seconds, gamma = fit_overheads(ops, traffic, rest)
    opts = [pooled_median(comm, optimizer_times(k, n, repeats, tick)) for k, n in (OPT_SMALL, OPT_LARGE)]
    tensor_seconds, optimizer_gamma = fit_optimizer([OPT_SMALL[0], OPT_LARGE[0]], [OPT_SMALL[1], OPT_LARGE[1]], opts)
    return Rates(rate, gamma, op_seconds, tensor_seconds, optimizer_gamma, (steps[0], steps[1]), (opts[0], opts[1]))


def compute_rates(comm: Any, gpt: dict[str, int] | None = None, repeats: int = 10) -> Rates:
    """``measure_rates`` in each thread's CPU time (collective): one core per rank, the terms in
    which ``minipar.replay`` charges a span; gamma at least ``np.add``'s. Give ``gpt`` the shapes one
    rank computes (a tensor-parallel slice: its micro-batch, sequence shard, width, heads, vocabulary)."""
    rates = measure_rates(comm, gpt, repeats, "cpu")
    floor = pooled_median(comm, [add_gamma(repeats, time.thread_time)])
    return replace(rates, gamma=max(rates.gamma, floor))


def message_overhead(comm: Any, shard: dict[str, int], path: str | os.PathLike[str]) -> tuple[float, float]:
    """``(per call, per message step)``: the seconds of CPU a replay charges a rank for a collective
    call and for each of its steps beyond the ops around it (entering the call, resuming after its
    wait with caches others refilled; posting, completing and recording each message). Measured as
    the replay sees it, on the program lesson 8 runs, every rank at once: groups of ``t`` = 2 and 4
    ranks (2 alone below 4 ranks: then all of it per step) train the GPT whose tensor-parallel slices
    are ``shard``, traced and replayed on a network that costs nothing, and each rank ``shard`` alone
    (its one-rank collectives return at once; ``step_span_times``); per rank the difference of
    the two steps over its calls is ``call + 2 (t - 1) step`` (medians over ranks; ``fit_line``).
    Collective; the values on every rank."""
    from minipar.mesh import DeviceMesh
    from minipar.parallel.hybrid import HybridGPT
    from minipar.replay import replay  # a measurement of the replay itself (docs/architecture.md)

    free = Cluster("free", comm.size, 1.0, 1.0, 1.0, Link(0.0, 0.0), Link(0.0, 0.0), 0.0)
    sizes = [2, 4] if comm.size >= 4 else [2]
    idx = np.random.default_rng(0).integers(0, shard["vocab"], (shard["batch"], shard["seq"]))
    one = comm.split(comm.rank)
    alone = comm.allgather_object(float(np.median(step_span_times(one, shard, MESSAGE_REPEATS, "cpu"))))
    per_call = []
    for t in sizes:
        sub = comm.split(comm.rank // t)
        g = {**shard, **{k: t * shard[k] for k in ("d_model", "heads", "vocab", "d_ff")}}  # t slices of shard
        model = HybridGPT(DeviceMesh(sub, pp=1, dp=1, sp=1, tp=sub.size), g["vocab"], g["seq"], g["d_model"],
                          g["heads"], g["layers"], g["d_ff"], seed=0)
        model.forward_backward(idx, np.roll(idx, -1, axis=1))  # warm-up
        comm.barrier()
        with trace.record(path, comm):
            for _ in range(MESSAGE_REPEATS):
                model.forward_backward(idx, np.roll(idx, -1, axis=1))
        if comm.rank == 0:
            out = replay(trace.load(path), free)
            per_call.append(float(np.median([
                (_rank_seconds(out, r) - MESSAGE_REPEATS * alone[r]) / sum(e.rank == r and e.src == r and e.step == 0
                                                                    for e in out.events)
                for r in range(comm.size - comm.size % t)])))  # whole groups only
    if comm.rank:
        return comm.broadcast_object(None)
    if min(per_call) <= 0:  # the replay charged the tensor-parallel step no more than the one-rank step
        return comm.broadcast_object((0.0, 0.0))
    if len(per_call) == 1:
        return comm.broadcast_object((0.0, per_call[0] / 2))
    return comm.broadcast_object(fit_line([2 * (t - 1) for t in sizes], per_call))


def _rank_seconds(recorded: trace.Trace, rank: int) -> float:
    """First to last compute or message event of ``rank``."""
    ev = [e for e in recorded.events if e.rank == rank and e.kind in ("compute", "comm")]
    return max(e.t1 for e in ev) - min(e.t0 for e in ev)


def replay_cluster(comm: Any, network: Cluster, shard: dict[str, int], path: str | os.PathLike[str],
                   repeats: int = RATE_REPEATS) -> Cluster:
    """``network``'s links with this machine's compute in CPU time (collective, every rank at once, as
    the traced step ran): ``compute_rates`` on ``shard``, the GPT shapes one rank computes, and
    ``message_overhead``. One cluster for the prediction and the replay."""
    rates = compute_rates(comm, shard, repeats=repeats)
    call, step = message_overhead(comm, shard, path)
    return replace(network, name=f"{network.name} + this core", peak_flops=rates.flops, efficiency=1.0,
                   gamma=rates.gamma, op_seconds=rates.op_seconds, call_seconds=call, message_seconds=step,
                   tensor_seconds=rates.tensor_seconds, optimizer_gamma=rates.optimizer_gamma,
                   gemm_sms=0, gemm_curve=(),  # the rate is measured on the shard's own shapes: no GPU's waves
                   source=f"{network.name}'s links; compute in one core's CPU time on {shard}, every rank at once")
