"""Lesson 2b's tables: the schedules simulated with unit costs and measured, against the formulas (the
terminal tables and the report's table figure), and the weight versions each stage held over the
measured step (asynchronous schedules). ``lesson.py`` loads this file (``lessons.load``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from lessons.common import REPLAY, Clock
from minipar import trace as mtrace
from viz import style
from viz.width import Table

RANGE = {"zb-h1": "W<=F,I only", "zb-v": "F=I=W only", "chimera": "F=B only"}  # where the idle formula holds


def _ints(xs: list[int] | None) -> str:
    return "no formula" if xs is None else " ".join(map(str, xs))


def unit_table(rows: list[dict[str, Any]], p: int) -> Table:
    """(1)/(3): the schedules simulated with unit costs against the formulas."""
    table = Table(title=f"(1) simulated, F = I = W = 1 (B = 2), p = {p}: idle per rank, stash and weight versions "
                  "vs the formulas", title_justify="left")
    for col in ("schedule", "step", "idle per rank", "formula", "peak stash", "formula", "weight versions",
                "formula"):
        table.add_column(col, justify="right")
    for row in rows:
        formula = RANGE.get(row["kind"], "no formula") if row["formula"] is None else f"{row['formula']:g}"
        kind = row["kind"] + (f" ({row['v']} chunks)" if row["v"] > 1 else "")
        table.add_row(kind, f"{row['makespan']:g}", " ".join(f"{x:g}" for x in row["idle"]), formula,
                      _ints(row["peak"]), _ints(row["formula_peak"]), _ints(row["versions"]),
                      _ints(row["formula_versions"]))
    table.caption = ("stash: micro-batches held from their F to their W (B); with chunks, chunk-micro-batches (each "
                     "half a rank's share: 2p weigh what p whole ones do). Versions per stage: PipeDream p - r, "
                     "2BW 2, synchronous 1. PipeDream and 2BW run 1F1B's order: 1F1B's formulas; Chimera: "
                     "both directions' micro-batches on a rank")
    return table


def measured_table(rows: list[dict[str, Any]], clock: Clock = REPLAY) -> Table:
    """(2)/(3): the real runs, last step (times on ``clock``), against the simulator and the formula fed with
    their durations."""
    table = Table(title=f"(2) the runtime, last step, {clock.label}: idle per rank (mean over ranks) and stash; "
                  "F, B = I + W and W are medians per action", title_justify="left")
    for col in ("schedule", "F / B / W (ms)", "step", "idle", "simulator", "formula", "peak stash", "formula",
                "versions"):
        table.add_column(col, justify="right")
    for row in rows:
        durations = " / ".join(f"{1e3 * x:.1f}" for x in (row["F"], row["B"], row["W"]) if x is not None)
        formula = f"{1e3 * row['formula']:.0f} ms" if row["formula"] is not None else (
            RANGE.get(row["kind"], "no formula"))
        idle, sim_idle = (f"{1e3 * np.mean(row[k]):.0f} ms" for k in ("idle", "sim_idle"))
        table.add_row(row["kind"], durations, f"{1e3 * row['step']:.0f} ms", idle, sim_idle, formula,
                      _ints(row["peak"]), _ints(row["formula_peak"]), _ints(row["versions"]))
    table.caption = (f"idle: {clock.short} in the trace; simulator: the schedule played with these durations; "
                     "formula: cost.pipeline.bubble_time with their means; versions: the most each stage held "
                     "(recorded at its updates)")
    return table


def table_figure(units: list[dict[str, Any]], measured: list[dict[str, Any]], clock: str = "replayed") -> go.Figure:
    """The lesson's table for the report: per schedule, unit-cost and run idle (on ``clock``) and stash vs the
    formulas."""
    by_kind = {row["kind"]: row for row in measured}

    def fmt(x: float | None, scale: float = 1.0, unit: str = "", kind: str = "") -> str:
        if x is None:  # ZB-V's (p-1) F holds for F = I = W only
            return RANGE.get(kind, "no formula")
        return f"{scale * x:.3g}{unit}"

    cols: dict[str, list[str]] = {k: [] for k in (
        "schedule", "idle per rank, F=I=W=1", "formula", "peak stash per rank", "stash formula", "weight versions per "
        "stage: simulated | measured", "versions formula", f"idle {clock} (mean)", f"simulator, {clock} durations",
        f"formula, {clock} durations")}
    for row in units:
        meas = by_kind.get(row["kind"], {"versions": None, "idle": [], "sim_idle": [], "formula": None})
        values = (row["kind"], " ".join(f"{x:g}" for x in row["idle"]), fmt(row["formula"], kind=row["kind"]),
                  _ints(row["peak"]), _ints(row["formula_peak"]), f"{_ints(row['versions'])} | "
                  f"{_ints(meas['versions']) if meas['versions'] else '-'}", _ints(row["formula_versions"]),
                  *(fmt(np.mean(meas[k]), 1e3, " ms") if meas[k] else "-" for k in ("idle", "sim_idle")),
                  fmt(meas["formula"], 1e3, " ms", row["kind"]) if meas["idle"] else "-")
        for key, value in zip(cols, values, strict=True):
            cols[key].append(value)
    fig = go.Figure(go.Table(header={"values": list(cols), "fill_color": "#E8EAF0", "align": "left"},
                             cells={"values": list(cols.values()), "align": "left"}))
    fig.update_layout(height=90 + 24 * len(units), margin={"l": 20, "r": 20, "t": 10, "b": 0})
    return fig


def versions_figure(traces: list[mtrace.Trace]) -> go.Figure:
    """Per asynchronous schedule's last step, the weight versions each stage holds over the step (the
    runtime's ``weight_versions`` samples: at each update and each release), one line per stage."""
    from plotly.subplots import make_subplots

    kinds = [str(t.meta["schedule"]) for t in traces]
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=kinds, shared_yaxes=True)
    for col, trace in enumerate(traces, 1):
        t0 = min(e.t0 for e in trace.events if e.kind == "compute")
        for s in range(trace.meta["p"]):
            held = trace.select("memory", name="weight_versions", stage=s)
            samples = sorted((e.t0, e.args["versions"]) for e in held)
            fig.add_scatter(x=[0.0] + [1e3 * (t - t0) for t, _ in samples], y=[1] + [v for _, v in samples],
                            mode="lines", line={"shape": "hv", "color": style.rank_color(s)}, name=f"stage {s}",
                            legendgroup=f"stage {s}", showlegend=col == 1, row=1, col=col)
        fig.update_xaxes(title_text="time in the step (ms)", row=1, col=col)
    fig.update_yaxes(title_text="weight versions held", dtick=1, row=1, col=1)
    fig.update_layout(height=330, margin={"l": 60, "r": 20, "t": 40, "b": 40})
    return fig
