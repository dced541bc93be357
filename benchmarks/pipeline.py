"""Pipeline schedules on 2 ranks: measured wall-clock bubble against the simulator's prediction.

    OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/pipeline.py

A tiny GPT (d_model 128, 4 blocks, seq 64) trains with naive, GPipe, 1F1B (m = 8) and interleaved
1F1B (v = 2, m = 8) on p = 2 ranks, one rank per core. The schedules alternate round by round
(``--rounds`` measured steps each, after one warm-up step), every measured step is traced, and per
schedule the script prints the median over rounds of:

- the step time (first F to last B, all ranks) and its speed-up over naive;
- the measured bubble: idle share of that F/B window, mean over ranks (``viz.analysis``);
- the simulator's bubble for the same schedule with the per-stage F and B durations measured in
  that very step (what the schedule costs given this machine's stage times, latency 0);
- the formula for uniform stages, (p - 1)/p naive, (p - 1)/(v m + p - 1) otherwise (= the simulator
  with F = 1, B = 2);
- peak stashed micro-batches per rank (memory samples) and the simulator's.

The gap between measured and simulated is what the simulator leaves out: message latency, the time
a rank spends in send/receive bookkeeping, and noise from other processes on the cores.

Measured on the 2-core machine (two runs, other processes active; step times vary run to run, the
bubbles do not):

===============  ==========  ===============  ============  =======  =====
schedule         vs naive    bubble measured  simulator     formula  stash
===============  ==========  ===============  ============  =======  =====
naive            1.00x       50.8%, 51.1%     50.0%, 50.0%  50.0%    1 1
GPipe            1.07-1.47x  14.7%, 14.7%     17.3%, 14.3%  11.1%    8 8
1F1B             1.43-1.65x  14.2%, 14.8%     12.5%, 12.3%  11.1%    2 1
interleaved v=2  1.31-1.78x  9.0%, 9.6%       6.1%, 6.1%    5.9%     5 3
===============  ==========  ===============  ============  =======  =====

Measured stash equals the simulator's in every run; the measured bubble is within 4 points of the
simulator's (mostly above it: message latency and bookkeeping), and interleaving lowers it as
predicted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minipar import datasets  # noqa: E402
from minipar import trace as mtrace  # noqa: E402
from minipar.comm import world  # noqa: E402
from minipar.optim import SGD  # noqa: E402
from minipar.parallel.pipeline import Pipeline, gpt, gpt_layer_counts, make_schedule, simulate  # noqa: E402

VOCAB, SEQ, D_MODEL, HEADS, BLOCKS, BATCH = 64, 64, 128, 4, 4, 32
SCHEDULES = (("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
OUT = Path("runs/bench_pipeline")


def analyse(trace: mtrace.Trace, kind: str, p: int, m: int, v: int) -> dict[str, object]:
    """Measured bubble, step, stash of one traced step, and the simulator's with its F/B durations."""
    from viz import analysis

    fb = [e for e in trace.events if e.kind == "compute" and e.name in ("F", "B")]
    sub = mtrace.Trace(trace.meta, fb)
    lo, hi = analysis.window(sub)
    n_stages = p * v
    fwd, bwd = ([statistics.median(e.duration for e in fb if e.name == op and e.stage == s)
                 for s in range(n_stages)] for op in ("F", "B"))
    sched = make_schedule(kind, p, m, v)
    sim = simulate(sched, forward=fwd, backward=bwd)
    peaks = [max(e.args["stashed"] for e in trace.select("memory", name="activations", rank=r))
             for r in range(p)]
    return {"step": hi - lo, "measured": float(np.mean(analysis.bubble_fractions(sub))),
            "simulated": sim.bubble_fraction, "formula": simulate(sched).bubble_fraction,
            "work": sum(e.duration for e in fb), "peak": peaks, "F": fwd, "B": bwd,
            "sim_peak": [sim.peak_stash[r] for r in range(p)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    comm = world()
    p, m = comm.size, args.microbatches
    lead = comm.rank == 0
    if lead:
        OUT.mkdir(parents=True, exist_ok=True)
    stream = datasets.token_stream(50_000, VOCAB, seed=0)
    pipes = {}
    for kind, v in SCHEDULES:
        model = gpt(VOCAB, SEQ, D_MODEL, HEADS, BLOCKS, seed=0)
        pipe = Pipeline(comm, model, kind, microbatches=m, chunks=v, layers=gpt_layer_counts(BLOCKS, p * v))
        pipes[kind] = (pipe, SGD(pipe.parameters(), lr=0.01), v)
        pipe.step(*datasets.lm_batch(stream, BATCH, SEQ, step=0), pipes[kind][1])  # warm-up
    results: dict[str, list[dict[str, object]]] = {kind: [] for kind, _ in SCHEDULES}
    for r in range(args.rounds):
        x, y = datasets.lm_batch(stream, BATCH, SEQ, step=r + 1)
        for kind, _ in SCHEDULES:
            pipe, opt, v = pipes[kind]
            path = OUT / f"{kind}.json"
            with mtrace.record(path, comm, **pipe.trace_meta(), time_unit="s"):
                pipe.step(x, y, opt)
            if lead:
                results[kind].append(analyse(mtrace.load(path), kind, p, m, v))
    if not lead:
        return
    fields = ("step", "work", "measured", "simulated", "formula")
    med = {k: {f: statistics.median(row[f] for row in rows) for f in fields} for k, rows in results.items()}
    print(f"pipeline schedules, p = {p} ranks, m = {m} micro-batches of {BATCH // m} x {SEQ} tokens, "
          f"GPT d_model {D_MODEL}, {BLOCKS} blocks; median of {args.rounds} rounds;\nbubble = idle share "
          "of the F/B window; work = sum of F/B span times over ranks")
    head = f"{'schedule':<16}{'step':>9}{'vs naive':>9}{'work':>9}{'measured':>10}{'simulated':>10}" \
           f"{'formula':>9}{'meas-sim':>9}  {'stash (sim)':<14}F / B per stage (ms)"
    print(head)
    print("-" * len(head))
    for kind, v in SCHEDULES:
        row, last = med[kind], results[kind][-1]
        name = kind + (f" v={v}" if v > 1 else "")
        stash = f"{last['peak']} ({last['sim_peak']})".replace(" ", "")
        durs = " ".join(f"{1e3 * f:.1f}/{1e3 * b:.1f}" for f, b in zip(last["F"], last["B"], strict=True))
        print(f"{name:<16}{1e3 * row['step']:7.1f}ms{med['naive']['step'] / row['step']:8.2f}x"
              f"{1e3 * row['work']:7.0f}ms"
              f"{100 * row['measured']:9.1f}%{100 * row['simulated']:9.1f}%{100 * row['formula']:8.1f}%"
              f"{100 * (row['measured'] - row['simulated']):+8.1f}%  {stash:<14}{durs}")
    print(f"traces of the last round: {OUT}/<schedule>.json")


if __name__ == "__main__":
    main()
