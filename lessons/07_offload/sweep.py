"""Lesson 7, part 3: step time against the device budget, per method (issue 14).

For each method a few device budgets from the smallest it trains on up to one where everything fits:

- ZeRO-Offload (Ren et al. 2021): from ``offload_device_need`` (every parameter, a gradient bucket, an
  upload) to the model states ZeRO-2 keeps on each of the N devices (``zero_state_bytes``, stage 2).
- ZeRO-Infinity (Rajbhandari et al. 2021): from ``ZeroInfinity.device_need()`` (the largest unit
  gathered and its gradient buffer) to the same ZeRO-2 states.
- PatrickStar chunks (Fang et al. 2021), one rank: the activations measured in warm-up plus k chunks,
  k = 1 (the chunk manager's minimum: one chunk beside the activations) up to C (every chunk fits).

Per budget: the step time measured (rank 0, median of the steps after the first), the bytes moved
between tiers per step and the time of those bytes at the ``minipar.tiers.Bandwidth`` model (per link:
bytes / the link's bandwidth), beside the moves' measured time. ZeRO-Offload and ZeRO-Infinity move
the same bytes at every budget (their schedules do not depend on it: a larger device buys nothing);
the chunks move fewer as more of them fit (``in_order_misses``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

import plotly.graph_objects as go

from minipar import trace as mtrace
from minipar.cost.offload import (
    chunk_offload_bytes,
    in_order_misses,
    zero_infinity_bytes,
    zero_infinity_device_need,
    zero_offload_bytes,
)
from minipar.parallel.offload import ChunkManager
from minipar.tiers import Tiers
from viz.tiers import budget_figure, per_step_moves
from viz.width import Table

STEPS = 4  # per budget: medians over steps 1..3 (step 0 places, warms up)
POINTS = 3  # budgets per method for ZeRO-Offload and ZeRO-Infinity: min, halfway, everything fits


def spread(low: int, high: int, points: int = POINTS) -> list[int]:
    """``points`` budgets from ``low`` to ``high`` (both included), evenly spaced, rounded to bytes."""
    return sorted({round(low + (high - low) * i / (points - 1)) for i in range(points)})


def measure(lesson: ModuleType, path: Path, method: str, budget: int) -> dict[str, Any]:
    """Rank 0's medians over steps 1..: step wall time, bytes moved per step, their measured time and
    their time at the lesson's ``Bandwidth`` (computed here per link from the bytes)."""
    trace = mtrace.load(path)
    t = lesson.part2.step_time(trace)
    steps = per_step_moves(trace, 0)[1:-1]
    modelled = [sum(lesson.BANDWIDTH.seconds(*k.split("->"), b) for k, b in s.items()) for s in steps]
    return {"method": method, "budget": budget, "step_s": t["step"], "bytes": statistics.median(
        sum(s.values()) for s in steps), "moves_s": t["measured"], "modelled_s": statistics.median(modelled)}


