"""Lesson 8, sections 5 and 6: predicted step times. ``perf.predict`` for the tiny GPT's step against
its replay (``minipar.replay``) on one cluster: the links of ``--cluster`` (a preset, or a file from
``minipar calibrate``) and this machine's compute in each rank's CPU time, the terms in which the
replay charges a span: FLOP/s, gamma, the per-op overhead and the optimizer's costs on the shapes one
rank computes (``rates.compute_rates``, every rank at once, as the traced step ran), and the CPU the
replay charges a message beyond the network (``message_overhead``); and the planner
(``minipar.cost.planner.plan``) on GPT-3 175B with 3072 A100s beside the 6 x 8 x 64 grid. Everything
here takes its model and layout as arguments; lesson.py holds the constants of the tiny GPT."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go

from minipar import trace as mtrace
from minipar.calibrate import FIT_FROM, bandwidth
from minipar.cost import perf, planner, presets
from minipar.cost.cluster import Cluster, Link
from minipar.mesh import MeshShape
from minipar.rates import compute_rates, fit_line, step_span_times
from minipar.replay import replay
from viz.mesh import AXIS_COLORS
from viz.width import Table

GPT3, GPUS, GPT3_BATCH, CLUSTER = "gpt3-175b", 3072, 1536, "a100-selene"
GRID = {"dp": 6, "tp": 8, "pp": 64}  # the d x t x p grid attributed to GPT-3 (Narayanan et al.'s 1T layout)
REPEATS = 4  # traced steps of each model message_overhead replays
RATE_REPEATS = 20  # timings of each of compute_rates' measurements per rank


def message_overhead(comm: Any, shard: dict[str, int], path: Path) -> tuple[float, float]:
    """``(per call, per message step)``: the seconds of CPU a replay charges a rank for a collective
    call and for each of its steps beyond the ops around it (entering the call, resuming after its
    wait with caches others refilled; posting, completing and recording each message). Measured as
    the replay sees it, on the program lesson 8 runs, every rank at once: groups of ``t`` = 2 and 4
    ranks (2 alone below 4 ranks: then all of it per step) train the GPT whose tensor-parallel slices
    are ``shard``, traced and replayed on a network that costs nothing, and each rank ``shard`` alone
    (its one-rank collectives return at once; ``rates.step_span_times``); per rank the difference of
    the two steps over its calls is ``call + 2 (t - 1) step`` (medians over ranks; ``rates.fit_line``).
    Collective; the values on every rank."""
    from minipar.mesh import DeviceMesh
    from minipar.parallel.hybrid import HybridGPT

    free = Cluster("free", comm.size, 1.0, 1.0, 1.0, Link(0.0, 0.0), Link(0.0, 0.0), 0.0)
    sizes = [2, 4] if comm.size >= 4 else [2]
    idx = np.random.default_rng(0).integers(0, shard["vocab"], (shard["batch"], shard["seq"]))
    alone = comm.allgather_object(float(np.median(step_span_times(comm.split(comm.rank), shard, REPEATS, "cpu"))))
    per_call = []
    for t in sizes:
        sub = comm.split(comm.rank // t)
        g = {**shard, **{k: t * shard[k] for k in ("d_model", "heads", "vocab", "d_ff")}}  # t slices of shard
        model = HybridGPT(DeviceMesh(sub, pp=1, dp=1, sp=1, tp=sub.size), g["vocab"], g["seq"], g["d_model"],
                          g["heads"], g["layers"], g["d_ff"], seed=0)
        model.forward_backward(idx, np.roll(idx, -1, axis=1))  # warm-up
        comm.barrier()
        with mtrace.record(path, comm):
            for _ in range(REPEATS):
                model.forward_backward(idx, np.roll(idx, -1, axis=1))
        if comm.rank == 0:
            out = replay(mtrace.load(path), free)
            per_call.append(float(np.median([
                (_rank_seconds(out, r) - REPEATS * alone[r]) / sum(e.rank == r and e.src == r and e.step == 0
                                                                    for e in out.events)
                for r in range(comm.size - comm.size % t)])))  # whole groups only
    if comm.rank:
        return comm.broadcast_object(None)
    if min(per_call) <= 0:  # the replay charged the tensor-parallel step no more than the one-rank step
        return comm.broadcast_object((0.0, 0.0))
    if len(per_call) == 1:
        return comm.broadcast_object((0.0, per_call[0] / 2))
    return comm.broadcast_object(fit_line([2 * (t - 1) for t in sizes], per_call))


def _rank_seconds(trace: mtrace.Trace, rank: int) -> float:
    """First to last compute or message event of ``rank``."""
    ev = [e for e in trace.events if e.rank == rank and e.kind in ("compute", "comm")]
    return max(e.t1 for e in ev) - min(e.t0 for e in ev)


def lesson_cluster(comm: Any, network: Cluster, shard: dict[str, int], path: Path) -> Cluster:
    """``network``'s links with this machine's compute in CPU time (collective, every rank at once, as
    the traced step ran): ``rates.compute_rates`` on ``shard``, the GPT shapes one rank computes, and
    ``message_overhead``. One cluster for the prediction and the replay."""
    rates = compute_rates(comm, shard, repeats=RATE_REPEATS)
    call, step = message_overhead(comm, shard, path)
    return replace(network, name=f"{network.name} + this core", peak_flops=rates.flops, efficiency=1.0,
                   gamma=rates.gamma, op_seconds=rates.op_seconds, call_seconds=call, message_seconds=step,
                   tensor_seconds=rates.tensor_seconds, optimizer_gamma=rates.optimizer_gamma,
                   source=f"{network.name}'s links; compute in one core's CPU time on {shard}, every rank at once")


def parts(p: perf.Prediction) -> dict[str, float]:
    """A prediction's step in parts: compute (FLOPs and bytes), CPU overhead (per op and per message
    step inside the stages), bubble, exposed communication per axis, optimizer (seconds; the overheads
    only where the cluster has them)."""
    out = {"compute": p.compute_seconds - p.overhead_seconds, "CPU overhead": p.overhead_seconds,
           "bubble": p.bubble_seconds, **{f"{k} comm": v for k, v in p.comm_seconds.items()},
           "optimizer": p.optimizer_seconds}
    return {k: v for k, v in out.items() if v > 0 or k in ("compute", "bubble")}


def prediction_table(pred: perf.Prediction, got: float, cluster: Cluster, clock: str = "replayed") -> Table:
    """The predicted step in parts beside the traced step on ``clock`` (replayed on the same ``cluster``:
    first to last event), and their ratio (the goal: within 15 %)."""
    table = Table(title=f"one step, predicted (perf.predict) vs {clock}, on {cluster.name}", title_justify="left",
                  caption=f"{cluster.source}: alpha {cluster.intra.alpha * 1e6:.1f} us (+ CPU "
                          f"{cluster.call_seconds * 1e6:.1f} us per call, {cluster.message_seconds * 1e6:.1f} us per "
                          f"message), 1/beta "
                          f"{bandwidth(cluster.intra.beta)}, {cluster.flops / 1e9:.2f} GFLOP/s, 1/gamma "
                          f"{bandwidth(cluster.gamma)}, {cluster.op_seconds * 1e6:.1f} us per autograd op, "
                          f"AdamW {cluster.tensor_seconds * 1e6:.1f} us per tensor and "
                          f"{bandwidth(cluster.optimizer_gamma)}. Goal: predicted / {clock} within 15 %.",
                  caption_justify="left")
    for col in ("", *parts(pred), "step", clock, f"predicted / {clock}"):
        table.add_column(col, justify="right")
    table.add_row("ms", *(f"{v * 1e3:.1f}" for v in parts(pred).values()), f"{pred.step_seconds * 1e3:.1f}",
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
