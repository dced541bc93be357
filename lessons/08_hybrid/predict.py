"""Lesson 8, sections 5 and 6: predicted step times. ``perf.predict`` for the tiny GPT's step on this
machine (a cluster file from ``minipar calibrate``, or calibrated here once, quickly), and the planner
(``minipar.cost.planner.plan``) on GPT-3 175B with 3072 A100s beside the 6 x 8 x 64 grid. Everything
here takes its model and layout as arguments; lesson.py holds the constants of the tiny GPT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from rich.table import Table

from minipar import trace as mtrace
from minipar.calibrate import FIT_FROM, calibrate, quick_options
from minipar.cost import perf, planner, presets
from minipar.cost.cluster import Cluster
from minipar.mesh import MeshShape
from viz.mesh import AXIS_COLORS

GPT3, GPUS, GPT3_BATCH, CLUSTER = "gpt3-175b", 3072, 1536, "a100-selene"
GRID = {"dp": 6, "tp": 8, "pp": 64}  # the d x t x p grid attributed to GPT-3 (Narayanan et al.'s 1T layout)


def this_cluster(comm: Any, path: str | None, out: Path) -> tuple[Cluster | None, str]:
    """The cluster file at ``path``; without one, ``out/cluster-<backend>-<P>.json`` if an earlier run
    wrote it, else this machine calibrated now on these ranks (``minipar calibrate --quick``'s
    measurements, a few seconds) and saved there. Rank 0 gets the Cluster and a sentence on its origin."""
    default = out / f"cluster-{comm.backend}-{comm.size}.json"
    if path is None and not comm.allgather_object(default.exists())[0]:  # rank 0's file system decides
        cluster = calibrate(comm, **quick_options(True))
        if cluster is not None:
            cluster.save(str(default))
        return cluster, (f"calibrated now on these {comm.size} ranks (quick), saved to {default}; "
                         f"`minipar calibrate -n {comm.size} -o FILE` measures longer, then --cluster FILE")
    chosen = path or str(default)
    return (Cluster.load(chosen) if comm.rank == 0 else None), f"cluster file {chosen}"


def parts(p: perf.Prediction) -> dict[str, float]:
    """A prediction's step in parts: compute, bubble, exposed communication per axis (seconds)."""
    return {"compute": p.compute_seconds, "bubble": p.bubble_seconds,
            **{f"{k} comm": v for k, v in p.comm_seconds.items() if v > 0}}


def prediction_table(pred: perf.Prediction, measured: list[float], cluster: Cluster, origin: str) -> Table:
    table = Table(title=f"one step, predicted (perf.predict on {cluster.name}) vs measured (median of the timed "
                        "steps, the slowest rank)", title_justify="left",
                  caption=f"{origin}. alpha {cluster.intra.alpha * 1e6:.0f} us, 1/beta "
                          f"{1 / cluster.intra.beta / 1e9:.2f} GB/s, {cluster.flops / 1e9:.2f} GFLOP/s per rank "
                          "with every rank computing.", caption_justify="left")
    for col in ("", *parts(pred), "step", "measured", "predicted / measured"):
        table.add_column(col, justify="right")
    got = float(np.median(measured))
    table.add_row("ms", *(f"{v * 1e3:.1f}" for v in parts(pred).values()), f"{pred.step_seconds * 1e3:.1f}",
                  f"{got * 1e3:.1f}", f"{pred.step_seconds / got:.2f}")
    return table


def small_messages(trace: mtrace.Trace, shape: MeshShape) -> str:
    """Which axes' messages are smaller than the sizes alpha and beta were fitted on (``FIT_FROM``)."""
    sizes: dict[str, list[int]] = {}
    for e in trace.events:
        if e.kind == "comm" and e.rank == e.src and e.dst is not None and e.nbytes:
            sizes.setdefault(shape.axis_of(e.src, e.dst), []).append(e.nbytes)
    text = "Messages of one step, median size per axis: " + ", ".join(
        f"{a} {int(np.median(v)):,} B ({len(v)} messages)" for a, v in sizes.items()) + "."
    small = [a for a, v in sizes.items() if np.median(v) < FIT_FROM]
    if small:
        text += (f" The {' and '.join(small)} messages are below the {FIT_FROM:,} B from which the calibration fits "
                 "alpha and beta: MPICH sends them eagerly, without the handshake that makes alpha large when ranks "
                 "wait for a core, so the prediction overestimates their time.")
    return text


# ---- the planner at scale ------------------------------------------------------------------------------
def grid_prediction() -> perf.Prediction:
    """The 6 x 8 x 64 grid on GPT-3: 96 layers on 64 stages do not split evenly (``Layout.check``
    refuses it), so predicted with ``uneven_stages`` (the slowest stage: 2 blocks), full recomputation
    as Narayanan et al.'s Table 1 runs."""
    layout = perf.Layout(**GRID, micro_batch=1, global_batch=GPT3_BATCH, recompute="full")
    return perf.predict(presets.MODELS[GPT3], layout, presets.CLUSTERS[CLUSTER], uneven_stages=True)


def plan_table(ranked: list[planner.Candidate], grid: perf.Prediction) -> Table:
    model, cluster = presets.MODELS[GPT3], presets.CLUSTERS[CLUSTER]
    table = Table(title=f"{model.name}: {GPUS} GPUs on {cluster.name}, global batch {GPT3_BATCH}: the planner's "
                        "fastest predicted layouts, and the 6 x 8 x 64 grid", title_justify="left")
    for col in ("", "dp", "tp", "pp", "sp", "v", "b", "ZeRO", "recompute", "step s", "TFLOP/s/GPU", "GiB/GPU"):
        table.add_column(col, justify="left" if col in ("", "recompute") else "right")
    rows = [(str(i + 1), c.layout, c.prediction) for i, c in enumerate(ranked)] + [("grid", grid.layout, grid)]
    for name, lay, pr in rows:
        table.add_row(name, str(lay.dp), str(lay.tp), str(lay.pp), str(lay.sp), str(lay.chunks), str(lay.micro_batch),
                      str(lay.zero), lay.recompute + (" +SP" if lay.sequence_parallel else ""),
                      f"{pr.step_seconds:.2f}", f"{pr.tflops_per_gpu:.0f}", f"{pr.memory['total'] / 2**30:.1f}",
                      style="bold" if name == "grid" else None)
    return table


def parts_figure(rows: dict[str, dict[str, float]], title: str) -> go.Figure:
    """Each row's step as a horizontal bar stacked by its parts (compute, bubble, communication per
    axis in ``viz.mesh``'s axis colours; a measured total in black)."""
    names = list(rows)
    kinds = list(dict.fromkeys(k for r in rows.values() for k in r))
    colors = {"compute": "#4C78A8", "bubble": "#BAB0AC", "measured": "#333333",
              **{f"{a} comm": c for a, c in AXIS_COLORS.items()}}
    fig = go.Figure([go.Bar(y=names, x=[rows[n].get(k, 0.0) for n in names], name=k, orientation="h",
                            marker={"color": colors.get(k, "#9D755D")}) for k in kinds])
    fig.update_layout(title=title, barmode="stack", xaxis_title="seconds per step",
                      height=max(300, 160 + 45 * len(names)), yaxis={"autorange": "reversed"}, margin={"l": 280})
    return fig
