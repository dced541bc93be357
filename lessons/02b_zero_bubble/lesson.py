"""Lesson 2b: zero-bubble pipelines. The backward split in two, and where the halves go.

    mpiexec -n 4 python lessons/02b_zero_bubble/lesson.py [--steps 3] [--microbatches 8]
    python lessons/02b_zero_bubble/lesson.py [--ranks 4]      # same, ranks as threads in one process

A backward computes two things: the gradient of its input (I), which the previous stage waits for,
and the gradient of its weights (W), which nobody waits for until the optimizer. Qi et al. 2024
("Zero Bubble Pipeline Parallelism") run them as two actions and move the W's into the holes 1F1B
leaves. The lesson trains the tiny GPT of lesson 2 under every schedule this checkout has:

- 1F1B (PipeDream-Flush, Narayanan et al. 2021): one B per micro-batch, B = I + W;
- ZB-H1 (Qi et al. 2024, Sec. 2.1, Fig. 3): 1F1B's order of F and I, each W run late enough that
  every rank keeps p micro-batches (1F1B's first rank's most): the last r W's of rank r fill the
  cool-down where 1F1B idles;
- ZB-V (Qi et al. 2024, Sec. 6): two chunks per rank in a V (stages r and 2p - 1 - r), no gap
  between a rank's first and last action when F = I = W;
- PipeDream (Narayanan et al. 2019, Sec. 3.3) and PipeDream-2BW (Narayanan et al. 2021, Sec. 3.1),
  asynchronous: 1F1B's order with a stage's own update (U) inside the step, after every backward
  (PipeDream: each micro-batch's forward and backward on the weight version its forward saw, weight
  stashing) or after every group of a >= p micro-batches (2BW: the version one update behind, a
  double buffer);
- Chimera (Li & Hoefler 2021, Sec. 3.1; ``chimera_part.py``, p even, m a multiple of p): two 1F1B
  pipelines, down on ranks 0..p-1 and up on p-1..0, m/2 micro-batches each, filling each other's
  bubbles; labelled F0↓ / F4↑, up drawn lighter and hatched (reversed colours in the terminal).

It prints, and draws in runs/02b_zero_bubble/report.html:

(1) every schedule simulated with unit costs F = I = W = 1 (1F1B's B = 2) on one shared time axis;
    ZB-H1's W's (teal) sit where 1F1B's cool-down idles (Fig. 3); Chimera also with F = B = 1 (table);
(2) every schedule run for real (``Pipeline``, the same executor for all), the last step traced,
    on one shared time axis (the report's "side by side");
(3) a table per schedule: the idle time per rank simulated and measured against the formula, in
    words: 1F1B idles (p - 1) times a forward plus a whole backward, (p - 1)(F + I + W); ZB-H1 gives
    back one W per hole, (p - 1)(F + I - W), a third of 1F1B's when F = I = W; the peak number of
    micro-batches each rank holds (from its F until its W) against ``cost.pipeline.peak_stash``
    (1F1B p - r, ZB-H1 p on every rank: the same peak memory as 1F1B's first rank; ZB-V 2p
    chunks, p whole stages; Chimera p/2 + 1 + min(r, p-1-r), idle (p - 2) F for F = B); the weight
    versions each stage holds at once: 1 for a synchronous schedule (Chimera too: its two replicas
    update alike), PipeDream p - r (one per micro-batch in flight), 2BW 2;
(4) the claim: every synchronous schedule gives the same losses as one process (a schedule changes
    the order of the work, never the result); PipeDream and 2BW do not (their updates inside the
    step use stale weights, by design): the versions stage 0 used are printed, and
    tests/test_pipedream.py holds them equal to a reference with the same stale versions.

Idle times are from the trace's F/B/I/W/U spans (window: first forward to last backward), replayed
(``--clock``, ``--cluster``: lessons/common.py's ``Clock``): each span lasts the CPU time its rank
spent in it and every rank has a core of its own, so 4 ranks on 2 cores rank the schedules as the
paper does, run after run; ``--clock wall`` shows the times as recorded, time-sharing included. The
simulator column plays the schedule with the run's median durations; the split backward costs a
little more than one B (two passes over the graph).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from lessons import load
from lessons.common import REPLAY, Clock, finish, lesson_parser, one_process, parse_lesson_args, run_ranks
from lessons.common import console as make_console
from minipar import datasets
from minipar import trace as mtrace
from minipar.cli_args import int_in
from minipar.cost import pipeline as pipeline_cost
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel import pipeline as pp
from minipar.parallel.pipeline import KINDS, Pipeline, Schedule, gpt, gpt_layer_counts, make_schedule, simulate

VOCAB, SEQ, D_MODEL, HEADS, BLOCKS = 32, 32, 64, 4, 8  # lesson 2's tiny GPT
BATCH, MICROBATCHES, LR = 32, 8, 3e-3
UNIT = {"forward": 1.0, "input": 1.0, "weight": 1.0}  # F = I = W = 1: 1F1B's B = 2
WANTED = ("1f1b", "zb-h1", "zb-v")  # in the order shown; those this checkout lacks are left out
ASYNC = ("pipedream", "2bw")  # asynchronous: a stage's update (U) inside the step, weight versions
STASHING = {"pipedream": "forward and backward on the same version: weight stashing; one update per micro-batch",
            "2bw": "each group of micro-batches on the version one update behind the newest: the double buffer"}
PIPELINE_OPS = ("F", "B", "I", "W", "U")
OUT = Path("runs/02b_zero_bubble")
chimera = load("02b_zero_bubble", "chimera_part.py")
tables = load("02b_zero_bubble", "tables.py")  # the lesson's tables and the report's figures of them
MODEL = {"vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL, "heads": HEADS, "blocks": BLOCKS}


def schedules() -> list[str]:
    """The schedules of ``WANTED`` that ``make_schedule`` knows, then the asynchronous ones."""
    return [k for k in WANTED if k in KINDS] + list(ASYNC)


def make(kind: str, p: int, m: int) -> Schedule:
    """``kind``'s schedule for ``p`` ranks and ``m`` micro-batches; 2BW updates every a micro-batches,
    the smallest a >= p that divides m (the paper's m >= d)."""
    if kind == "pipedream":
        return pp.asynchronous.pipedream(p, m)
    if kind == "2bw":
        return pp.asynchronous.pipedream_2bw(p, m, per_update=min(a for a in range(p, m + 1) if m % a == 0))
    return make_schedule(kind, p, m)


def stage_count(kind: str, p: int, m: int) -> int:
    """Virtual stages of ``kind`` on ``p`` ranks (ZB-V: 2 p, two chunks per rank)."""
    return pp.validate(make(kind, p, m)).virtual_stages


def formula_versions(kind: str, p: int) -> list[int]:
    """Weight versions stage r holds at once: PipeDream p - r (its micro-batches in flight, each on the
    version its forward used; Narayanan et al. 2019 Sec. 3.3, reached for m >= 2 (p - 1)), 2BW 2
    (Narayanan et al. 2021 Sec. 3.1), a synchronous schedule 1."""
    return [p - r if kind == "pipedream" else 2 if kind == "2bw" else 1 for r in range(p)]


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    stream = datasets.token_stream(20_000, VOCAB, seed=0)
    return [datasets.lm_batch(stream, BATCH, SEQ, step=s) for s in range(steps)]


def train(comm: Any, kind: str, steps: int = 3, microbatches: int = MICROBATCHES,
          trace_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Train the tiny GPT for ``steps`` steps under schedule ``kind``, the last step recorded into
    ``trace_path``; returns (on every rank) the losses and this rank's peak stash."""
    sched = make(kind, comm.size, microbatches)
    n_stages = stage_count(kind, comm.size, microbatches)

    def adamw(params: list) -> AdamW:
        return AdamW(params, lr=LR, weight_decay=0.0)

    stage_update = adamw if kind in ASYNC else None  # asynchronous: each stage's own AdamW in its U's
    pipe = Pipeline(comm, gpt(VOCAB, SEQ, D_MODEL, HEADS, BLOCKS, seed=0), sched,
                    layers=gpt_layer_counts(BLOCKS, n_stages), optimizer=stage_update)
    opt = None if stage_update else adamw(pipe.parameters())
    losses = []
    for step, (x, y) in enumerate(batches(steps)):
        if step < steps - 1:
            losses.append(pipe.step(x, y, opt))
            continue
        with mtrace.record(trace_path, comm, **pipe.trace_meta(), time_unit="s", step=step):
            losses.append(pipe.step(x, y, opt))
    seen = pipe.versions.seen if pipe.versions is not None else {}
    return {"losses": losses, "peak_stash": pipe.peak_stash, "seen": dict(seen)}


def reference(steps: int = 3) -> list[float]:
    """The same training in one process, on the whole batch (``minipar.nn.GPT``, same seed)."""
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, BLOCKS, seed=0)
    return one_process(model, AdamW(model.parameters(), lr=LR, weight_decay=0.0), batches(steps))


def formula_kind(kind: str) -> str:
    """The schedule whose formulas hold for ``kind``: PipeDream and 2BW run 1F1B's order of F and B."""
    return "1f1b" if kind in ASYNC else kind


def formula_idle(kind: str, p: int, f: float, i: float, w: float) -> float | None:
    """``cost.pipeline.bubble_time`` (idle per rank), or None when it has no formula for ``kind``."""
    try:
        return pipeline_cost.bubble_time(formula_kind(kind), p, f, i, w)
    except ValueError:
        return None


def formula_peaks(kind: str, p: int, m: int) -> list[int] | None:
    """``cost.pipeline.peak_stash`` per rank, or None when it has no formula for ``kind``."""
    try:
        return [pipeline_cost.peak_stash(formula_kind(kind), p, m, r) for r in range(p)]
    except ValueError:
        return None


def simulate_units(kind: str, p: int, m: int, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``kind`` played with F = I = W = 1 per rank's share of the model (B = 2; a schedule with v chunks
    per rank, ZB-V's 2, takes 1/v per chunk, so every schedule does the same work per rank): idle per
    rank, peak stash, and the formulas' (fed with the per-chunk times)."""
    v = stage_count(kind, p, m) // p
    f, i, w = UNIT["forward"] / v, UNIT["input"] / v, UNIT["weight"] / v
    sim = simulate(make(kind, p, m), forward=f, backward=i + w, weight=w)
    sim.trace.meta.update(schedule=f"{kind} (simulated, F = I = W = 1{f' per rank, 1/{v} per chunk' if v > 1 else ''})")
    if path is not None:
        mtrace.save(sim.trace, path)
    versions = [sim.peak_versions.get(r, 1) for r in range(p)]  # stage r on rank r (v = 1)
    return {"kind": kind, "v": v, "makespan": sim.makespan, "idle": [sim.idle[r] for r in range(p)],
            "formula": formula_idle(kind, p, f, i, w), "versions": versions,
            "peak": [sim.peak_stash[r] for r in range(p)], "formula_peak": formula_peaks(kind, p, m),
            "formula_versions": formula_versions(kind, p), "trace": sim.trace}


def medians(trace: mtrace.Trace, n_stages: int) -> dict[str, list[float]]:
    """Median duration of each op of the trace (F, B, I, W) per (virtual) stage, seconds."""
    out = {}
    for op in PIPELINE_OPS:
        per = [[e.duration for e in trace.select("compute", name=op, stage=s)] for s in range(n_stages)]
        if all(per):
            out[op] = [float(np.median(d)) for d in per]
    return out


def analyse(trace_path: str | os.PathLike[str], clock: Clock = REPLAY) -> dict[str, Any]:
    """One recorded run on ``clock`` (replayed by default) vs simulated vs formula."""
    from viz import analysis

    trace = clock.of(trace_path)
    kind, p, m = trace.meta["schedule"], trace.meta["p"], trace.meta["m"]
    work = mtrace.Trace(trace.meta, [e for e in trace.events if e.kind == "compute" and e.name in PIPELINE_OPS])
    lo, hi = analysis.window(work)
    idle = [(hi - lo) * f for f in analysis.bubble_fractions(work)]
    med = medians(trace, stage_count(kind, p, m))
    split = "W" in med
    backward = [i + w for i, w in zip(med["I"], med["W"], strict=True)] if split else med["B"]
    sim = simulate(make(kind, p, m), forward=med["F"], backward=backward, weight=med.get("W"),
                   update=med.get("U", 0.0))
    f, b = float(np.mean(med["F"])), float(np.mean(backward))
    w = float(np.mean(med["W"])) if split else 0.0  # 1F1B: (p-1)(F + I + W) = (p-1)(F + B)
    peaks = [max((e.args["stashed"] for e in trace.select("memory", name="activations", rank=r)), default=0)
             for r in range(p)]
    versions = [max((e.args["versions"] for e in trace.select("memory", name="weight_versions", stage=s)),
                    default=1) for s in range(p)]  # recorded at each U; a synchronous stage keeps 1
    return {"kind": kind, "step": hi - lo, "idle": idle, "sim_idle": [sim.idle[r] for r in range(p)],
            "formula": formula_idle(kind, p, f, b - w, w), "F": f, "B": b, "W": w if split else None,
            "peak": peaks, "sim_peak": [sim.peak_stash[r] for r in range(p)],
            "formula_peak": formula_peaks(kind, p, m), "versions": versions}


def check_ranks(p: int, microbatches: int = MICROBATCHES) -> str | None:
    """What is wrong with running the lesson on ``p`` ranks, or None."""
    if p < 2 or 2 * p > BLOCKS or microbatches < p:
        return (f"lesson 2b needs 2 or more ranks with {BLOCKS} blocks >= 2 chunks x ranks (ZB-V) and "
                f"{microbatches} micro-batches >= ranks (the formulas' m >= p); got {p} ranks: run it on 2, 3 or 4")
    return None


def print_unit_timelines(console: Console, units: list[dict[str, Any]]) -> None:
    from viz.terminal import print_timeline

    for row in units:
        if row["kind"] in ("1f1b", "zb-h1", "chimera"):
            print_timeline(row["trace"], console=console, title=f"{row['kind']}, F = I = W = 1 (simulated)")


def run(comm: Any, steps: int, m: int, clock: Clock = REPLAY) -> None:
    """Every schedule simulated, then run on ``comm``; rank 0 prints (times on ``clock``) and writes the report."""
    console = make_console()
    p, lead, kinds = comm.size, comm.rank == 0, schedules()
    runs, units = kinds + [chimera.KIND] * chimera.fits(p, m), []
    if lead:
        (OUT / "simulated").mkdir(parents=True, exist_ok=True)
        console.print(f"[bold]tiny GPT[/bold] ({VOCAB} tokens, seq {SEQ}, d_model {D_MODEL}, {BLOCKS} blocks) on {p} "
                      f"pipeline ranks, batch {BATCH} = {m} micro-batches, {steps} steps per schedule; schedules: "
                      f"{', '.join(runs)}{'' if chimera.KIND in runs else ' (chimera: p even, m a multiple of p)'}",
                      highlight=False)
        console.rule("[bold](1) simulated with unit costs F = I = W = 1")
        units = [simulate_units(k, p, m, OUT / "simulated" / f"{k}.json") for k in kinds]
        if chimera.KIND in runs:  # the lesson's costs (F = 1, B = I + W = 2), then the paper's equal slots
            units += chimera.unit_rows(p, m, UNIT["forward"], UNIT["input"] + UNIT["weight"], OUT / "simulated")
        print_unit_timelines(console, units)
        console.print(tables.unit_table(units, p), *[chimera.claim(units, p, m)] * (chimera.KIND in runs),
                      highlight=False)
    rows, losses, paths, seen = [], {}, [], {}
    for kind in runs:
        path, is_chimera = OUT / f"{kind}.json", kind == chimera.KIND
        result = (chimera.train(comm, steps, m, MODEL, LR, batches(steps), path) if is_chimera
                  else train(comm, kind, steps, m, path))
        if lead:
            rows.append(chimera.analyse(path, clock) if is_chimera else analyse(path, clock))
            losses[kind], seen[kind] = result["losses"], result["seen"]
            paths.append(path)
    if not lead:
        return
    console.rule(f"[bold](2) the real runtime, last step, {clock.short}")
    note = clock.caveat(p)
    if note:
        console.print(f"[yellow]note:[/yellow] {note}: compare the simulator column with the formula.",
                      highlight=False)
    console.print(tables.measured_table(rows, clock))
    print_claims(console, losses, seen, reference(steps), m)
    from viz import figures

    shown = [row for row in units if row["kind"] != chimera.PAPER]  # one cost model on the shared axis
    sim_fig = figures.compare([row["trace"] for row in shown], [f"{row['kind']}: simulated, F = I = W = 1"
                                                               for row in shown])
    extra = [("(1) simulated with unit costs F = I = W = 1 (1F1B: B = 2), one time axis: ZB-H1's W's "
              "(teal) fill 1F1B's cool-down; Chimera's up pipeline lighter and hatched (F4↑)", sim_fig),
             ("(3) idle per rank, stash and weight versions per schedule vs the formulas",
              tables.table_figure(units, rows, clock.short))]
    if any(k in ASYNC for k in kinds):
        extra.append((f"weight versions each stage holds over the last step ({clock.label}): PipeDream p - r, "
                      "2BW 2", tables.versions_figure([clock.of(OUT / f"{k}.json") for k in kinds if k in ASYNC])))
    if chimera.KIND in runs:
        chimera.print_measured(console, clock.of(OUT / "chimera.json"), clock.short)
    console.rule(f"[bold]ZB-H1 timeline (last step, {clock.short})")
    finish(paths, OUT / "report.html", console, timeline=OUT / "zb-h1.json",
           titles=[f"{k}: the runtime (last step)" for k in runs], extra_figures=extra, clock=clock)


def print_claims(console: Console, losses: dict[str, list[float]], seen: dict[str, dict], ref: list[float],
                 m: int) -> None:
    """(4): the synchronous schedules' losses equal one process's; the asynchronous ones train on stale
    weights, by design: the versions stage 0 used, and their losses."""
    sync = [k for k in losses if k not in ASYNC]
    spread = max(abs(a - b) for k in sync for a, b in zip(losses[k], ref, strict=True))
    console.print(f"(4) {', '.join(sync)} give the same losses as one process (largest difference {spread:.1e} over "
                  "every step): a synchronous schedule changes the order of the work, never the result.",
                  highlight=False)
    for kind in (k for k in ASYNC if k in losses):
        used = [seen[kind][(0, i)][0] for i in range(m)]
        console.print(f"    {kind}: stage 0 ran micro-batches 0..{m - 1} of the last step on weight versions {used} "
                      f"({STASHING[kind]}); losses "
                      f"{' '.join(f'{x:.4f}' for x in losses[kind])} vs one process's "
                      f"{' '.join(f'{x:.4f}' for x in ref)}: updates inside the step, on stale weights "
                      "(tests/test_pipedream.py holds them equal to a reference with the same stale versions)",
                      highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = lesson_parser(__doc__, steps=3, ranks=4)
    parser.add_argument("--microbatches", type=int_in(1, 1024), default=MICROBATCHES)
    return parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks, a.microbatches))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_ranks(run, args.ranks, lambda p: check_ranks(p, args.microbatches), steps=args.steps, m=args.microbatches,
              clock=Clock.of_args(args))


if __name__ == "__main__":
    main()
