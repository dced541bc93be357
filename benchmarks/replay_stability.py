"""Replay against the wall clock: replayed bubbles run after run, and replayed steps where nothing is shared.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/replay_stability.py [--runs 5] [--cluster local]

It starts ``mpiexec`` itself (one job per recorded step) and prints two tables (issue 27, item 3):

1. **Stability**: lesson 02's GPT (8 blocks, m = 8) with 1F1B and interleaved 1F1B (v = 2) on 4 ranks,
   4 processes time-sharing the machine's cores, ``--runs`` times each. Per run: the bubble measured
   on the wall clock (idle share of the F/B window, mean over ranks: the lesson's measure), the same
   bubble of the replay on ``--cluster``, and the simulator's bubble fed with that run's median CPU
   time per (virtual) stage for F and B (``simulate``, latency 0). Then the spread (max - min over
   runs) of the wall-clock and replayed bubbles, and the replay's largest distance to the simulator.
   The goal: a replay spread of at most 2 points, within 3 points of the simulator.
2. **Faithfulness**: 2 ranks on 2 cores, each rank a core of its own: a pipeline step (the same GPT,
   1F1B, m = 8) and a DDP step (lesson 03's GPT, ring all-reduce overlapping the backward), the
   replayed step (first to last compute or message event) against the measured one, replayed by the
   default rules and as this host ran it (``replay(host=True)``: docs/formulas.md section 11, rule 8).
   The goal: within 15 % (on an idle machine: other programs on the cores slow the wall clock, not
   the replay).

Measurements, not tests: they print numbers and assert nothing.

Measured on the 2-core machine, 2026-11-27, while other engineers' test suites kept it busy (load
average 7-9: the faithfulness half could not be measured idle; rerun it on a quiet machine):

===========  ==============================  ==============================  ==================
schedule     wall-clock bubble, 5 runs       replayed (local), 5 runs        replay - simulator
===========  ==============================  ==============================  ==================
1F1B         45.0-50.0 % (spread 5.0 pts)    28.3-31.3 % (spread 3.0 pts)    at most 2.4 pts
interleaved  43.7-51.9 % (spread 8.2 pts)    20.1-21.9 % (spread 1.8 pts)    at most 2.8 pts
===========  ==============================  ==============================  ==================

On the quiet machine (load 2.5, 2026-11-27 18:28, after the replay's fix for compute between two
calls of one collective):

===========  ==============================  ==============================  ==================
schedule     wall-clock bubble, 5 runs       replayed (local), 5 runs        replay - simulator
===========  ==============================  ==============================  ==================
1F1B         34.7-44.3 % (spread 9.6 pts)    29.0-31.6 % (spread 2.6 pts)    at most 3.7 pts
interleaved  37.8-44.3 % (spread 6.5 pts)    18.5-22.3 % (spread 3.8 pts)    at most 2.3 pts
===========  ==============================  ==============================  ==================

and 2 ranks on 2 cores, replayed / wall-clock step over 5 runs: pipeline 0.88-0.91 (within the 15 %
goal), DDP 0.38-0.55 (not: a rank's main thread and its all-reduce worker share one GIL, which the
replay, giving the worker a core of its own, does not model). The goals (spread <= 2 points, within 3
of the simulator) are not met yet: single spans' CPU time still varies run to run.

Again on the quiet machine, 2026-11-27 22:52 (lessons 02 and 03 as they are after issue 28):
1F1B replayed 29.6-32.5 % (spread 3.0 points; wall clock 37.5-44.6 %, spread 7.1), at most 3.4
points from the simulator; interleaved 18.9-20.7 % (spread 1.8; wall clock 33.6-44.9 %, spread
11.3), at most 1.4 points from it. 2 ranks: pipeline 0.88-0.91, DDP 0.39-0.59. Where DDP's time
goes: the all-reduce worker's CPU time between its messages, which the replay does not charge, is
~65 us per ring step on lesson 03's run (6 ms a step for 16 buckets, against the calibrated alpha
of 13.4 us), and it shares the core and the GIL with the backward. A replay that charged it and
ran a rank's threads on one core (tried, then reverted) reached 0.68-0.79 here but put lesson 03's
replayed exposure after the backward at 10.4 ms against the alpha-beta formula's 2.5 ms.

2026-11-28, with the replay's default span costs now the median of the repeats of the same work
(``replay(costs="median")``; load 1-3 from other engineers' work): 1F1B replayed 27.7-29.0 %
(spread 1.3 points; wall clock 38.8-44.4 %, spread 5.6), at most 0.2 points from the simulator;
interleaved 17.5-22.2 % (spread 4.7; wall clock 41.9-46.9 %), at most 0.1 from the simulator. The
replay and the simulator now agree, so what still moves is the per-stage medians themselves: lesson
02 traces one step, 8 spans per (virtual) stage, and with 8 samples of a +-20 % noise a median moves
by ~+-9 %. Traced over 3 steps instead (24 samples; a loop outside the lesson), interleaved's replayed
bubble spread 1.1 points over 5 runs (19.2-20.3 %). 2 ranks: pipeline 0.82-0.87 and DDP 0.44-0.50
(load 1-3: the wall clock is the one that suffers).

Quiet, after the non-blocking collectives' worker stopped pausing while its rank waits for it
(minipar.comm.asyncwork): 2 ranks, pipeline 0.86-0.89, DDP 0.56 in three runs (wall 12.9-13.3 ms
against 7.2-7.5 replayed; it was 0.44-0.46 beside it without the change): the DDP goal is still
missed.

2026-11-28 04:50, quiet (load 1), after the host replay (``replay(host=True)``) and lesson 02's barrier
before each traced step (rank 0 wrote the step before's trace while rank 1 began the next: 14 ms of
that skew counted in the wall-clock step): 1F1B replayed 28.0-28.4 % (spread 0.3 points; wall clock
7.1), interleaved spread 1.5 points (wall clock 4.4), replay - simulator at most 0.2 points; 2 ranks,
replayed / wall: pipeline 0.89-0.96 (host 0.92-0.98), DDP 0.53-0.57 by the default rules and
0.85-0.89 on the host in four runs, the fifth a wall-clock stall (49.7 ms against 17-21: 0.44). Two
runs before the barrier: interleaved spreads 3.0 and 1.7 points, pipeline 0.79-0.91.

(Formula, uniform stages: 27.3 % and 15.8 %; lesson 02's first and last stages also carry the
embedding and the head, which the simulator fed with the CPU costs per stage accounts for.) The
replay ranks interleaved below 1F1B in every run, the wall clock in none: the wall-clock bubble is
the scheduler's. Under that load the 2-rank steps replayed to 0.07-0.42 of their wall-clock time:
the spans' own CPU time was half their wall time (the cores were shared after all), and 5-10 % of a
rank's CPU time falls outside spans (MPI's 1 ms spin while waiting, bookkeeping), which a replay
does not charge.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipar import trace as mtrace  # noqa: E402
from minipar.parallel.pipeline import make_schedule, simulate  # noqa: E402
from minipar.replay import cluster_named, replay  # noqa: E402
from minipar.span_costs import earlier_steps  # noqa: E402
from viz import analysis  # noqa: E402

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def _lesson(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"lesson_{name}", ROOT / "lessons" / name / "lesson.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def record(what: str, kind: str, chunks: int, out: str) -> None:
    """Under mpiexec: train and record the last step of ``what`` into ``out``."""
    from minipar.comm import world

    comm = world()
    if what == "pipeline":
        _lesson("02_pipeline").train(comm, kind, chunks, trace_path=out)
    else:
        ddp = _lesson("03_data_parallel")
        ddp.ddp_run(comm, "ring", 4, Path(out).parent)
        if comm.rank == 0:
            os.replace(Path(out).parent / "ddp_ring.json", out)


def run(ranks: int, what: str, kind: str, chunks: int, out: str) -> None:
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, __file__, "--record", what, "--kind", kind,
           "--chunks", str(chunks), "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def fb_bubble(trace: mtrace.Trace) -> float:
    """Mean over ranks of idle / (first F to last B): lesson 02's measure."""
    fb = [e for e in trace.events if e.kind == "compute" and e.name in ("F", "B")]
    return float(np.mean(analysis.bubble_fractions(mtrace.Trace(trace.meta, fb))))


