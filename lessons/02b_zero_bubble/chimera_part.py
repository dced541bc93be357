"""Lesson 2b, Chimera's part: two pipelines in opposite directions over the same ranks.

Li & Hoefler 2021 ("Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional
Pipelines", SC'21, Sec. 3.1, Fig. 3): rank r holds stage r of the *down* pipeline and stage p-1-r of
the *up* pipeline (two replicas of the model), down runs the first m/2 micro-batches and up the rest,
each 1F1B; merged, each direction fills the other's bubbles, and the two replicas of each stage
all-reduce their gradients before the (synchronous) update. Needs p even and m a multiple of p.

Here, for lesson 2b's table and figures (``minipar.parallel.pipeline.chimera`` does the work):

- ``simulate_units``: the joint simulation with the lesson's F = 1, B = I + W = 2 (on the shared axis)
  and with the paper's equal slots F = B = 1, where docs/formulas.md section 3 gives idle (p - 2) F per
  rank (1F1B: 2 (p - 1) F), bubble share (p - 2)/(2m + p - 2) and peak stash p/2 + 1 + min(r, p-1-r);
  with F != B the slots no longer line up and the formula does not hold ("F=B only");
- ``train``: ``Chimera`` on the lesson's tiny GPT, the last step traced (its spans say their direction:
  ``args["direction"]``, chunk 0 down, 1 up);
- ``analyse``: that trace's idle per rank (replayed by default: ``lessons.common.Clock``) and peak stash
  (both directions' micro-batches on a rank), against ``simulate_chimera`` fed with the run's F and B
  and against the formulas.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from lessons.common import REPLAY, Clock
from minipar import trace as mtrace
from minipar.parallel.pipeline import Chimera, gpt, gpt_layer_counts, simulate_chimera
from minipar.parallel.pipeline.chimera import DIRECTIONS, check_config

KIND = "chimera"
PAPER = "chimera, F = B = 1"  # the paper's equal slots: where its formulas hold
RANGE = "F=B only"


def fits(p: int, m: int) -> bool:
    """Whether Chimera runs on ``p`` ranks with ``m`` micro-batches (p even, m a multiple of p)."""
    try:
        check_config(p, m)
    except ValueError:
        return False
    return True


def formula_peak(p: int) -> list[int]:
    """Peak stash on rank r: down's p/2 plus up's r + 1, mirrored (the paper's [(D/2 + 1) M_a, D M_a])."""
    return [p // 2 + 1 + min(r, p - 1 - r) for r in range(p)]


def formula_idle(p: int, f: float, b: float) -> float | None:
    """Idle per rank, (p - 2) F, when F = B (the paper's slots); None otherwise."""
    return (p - 2) * f if f == b else None


def simulate_units(p: int, m: int, forward: float, backward: float,
                   path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """One row of the lesson's unit table: the joint simulation with ``forward`` and ``backward`` per
    stage and micro-batch (each rank does 1F1B's work: two stages, m/2 micro-batches each)."""
    sim = simulate_chimera(p, m, forward, backward)
    equal = forward == backward
    sim.trace.meta.update(schedule=f"chimera (simulated, F = {forward:g}, B = {backward:g}; down and up)")
    if path is not None:
        mtrace.save(sim.trace, path)
    share = (p - 2) / (2 * m + p - 2)
    return {"kind": PAPER if equal else KIND, "v": 1, "makespan": sim.makespan, "idle": [sim.idle[r] for r in range(p)],
            "formula": formula_idle(p, forward, backward), "peak": [sim.peak_stash[r] for r in range(p)],
            "formula_peak": formula_peak(p), "versions": [1] * p, "formula_versions": [1] * p, "trace": sim.trace,
            "share": sim.bubble_fraction, "formula_share": share if equal else None}


def unit_rows(p: int, m: int, forward: float, backward: float, out: Path) -> list[dict[str, Any]]:
    """The lesson's costs (saved as ``out``/chimera.json for the shared axis), then the paper's F = B = 1."""
    return [simulate_units(p, m, forward, backward, out / f"{KIND}.json"), simulate_units(p, m, 1.0, 1.0)]


def print_measured(console: Any, trace: mtrace.Trace, clock: str) -> None:
    """The last step's terminal timeline (on ``clock``): the two directions' blocks told apart."""
    from viz.terminal import print_timeline

    console.rule(f"[bold]Chimera timeline (last step, {clock}): down F0\u2193, up F4\u2191 (reversed colours)")
    print_timeline(trace, console=console)


def train(comm: Any, steps: int, m: int, model: dict[str, Any], lr: float, batches: list,
          trace_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Train the lesson's GPT (``model``: gpt's arguments and ``blocks``) with ``Chimera`` and one AdamW
    per replica; the last step recorded into ``trace_path``. Returns the losses and this rank's peak."""
    from minipar.optim import AdamW

    layers = gpt_layer_counts(model["blocks"], comm.size)
    chimera = Chimera(comm, gpt(model["vocab"], model["seq"], model["d_model"], model["heads"], model["blocks"],
                                seed=0), m, layers=layers, optimizer=lambda ps: AdamW(ps, lr=lr, weight_decay=0.0))
    meta = {"paradigm": "pipeline", "schedule": KIND, "p": comm.size, "m": m, "v": 2, "chunk_names": list(DIRECTIONS),
            "activation_unit": "bytes", "time_unit": "s"}
    losses = []
    for step, (x, y) in enumerate(batches[:steps]):
        if step < steps - 1:
            losses.append(chimera.step(x, y))
            continue
        with mtrace.record(trace_path, comm, **meta, step=step):
            losses.append(chimera.step(x, y))
    return {"losses": losses, "peak_stash": chimera.peak_stash, "seen": {}}


def analyse(trace_path: str | os.PathLike[str], clock: Clock = REPLAY) -> dict[str, Any]:
    """Idle per rank on ``clock`` (window: first to last F/B), the joint simulator with the run's median
    F and B (over both directions), the formula where it holds, and the peak stash per rank."""
    from viz import analysis

    trace = clock.of(trace_path)
    p, m = trace.meta["p"], trace.meta["m"]
    work = mtrace.Trace(trace.meta, [e for e in trace.events if e.kind == "compute" and e.name in ("F", "B")])
    lo, hi = analysis.window(work)
    idle = [(hi - lo) * f for f in analysis.bubble_fractions(work)]
    f, b = (float(np.median([e.duration for e in work.events if e.name == op])) for op in ("F", "B"))
    sim = simulate_chimera(p, m, f, b)
    peaks = [max((e.args["stashed"] for e in trace.select("memory", name="activations", rank=r)), default=0)
             for r in range(p)]
    return {"kind": KIND, "step": hi - lo, "idle": idle, "sim_idle": [sim.idle[r] for r in range(p)],
            "formula": formula_idle(p, f, b), "F": f, "B": b, "W": None, "peak": peaks,
            "sim_peak": [sim.peak_stash[r] for r in range(p)], "formula_peak": formula_peak(p), "versions": [1] * p}


def claim(rows: list[dict[str, Any]], p: int, m: int) -> str:
    """The unit rows' lesson in one sentence: the paper's bubble and stash, and what F != B does."""
    by = {row["kind"]: row for row in rows}
    paper, ours = by[PAPER], by[KIND]
    return (f"chimera (two pipelines, down on ranks 0..{p - 1} and up on {p - 1}..0; arrows and hatching tell them "
            f"apart): with F = B = 1 it idles {paper['idle'][0]:g} per rank = (p - 2) F (1F1B: 2 (p - 1) F = "
            f"{2 * (p - 1)}), bubble share {paper['share']:.3f} = (p - 2)/(2m + p - 2) = {paper['formula_share']:.3f}"
            f", peak stash {' '.join(map(str, paper['peak']))} = p/2 + 1 + min(r, p-1-r); with the lesson's F = 1, "
            f"B = 2 the slots no longer line up and it idles {ours['idle'][0]:g} (step {ours['makespan']:g})")
