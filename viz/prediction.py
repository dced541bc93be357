"""A step time predicted by ``minipar.cost.perf`` beside a measured or replayed one, and the planner's
layouts, for the terminal and the report (lesson 8).

- ``parts(prediction)``: the predicted step in parts (compute, CPU overhead, bubble, exposed
  communication per mesh axis, optimizer), seconds.
- ``prediction_table(prediction, got, cluster, clock)``: those parts beside the traced step on
  ``clock`` and their ratio; the caption names the cluster's terms.
- ``replayed_parts(trace, prediction)``, ``small_messages(trace, shape, fit_from)``: one sentence each: what a
  replay's ranks spent beside the prediction's terms; which mesh axes' messages are smaller than the
  sizes the calibration fitted alpha and beta on.
- ``plan_table(ranked, grid, model, gpus, cluster, batch)``: the planner's fastest layouts and a grid.
- ``parts_figure(rows, title)``: each row's step as a horizontal bar stacked by its parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

from minipar import trace as mtrace
from viz.mesh import AXIS_COLORS
from viz.width import Table

if TYPE_CHECKING:  # the viewer reads traces; these are the types of what a lesson hands it
    from minipar.cost import perf, planner
    from minipar.cost.cluster import Cluster
    from minipar.mesh import MeshShape


def bandwidth(seconds_per_byte: float) -> str:
    """``1 / seconds_per_byte`` in GB/s, "inf" for a fitted 0 (``minipar.calibrate.bandwidth``'s form)."""
    return f"{1 / seconds_per_byte / 1e9:.2f} GB/s" if seconds_per_byte > 0 else "inf"


def parts(p: perf.Prediction) -> dict[str, float]:
    """A prediction's step in parts: compute (FLOPs and bytes), CPU overhead (per op and per message
    step inside the stages), bubble, exposed communication per axis, optimizer (seconds; the overheads
    only where the cluster has them)."""
    out = {"compute": p.compute_seconds - p.overhead_seconds, "CPU overhead": p.overhead_seconds,
           "bubble": p.bubble_seconds, **{f"{k} comm": v for k, v in p.comm_seconds.items()},
           "optimizer": p.optimizer_seconds}
    return {k: v for k, v in out.items() if v > 0 or k in ("compute", "bubble")}


def prediction_table(pred: perf.Prediction, got: float, cluster: Cluster, clock: str = "replayed",
                     detail: bool = True) -> Table:
    """The predicted step (``detail``: in parts, and the cluster's terms in the caption) beside the traced
    step on ``clock`` (replayed on the same ``cluster``: first to last event), and their ratio (the goal:
    within 15 %)."""
    terms = (f"{cluster.source}: alpha {cluster.intra.alpha * 1e6:.1f} us (+ CPU {cluster.call_seconds * 1e6:.1f} us "
             f"per call, {cluster.message_seconds * 1e6:.1f} us per message), 1/beta {bandwidth(cluster.intra.beta)}, "
             f"{cluster.flops / 1e9:.2f} GFLOP/s, 1/gamma {bandwidth(cluster.gamma)}, {cluster.op_seconds * 1e6:.1f} "
             f"us per autograd op, AdamW {cluster.tensor_seconds * 1e6:.1f} us per tensor and "
             f"{bandwidth(cluster.optimizer_gamma)}. ")
    table = Table(title=f"one step, predicted (perf.predict) vs {clock}, on {cluster.name}", title_justify="left",
                  caption=(terms if detail else "") + f"Goal: predicted / {clock} within 15 %.",
                  caption_justify="left")
    shown = parts(pred) if detail else {}
    for col in ("", *shown, "predicted step" if not detail else "step", clock, f"predicted / {clock}"):
        table.add_column(col, justify="right")
    table.add_row("ms", *(f"{v * 1e3:.1f}" for v in shown.values()), f"{pred.step_seconds * 1e3:.1f}",
                  f"{got * 1e3:.1f}", f"{pred.step_seconds / got:.2f}")
    return table


def replayed_parts(trace: mtrace.Trace, pred: perf.Prediction) -> str:
    """What the replay's ranks spent (medians over ranks) beside the prediction's terms."""
    def per_rank(*names: str) -> float:
        return float(np.median([sum(e.duration for e in trace.events if e.rank == r and e.thread is None
                                    and e.kind == "compute" and e.name in names) for r in range(trace.world_size)]))

    return (f"Replayed, per rank (median): forward + backward {per_rank('F', 'B') * 1e3:.1f} ms, tensor- and "
            f"sequence-parallel communication inside (predicted for the slowest stage: compute "
            f"{pred.compute_seconds * 1e3:.1f}, of which {pred.overhead_seconds * 1e3:.1f} CPU overhead per op and "
            f"per message, which tensor parallelism does not divide), gradient sync {per_rank('sync') * 1e3:.1f} ms, "
            f"optimizer {per_rank('opt') * 1e3:.1f} ms (predicted {pred.optimizer_seconds * 1e3:.1f}).")


def small_messages(trace: mtrace.Trace, shape: MeshShape, fit_from: int) -> str:
    """Which axes' messages are smaller than ``fit_from`` bytes, the smallest size alpha and beta were
    fitted on (``minipar.calibrate.FIT_FROM``)."""
    sizes: dict[str, list[int]] = {}
    for e in trace.events:
        if e.kind == "comm" and e.rank == e.src and e.dst is not None and e.nbytes:
            sizes.setdefault(shape.axis_of(e.src, e.dst), []).append(e.nbytes)
    text = "Messages of one step, median size per axis: " + ", ".join(
        f"{a} {int(np.median(v)):,} B ({len(v)} messages)" for a, v in sizes.items()) + "."
    small = [a for a, v in sizes.items() if np.median(v) < fit_from]
    if small:
        text += (f" The {' and '.join(small)} messages are below the {fit_from:,} B from which the calibration fits "
                 "alpha and beta: MPICH sends them eagerly, without the handshake that makes alpha large when ranks "
                 "wait for a core, so the prediction overestimates their time.")
    return text


def plan_table(ranked: list[planner.Candidate], grid: perf.Prediction, model: perf.ModelSpec, gpus: int,
               cluster: Cluster, batch: int) -> Table:
    """The planner's ``ranked`` layouts of ``model`` on ``gpus`` GPUs of ``cluster`` (global ``batch``),
    and a hand-picked ``grid`` layout's prediction in bold below them; predicted seconds per step."""
    lay = grid.layout
    table = Table(title=f"{model.name}: {gpus} GPUs on {cluster.name}, global batch {batch}: the planner's "
                        f"fastest predicted layouts, and the {lay.dp} x {lay.tp} x {lay.pp} grid (perf.predict, "
                        "seconds per step)", title_justify="left")
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