def cpu_simulated(traces: list[mtrace.Trace], kind: str, p: int, m: int, v: int) -> float:
    """The simulator's bubble with the run's median CPU time per (virtual) stage for F and B (over every
    traced step: the replay pools the same spans)."""
    med = {op: [float(np.median([e.c1 - e.c0 for t in traces for e in t.select("compute", name=op, stage=s)]))
                for s in range(p * v)] for op in ("F", "B")}
    return simulate(make_schedule(kind, p, m, v), forward=med["F"], backward=med["B"]).bubble_fraction


def step_seconds(trace: mtrace.Trace) -> float:
    spans = [e for e in trace.events if e.kind in ("compute", "comm")]
    return max(e.t1 for e in spans) - min(e.t0 for e in spans)


def stability(runs: int, cluster: Any, folder: str) -> None:
    print(f"1. Stability: lesson 02, 4 ranks (mpiexec -n 4) on {os.cpu_count()} cores, {runs} runs, "
          f"replayed on {cluster.name}")
    print(f"{'schedule':<12} {'run':>3}  {'wall bubble':>11}  {'replayed':>8}  {'simulator (CPU F/B)':>19}")
    for kind, v in (("1f1b", 1), ("interleaved", 2)):
        rows = []
        for i in range(runs):
            path = os.path.join(folder, f"{kind}{i}.json")
            run(4, "pipeline", kind, v, path)
            t = mtrace.load(path)
            p, m, earlier = t.meta["p"], t.meta["m"], earlier_steps(path, t)
            rows.append((fb_bubble(t), fb_bubble(replay(t, cluster, samples=earlier)),
                         cpu_simulated([t, *earlier], kind, p, m, v)))
            print(f"{kind:<12} {i:>3}  {rows[-1][0]:>11.1%}  {rows[-1][1]:>8.1%}  {rows[-1][2]:>19.1%}")
        wall, rep, sim = (np.array(c) for c in zip(*rows, strict=True))
        print(f"{kind:<12} spread: wall clock {100 * np.ptp(wall):.1f} points, replay {100 * np.ptp(rep):.1f} "
              f"points; replay - simulator at most {100 * np.max(np.abs(rep - sim)):.1f} points")


