"""``minipar calibrate``: measure this machine's alpha, beta, gamma and FLOP/s and write a cluster file.

    cluster = calibrate(comm)                    # on every rank (collective); rank 0 gets the Cluster
    m = measure(comm)                            # the same, with every raw measurement (``Measurements``)
    m = run_calibration(4, "mpi", quick=True)    # launches the ranks itself (what the CLI calls)

What is timed (``time.perf_counter``; a barrier before every measurement; the first repetition of
each is a warm-up and dropped; medians over repetitions and ranks):

1. alpha and beta: every rank sends ``n`` bytes to its right neighbour and receives ``n`` from its
   left at the same time (one step of a ring collective: pairs of ranks exchanging point to point,
   all pairs at once), for ``n`` from 8 B to 8 MiB, through the communicator's own transport (the
   ``_step`` hook the hand-written collectives are built on, so no header message). A ping-pong
   between two ranks would leave half the ranks idle at any moment: with more ranks than cores it
   would time a machine without time-sharing, while a collective or a training step keeps every
   rank busy. ``fit_alpha_beta`` fits ``t = alpha + n beta`` by least squares on relative errors
   (weights ``1/t^2``), so every fitted size weighs the same, over the sizes from ``FIT_FROM``
   (8 KiB) up: MPICH sends a message up to its eager limit at once and a larger one after a
   handshake that needs both ranks inside MPI, and with more ranks than cores that handshake waits
   for the peer to be scheduled (4 ranks on 2 cores: ~40 us below 8 KiB, ~0.2 ms from 8 KiB with
   waits that do not spin, ``watchdog.spin_for``; ~2 ms when a waiting rank spun 1 ms before
   sleeping and took the core from its peer; the cluster's ``source`` records the spin). The two
   regimes are two lines; a training step's messages (activations, gradient chunks) are on the
   second. The smaller sizes are timed and shown beside the fit, not fitted.
2. gamma: the cost of memory-bound work, which ``minipar.cost.perf`` charges as ``gamma / 3`` per
   byte moved (reducing a byte reads two and writes one) both for reductions and for the
   non-matmul work of a layer (softmax, masks, GeLU, layer norms: ``perf.memory_traffic_bytes``).
   It is measured on a small GPT (``nn.GPT``, the ``GPT`` shape below) trained forward and backward
   on ALL ranks at once, as ``perf.predict`` would charge it: ``gamma = 3 (step time - step FLOPs /
   FLOP/s) / (layers x memory_traffic_bytes)``, i.e. the time the FLOP term leaves over (layer
   norms, softmax, GeLU, the loss, the autograd's bookkeeping) per byte the model counts. A whole
   model, not one block: with 4 ranks on 2 cores the element-wise work slows ~4x against one rank
   alone (caches shared and flushed by the switches; matmuls slow 2x), more with a model's working
   set than with one block's (one block gave gamma ~2x too small for the GPT's own step). The
   optimizer step is not in it (``perf`` has no optimizer term; AdamW streams its arrays and costs
   far less per byte). Two other estimates are timed and shown, not used: the bare ``np.add``
   (``add_gamma``, a floor for gamma; 40 GB/s here, 10-50x below what numpy's unfused element-wise
   ops cost per counted byte), and the ring all-reduce's time minus its alpha-beta part
   (``reduce_gamma``; on 4 ranks on 2 cores that residual is ~10% of a time dominated by 6 alpha,
   and swung from 0.2 to 47 GB/s between runs).
3. FLOP/s: the matmuls of a small GPT's forward and backward (``gpt_matmul_shapes``: q, k, v,
   output projections, the MLP and the vocabulary head, and their gradients) timed on ALL ranks at
   once, so the time-sharing of the cores is in the number (4 ranks on 2 cores get about half a
   core each). ``peak_flops`` is one rank alone on large square matmuls (the others wait), and
   ``efficiency`` = the shared per-rank GPT-shape rate / that peak, so ``Cluster.flops`` (peak x
   efficiency) is the per-rank rate under sharing, what a local run achieves. (Should the shared
   rate beat the solo one, as it can when ranks <= cores, the peak is raised to it: efficiency 1.)

``compute_rates(gpt)`` times 3. and the GPT of 2. on one rank in its own CPU time instead: the rates of
one core per rank, as a replay (``minipar.replay``) charges compute, for ``perf.predict`` to be held
against a replay (lesson 8).

``memory_bytes`` is ``MemTotal`` of ``/proc/meminfo`` over the ranks. One machine is one node:
``gpus_per_node`` = ranks, and ``inter`` = ``intra`` (there is no second node to measure).
The values describe this machine at this rank count and backend only: the name says which, e.g.
``"this machine (host), 4 ranks, mpi"``. The threads backend times in-process threads: run it with
``OPENBLAS_NUM_THREADS=1`` set before numpy is imported, or BLAS threads share the cores too.

Hockney 1994 (the alpha-beta model); Thakur, Rabenseifner and Gropp 2005 (alpha-beta-gamma for
collectives); the ring all-reduce is Patarasuk and Yuan 2009's.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar.cost.cluster import Cluster, Link
from minipar.cost.collectives import collective_time
from minipar.cost.perf import Layout, ModelSpec, memory_traffic_bytes

SIZES = tuple(8 * 4**k for k in range(11))  # 8 B .. 8 MiB, x4
QUICK_SIZES = tuple(8 * 16**k for k in range(6))  # 8 B .. 8 MiB, x16
ALLREDUCE_SIZES = (2**16, 2**18, 2**20, 2**22)  # bytes of float64
QUICK_ALLREDUCE_SIZES = (2**16, 2**20)
GPT = {"batch": 4, "seq": 64, "d_model": 128, "heads": 4, "layers": 4, "vocab": 256}  # a small GPT (per rank)
SQUARE = 384  # the large square matmul of the solo peak
FIT_FROM = 8192  # bytes: alpha and beta are fitted on the exchanges of at least this size
QUIET_CORES = 0.1  # other programs using more cores than this during a calibration: a warning


@dataclass(frozen=True)
class Measurements:
    """Everything ``measure`` timed (seconds, bytes, FLOP/s) and the ``Cluster`` made from it."""

    ranks: int
    backend: str
    exchange: tuple[tuple[int, float], ...]  # (bytes, median seconds of one neighbour exchange)
    allreduce: tuple[tuple[int, float], ...]  # (bytes, median seconds of a ring all-reduce)
    add_gamma: float  # seconds per byte of np.add alone
    reduce_gamma: float  # seconds per byte reduced: the ring all-reduce's time minus its alpha-beta part
    gpt_seconds: float  # the GPT's forward + backward, every rank at once
    matmul_solo: float  # FLOP/s of one rank alone, square matmuls
    matmul_shared: float  # FLOP/s per rank, GPT shapes, every rank at once
    cluster: Cluster
    others_cores: float = 0.0  # cores other programs kept busy meanwhile (``busy_cpu_seconds``), nan if unknown

    def table(self) -> str:
        """The numbers as a small text table (what ``minipar calibrate`` prints)."""
        c = self.cluster
        rows = [("alpha", f"{c.intra.alpha * 1e6:.1f} us", "per message"),
                ("beta", f"{1 / c.intra.beta / 1e9:.2f} GB/s" if c.intra.beta else "inf", "1 / beta"),
                ("gamma", f"{1 / c.gamma / 1e9:.2f} GB/s", f"1 / gamma, a GPT step (np.add alone: "
                 f"{1 / self.add_gamma / 1e9:.1f} GB/s, all-reduce residual: {_rate(self.reduce_gamma)})"),
                ("GFLOP/s per rank", f"{c.flops / 1e9:.2f}",
                 f"all {self.ranks} ranks at once; one alone: {self.matmul_solo / 1e9:.2f}"),
                ("memory per rank", f"{c.memory_bytes / 2**30:.1f} GiB", "MemTotal / ranks")]
        lines = [f"{c.name}", *(f"  {a:<17}{b:>12}   {note}" for a, b, note in rows)]
        lines.append(f"  exchange step (bytes: measured us / alpha + n beta us; fitted from {FIT_FROM} B)")
        lines += [f"    {n:>9}: {t * 1e6:9.1f} / {c.intra.seconds(n) * 1e6:9.1f}" for n, t in self.exchange]
        lines.append("  ring all-reduce (bytes: measured us / model us)")
        for n, t in self.allreduce:
            model = collective_time("allreduce", "ring", n, self.ranks, c.intra.alpha, c.intra.beta, c.gamma)
            lines.append(f"    {n:>9}: {t * 1e6:9.1f} / {model * 1e6:9.1f}")
        if self.others_cores > QUIET_CORES:
            lines.append(f"  warning: other programs kept {self.others_cores:.2f} cores busy while this ran; every "
                         "number above is slower than this machine alone: rerun when it is quiet")
        return "\n".join(lines)


def _rate(seconds_per_byte: float) -> str:
    return f"{1 / seconds_per_byte / 1e9:.2f} GB/s" if seconds_per_byte > 0 else "inf"


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """``Link(alpha, beta)`` minimising ``sum(((alpha + n beta) - t) / t)^2`` (relative errors).

    Exact on data that obey ``t = alpha + n beta``. A negative intercept (noise on small messages)
    is refitted with ``alpha = 0``, a negative slope with ``beta = 0``. Needs at least 2 different
    sizes and positive times.
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"fit_alpha_beta: sizes and seconds must be two lists of equal length, got "
                         f"{n.shape} and {t.shape}")
    if len(np.unique(n)) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 different message sizes to fit alpha and beta, "
                         f"got {sorted(set(n.tolist()))}")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n >= 0)):
        raise ValueError("fit_alpha_beta: times must be finite and > 0, sizes >= 0")
    w = 1 / t**2
    sw, sn, snn, st, snt = w.sum(), (w * n).sum(), (w * n * n).sum(), (w * t).sum(), (w * n * t).sum()
    det = sw * snn - sn * sn
    alpha = (snn * st - sn * snt) / det
    beta = (sw * snt - sn * st) / det
    if alpha < 0:
        alpha, beta = 0.0, snt / snn
    if beta < 0:
        alpha, beta = st / sw, 0.0
    return Link(float(alpha), float(beta))


