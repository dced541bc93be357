"""Hand-written ring all-reduce against MPICH's own, polled (native) and blocking, side by side.

    OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/collectives.py

Three variants on float64 buffers of 16K, 1M and 16M elements, alternating within every repeat:
"blocking" is MPICH's ``MPI_Allreduce`` called straight through mpi4py (here only: library code
goes through ``minipar.comm``), the fair baseline; "native" is ``comm.allreduce(x,
algorithm="native")``, MPICH's non-blocking ``MPI_Iallreduce`` polled by the watchdog (spin 1 ms,
then sleeps of 1/32 of the time waited, at most 1 ms); "ring" is the hand-written ring on
non-blocking send/recv polled the same way. Each timing is the slowest rank's; the median of
``--reps`` runs is reported (more for the smaller sizes), with ratios to the blocking call. Then
the tracing overhead: the ring all-reduce with a trace recorder on vs off.

Measured on the 2-core machine, other jobs light (load 1.2), two runs, 2 ranks:

    elements     MB     blocking (ms)  native (ms)  ring (ms)   native/blocking  ring/blocking  ring/native
    16,384       0.1    0.07-0.08      0.11-0.12    0.17-0.20   1.56-1.68x       2.5-2.6x       1.5-1.6x
    1,048,576    8.4    6.9-7.8        9.3-10.4     6.9-7.4     1.34-1.36x       0.95-1.01x     0.71-0.74x
    16,777,216   134.2  108-111        109-113      58-59       1.02x            0.53-0.54x     0.52-0.53x
    tracing on vs off: 1M float64 0.92-0.99x; 200 x 16 float64 1.17-1.32x

Before the polling fix (20 spins, then sleeps doubling to 1 ms; same machine, same load) native
was 7.3-8.7x the blocking call at 16K elements and 1.4-1.55x at 1M: MPI moves data only inside MPI
calls, so a rank asleep between tests stalls its own collective (with sleeps of 1/8 of the time
waited instead of 1/32, 1M was still 1.3x). At 134 MB native equals blocking, and MPICH's own
all-reduce is slower than the hand ring there. With 4 ranks on the 2 cores (they time-share, so
these are not scaling numbers): native/blocking, ring/blocking, ring/native 2.1x, 5.2x, 2.5x at
16K; 1.5x, 1.9x, 1.3x at 1M; 0.93x, 0.71x, 0.77x at 16M. At load 3 the same ratios moved by
20-50%.

Issue 26 (ranks outnumbering cores), 2026-11-27, nothing else running (load 3-6 from the benchmark's
own ranks), ring / MPICH's blocking call, median of 7 (more at 1M), two runs each:

    p  before (ring copied its input)    after (input read in place, next receive pre-posted)
       1M        16M                     1M             16M            rd at 1M / 16M   tree at 1M / 16M
    2  1.18x     0.43x                   0.68x, 0.73x   0.30x, 0.27x   1.24-1.39x / 0.58x   1.86-1.92x / 0.93-1.07x
    3  -         -                       0.38x, 0.24x   0.07x, 0.08x   0.62-0.90x / 0.84-0.94x   0.52-0.77x / 0.22x
    4  1.21x     0.68x                   0.76x, 0.76x   0.40x, 0.36x   1.43-1.50x / 1.67-1.81x   1.33-1.43x / 0.82-0.93x
    8  1.02x     0.72x                   0.74x, 0.81x   0.45x, 0.44x   1.34-1.53x / 2.00-2.52x   0.97-1.05x / 0.84-0.87x

(the "before" row at p = 8 was measured under load 8-11, when MPICH's busy-polling call loses its edge).
MPICH picks its own algorithm per size and rank count (the classic choice at these sizes is
Rabenseifner's reduce-scatter + all-gather, 2 lg p steps against the ring's 2(p-1) for p a power
of two; not verified here); relative to the ring it does worst at p = 3, not a power of two.
``benchmarks/oversubscribed.py`` compares the ways a ring step waits (sleep, spin, sched_yield, a
doorbell, MPI's blocking wait) side by side in one run, and
``benchmarks/oversubscribed_step.py`` where a lesson-sized training step's time goes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minipar import trace  # noqa: E402
from minipar.comm import Communicator, world  # noqa: E402


def timed(comm: Communicator, fn: Callable[[], object]) -> float:
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return max(comm.allgather_object(dt))


def blocking_allreduce(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """MPICH's blocking ``MPI_Allreduce`` called straight through mpi4py (benchmark only: library
    code goes through ``minipar.comm``). A fresh output array, as ``comm.allreduce`` returns one."""
    from mpi4py import MPI

    out = np.empty_like(x)
    comm.mpicomm.Allreduce(x, out, op=MPI.SUM)  # type: ignore[attr-defined]
    return out


def tree_allreduce(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast (``minipar.comm.tree``)."""
    return comm.broadcast(comm.reduce(x, root=0), root=0)