def chunk_run(lesson: ModuleType, comm: Any, k: int, acts: int, path: Path) -> dict[str, Any]:
    """The GPT on rank 0 alone under chunks (warm-up order) with a device of ``acts`` + ``k`` chunks."""
    part2 = lesson.part2
    tiers = Tiers(acts + k * 8 * part2.CHUNK, bandwidth=lesson.BANDWIDTH)
    batches = [(x[:lesson.BATCH // 2], y[:lesson.BATCH // 2]) for x, y in lesson.batches(STEPS)]
    with mtrace.record(path, comm, paradigm=f"PatrickStar chunks (GPT, {k} fit)", time_unit="s",
                       config={"chunk elements": part2.CHUNK, "device budget": tiers.device_budget}):
        cm = ChunkManager(lesson.model(), tiers, part2.CHUNK, policy="warmup", lr=lesson.LR)
        for step, (x, y) in enumerate(batches):
            mtrace.mark("step", step=step)
            cm.backward(cm.loss(x, y))
            cm.step()
        mtrace.mark("flush")
    chunks = len(cm.chunks)
    cm.close()
    tiers.close()
    return {"chunks": chunks, "budget": tiers.device_budget}


def run_sweep(lesson: ModuleType, comm: Any, out: Path, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every method at its budgets (traces under ``out/sweep``); rank 0 gets the rows, the others []."""
    sweep, n, rows = out / "sweep", comm.size, []
    if comm.rank == 0:
        sweep.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    full = sum(lesson.zero_formulas.zero_state_bytes(results["zero2"]["numels"], 2, n).values())
    formula = sum(zero_offload_bytes(results["offload"]["numels"], 8, 8, dp=n).values())
    for budget in spread(lesson.device_need(n)["total"], full):
        path = sweep / f"offload_{budget}.json"
        lesson.train(comm, "offload", STEPS, path, budget=budget)
        if comm.rank == 0:  # the trace is written by rank 0
            rows.append(measure(lesson, path, "ZeRO-Offload", budget) | {"formula": formula})
    units = lesson.part2.unit_sizes(lesson.model())
    need = zero_infinity_device_need(units, n, 8)["total"]
    formula = sum(zero_infinity_bytes(units, n).values()) + lesson.part2.MANIFEST
    for budget in spread(need, max(full, need)):
        path = sweep / f"infinity_{budget}.json"
        lesson.part2.train_infinity(lesson, comm, STEPS, path, out, budget=budget)
        if comm.rank == 0:
            rows.append(measure(lesson, path, "ZeRO-Infinity", budget) | {"formula": formula})
    solo = comm.split(0 if comm.rank == 0 else 1)
    if comm.rank != 0:
        return []
    acts, k, chunks = results["chunks"][("GPT", "warmup")]["acts"], 1, None
    while chunks is None or k <= chunks:
        path = sweep / f"chunks_{k}.json"
        run = chunk_run(lesson, solo, k, acts, path)
        chunks = run["chunks"]
        misses = in_order_misses(chunks, k)
        rows.append(measure(lesson, path, "chunks (1 rank)", run["budget"])
                    | {"fit": k, "chunks": chunks, "formula": sum(chunk_offload_bytes(8 * lesson.part2.CHUNK,
                                                                                      misses).values())})
        k += 1
    return rows


def sweep_table(rows: list[dict[str, Any]], n: int) -> Table:
    table = Table(title=f"step time vs device budget on rank 0, wall clock (the files' and copies' own time: a "
                        f"replay does not model it; N = {n}; chunks: one rank, half the batch; ms, medians of "
                        "steps 1..)", title_justify="left",
                  caption="bytes: every move between tiers in one step; modelled: those bytes at the Bandwidth "
                          "model (PCIe 16 GB/s, NVMe read 3, write 2 GB/s), link by link; measured: this machine's "
                          "copies and "
                          "fsync'ed files, on a shared machine: they vary from run to run. The last budget of "
                          "ZeRO-Offload and ZeRO-Infinity holds ZeRO-2's model "
                          "states: they move the same bytes at every budget (their schedules ignore spare memory); "
                          "the chunks' last budget holds every chunk beside the activations (k of C chunks fit). "
                          "formula: zero_offload_bytes, zero_infinity_bytes (+ the manifest), chunk_offload_bytes with "
                          "in_order_misses(C, k), both directions.",
                  caption_justify="left", key=2)  # split to fit: each part keeps the method and the budget
    for col in ("method", "device budget", "step measured", "bytes per step", "formula", "moves measured",
                "moves modelled"):
        table.add_column(col, justify="right", no_wrap=col == "method")
    for r in rows:
        name = r["method"] + (f", k = {r['fit']} of {r['chunks']}" if "fit" in r else "")
        table.add_row(name, f"{r['budget']:,}", f"{r['step_s'] * 1e3:.2f}", f"{r['bytes']:,.0f}", f"{r['formula']:,}",
                      f"{r['moves_s'] * 1e3:.3f}", f"{r['modelled_s'] * 1e3:.4f}")
    return table


def figure(rows: list[dict[str, Any]]) -> go.Figure:
    return budget_figure(rows, "step time vs device budget (rank 0, median of steps 1..; wall clock)")
