"""Data parallelism (DDP) under mpiexec: weak scaling 1 -> 2 ranks, overlap on vs off, the hand ring
vs MPICH's all-reduce polled (native) and blocking.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/data_parallel.py [--batch 1024] [--repeats 3]

Weak scaling: the per-rank batch is fixed, so 2 ranks process twice the samples per step; the
throughput ratio (global samples / s, 2 ranks over 1) would be 2.0 with free communication (target
>= 1.7x on 2 cores). The 1-rank baseline is plain single-process training (no DDP at all). The
model is a matmul-heavy float64 MLP; gradients go in buckets of ``--cap`` bytes.

The script starts ``mpiexec -n 1`` and ``mpiexec -n 2`` of itself (``--inner``) ``--repeats`` times,
alternating. In a 2-rank job the configurations take turns step by step, so load from elsewhere hits
them alike: the ring and native (MPICH's ``MPI_Iallreduce``, polled) each with and without overlap
(without: every bucket starts after backward); "blocking Allreduce", the same buckets all-reduced
after backward by MPICH's blocking ``MPI_Allreduce`` called through mpi4py (here only); "no sync",
every rank trains on its shard with no communication (what sharing the machine costs). A step's
time is the slowest rank's; the table gives medians, throughput against 1 rank, and step time over
"no sync".

Measured on the 2-core machine, other jobs light (load 1.6-2.0; no sync / 1 rank 0.95-0.97), MLP
512-1024-1024-1024-512 (25 MB of gradients, 8 buckets), per-rank batch 1024, two runs (3 and 5 jobs
x 6 steps); step time and throughput against 1 rank (556-557 ms):

    ring + overlap        588-633 ms  1.76-1.89x     native + overlap     580-607 ms  1.84-1.92x
    ring, no overlap      568-570 ms  1.95-1.96x     native, no overlap   600-622 ms  1.79-1.85x
    blocking Allreduce    543-554 ms  2.01-2.05x     no sync              531-539 ms  2.07-2.10x
    ring+overlap / native+overlap 1.01-1.04, / blocking 1.08-1.14; native+overlap / blocking 1.07-1.10

Re-measured with nothing else running (--repeats 3, 1 rank 512 ms): ring + overlap 568 ms 1.80x,
ring without 553 ms 1.85x, native + overlap 568 ms 1.80x, native without 579 ms 1.77x, blocking
522 ms 1.96x, no sync 504 ms 2.03x; ring+overlap / native+overlap 1.00, / blocking 1.09.

At load 2-4 the same ratios moved by ~10% between runs. Before the changes of issue 10 this
benchmark (configurations not alternating) gave 1.63x ring + overlap, 1.69x ring without, 1.77x
native. Communication here is memory copies and additions done by the CPU (no NIC or DMA
engine), so with both cores busy overlap can only hide waiting, not work: it still costs 20-60 ms
over the ring without overlap, and MPICH's blocking call after backward (no thread, no Python) is
cheapest. Overlap cost more before because (measured per step with rusage under mpiexec) fresh
bucket arrays allocated while backward ran caused 3,600 page faults (12 ms of the compute
thread's CPU; now one buffer per bucket for the run, reduced in place) and the worker thread's
frequent wake-ups preempted backward 140-190 times (now 45-80: it sleeps half the time waited);
the GIL never blocked the compute thread. The lead re-measures on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipar import Tensor  # noqa: E402
from minipar import functional as F  # noqa: E402
from minipar.nn import MLP  # noqa: E402
from minipar.optim import SGD  # noqa: E402
from minipar.parallel.ddp import DistributedDataParallel, local_batch, train_step  # noqa: E402

# (name, algorithm, overlap): DDP configurations of the 2-rank job, timed step by step in turn
CONFIGS = [("ring/overlap", "ring", True), ("ring/no overlap", "ring", False),
           ("native/overlap", "native", True), ("native/no overlap", "native", False),
           ("blocking Allreduce", "blocking", False), ("no sync", "local", False)]


def loss_fn(model: MLP, x: np.ndarray, y: np.ndarray) -> Tensor:
    return F.mse_loss(model(Tensor(x)), Tensor(y))


def make_step(comm: Any, kind: str, overlap: bool, args: argparse.Namespace, x: np.ndarray,
              y: np.ndarray) -> Callable[[], None]:
    """One training step of configuration ``kind``: "local" (this rank's shard, no communication;
    on one rank: single-process training), a DDP all-reduce algorithm, or "blocking": the same
    buckets all-reduced after backward by MPICH's blocking ``MPI_Allreduce`` called straight
    through mpi4py (benchmark only)."""
    model = MLP(args.sizes, seed=0)
    opt = SGD(model.parameters(), lr=1e-3)
    if kind == "local":
        xs, ys = local_batch(comm, x, y)

        def local() -> None:
            opt.zero_grad()
            loss_fn(model, xs, ys).backward()
            opt.step()
        return local
    ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=args.cap,
                                  algorithm="ring" if kind == "blocking" else kind, overlap=overlap)
    if kind != "blocking":
        def ddp_step() -> None:
            train_step(ddp, opt, loss_fn, x, y)
        return ddp_step
    from mpi4py import MPI

    ddp.remove_hooks()
    xs, ys = local_batch(comm, x, y)

    def blocking() -> None:
        opt.zero_grad()
        loss_fn(model, xs, ys).backward()
        for b in ddp.buckets:
            out = np.empty(b.numel, b.dtype)
            comm.mpicomm.Allreduce(b.flat_grads(), out, op=MPI.SUM)
            out /= comm.size
            b.unflatten(out, "grad")
        opt.step()
    return blocking


def inner(args: argparse.Namespace) -> None:
    """Under mpiexec: time ``--steps`` steps of every configuration, the configurations taking turns
    step by step (so load from elsewhere hits them alike); rank 0 prints the median step times
    (each step's time is the slowest rank's) as one JSON line."""
    from minipar.comm import world

    comm = world()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch * comm.size, args.sizes[0]))
    y = rng.standard_normal((args.batch * comm.size, args.sizes[-1]))
    configs = [("single", "local", False)] if comm.size == 1 else CONFIGS
    steps = {name: make_step(comm, kind, overlap, args, x, y) for name, kind, overlap in configs}
    for step in steps.values():
        step()  # warm-up (and the async worker thread's start)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            comm.barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(max(comm.allgather_object(time.perf_counter() - t0)))
    if comm.rank == 0:
        print(json.dumps({"size": comm.size, "times": {k: statistics.median(v) for k, v in times.items()}}),
              flush=True)


def launch(n: int, args: argparse.Namespace) -> dict[str, float]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(n), sys.executable, __file__, "--inner", "--steps", str(args.steps),
           "--batch", str(args.batch), "--cap", str(args.cap), "--sizes", *map(str, args.sizes)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["times"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 1024, 1024, 512])
    ap.add_argument("--cap", type=int, default=2 * 2**20, help="bucket cap in bytes")
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return
    samples: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for n in (1, 2):
            for key, t in launch(n, args).items():
                samples.setdefault(key, []).append(t)
    t = {k: statistics.median(v) for k, v in samples.items()}
    params = sum(a * b + b for a, b in zip(args.sizes[:-1], args.sizes[1:]))
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    table = Table(title=f"DDP weak scaling: MLP {args.sizes} ({params * 8 / 1e6:.1f} MB of float64 "
                        f"gradients), {args.batch} samples per rank, buckets <= {args.cap / 2**20:.1f} MiB, "
                        f"median of {args.repeats} jobs x {args.steps} steps")
    for col in ("run", "step (ms)", "samples / s", "vs 1 rank", "step / no sync"):
        table.add_column(col, justify="right")
    base = args.batch / t["single"]
    table.add_row("1 rank, no DDP", f"{t['single'] * 1e3:.0f}", f"{base:,.0f}", "1.00x", "")
    for name, _, _ in CONFIGS:
        thr = 2 * args.batch / t[name]
        table.add_row(f"2 ranks, {name}", f"{t[name] * 1e3:.0f}", f"{thr:,.0f}", f"{thr / base:.2f}x",
                      f"{t[name] / t['no sync']:.2f}")
    console.print(table)
    ring, native, blocking = t["ring/overlap"], t["native/overlap"], t["blocking Allreduce"]
    console.print(f"weak-scaling throughput ratio (ring, overlap): {2 * t['single'] / ring:.2f}x (target >= 1.7x); "
                  f"overlap saves {(t['ring/no overlap'] - ring) * 1e3:.0f} ms per step with the ring, "
                  f"{(t['native/no overlap'] - native) * 1e3:.0f} ms with native")
    console.print(f"step time ring/overlap / native/overlap {ring / native:.2f}, ring/overlap / blocking "
                  f"{ring / blocking:.2f}, native/overlap / blocking {native / blocking:.2f}; no sync / 1 rank "
                  f"{t['no sync'] / t['single']:.2f} (two ranks sharing the machine, no communication)")


if __name__ == "__main__":
    main()
