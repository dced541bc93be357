"""Lesson 2b: zero-bubble pipelines. The backward split in two, and where the halves go.

    mpiexec -n 4 python lessons/02b_zero_bubble/lesson.py [--steps 2] [--microbatches 8] [--verbose]
    python lessons/02b_zero_bubble/lesson.py [--ranks 4]      # same, ranks as threads in one process

A backward computes the gradient of its input (I), which the previous stage waits for, and of its
weights (W), which nobody waits for until the optimizer. Qi et al. 2024 run them as two actions and
move the W's into the holes 1F1B leaves. Idle per rank and peak stash (``minipar.cost.pipeline``):

- 1F1B (Narayanan et al. 2021): B = I + W, idle (p - 1)(F + I + W), stash p - r; ZB-H1 (Qi et al.
  2024, Sec. 2.1, Fig. 3): 1F1B's order of F and I, rank r's last r W's in the cool-down: (p - 1)
  (F + I - W), a third of 1F1B's when F = I = W; stash p on every rank;
- ZB-H2 (Sec. 2.2): rank r starts with 2(p - r) - 1 forwards, W's fill the rest: no gap inside a
  rank's step once m >= 2p - 1, at a stash of min(2p - 1, m) micro-batches;
- ZB-V (Sec. 6): two chunks per rank in a V: (p - 1) F when F = I = W; 2p chunk-micro-batches;
- DualPipeV (DeepSeek-V3 report 2024; m >= 2p): ZB-V's V in DualPipe's order, each overlapped pair
  run F then B: (p - 1) F when F = I = W; 2p + 1 chunk-micro-batches (the report's PP + 1);
- PipeDream (Narayanan et al. 2019) and PipeDream-2BW (2021), asynchronous: 1F1B's order with each
  stage's update (U) inside the step: p - r weight versions on stage r, resp. 2; their losses differ
  from one process's by design (tests/test_pipedream.py holds them to the same stale versions);
- Chimera (Li & Hoefler 2021; p even, m a multiple of p): two 1F1B pipelines, down on ranks 0..p-1
  and up on p-1..0, each filling the other's bubbles: (p - 2) F with F = B, stash p/2 + 1 +
  min(r, p-1-r); drawn F0↓ / F4↑ (up lighter and hatched, reversed in the terminal).

By default: (1) every schedule simulated with unit costs F = I = W = 1 against the formulas; (2) 1F1B
and ZB-H1 run for real (``Pipeline``, last step traced and replayed: ``--clock``, ``--cluster``)
against the simulator fed with their durations; (3) their losses equal one process's; and the figure,
1F1B's and ZB-H1's unit-cost timelines one above the other (the paper's Fig. 3). ``--verbose`` runs
every schedule for real, with weight versions, stale losses and measured timelines. The report
(runs/02b_zero_bubble/report.html) draws the unit-cost schedules on one axis, every run and the tables.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from lessons import common
from lessons.common import REPLAY, Clock
from lessons.common import console as make_console
from minipar import trace as mtrace
from minipar.cli_args import int_in
from minipar.cost import pipeline as pipeline_cost
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel import pipeline as pp
from minipar.parallel.pipeline import Chimera, Pipeline, Schedule, gpt, gpt_layer_counts, make_schedule, simulate
from minipar.parallel.pipeline.chimera import DIRECTIONS, simulate_chimera
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, BLOCKS = 32, 32, 64, 4, 8  # lesson 2's tiny GPT
BATCH, MICROBATCHES, LR, STEPS = 32, 8, 3e-3, 2
SYNC, ASYNC, CHIMERA = ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"), ("pipedream", "2bw"), "chimera"
BRIEF = ("1f1b", "zb-h1")  # run for real by default (the paper's Fig. 3 pair); --verbose: every schedule
PAPER = "chimera, F = B = 1"  # Chimera with the paper's equal slots, where its formulas hold
# where the idle formula holds
RANGE = {"zb-h1": "W<=F,I only", "zb-h2": "m>=2p-1, W<=F,I", "zb-v": "F=I=W only", "dualpipev": "F=I=W only",
         CHIMERA: "F=B only"}
STASHING = {"pipedream": "forward and backward on the same version: weight stashing",
            "2bw": "a group of micro-batches on the version one update behind: the double buffer"}
OPS = ("F", "B", "I", "W", "U")
OUT = Path("runs/02b_zero_bubble")


def make(kind: str, p: int, m: int) -> Schedule:
    """``kind``'s schedule; 2BW updates every a micro-batches, the smallest a >= p dividing m (m >= d)."""
    if kind == "pipedream":
        return pp.asynchronous.pipedream(p, m)
    if kind == "2bw":
        return pp.asynchronous.pipedream_2bw(p, m, per_update=min(a for a in range(p, m + 1) if m % a == 0))
    return make_schedule(kind, p, m)