def fit_gamma(sizes: Sequence[float], seconds: Sequence[float], p: int, link: Link, floor: float = 0.0) -> float:
    """Seconds per byte reduced: ``(p-1)/p n gamma`` fitted (relative least squares, through zero)
    to a ring all-reduce's measured time minus ``2(p-1) alpha + 2(p-1)/p n beta``; at least ``floor``
    (``reduce_gamma`` in ``Measurements``: shown, not written to the cluster file)."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    x = (p - 1) / p * n
    resid = t - np.array([collective_time("allreduce", "ring", v, p, link.alpha, link.beta) for v in n])
    w = 1 / t**2
    gamma = float((w * x * resid).sum() / (w * x * x).sum())
    return max(gamma, floor)


def gpt_matmul_shapes(tokens: int, d_model: int, vocab: int) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of every matmul of one transformer block and the vocabulary head, forward
    (``x (m,k) @ w (k,n)``) and backward (``dy @ w.T`` and ``x.T @ dy``), for ``tokens`` rows."""
    h, f = d_model, 4 * d_model
    forward = [(tokens, h, h)] * 4 + [(tokens, h, f), (tokens, f, h), (tokens, h, vocab)]
    out = []
    for m, k, n in forward:
        out += [(m, k, n), (m, n, k), (k, m, n)]
    return out


