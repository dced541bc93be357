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
2. The compute side, every rank at once (``rates.measure_rates`` in wall-clock time, so the
   time-sharing of the cores is in the numbers; medians over repetitions and ranks): FLOP/s on the
   matmuls of a small GPT (``GPT``: ``gpt_matmul_shapes``, its q, k, v, output projections, MLP
   and head, forward and backward); the per-op overhead and gamma from minipar's hybrid GPT traced
   forward and backward at two sizes, ``GPT`` and ``rates.TINY`` (each size's F and B spans less
   its matmuls are ``N op_seconds + B gamma / 3``, ``N`` its autograd ops, ``B`` the bytes
   ``perf.memory_traffic_bytes`` counts: the tiny size is nearly all overhead, which separates the
   two); the optimizer's ``tensor_seconds`` and ``optimizer_gamma`` from ``AdamW.step`` over many
   tiny tensors and a few large ones. gamma is at least ``np.add``'s (``add_gamma``, 1 MiB arrays).
   ``message_seconds`` is 0: alpha, fitted to wall-clock exchanges through minipar's message path,
   already holds the CPU a message costs. Also timed and shown, not used: the ring all-reduce's time
   minus its alpha-beta part (``reduce_gamma``; on 4 ranks on 2 cores that residual is ~10% of a time
   dominated by 6 alpha, and swung from 0.2 to 47 GB/s between runs).
