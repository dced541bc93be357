"""Lesson 2: pipeline parallelism. One tiny GPT, four schedules, the bubble measured and predicted.

    mpiexec -n 4 python lessons/02_pipeline/lesson.py [--steps 4] [--microbatches 8] [--verbose]
    python lessons/02_pipeline/lesson.py [--ranks 4]      # same, ranks as threads in one process

The GPT's layers ([embed] + 8 blocks + [ln_f + head] = 10) are cut into consecutive stages, one
per rank (two "model chunks" per rank for the interleaved schedule), the blocks spread evenly and
the light embedding and head riding with the first and last stage's blocks. Each schedule trains
the same model from the same initial values on the same batches (so every schedule prints the same
loss); only the order of the forwards (F) and backwards (B) differs:

- naive model parallelism: one micro-batch in flight, bubble (p - 1)/p;
- GPipe (Huang et al. 2018): all forwards, then all backwards; bubble (p - 1)/(m + p - 1); every
  rank stashes all m micro-batches;
- 1F1B / PipeDream-Flush (Narayanan et al. 2021, section 2.2.1): same bubble, at most p - rank stashed;
- interleaved 1F1B (section 2.2.2): v chunks per rank, bubble (p - 1)/(v m + p - 1).

By default the lesson prints one row per schedule (the bubble fraction of the trace's F/B spans next
to the formula and to the simulator fed with the run's per-stage durations, the peak number of
stashed micro-batches next to the simulator's; interleaved counts chunk micro-batches, each half a
rank's layers), the claim that every schedule gives the same losses, and the 1F1B timeline;
``--verbose`` adds each schedule's section (what rank 0 holds, the per-rank action order, the median
F and B per stage) and the timeline's traffic table. Times are replayed (``--clock``,
``--cluster``: lessons/common.py's ``Clock``): each span lasts the CPU time its rank spent in it and
every rank has a core of its own, so the bubbles mean the same run after run even when 4 ranks
share 2 cores; ``--clock wall`` shows the times as recorded, time-sharing included. It writes
runs/02_pipeline/<schedule>.json (the last step of the real run, with the formula's bytes sent per
rank in its meta: m activations forward and m gradients back across every stage boundary) and
runs/02_pipeline/simulated/<schedule>.json (the simulator's prediction, apart so that
runs/02_pipeline/*.json means the measured runs), prints the 1F1B timeline and traffic, and writes
runs/02_pipeline/report.html (the replayed timelines, a button on each for the wall clock).
The formula assumes uniform stages; the first and last stages also carry the embedding and the
head, which the simulator fed with the run's durations accounts for.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from lessons.common import REPLAY, Clock, finish, lesson_parser, parse_lesson_args, print_note, reading_path, run_lesson
from lessons.common import console as make_console
from minipar import datasets
from minipar import trace as mtrace
from minipar.cli_args import int_in
from minipar.cost import pipeline as pipeline_cost
from minipar.optim import AdamW
from minipar.parallel.pipeline import Pipeline, format_schedule, gpt, gpt_layer_counts, make_schedule
from minipar.parallel.pipeline import simulate as simulate_schedule
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, BLOCKS = 32, 32, 64, 4, 8
BATCH, MICROBATCHES, CHUNKS = 32, 8, 2
SCHEDULES = (("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", CHUNKS))
OUT = Path("runs/02_pipeline")
TRACED = 3  # steps recorded: the last, and the ones before it that the replay's medians pool (``train``)


def train(comm: Any, kind: str, chunks: int = 1, steps: int = 4, microbatches: int = MICROBATCHES,
          trace_path: str | os.PathLike[str] | None = None, blocks: int = BLOCKS) -> dict[str, Any]:
    """Train the tiny GPT for ``steps`` steps with schedule ``kind``; the last step is recorded into
    ``trace_path``, up to ``TRACED - 1`` steps before it (never the first: it warms up) into
    ``<stem>-step<k>.json`` beside it, which the last lists in ``meta["earlier_steps"]``: a replay takes
    each stage's F and B at the median of all of them (3 x m spans, not m). Returns (on every rank) the
    losses and this rank's peak stash."""
    pipe = Pipeline(comm, gpt(VOCAB, SEQ, D_MODEL, HEADS, blocks, seed=0), kind, microbatches=microbatches,
                    chunks=chunks, layers=gpt_layer_counts(blocks, comm.size * chunks))
    opt = AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.0)
    stream = datasets.token_stream(20_000, VOCAB, seed=0)
    config = {"vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL, "blocks": blocks, "batch": BATCH}
    last = Path(trace_path) if trace_path is not None else None
    earlier = {k: last.with_name(f"{last.stem}-step{k}.json") for k in range(max(1, steps - TRACED), steps - 1)
               } if last is not None else {}
    losses = []
    for step in range(steps):
        x, y = datasets.lm_batch(stream, BATCH, SEQ, step=step)
        meta = pipe.trace_meta(boundary_bytes(len(x), microbatches)) | {"time_unit": "s", "step": step,
                                                                        "config": config}
        if step == steps - 1:
            meta["earlier_steps"] = [e.name for e in earlier.values()]
        path = last if step == steps - 1 else earlier.get(step)
        if path is None:
            losses.append(pipe.step(x, y, opt))
            continue
        comm.barrier()  # every rank enters together (rank 0 has just written the step before's trace)
        with mtrace.record(path, comm, **meta):
            losses.append(pipe.step(x, y, opt))
    return {"losses": losses, "peak_stash": pipe.peak_stash,
            "stages": {s: st.layer_names for s, st in pipe.stages.items()}}


def boundary_bytes(batch: int = BATCH, microbatches: int = MICROBATCHES) -> int:
    """Bytes of one micro-batch's activation between two GPT stages: (batch / m, seq, d_model) float64
    (the embedding's and every block's output have that shape). Each boundary between stages on two
    ranks carries m of them forward and m gradients of the same size back (``minipar.cost.pipeline.send_bytes``),
    which the trace meta holds as the formula the report draws over the measured bytes."""
    return 8 * (batch // microbatches) * SEQ * D_MODEL


def schedule_bubble(trace: mtrace.Trace) -> float:
    """Mean over ranks of idle / step, counting only the F/B spans (window: first F to last B):
    the pipeline's bubble as the formulas define it, without the loss broadcast and optimizer."""
    from viz import analysis

    fb = [e for e in trace.events if e.kind == "compute" and e.name in ("F", "B")]
    fractions = analysis.bubble_fractions(mtrace.Trace(trace.meta, fb))
    return float(np.mean(fractions)) if fractions else float("nan")


def stage_durations(trace: mtrace.Trace, n_stages: int) -> tuple[list[float], list[float]]:
    """Median F and B time of every (virtual) stage, in seconds (on the trace's clock)."""
    med = {}
    for op in ("F", "B"):
        med[op] = [float(np.median([e.duration for e in trace.select("compute", name=op, stage=s)]))
                   for s in range(n_stages)]
    return med["F"], med["B"]


def analyse(trace_path: str | os.PathLike[str], sim_path: str | os.PathLike[str] | None = None,
            clock: Clock = REPLAY) -> dict[str, Any]:
    """One recorded run on ``clock`` (replayed by default) vs predicted; writes the simulator's trace,
    fed with the run's per-stage durations on that clock, to ``sim_path``."""
    trace = clock.of(trace_path)
    kind, p, m, v = (trace.meta[k] for k in ("schedule", "p", "m", "v"))
    fwd, bwd = stage_durations(trace, p * v)
    sim = simulate_schedule(make_schedule(kind, p, m, v), forward=fwd, backward=bwd)
    sim.trace.meta.update(time_unit="s", schedule=f"{kind} (simulated)")
    if sim_path is not None:
        mtrace.save(sim.trace, sim_path)
    peaks = {r: max((e.args["stashed"] for e in trace.select("memory", name="activations", rank=r)),
                    default=0) for r in range(p)}
    return {"kind": kind, "p": p, "m": m, "v": v, "bubble": schedule_bubble(trace),
            "simulated": sim.bubble_fraction, "formula": pipeline_cost.bubble_fraction(kind, p, m, v),
            "peak": peaks, "sim_peak": dict(sim.peak_stash), "forward": fwd, "backward": bwd,
            "step_time": max(e.t1 for e in trace.events if e.kind == "compute" and e.name in "FB")
            - min(e.t0 for e in trace.events if e.kind == "compute" and e.name in "FB"),
            "sim_step_time": sim.makespan, "actions": format_schedule(make_schedule(kind, p, m, v))}


def print_actions(console: Console, kind: str, actions: dict[int, list[str]]) -> None:
    title = f"{kind}: action order per rank (compute actions; lower() inserts the sends and receives)"
    table = Table(title=title, title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("actions (stage, F/B, micro-batch)")
    for r, acts in actions.items():
        table.add_row(str(r), " ".join(acts))
    console.print(table)


def summary_table(rows: list[dict[str, Any]], losses: dict[str, list[float]], clock: Clock = REPLAY) -> Table:
    """One row per schedule. Short headers so that it fits 80 columns: the clock in the title, "sim."."""
    table = Table(title=f"last step, {clock.label}; bubble: idle share of the F/B window; stash: peak "
                        "micro-batches per rank",
                  caption="sim.: the simulator, the same order with this run's F/B time per stage; formula: "
                          "uniform stages, no communication time; interleaved stash: chunk micro-batches, each "
                          "half a rank's layers; loss: the last step's")
    for col in ("schedule", "step ms", "bubble", "sim.", "formula", "stash", "sim.", "loss"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            f"{row['kind']}" + (f" v={row['v']}" if row["v"] > 1 else ""), f"{1e3 * row['step_time']:.0f}",
            f"{100 * row['bubble']:.1f}%", f"{100 * row['simulated']:.1f}%", f"{100 * row['formula']:.1f}%",
            " ".join(str(row["peak"][r]) for r in sorted(row["peak"])),
            " ".join(str(row["sim_peak"][r]) for r in sorted(row["sim_peak"])),
            f"{losses[row['kind']][-1]:.4f}")
    return table


def print_schedule(console: Console, row: dict[str, Any], stages: dict[int, list[str]], clock: Clock = REPLAY
                   ) -> None:
    """One schedule's section: what rank 0 holds, the action order, durations, bubble and stash."""
    kind, v = row["kind"], row["v"]
    console.rule(f"[bold]{kind}[/bold]" + (f" (v = {v} chunks per rank)" if v > 1 else ""))
    held = " | ".join(f"stage {s}: {', '.join(n)}" for s, n in sorted(stages.items()))
    console.print(f"rank 0 holds {held}", highlight=False)
    print_actions(console, kind, row["actions"])

    def ms(xs: list[float]) -> str:
        return " ".join(f"{1e3 * x:.1f}" for x in xs)

    unit = f"chunk micro-batches, each 1/{v} of a rank's layers" if v > 1 else "micro-batches"
    console.print(f"median F per stage {ms(row['forward'])} ms, B {ms(row['backward'])} ms ({clock.short})",
                  highlight=False)
    console.print(f"bubble {clock.short} {100 * row['bubble']:.1f}%, simulator {100 * row['simulated']:.1f}%, "
                  f"formula {100 * row['formula']:.1f}%;  peak stash per rank "
                  f"{list(row['peak'].values())}, simulator {list(row['sim_peak'].values())} ({unit})",
                  highlight=False)


def check_ranks(p: int, microbatches: int = MICROBATCHES) -> str | None:
    """What is wrong with running the lesson on ``p`` ranks, or None."""
    if p < 2 or BLOCKS < CHUNKS * p or microbatches % p:
        return (f"lesson 2 needs 2 or more ranks with {BLOCKS} blocks >= {CHUNKS} chunks x ranks and "
                f"{microbatches} micro-batches a multiple of the ranks (interleaved); got {p} ranks: "
                "run it on 2 or 4")
    return None


def run(comm: Any, steps: int, m: int, clock: Clock = REPLAY, verbose: bool = False) -> None:
    """Every schedule in turn on ``comm``; rank 0 prints (each schedule's section with ``verbose``), times on
    ``clock``."""
    console = make_console()
    p, lead = comm.size, comm.rank == 0
    if lead:
        (OUT / "simulated").mkdir(parents=True, exist_ok=True)
        console.print(f"[bold]tiny GPT[/bold] ({BLOCKS} blocks) on {p} pipeline ranks, batch {BATCH} = {m} "
                      f"micro-batches, {steps} step{'s' * (steps > 1)} per schedule, the last traced"
                      f"{'' if verbose else ' (--verbose: each schedule in detail)'}", highlight=False)
    rows, losses, paths, titles = [], {}, [], []
    for kind, v in SCHEDULES:
        path, sim_path = OUT / f"{kind}.json", OUT / "simulated" / f"{kind}.json"
        result = train(comm, kind, v, steps, m, path)
        if lead:
            row = analyse(path, sim_path, clock)
            rows.append(row)
            losses[kind] = result["losses"]
            paths += [path, sim_path]
            titles += [kind, f"{kind}: simulator with the run's F/B durations ({clock.short})"]
            if verbose:
                print_schedule(console, row, result["stages"], clock)
    if not lead:
        return
    console.print(summary_table(rows, losses, clock))
    print_note(console, clock.caveat(p), ": compare the simulator column, not the measured one, with the formula "
               "(or drop --clock wall).")
    spread = max(abs(a - b) for ls in losses.values() for a, b in zip(ls, losses["naive"], strict=True))
    console.print(f"Every schedule gives the same losses (largest difference {spread:.1e}): a schedule "
                  "changes the order of the work, never the result.", highlight=False)
    console.rule(f"[bold]1F1B timeline (last step, {clock.short}; idle counts the whole step)")
    finish(paths, OUT / "report.html", console, timeline=OUT / "1f1b.json", titles=titles, clock=clock,
           brief=not verbose)
    if verbose:
        console.print(f"traces: {', '.join(str(p_) for p_ in paths[::2])}  "
                      f"(or: minipar view {OUT / '1f1b.json'})", highlight=False)
    console.print(reading_path("02_pipeline"), highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = lesson_parser(__doc__, steps=4, ranks=4)
    parser.add_argument("--microbatches", type=int_in(1, 1024), default=MICROBATCHES)
    return parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks, a.microbatches))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_lesson(run, args, lambda p: check_ranks(p, args.microbatches), m=args.microbatches)


if __name__ == "__main__":
    main()
