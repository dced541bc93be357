"""Where a lesson-sized training step's time goes when ranks outnumber cores (issue 26, item 1).

    .venv/bin/python benchmarks/oversubscribed_step.py --ranks 2 4 8

The driver starts one ``mpiexec -n p`` per rank count, each running this file with ``--worker``:
two workloads of the lessons' size, each ``--steps`` measured steps after one warm-up step:

- ``ddp``: lesson 03's tiny GPT (d_model 32, 2 layers; global batch 12 split over the ranks, 24
  where p does not divide 12) with DDP (ring all-reduce of 16 KiB buckets, overlapped with backward
  on the all-reduce worker thread), SGD;
- ``1f1b``: lesson 02's pipeline (tiny GPT d_model 64, 8 blocks, 8 micro-batches of 4), 1F1B, AdamW.

Per rank and step it reads the wall time (``perf_counter``), the process's CPU time (``RUSAGE_SELF``:
every thread, the all-reduce worker and the heartbeat too), the time any of its threads was runnable
but waited for a core (``/proc/self/task/*/schedstat`` run delay, summed over threads) and the
voluntary / involuntary context switches. Printed, per workload, medians over steps:

- ``wall``: the slowest rank's step (wall clock);
- ``CPU``: the CPU time of all ranks together (the work the step needs, on this machine);
- ``floor``: ``CPU / min(p, cores)``, the step if the cores never idled and no rank waited for a
  message while another could run; ``floor / wall`` is how busy the cores were;
- ``delay`` and ``idle`` (= wall - CPU - delay, per rank, mean): waiting for a core vs waiting for a
  peer (asleep or blocked).

When ``floor / wall`` is near 1 the step is bound by the work itself (more ranks on the same cores
cannot be faster); the gap is the waiting a better wait could recover.

Measured 2026-11-27 on the 2-core machine (other jobs light), before (a660664: the ring copied its
input) and after (c3fadc5), runs interleaved, two each:

    workload  p   wall ms before / after   CPU ms (all ranks)   floor/wall   delay ms   idle ms
    ddp       2   11.0-22.5 / 9.6-9.8      17-22 / 17           0.49-0.79 / 0.84-0.88   5-19 / 4-6   ~0
    1f1b      2   146-259 / 145-149        265-303 / 260-262    0.59-0.91 / 0.88-0.90   1-91 / 1     8-11
    ddp       4   44-48 / 43-44            60-66 / 62-65        0.68-0.69 / 0.71-0.76   16-18      9-11
    1f1b      4   166-238 / 170-173        303-322 / 309-317    0.68-0.91 / 0.91-0.92   60-125     20-30
    ddp       8   180-198 / 183-189        211-237 / 215-222    0.59-0.60 / 0.59        37-44      103-114
    1f1b      8   230-241 / 243-273        419-431 / 429-442    0.89-0.91 / 0.78-0.91   117-153    42-52

The pipeline step is bound by its work at every p (the cores busy 0.9 of the step; 8 ranks need 1.6x
the CPU of 2: each rank's stages are smaller but every micro-batch still pays its messages and
Python bookkeeping). DDP at p = 8 is the one that waits: 3 samples per rank, 16 KiB buckets, so a
rank's 8 ms of compute pays ~16 buckets x 14 ring steps of messages (27 ms of CPU per rank, mostly
message bookkeeping) and sits idle 110 ms of its 190 ms step for peers that wait for a core.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from oversubscribed import worker_json  # noqa: E402


def counters() -> tuple[float, ...]:
    """(wall, process CPU, run delay of all threads, voluntary cs, involuntary cs) now."""
    pr = resource.getrusage(resource.RUSAGE_SELF)
    delay = 0
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                delay += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended between the glob and the read
    return (time.perf_counter(), pr.ru_utime + pr.ru_stime, delay * 1e-9, float(pr.ru_nvcsw),
            float(pr.ru_nivcsw))


def workloads(comm: Any) -> dict[str, Any]:
    """``name -> step()`` for lesson 03's DDP and lesson 02's 1F1B, built on ``comm``."""
    from minipar import datasets
    from minipar.nn import GPT
    from minipar.optim import SGD, AdamW
    from minipar.parallel.ddp import DistributedDataParallel, train_step
    from minipar.parallel.pipeline import Pipeline, gpt, gpt_layer_counts

    p = comm.size
    stream = datasets.token_stream(20_000, 32, seed=0)
    batch = 12 if 12 % p == 0 else 24
    model = GPT(16, 16, 32, 4, 2, seed=0)
    ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=16 * 1024)
    sgd = SGD(model.parameters(), lr=1.0)
    x16, y16 = datasets.lm_batch(datasets.token_stream(20_000, 16, seed=0), batch, 16, step=0)

    pipe = Pipeline(comm, gpt(32, 32, 64, 4, 8, seed=0), "1f1b", microbatches=8,
                    layers=gpt_layer_counts(8, p)) if 8 % p == 0 else None
    adam = AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.0) if pipe is not None else None
    x32, y32 = datasets.lm_batch(stream, 32, 32, step=0)
    out: dict[str, Any] = {"ddp": lambda: train_step(ddp, sgd, lambda m, a, b: m.loss(a, b), x16, y16)}
    if pipe is not None:
        out["1f1b"] = lambda: pipe.step(x32, y32, adam)
    return out


def worker(steps: int) -> None:
    from minipar.comm import world

    comm = world()
    results: dict[str, Any] = {"p": comm.size, "cores": os.cpu_count(), "spin": comm.spin, "work": {}}
    for name, step in workloads(comm).items():
        step()  # warm-up
        rows = []
        for _ in range(steps):
            comm.barrier()
            c0 = counters()
            step()
            c1 = counters()
            rows.append(comm.allgather_object([b - a for a, b in zip(c0, c1, strict=True)]))
        results["work"][name] = rows
    if comm.rank == 0:
        print("JSON " + json.dumps(results), flush=True)


def summarise(rows: list[list[list[float]]], p: int, cores: int) -> dict[str, float]:
    """Medians over steps of the slowest wall, all ranks' CPU, the floor and the mean delay and idle."""
    per = []
    for step in rows:
        d = np.array(step)  # ranks x (wall, cpu, delay, vcs, ivcs)
        wall, cpu = float(d[:, 0].max()), float(d[:, 1].sum())
        per.append({"wall": wall, "cpu": cpu, "floor": cpu / min(p, cores), "delay": float(d[:, 2].mean()),
                    "idle": float(np.mean(d[:, 0] - d[:, 1] - d[:, 2])), "vcs": float(d[:, 3].mean()),
                    "ivcs": float(d[:, 4].mean())})
    return {k: statistics.median(r[k] for r in per) for k in per[0]}