3. Peak: one rank alone on large square matmuls (the others wait); ``efficiency`` = the shared
   per-rank GPT-shape rate of 2. / that peak, so ``Cluster.flops`` (peak x efficiency) is the
   per-rank rate under sharing, what a local run achieves. (Should the shared rate beat the solo
   one, as it can when ranks <= cores, the peak is raised to it: efficiency 1.) Also timed alone:
   square matmuls of sides ``GEMM_SIDES`` up to that peak's, their rates over the peak's rate written
   as ``Cluster.gemm_curve`` (``minipar.cost.gemm``: a matmul's share of ``efficiency`` by its shape);
   ``efficiency`` then leaves the GPT shapes' share out (``shape_free_efficiency``), so that its
   matmuls priced through the curve take what they measured.

4. The memory tiers, the ranks done (``run_calibration``; ``minipar.tiers.rates.measure``): the disk's
   sequential writes and reads, ``O_DIRECT`` where allowed, one request at a time, at the sizes offload
   moves (64 KiB .. 16 MiB), the copy that is a move between host and "device" here, and what an atomic
   (synced) write adds; each fitted as latency + bytes / bandwidth, the tier model's terms
   (``minipar.cost.offload.transfer_seconds``). ``Measurements.tiers``; ``tiers_path`` names its file.

``rates.compute_rates(comm, gpt)`` measures 2. in each thread's CPU time instead: the rates of one
core per rank, as a replay (``minipar.replay``) charges compute, for ``perf.predict`` to be held
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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from minipar.cost.cluster import Cluster, Link
from minipar.cost.collectives import collective_time
from minipar.cost.gemm import curve_efficiency
from minipar.rates import (
    GPT,
    Rates,
    add_gamma,
    fit_line,
    gpt_matmul_shapes,
    matmul_flops,
    matmul_times,
    measure_rates,
    median_times,
    pooled_median,
)
from minipar.tiers.core import Bandwidth

SIZES = tuple(8 * 4**k for k in range(11))  # 8 B .. 8 MiB, x4
QUICK_SIZES = tuple(8 * 16**k for k in range(6))  # 8 B .. 8 MiB, x16
ALLREDUCE_SIZES = (2**16, 2**18, 2**20, 2**22)  # bytes of float64
QUICK_ALLREDUCE_SIZES = (2**16, 2**20)
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
    rates: Rates  # the compute side, every rank at once (FLOP/s per rank on GPT shapes, overheads)
    matmul_solo: float  # FLOP/s of one rank alone, square matmuls
    cluster: Cluster
    others_cores: float = 0.0  # cores other programs kept busy meanwhile (``busy_cpu_seconds``), nan if unknown
    tiers: Bandwidth | None = None  # the disk and memory copies (``tiers.rates.measure``), when measured

    def table(self) -> str:
        """The numbers as a small text table (what ``minipar calibrate`` prints)."""
        c, r = self.cluster, self.rates
        rows = [("alpha", f"{c.intra.alpha * 1e6:.1f} us", "per message"),
                ("beta", bandwidth(c.intra.beta), "1 / beta"),
                ("gamma", bandwidth(c.gamma), f"1 / gamma, a GPT step's memory-bound work (np.add alone: "
                 f"{1 / self.add_gamma / 1e9:.1f} GB/s, all-reduce residual: {bandwidth(self.reduce_gamma)})"),
                ("GFLOP/s per rank", f"{c.flops / 1e9:.2f}",
                 f"all {self.ranks} ranks at once, large matmuls (the GPT's shapes: {r.flops / 1e9:.2f}); one "
                 f"alone: {self.matmul_solo / 1e9:.2f}; by side "
                 + ", ".join(f"{n:g}: {e:.2f}" for n, e in c.gemm_curve)),
                ("per op", f"{c.op_seconds * 1e6:.1f} us", f"an autograd op's overhead, forward and backward (the "
                 f"hybrid GPT's spans: {r.step_seconds[0] * 1e3:.2f} ms tiny, {r.step_seconds[1] * 1e3:.2f} ms)"),
                ("optimizer", f"{c.tensor_seconds * 1e6:.1f} us", f"per parameter tensor, and "
                 f"{bandwidth(c.optimizer_gamma)} of parameters, gradients and moments (AdamW)"),
                ("memory per rank", f"{c.memory_bytes / 2**30:.1f} GiB", "MemTotal / ranks")]
        lines = [f"{c.name}", *(f"  {a:<17}{b:>12}   {note}" for a, b, note in rows)]
        lines.append(f"  exchange step (bytes: measured us / alpha + n beta us; fitted from {FIT_FROM} B)")
        lines += [f"    {n:>9}: {t * 1e6:9.1f} / {c.intra.seconds(n) * 1e6:9.1f}" for n, t in self.exchange]
        lines.append("  ring all-reduce (bytes: measured us / model us)")
        for n, t in self.allreduce:
            model = collective_time("allreduce", "ring", n, self.ranks, c.intra.alpha, c.intra.beta, c.gamma)
            lines.append(f"    {n:>9}: {t * 1e6:9.1f} / {model * 1e6:9.1f}")
        if self.tiers is not None:
            lines += tier_lines(self.tiers)
        if self.others_cores > QUIET_CORES:
            lines.append(f"  warning: other programs kept {self.others_cores:.2f} cores busy while this ran; every "
                         "number above is slower than this machine alone: rerun when it is quiet")
        return "\n".join(lines)


def tier_lines(bw: Bandwidth) -> list[str]:
    """The tier model's rows: each link's bandwidth and latency per request (``transfer_seconds``)."""
    rows = [("disk write", bw.nvme_write, bw.nvme_write_latency), ("disk read", bw.nvme_read, bw.nvme_read_latency),
            ("memory copy", bw.pcie, bw.pcie_latency)]
    return ["  tiers (latency + bytes / bandwidth per request; device <-> host is a memory copy here)",
            *(f"    {name:<13}{rate / 1e9:7.2f} GB/s + {lat * 1e6:7.1f} us" for name, rate, lat in rows),
            f"    synced write + {bw.nvme_sync * 1e3:.2f} ms (a new file, fdatasync, rename)", f"    {bw.source}"]


def tiers_path(cluster_path: str) -> str:
    """Where the tier rates go beside a cluster file: ``cluster.json`` -> ``cluster.tiers.json``."""
    stem = cluster_path[:-5] if cluster_path.endswith(".json") else cluster_path
    return f"{stem}.tiers.json"


def bandwidth(seconds_per_byte: float) -> str:
    """``1 / seconds_per_byte`` in GB/s, "inf" for a fitted 0 (a rate too fast to measure)."""
    return f"{1 / seconds_per_byte / 1e9:.2f} GB/s" if seconds_per_byte > 0 else "inf"


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """``Link(alpha, beta)`` minimising ``sum(((alpha + n beta) - t) / t)^2`` (relative errors).

    Exact on data that obey ``t = alpha + n beta``. A negative intercept (noise on small messages)
    is refitted with ``alpha = 0``, a negative slope with ``beta = 0``. Needs at least 2 different
    sizes and positive times.
    """
    if len(set(sizes)) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 different message sizes to fit alpha and beta, "
                         f"got {sorted(set(sizes))}")
    alpha, beta = fit_line(sizes, seconds)
    return Link(alpha, beta)


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