def stage_count(kind: str, p: int, m: int) -> int:
    """Stages of one model replica (ZB-V: 2 p, two chunks per rank; Chimera: p per direction)."""
    return p if kind == CHIMERA else pp.validate(make(kind, p, m)).virtual_stages


def train(comm: Any, kind: str, steps: int = STEPS, microbatches: int = MICROBATCHES,
          trace_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Train the tiny GPT for ``steps`` steps under ``kind`` (Chimera too), the last step recorded into
    ``trace_path``; returns (on every rank) the losses, this rank's peak stash and the weight versions
    each (stage, micro-batch) used (asynchronous schedules)."""
    p, m = comm.size, microbatches
    model = gpt(VOCAB, SEQ, D_MODEL, HEADS, BLOCKS, seed=0)
    layers = gpt_layer_counts(BLOCKS, stage_count(kind, p, m))

    def adamw(params: list) -> AdamW:
        return AdamW(params, lr=LR, weight_decay=0.0)

    if kind == CHIMERA:  # one AdamW per replica; the replicas all-reduce their gradients first
        pipe: Any = Chimera(comm, model, m, layers=layers, optimizer=adamw)
        meta = {"paradigm": "pipeline", "schedule": kind, "p": p, "m": m, "v": 2, "chunk_names": list(DIRECTIONS),
                "activation_unit": "bytes"}
        step = pipe.step
    else:  # asynchronous: each stage's own AdamW in its U's
        pipe = Pipeline(comm, model, make(kind, p, m), layers=layers, optimizer=adamw if kind in ASYNC else None)
        opt = None if kind in ASYNC else adamw(pipe.parameters())
        meta = pipe.trace_meta()

        def step(x: np.ndarray, y: np.ndarray) -> float:
            return pipe.step(x, y, opt)

    *first, last = common.lm_batches(steps, VOCAB, BATCH, SEQ)
    losses = [step(x, y) for x, y in first]
    with mtrace.record(trace_path, comm, **meta, time_unit="s", step=steps - 1):
        losses.append(step(*last))
    versions = getattr(pipe, "versions", None)
    return {"losses": losses, "peak_stash": pipe.peak_stash, "seen": dict(versions.seen) if versions else {}}


def reference(steps: int = STEPS) -> list[float]:
    """The same training in one process, on the whole batch (``minipar.nn.GPT``, same seed)."""
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, BLOCKS, seed=0)
    return common.one_process(model, AdamW(model.parameters(), lr=LR, weight_decay=0.0),
                              common.lm_batches(steps, VOCAB, BATCH, SEQ))


def formula_idle(kind: str, p: int, f: float, i: float, w: float) -> float | None:
    """Idle per rank by ``cost.pipeline`` (PipeDream and 2BW: 1F1B's order), None outside its range."""
    try:
        if kind == CHIMERA:
            return pipeline_cost.chimera_bubble_time(p, f, i + w)
        return pipeline_cost.bubble_time("1f1b" if kind in ASYNC else kind, p, f, i, w)
    except ValueError:
        return None


def simulate_units(kind: str, p: int, m: int, path: str | os.PathLike[str] | None = None,
                   backward: float = 2.0) -> dict[str, Any]:
    """``kind`` played with F = 1 and B = I + W = ``backward`` (I = W) per rank's share of the model (a
    schedule with v chunks per rank, ZB-V's 2, takes 1/v per chunk): step, idle per rank, bubble share,
    peak stash and weight versions, with the formulas'. Chimera with ``backward=1``: the paper's slots."""
    v = stage_count(kind, p, m) // p
    f, i = 1.0 / v, backward / 2 / v
    if kind == CHIMERA:
        sim, name = simulate_chimera(p, m, f, backward), PAPER if backward == f else kind
    else:
        sim, name = simulate(make(kind, p, m), forward=f, backward=2 * i, weight=i), kind
    per_chunk = f" per rank, 1/{v} per chunk" if v > 1 else ""
    sim.trace.meta.update(schedule=f"{kind} (simulated, F = 1, B = {backward:g}{per_chunk})")
    if path is not None:
        mtrace.save(sim.trace, path)
    return {"kind": name, "v": v, "makespan": sim.makespan, "share": sim.bubble_fraction, "trace": sim.trace,
            "idle": [sim.idle[r] for r in range(p)], "formula": formula_idle(kind, p, f, i, i),
            "peak": [sim.peak_stash[r] for r in range(p)], "formula_peak": pipeline_cost.stash_peaks(kind, p, m),
            "versions": [sim.peak_versions.get(r, 1) for r in range(p)],
            "formula_versions": [pipeline_cost.weight_versions(kind, p, r) for r in range(p)]}


def analyse(trace_path: str | os.PathLike[str], clock: Clock = REPLAY) -> dict[str, Any]:
    """One recorded run on ``clock`` (replayed by default): idle per rank in the F/B/I/W/U window, against
    the simulator fed with the run's median durations per stage and the formula fed with their means."""
    from viz import analysis

    trace = clock.of(trace_path)
    kind, p, m = trace.meta["schedule"], trace.meta["p"], trace.meta["m"]
    work = mtrace.Trace(trace.meta, [e for e in trace.events if e.kind == "compute" and e.name in OPS])
    lo, hi = analysis.window(work)
    per = {op: [[e.duration for e in work.select("compute", name=op, stage=s)] for s in range(stage_count(kind, p, m))]
           for op in OPS}
    med = {op: [float(np.median(d)) for d in ds] for op, ds in per.items() if all(ds)}
    backward = [i + w for i, w in zip(med["I"], med["W"], strict=True)] if "W" in med else med["B"]
    f, b, w = float(np.mean(med["F"])), float(np.mean(backward)), float(np.mean(med.get("W", [0.0])))
    sim = simulate_chimera(p, m, f, b) if kind == CHIMERA else simulate(
        make(kind, p, m), forward=med["F"], backward=backward, weight=med.get("W"), update=med.get("U", 0.0))
    held = [[e.args["stashed"] for e in trace.select("memory", name="activations", rank=r)] for r in range(p)]
    versions = [max((e.args["versions"] for e in trace.select("memory", name="weight_versions", stage=s)), default=1)
                for s in range(p)]  # recorded at each U; a synchronous stage keeps 1
    return {"kind": kind, "step": hi - lo, "idle": [(hi - lo) * x for x in analysis.bubble_fractions(work)],
            "sim_idle": [sim.idle[r] for r in range(p)], "formula": formula_idle(kind, p, f, b - w, w), "F": f, "B": b,
            "W": w if "W" in med else None, "peak": [max(h, default=0) for h in held],
            "sim_peak": [sim.peak_stash[r] for r in range(p)], "formula_peak": pipeline_cost.stash_peaks(kind, p, m),
            "versions": versions}


def _ints(xs: list[int]) -> str:
    return " ".join(map(str, xs))


def unit_table(rows: list[dict[str, Any]], p: int, verbose: bool) -> Table:
    """(1): the schedules simulated with unit costs against the formulas; weight versions with ``verbose``."""
    cells = []
    for row in rows:
        formula = RANGE.get(row["kind"].split(",")[0], "-") if row["formula"] is None else f"{row['formula']:g}"
        cells.append((row["kind"] + (f" (v={row['v']})" if row["v"] > 1 else ""), f"{row['makespan']:g}",
                      " ".join(f"{x:g}" for x in row["idle"]), formula, _ints(row["peak"]), _ints(row["formula_peak"]),
                      *((_ints(row["versions"]), _ints(row["formula_versions"])) if verbose else ())))
    caption = "stash: micro-batches held from F to W (B); v=2: two half-size chunks per rank" + (
        "; Chimera: both directions'; versions: PipeDream p - r, 2BW 2, synchronous 1" if verbose else "")
    return Table.of(f"(1) simulated with unit costs F = I = W = 1 (B = 2), p = {p}: idle per rank (in units of F) and "
                    "peak stash vs the formulas", ("schedule", "step", "idle per rank", "formula", "peak stash",
                                                   "formula", *(("weight versions", "formula") if verbose else ())),
                    cells, text=0, caption=caption)


def measured_table(rows: list[dict[str, Any]], clock: Clock = REPLAY, verbose: bool = True) -> Table:
    """(2): the real runs, last step, times on ``clock``, against the simulator and the formula fed with their
    durations; the weight versions each stage held with ``verbose``."""
    cells = []
    for row in rows:
        formula = RANGE.get(row["kind"], "-") if row["formula"] is None else f"{1e3 * row['formula']:.0f}"
        durations = " / ".join(f"{1e3 * x:.1f}" for x in (row["F"], row["B"], row["W"]) if x is not None)
        cells.append((row["kind"], durations, *(f"{1e3 * np.mean(row[k]):.0f}" for k in ("idle", "sim_idle")),
                      formula, *(_ints(row[k]) for k in ("peak", "formula_peak", "versions")[:2 + verbose])))
    return Table.of(f"(2) the runtime, last step ({clock.label}): ms, idle per rank (mean of the ranks)",
                    ("schedule", "F / B / W", "idle", "sim.", "formula", "stash", "formula", *("versions",) * verbose),
                    cells, text=0, caption="F, B = I + W, W: medians per action; sim.: simulated with them; formula: "
                    "with their means; stash: micro-batches")


def print_claims(console: Console, losses: dict[str, list[float]], seen: dict[str, dict], ref: list[float],
                 m: int) -> None:
    """(3): the synchronous schedules' losses equal one process's; the asynchronous ones train on stale weights."""
    sync = [k for k in losses if k not in ASYNC]
    spread = max(abs(a - b) for k in sync for a, b in zip(losses[k], ref, strict=True))
    console.print(f"(3) {', '.join(sync)} give one process's losses (largest difference {spread:.1e} over "
                  f"{len(ref)} steps): a synchronous schedule changes the order of the work, never the result.",
                  highlight=False)
    for kind in (k for k in ASYNC if k in losses):
        console.print(f"    {kind}: stage 0 ran the last step's micro-batches on weight versions "
                      f"{[seen[kind][(0, i)][0] for i in range(m)]} ({STASHING[kind]}); losses "
                      f"{' '.join(f'{x:.4f}' for x in losses[kind])}, one process's "
                      f"{' '.join(f'{x:.4f}' for x in ref)}", highlight=False)


def check_ranks(p: int, microbatches: int = MICROBATCHES) -> str | None:
    """What is wrong with running the lesson on ``p`` ranks, or None."""
    if p < 2 or 2 * p > BLOCKS or microbatches < p:
        return (f"lesson 2b needs 2 or more ranks with {BLOCKS} blocks >= 2 chunks x ranks (ZB-V) and "
                f"{microbatches} micro-batches >= ranks (the formulas' m >= p); got {p} ranks: run it on 2, 3 or 4")
    return None


def run(comm: Any, steps: int, m: int, clock: Clock = REPLAY, verbose: bool = False) -> None:
    """Every schedule simulated, then run on ``comm`` (1F1B and ZB-H1, every one with ``verbose``); rank 0 prints
    (times on ``clock``) and writes the report."""
    from viz import figures
    from viz.terminal import print_timeline

    console, p, lead = make_console(), comm.size, comm.rank == 0
    kinds = [*(k for k in SYNC if k != "dualpipev" or m >= 2 * p), *ASYNC,  # DualPipeV needs m >= 2p
             *[CHIMERA] * (p % 2 == 0 and m % p == 0)]  # Chimera: chimera.check_config
    runs = kinds if verbose else list(BRIEF)
    if lead:
        (OUT / "simulated").mkdir(parents=True, exist_ok=True)
        console.print(f"[bold]tiny GPT[/bold] ({BLOCKS} blocks) on {p} ranks, {m} micro-batches; simulated: "
                      f"{', '.join(kinds)}; run, {steps} step{'s' * (steps > 1)} each: {', '.join(runs)}"
                      f"{'' if verbose else ' (--verbose: all)'}", highlight=False)
        units = [simulate_units(k, p, m, OUT / "simulated" / f"{k}.json") for k in kinds]
        if CHIMERA in kinds:  # with the paper's equal slots too
            units.append(simulate_units(CHIMERA, p, m, backward=1.0))
        shown = [u for u in units if verbose or u["kind"] not in (*ASYNC, CHIMERA)]  # the paper's Chimera
        console.print(unit_table(shown, p, verbose))
    rows, losses, seen = [], {}, {}
    for kind in runs:
        result = train(comm, kind, steps, m, OUT / f"{kind}.json")
        if lead:
            rows.append(analyse(OUT / f"{kind}.json", clock))
            losses[kind], seen[kind] = result["losses"], result["seen"]
    if not lead:
        return
    common.print_note(console, clock.caveat(p), ": compare the sim. column with the formula.")
    console.print(measured_table(rows, clock, verbose))
    print_claims(console, losses, seen, reference(steps), m)
    async_runs = [clock.of(OUT / f"{k}.json") for k in runs if k in ASYNC]
    extra = [("(1) simulated with unit costs F = I = W = 1 (1F1B: B = 2), one time axis: ZB-H1's W's (teal) fill "
              "1F1B's cool-down; Chimera's up pipeline lighter and hatched (F4↑)",
              figures.compare([u["trace"] for u in units if u["kind"] != PAPER],
                              [f"{u['kind']}: simulated, F = I = W = 1" for u in units if u["kind"] != PAPER])),
             ("(1) the table", figures.table(unit_table(units, p, verbose=True))),
             (f"(2) the table ({clock.label})", figures.table(measured_table(rows, clock)))]
    if async_runs:
        extra.append((f"(2) weight versions each stage holds over the last step ({clock.label}): PipeDream p - r, "
                      "2BW 2", figures.weight_versions(async_runs)))
    if verbose:
        for kind in (k for k in (CHIMERA, "zb-h1") if k in runs):
            console.rule(f"[bold]{kind} timeline (last step, {clock.short})")
            print_timeline(clock.of(OUT / f"{kind}.json"), console=console)
    console.rule("[bold]1F1B, then ZB-H1, simulated with F = I = W = 1 (Qi et al.'s Fig. 3)")
    print_timeline(units[0]["trace"], console=console, max_bands=2, traffic=False)  # as finish(brief=True)
    common.finish([OUT / f"{k}.json" for k in runs], OUT / "report.html", console, timeline=units[1]["trace"],
                  titles=[f"{k}: the runtime (last step)" for k in runs], extra_figures=extra, clock=clock,
                  brief=True)
    console.print(common.reading_path("02b_zero_bubble"), highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=STEPS, ranks=4)
    parser.add_argument("--microbatches", type=int_in(1, 1024), default=MICROBATCHES)
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks, a.microbatches))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.run_lesson(run, args, lambda p: check_ranks(p, args.microbatches), m=args.microbatches)


if __name__ == "__main__":
    main()
