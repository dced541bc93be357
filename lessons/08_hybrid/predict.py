"""Lesson 8, sections 5 and 6: predicted step times. ``perf.predict`` for the tiny GPT's step against
its replay (``minipar.replay``) on one cluster: the links of ``--cluster`` (a preset, or a file from
``minipar calibrate``) and this machine's compute rates in one core's CPU time on the shapes one rank
computes (``calibrate.compute_rates``), the terms in which the replay charges a span; and the planner
(``minipar.cost.planner.plan``) on GPT-3 175B with 3072 A100s beside the 6 x 8 x 64 grid. Everything
here takes its model and layout as arguments; lesson.py holds the constants of the tiny GPT."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import plotly.graph_objects as go
from rich.table import Table

from minipar import trace as mtrace
from minipar.calibrate import FIT_FROM, compute_rates
from minipar.cost import perf, planner, presets
from minipar.cost.cluster import Cluster
from minipar.mesh import MeshShape
from viz.mesh import AXIS_COLORS

GPT3, GPUS, GPT3_BATCH, CLUSTER = "gpt3-175b", 3072, 1536, "a100-selene"
GRID = {"dp": 6, "tp": 8, "pp": 64}  # the d x t x p grid attributed to GPT-3 (Narayanan et al.'s 1T layout)


def lesson_cluster(network: Cluster, shard: dict[str, int]) -> Cluster:
    """``network``'s links with this core's FLOP/s and gamma measured in CPU time on ``shard``, the GPT
    shapes one rank computes (``calibrate.compute_rates``): one cluster for the prediction and the replay."""
    flops, gamma = compute_rates(shard)
    return replace(network, name=f"{network.name} + this core", peak_flops=flops, efficiency=1.0, gamma=gamma,
                   source=f"{network.name}'s links; FLOP/s and gamma in one core's CPU time on {shard}")


def parts(p: perf.Prediction) -> dict[str, float]:
    """A prediction's step in parts: compute, bubble, exposed communication per axis (seconds)."""
    return {"compute": p.compute_seconds, "bubble": p.bubble_seconds,
            **{f"{k} comm": v for k, v in p.comm_seconds.items() if v > 0}}


def prediction_table(pred: perf.Prediction, got: float, cluster: Cluster, clock: str = "replayed") -> Table:
    """The predicted step in parts beside the traced step on ``clock`` (replayed on the same ``cluster``:
    first to last event, the optimizer, which perf leaves out, included), and their ratio (the goal:
    within 15 %)."""
    table = Table(title=f"one step, predicted (perf.predict) vs {clock}, on {cluster.name}", title_justify="left",
                  caption=f"{cluster.source}: alpha {cluster.intra.alpha * 1e6:.1f} us, 1/beta "
                          f"{1 / cluster.intra.beta / 1e9:.2f} GB/s, {cluster.flops / 1e9:.2f} GFLOP/s, 1/gamma "
                          f"{1 / cluster.gamma / 1e9:.2f} GB/s. Goal: predicted / {clock} within 15 %.",
                  caption_justify="left")
    for col in ("", *parts(pred), "step", clock, f"predicted / {clock}"):
        table.add_column(col, justify="right")
    table.add_row("ms", *(f"{v * 1e3:.1f}" for v in parts(pred).values()), f"{pred.step_seconds * 1e3:.1f}",
                  f"{got * 1e3:.1f}", f"{pred.step_seconds / got:.2f}")
    return table


def replayed_parts(trace: mtrace.Trace, pred: perf.Prediction) -> str:
    """What the replay's ranks computed (medians over ranks) beside the prediction's terms."""
    def per_rank(*names: str) -> float:
        return float(np.median([sum(e.duration for e in trace.events if e.rank == r and e.thread is None
                                    and e.kind == "compute" and e.name in names) for r in range(trace.world_size)]))

    return (f"Replayed, per rank (median): forward + backward {per_rank('F', 'B') * 1e3:.1f} ms (predicted compute "
            f"{pred.compute_seconds * 1e3:.1f}: FLOPs and bytes, no per-operation cost of Python and autograd), "
            f"gradient sync {per_rank('sync') * 1e3:.1f} ms, optimizer {per_rank('opt') * 1e3:.1f} ms (no perf term).")


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
    axis in ``viz.mesh``'s axis colours; a replayed or wall-clock total in black)."""
    names = list(rows)
    kinds = list(dict.fromkeys(k for r in rows.values() for k in r))
    colors = {"compute": "#4C78A8", "bubble": "#BAB0AC", "replayed": "#333333", "wall clock": "#333333",
              **{f"{a} comm": c for a, c in AXIS_COLORS.items()}}
    fig = go.Figure([go.Bar(y=names, x=[rows[n].get(k, 0.0) for n in names], name=k, orientation="h",
                            marker={"color": colors.get(k, "#9D755D")}) for k in kinds])
    fig.update_layout(title=title, barmode="stack", xaxis_title="seconds per step",
                      height=max(300, 160 + 45 * len(names)), yaxis={"autorange": "reversed"}, margin={"l": 280})
    return fig