def memtotal_bytes(path: str = "/proc/meminfo") -> float:
    """``MemTotal`` of ``/proc/meminfo`` in bytes (it is given in kB)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    raise ValueError(f"{path} has no MemTotal line")


def _exchange(comm: Any, nbytes: int, repeats: int) -> float:
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    comm.barrier()
    return pooled_median(comm, median_times(lambda: comm._step([(right, send)], [(left, recv)], "calibrate",
                                                                 None, None), repeats))


def _allreduce(comm: Any, nbytes: int, repeats: int) -> float:
    x = np.ones(nbytes // 8)
    comm.barrier()
    return pooled_median(comm, median_times(lambda: comm.allreduce(x, algorithm="ring"), repeats))


def busy_cpu_seconds(path: str = "/proc/stat") -> float:
    """CPU seconds every program on the machine has used since boot (``/proc/stat``'s first line: all
    but idle and iowait); nan where there is no such file."""
    try:
        with open(path) as fh:
            ticks = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return math.nan
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


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
    floor = add_gamma(repeats)
    reduce_gamma = fit_gamma([n for n, _ in allreduce], [t for _, t in allreduce], p, link, floor=floor)
    gpt = gpt or GPT
    rates = measure_rates(comm, gpt, repeats, "wall")
    gamma = max(rates.gamma, floor)
    comm.barrier()
    sweep = gemm_sweep((*(n for n in GEMM_SIDES if n < square), square), max(3, repeats // 2)) \
        if comm.rank == 0 else {}
    comm.barrier()
    busy, wall = busy_cpu_seconds() - busy0, time.perf_counter() - wall0
    own = comm.gather_object(time.process_time() - own0)  # threads: each is the whole process's
    if comm.rank != 0:
        return None
    others = max(0.0, busy - (own[0] if comm.backend == "threads" else sum(own))) / wall
    solo_rate = sweep[square]
    peak = max(solo_rate, rates.flops)
    curve = tuple((float(n), r / solo_rate) for n, r in sorted(sweep.items()))
    cluster = Cluster(name=f"this machine ({socket.gethostname()}), {p} ranks, {comm.backend}", gpus_per_node=p,
                      peak_flops=peak, efficiency=shape_free_efficiency(rates.flops, peak, curve, gpt),
                      gemm_curve=curve, memory_bytes=memtotal_bytes() / p, intra=link,
                      inter=link, gamma=gamma, op_seconds=rates.op_seconds, tensor_seconds=rates.tensor_seconds,
                      optimizer_gamma=rates.optimizer_gamma,
                      source=f"minipar calibrate {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
                             f"neighbour exchanges of {min(sizes)}-{max(sizes)} B; GPT-shaped matmuls, "
                             f"the hybrid GPT {gpt} and AdamW on all {p} ranks at once (see minipar/calibrate.py)"
                             + (f"; a waiting rank spun {comm.spin * 1e3:g} ms before sleeping (comm.spin)"
                                if isinstance(getattr(comm, "spin", None), float) else ""))
    for v in (link.alpha, link.beta, gamma, peak, rates.op_seconds, rates.tensor_seconds, rates.optimizer_gamma):
        if not math.isfinite(v):
            raise ValueError(f"calibrate: a non-finite measurement ({v}); rerun on a quieter machine")
    return Measurements(p, comm.backend, exchange, allreduce, floor, reduce_gamma, rates, solo_rate, cluster, others)


# --- GEMM efficiency against the matmul's shape (cost.gemm's gemm_curve) ---------------------------------
GEMM_SIDES = (16, 32, 64, 128, 256)  # square matmuls timed below ``square`` (rank 0 alone)


def gemm_sweep(sides: Sequence[int], repeats: int) -> dict[int, float]:
    """FLOP/s of square float64 matmuls of each side, this rank alone (medians of ``repeats`` timings,
    each of at least ``2^21`` multiply-adds: a small side's timing holds many matmuls)."""
    out = {}
    for n in sides:
        shapes = [(n, n, n)] * max(1, 2**21 // n**3)
        out[n] = matmul_flops(shapes) / float(np.median(matmul_times(shapes, repeats, seed=0)))
    return out


def shape_free_efficiency(rate: float, peak: float, curve: Sequence[tuple[float, float]],
                          gpt: dict[str, int]) -> float:
    """``efficiency`` with the shapes' share taken out: the GPT's matmuls (``gpt_matmul_shapes``),
    each at ``peak x efficiency x curve(its shape)``, take as long as at the measured ``rate``:
    ``rate sum(F_i / c_i) / (peak sum F_i)`` (at most 1)."""
    shapes = gpt_matmul_shapes(gpt["batch"] * gpt["seq"], gpt["d_model"], gpt["vocab"], gpt.get("d_ff"))
    weighted = sum(matmul_flops([s]) / curve_efficiency(*s, curve) for s in shapes)
    return min(1.0, rate * weighted / (peak * matmul_flops(shapes)))


def calibrate(comm: Any, sizes: Sequence[int] = SIZES, repeats: int = 10, **kwargs: Any) -> Cluster | None:
    """This machine as a ``Cluster`` (collective); rank 0 gets it, the others None. See ``measure``."""
    m = measure(comm, sizes=sizes, repeats=repeats, **kwargs)
    return None if m is None else m.cluster


def quick_options(quick: bool) -> dict[str, Any]:
    """``measure``'s keyword arguments for the full run or ``--quick``."""
    if quick:
        return {"sizes": QUICK_SIZES, "repeats": 8, "allreduce_sizes": QUICK_ALLREDUCE_SIZES}
    return {"sizes": SIZES, "repeats": 30, "allreduce_sizes": ALLREDUCE_SIZES}


def run_calibration(ranks: int, backend: str = "mpi", quick: bool = False, timeout: float = 120,
                    disk_dir: str | None = ".") -> Measurements:
    """Launch ``ranks`` ranks on ``backend`` ("mpi": ``mpiexec`` from this Python's environment,
    "threads": in this process), measure, and return rank 0's ``Measurements``; then, the ranks done,
    by ``ranks`` processes at once (a run's requesters), the disk under ``disk_dir`` (default: here,
    where the cluster file goes) and memory copies
    (``tiers.rates.measure``: ``Measurements.tiers``, for ``Bandwidth.save(tiers_path(cluster file))``;
    None skips it)."""
    from minipar.testing import run
    from minipar.tiers import rates

    m = run(measure, ranks, backend=backend, timeout=timeout, **quick_options(quick))[0]
    if disk_dir is None:
        return m
    sizes = rates.QUICK_SIZES if quick else rates.SIZES
    return replace(m, tiers=rates.measure(disk_dir, sizes, 3 if quick else 5, requesters=ranks))