def matmul_flops(shapes: Sequence[tuple[int, int, int]]) -> int:
    """Floating-point operations of the matmuls ``(m, k, n)``: ``2 m k n`` each."""
    return sum(2 * m * k * n for m, k, n in shapes)


def memtotal_bytes(path: str = "/proc/meminfo") -> float:
    """``MemTotal`` of ``/proc/meminfo`` in bytes (it is given in kB)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise ValueError(f"{path} has no MemTotal line")


def _median_time(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """``repeats`` timings of ``fn`` on ``clock`` after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def _pooled_median(comm: Any, samples: list[float]) -> float:
    """Median of every rank's samples together (on every rank)."""
    return float(np.median(np.concatenate([np.asarray(s) for s in comm.allgather_object(samples)])))


def _exchange(comm: Any, nbytes: int, repeats: int) -> float:
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    comm.barrier()
    return _pooled_median(comm, _median_time(lambda: comm._step([(right, send)], [(left, recv)], "calibrate",
                                                                 None, None), repeats))


def _allreduce(comm: Any, nbytes: int, repeats: int) -> float:
    x = np.ones(nbytes // 8)
    comm.barrier()
    return _pooled_median(comm, _median_time(lambda: comm.allreduce(x, algorithm="ring"), repeats))


def _matmul_rate(shapes: Sequence[tuple[int, int, int]], repeats: int, seed: int,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds per pass over ``shapes`` (float64, operands made once)."""
    rng = np.random.default_rng(seed)
    pairs = [(rng.standard_normal((m, k)), rng.standard_normal((k, n))) for m, k, n in shapes]

    def once() -> None:
        for a, b in pairs:
            a @ b

    return _median_time(once, repeats, clock)


def gpt_spec(gpt: dict[str, int]) -> tuple[ModelSpec, Layout]:
    """The ``ModelSpec`` and ``Layout`` (float64, one micro-batch, one rank) of the ``GPT`` shape."""
    model = ModelSpec(layers=gpt["layers"], hidden=gpt["d_model"], heads=gpt["heads"], seq=gpt["seq"],
                      vocab=gpt["vocab"], bytes_per_number=8)
    return model, Layout(micro_batch=gpt["batch"], global_batch=gpt["batch"])


def gamma_from_gpt(seconds: float, flops: float, gpt: dict[str, int], floor: float = 0.0) -> float:
    """``3 (seconds - step FLOPs / flops) / (layers x memory_traffic_bytes)`` of the GPT ``gpt``
    trained forward and backward in ``seconds``: the gamma with which ``perf.predict`` charges that
    step its measured time; at least ``floor``."""
    model, layout = gpt_spec(gpt)
    left = seconds - model.step_flops(gpt["batch"]) / flops
    return max(3 * left / (model.layers * memory_traffic_bytes(model, layout)), floor)


def _gpt_times(gpt: dict[str, int], repeats: int, seed: int, clock: Callable[[], float] = time.perf_counter
               ) -> list[float]:
    """Seconds of one forward and backward of ``nn.GPT`` on a ``(batch, seq)`` batch of tokens."""
    from minipar.nn import GPT as Model

    model = Model(gpt["vocab"], gpt["seq"], gpt["d_model"], gpt["heads"], gpt["layers"], seed=seed)
    params = model.parameters()
    rng = np.random.default_rng(seed)
    for q in params:
        q.data[...] = rng.standard_normal(q.data.shape) * 0.05
    idx = rng.integers(0, gpt["vocab"], (gpt["batch"], gpt["seq"]))
    targets = np.roll(idx, -1, axis=1)

    def once() -> None:
        model.zero_grad()
        model.loss(idx, targets).backward()

    return _median_time(once, repeats, clock)


def busy_cpu_seconds(path: str = "/proc/stat") -> float:
    """CPU seconds every program on the machine has used since boot (``/proc/stat``'s first line: all
    but idle and iowait); nan where there is no such file."""
    try:
        with open(path) as fh:
            ticks = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return math.nan
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _add_gamma(repeats: int) -> float:
    x, y = np.ones(2**17), np.ones(2**17)  # 1 MiB each
    return float(np.median(_median_time(lambda: np.add(x, y, out=x), repeats))) / x.nbytes


def measure(comm: Any, sizes: Sequence[int] = SIZES, repeats: int = 10,
            allreduce_sizes: Sequence[int] = ALLREDUCE_SIZES, gpt: dict[str, int] | None = None,
            square: int = SQUARE, fit_from: int = FIT_FROM) -> Measurements | None:
    """Time everything (collective: every rank calls it); rank 0 gets ``Measurements``, others None."""
    p = comm.size
    if p < 2:
        raise ValueError("calibrate needs at least 2 ranks: alpha and beta are timed on messages between ranks")
    comm.barrier()
    busy0, own0, wall0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    exchange = tuple((int(n), _exchange(comm, int(n), repeats)) for n in sizes)
    fitted = [(n, t) for n, t in exchange if n >= fit_from]
    if len(fitted) < 2:
        raise ValueError(f"calibrate: sizes {list(sizes)} hold fewer than 2 sizes >= fit_from={fit_from} B to fit "
                         f"alpha and beta on")
    link = fit_alpha_beta([n for n, _ in fitted], [t for _, t in fitted])
    allreduce = tuple((int(n), _allreduce(comm, int(n), max(3, repeats // 2))) for n in allreduce_sizes)
    add_gamma = _add_gamma(repeats)
    reduce_gamma = fit_gamma([n for n, _ in allreduce], [t for _, t in allreduce], p, link, floor=add_gamma)
    gpt = gpt or GPT
    shapes = gpt_matmul_shapes(gpt["batch"] * gpt["seq"], gpt["d_model"], gpt["vocab"])
    comm.barrier()
    shared_t = _matmul_rate(shapes, repeats, seed=comm.rank)
    shared = matmul_flops(shapes) / _pooled_median(comm, shared_t)
    comm.barrier()
    gpt_seconds = _pooled_median(comm, _gpt_times(gpt, repeats, seed=comm.rank))
    gamma = gamma_from_gpt(gpt_seconds, shared, gpt, floor=add_gamma)
    comm.barrier()
    solo = _matmul_rate([(square, square, square)], max(3, repeats // 2), seed=0) if comm.rank == 0 else []
    comm.barrier()
    busy, wall = busy_cpu_seconds() - busy0, time.perf_counter() - wall0
    own = comm.gather_object(time.process_time() - own0)  # threads: each is the whole process's
    if comm.rank != 0:
        return None
    others = max(0.0, busy - (own[0] if comm.backend == "threads" else sum(own))) / wall
    solo_rate = matmul_flops([(square, square, square)]) / float(np.median(solo))
    peak = max(solo_rate, shared)
    cluster = Cluster(name=f"this machine ({socket.gethostname()}), {p} ranks, {comm.backend}", gpus_per_node=p,
                      peak_flops=peak, efficiency=shared / peak, memory_bytes=memtotal_bytes() / p, intra=link,
                      inter=link, gamma=gamma,
                      source=f"minipar calibrate {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
                             f"neighbour exchanges of {min(sizes)}-{max(sizes)} B; GPT-shaped matmuls and "
                             f"the GPT {gpt} on all {p} ranks at once (see minipar/calibrate.py)"
                             + (f"; a waiting rank spun {comm.spin * 1e3:g} ms before sleeping (comm.spin)"
                                if isinstance(getattr(comm, "spin", None), float) else ""))
    for v in (link.alpha, link.beta, gamma, peak, gpt_seconds):
        if not math.isfinite(v):
            raise ValueError(f"calibrate: a non-finite measurement ({v}); rerun on a quieter machine")
    return Measurements(p, comm.backend, exchange, allreduce, add_gamma, reduce_gamma, gpt_seconds, solo_rate,
                        shared, cluster, others)


def compute_rates(gpt: dict[str, int] | None = None, repeats: int = 10) -> tuple[float, float]:
    """(FLOP/s, gamma) of this core, as ``measure`` derives them from the GPT ``gpt``'s matmul shapes
    and its forward and backward, but timed in the calling thread's CPU time (``time.thread_time``):
    one core's rates, whatever else shares the cores, the terms in which ``minipar.replay`` charges a
    span. Give ``gpt`` the shapes one rank computes (a tensor-parallel slice) to describe that rank."""
    gpt = gpt or GPT
    shapes = gpt_matmul_shapes(gpt["batch"] * gpt["seq"], gpt["d_model"], gpt["vocab"])
    flops = matmul_flops(shapes) / float(np.median(_matmul_rate(shapes, repeats, 0, time.thread_time)))
    return flops, gamma_from_gpt(float(np.median(_gpt_times(gpt, repeats, 0, time.thread_time))), flops, gpt)


def calibrate(comm: Any, sizes: Sequence[int] = SIZES, repeats: int = 10, **kwargs: Any) -> Cluster | None:
    """This machine as a ``Cluster`` (collective); rank 0 gets it, the others None. See ``measure``."""
    m = measure(comm, sizes=sizes, repeats=repeats, **kwargs)
    return None if m is None else m.cluster


def quick_options(quick: bool) -> dict[str, Any]:
    """``measure``'s keyword arguments for the full run or ``--quick``."""
    if quick:
        return {"sizes": QUICK_SIZES, "repeats": 8, "allreduce_sizes": QUICK_ALLREDUCE_SIZES}
    return {"sizes": SIZES, "repeats": 30, "allreduce_sizes": ALLREDUCE_SIZES}


def run_calibration(ranks: int, backend: str = "mpi", quick: bool = False, timeout: float = 120) -> Measurements:
    """Launch ``ranks`` ranks on ``backend`` ("mpi": ``mpiexec`` from this Python's environment,
    "threads": in this process), measure, and return rank 0's ``Measurements``."""
    from minipar.testing import run

    return run(measure, ranks, backend=backend, timeout=timeout, **quick_options(quick))[0]