def driver(ranks: list[int], steps: int) -> None:
    py, mpiexec = str(ROOT / ".venv/bin/python"), str(ROOT / ".venv/bin/mpiexec")
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start; median of {steps} steps "
          "after a warm-up; ms of wall clock except CPU (getrusage, all ranks' threads)")
    head = ("workload", "p", "wall ms", "CPU ms", "floor ms", "floor/wall", "delay ms", "idle ms", "vol cs",
            "invol cs")
    print("  ".join(f"{h:>10}" for h in head))
    for p in ranks:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        cmd = [mpiexec, "-n", str(p), py, __file__, "--worker", "--steps", str(steps)]
        res = worker_json(cmd, env, f"p={p}")
        if res is None:
            continue
        for name, rows in res["work"].items():
            m = summarise(rows, res["p"], res["cores"])
            cells = [name, str(p), *(f"{m[k] * 1e3:.1f}" for k in ("wall", "cpu", "floor")),
                     f"{m['floor'] / m['wall']:.2f}", f"{m['delay'] * 1e3:.1f}", f"{m['idle'] * 1e3:.1f}",
                     f"{m['vcs']:.0f}", f"{m['ivcs']:.0f}"]
            print("  ".join(f"{c:>10}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps)
    else:
        driver(args.ranks, args.steps)


if __name__ == "__main__":
    main()