def faithfulness(runs: int, cluster: Any, folder: str) -> None:
    print(f"\n2. Faithfulness: 2 ranks (mpiexec -n 2) on {os.cpu_count()} cores, replayed on {cluster.name}")
    print("replayed: by the default rules (the collectives' worker beside the rank's core, Python between "
          "spans free) and on the host (host=True: a rank's threads on its one core, all their CPU time)")
    print(f"{'step':<10} {'run':>3}  {'wall ms':>8}  {'replayed ms':>11}  {'/ wall':>6}  {'host ms':>8}  {'/ wall':>6}")
    for what, kind in (("pipeline", "1f1b"), ("ddp", "ring")):
        for i in range(runs):
            path = os.path.join(folder, f"{what}{i}.json")
            run(2, what, kind, 1, path)
            t = mtrace.load(path)
            earlier = earlier_steps(path, t)
            wall, rep = step_seconds(t), step_seconds(replay(t, cluster, samples=earlier))
            host = step_seconds(replay(t, cluster, samples=earlier, host=True))
            print(f"{what:<10} {i:>3}  {wall * 1e3:>8.2f}  {rep * 1e3:>11.2f}  {rep / wall:>6.2f}  "
                  f"{host * 1e3:>8.2f}  {host / wall:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cluster", default="local", help="a replay preset or cluster file (default local)")
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record:
        record(args.record, args.kind, args.chunks, args.out)
        return
    cluster = cluster_named(args.cluster)
    with tempfile.TemporaryDirectory() as folder:
        stability(args.runs, cluster, folder)
        faithfulness(args.runs, cluster, folder)


if __name__ == "__main__":
    main()