def compare(comm: Communicator, n: int, reps: int, names: tuple[str, ...] = ("blocking", "native", "ring")
            ) -> dict[str, float]:
    """Median time of each variant on ``n`` float64, the variants alternating within every repeat."""
    x = np.random.default_rng(comm.rank).standard_normal(n)
    every: dict[str, Callable[[], np.ndarray]] = {
        "blocking": lambda: blocking_allreduce(comm, x),
        "native": lambda: comm.allreduce(x, algorithm="native"),
        "ring": lambda: comm.allreduce(x, algorithm="ring"),
        "rd": lambda: comm.allreduce(x, algorithm="recursive_doubling"),
        "tree": lambda: tree_allreduce(comm, x),
    }
    variants = {k: fn for k, fn in every.items() if k in names}
    ref = variants["blocking"]()
    for name in variants:
        if name != "blocking":
            assert np.allclose(variants[name](), ref), name
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(comm, fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def tracing_overhead(comm: Communicator, n: int, calls: int, reps: int) -> tuple[float, float]:
    x = np.ones(n)

    def work() -> None:
        for _ in range(calls):
            comm.allreduce(x, algorithm="ring")

    off, on = [], []
    for _ in range(reps):
        off.append(timed(comm, work))
        with trace.recording(comm.world_rank):
            on.append(timed(comm, work))
    return statistics.median(off), statistics.median(on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 14, 1 << 20, 1 << 24])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--variants", nargs="+", default=["native", "ring", "rd", "tree"],
                    choices=["native", "ring", "rd", "tree"],
                    help="beside the blocking call: native, ring, rd (recursive doubling), tree (reduce + broadcast)")
    ap.add_argument("--no-tracing", action="store_true", help="skip the tracing-overhead lines")
    args = ap.parse_args()
    comm = world()
    if comm.backend != "mpi":
        raise SystemExit("run under mpiexec: .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/collectives.py")
    # small messages are cheap and noisy: more repeats (the largest size gets ``--reps``)
    names = ("blocking", *args.variants)
    rows = [(n, compare(comm, n, max(args.reps, min(51, max(args.sizes) // n)), names)) for n in args.sizes]
    if not args.no_tracing:
        big_off, big_on = tracing_overhead(comm, 1 << 20, 1, args.reps)
        small_off, small_on = tracing_overhead(comm, 16, 200, args.reps)
    if comm.rank != 0:
        return
    from rich.console import Console
    from rich.table import Table

    cores = os.cpu_count() or 1
    shared = f"; {comm.size} ranks on {cores} cores time-share" if comm.size > cores else ""
    how = "doorbell" if getattr(comm, "bell", None) is not None else \
        getattr(getattr(comm, "rest", None), "__name__", "sleep").strip("_")
    table = Table(title=f"all-reduce, float64, {comm.size} ranks ({comm.backend}{shared}; waits pause: {how}), "
                        f"median of >= {args.reps}, wall clock of the slowest rank")
    for col in ("elements", "MB", "blocking (ms)", *(f"{k} (ms)" for k in args.variants),
                *(f"{k} / blocking" for k in args.variants)):
        table.add_column(col, justify="right")
    for n, m in rows:
        table.add_row(f"{n:,}", f"{n * 8 / 1e6:.1f}", *(f"{m[k] * 1e3:.2f}" for k in names),
                      *(f"{m[k] / m['blocking']:.2f}x" for k in args.variants))
    console = Console(width=160)
    console.print(table)
    if args.no_tracing:
        return
    console.print(f"tracing overhead, ring all-reduce of 1M float64: off {big_off * 1e3:.1f} ms, "
                  f"on {big_on * 1e3:.1f} ms ({big_on / big_off:.2f}x)")
    console.print(f"tracing overhead, 200 ring all-reduces of 16 float64: off {small_off * 1e3:.1f} ms, "
                  f"on {small_on * 1e3:.1f} ms ({small_on / small_off:.2f}x)")


if __name__ == "__main__":
    main()
