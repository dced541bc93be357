"""Plotly figures of one trace (or several on one time axis).

- ``timeline`` / ``compare`` (``viz.timeline``): per rank a compute lane and a communication lane
  on a real time axis, one labelled bar per collective call; ``compare`` stacks several traces on
  one shared time axis.
- ``schedule_grid`` (``viz.pipeline_grid``): a pipeline schedule as the papers draw it, unit-time
  cells with micro-batch numbers.
- ``traffic``: rank x rank heat map of bytes sent (cell [src][dst]) and, per ``op/algorithm``, the
  bytes each rank sent (one colour per rank) with the formula drawn as an outline over each rank's
  own bar (the rank's offset group, so it sits exactly over the measured bar it predicts). A bare
  ``"op"`` formula key sits on the one measured ``"op/algorithm"`` of that op (``analysis.traffic_rows``).
  ``group="axis"``: per mesh axis instead (a hybrid run's trace: ``viz.mesh.axis_rows``).
- ``memory``: bytes held per rank over time, stacked by the labels of the memory samples (stashed
  micro-batches, not bytes, for the simulator's counts: ``analysis.memory_counts``).
- ``measured_bars``: measured numbers (bytes, parameters) as grouped bars, each labelled with its
  formula's value (red where they differ).
- ``clock_toggle``: two drawings of one run on two clocks (replayed and wall clock) in one figure, with
  a button for each: the first shown, the second hidden until its button is pressed.
- ``table``: a terminal table (``viz.width.Table``) as a report figure: the same headers, cells, title and
  caption, so the page shows what the terminal printed.
- ``weight_versions``: per asynchronous pipeline run (PipeDream, 2BW), the weight versions each stage
  held over the step, from the runtime's ``weight_versions`` samples.

The drawn numbers come from ``viz.analysis`` (see its docstring for the bubble definition).
Cost: O(E) Plotly points for E events.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from rich.table import Table
from rich.text import Text

from minipar.trace import Trace
from viz import analysis as A
from viz import mesh, style
from viz.pipeline_grid import schedule_grid
from viz.style import FORMULA_COLOR, MEMORY_COLORS, rank_color
from viz.timeline import add_timeline, compare, timeline

__all__ = ["add_timeline", "clock_toggle", "compare", "measured_bars", "memory", "schedule_grid", "table", "timeline",
           "traffic", "weight_versions"]
BUTTONS_HEIGHT = 34  # pixels added above the plot for the clock buttons


def traffic(trace: Trace, title: str | None = None, group: str = "op") -> go.Figure:
    """Heat map of bytes sent src -> dst, and bytes per op/algorithm (``group="axis"``: per mesh axis,
    ``ValueError`` for a trace without a mesh) per rank with the formula."""
    if group not in ("op", "axis"):
        raise ValueError(f"traffic: group={group!r}; choose 'op' (op/algorithm) or 'axis' (mesh axis)")
    p = trace.world_size
    m = A.traffic_matrix(trace)
    every = mesh.axis_rows(trace) if group == "axis" else A.traffic_rows(trace)
    rows = [row for row in every if any(row[1]) or row[2] is not None]  # no empty category
    per = "mesh axis" if group == "axis" else "op/algorithm"
    fig = make_subplots(rows=1, cols=2, column_widths=[0.42, 0.58], horizontal_spacing=0.16,
                        subplot_titles=("bytes sent (row = sender, column = receiver)",
                                        f"bytes sent per rank, per {per}"))
    names = [f"rank {r}" for r in range(p)]
    fig.add_trace(go.Heatmap(
        z=m, x=names, y=names, colorscale="Blues", colorbar={"x": 0.36, "title": "bytes"},
        text=[[A.fmt_bytes(v) for v in row] for row in m], texttemplate="%{text}",
        hovertemplate="%{y} -> %{x}: %{z} bytes<extra></extra>",
    ), row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_xaxes(side="bottom", row=1, col=1)
    keys = [k for k, _, _ in rows]
    for r in range(p):
        fig.add_trace(go.Bar(
            x=keys, y=[got[r] for _, got, _ in rows], name=f"rank {r}", legendgroup="measured",
            offsetgroup=f"rank {r}", marker={"color": rank_color(r)},
            hovertemplate=f"rank {r}: %{{x}} %{{y}} bytes<extra></extra>",
        ), row=1, col=2)
    predicted = [(k, got, f) for k, got, f in rows if f is not None]
    for r in range(p if predicted else 0):  # an outline over rank r's measured bar (same offset group)
        fig.add_trace(go.Bar(
            x=[k for k, _, _ in predicted], y=[f[r] for _, _, f in predicted], name="formula (outline)",
            legendgroup="formula", showlegend=r == 0, offsetgroup=f"rank {r}",
            marker={"color": "rgba(0,0,0,0)", "line": {"color": FORMULA_COLOR, "width": 2.5}},
            customdata=[[got[r]] for _, got, _ in predicted],
            hovertemplate=f"rank {r} formula: %{{x}} %{{y:.0f}} bytes (measured %{{customdata[0]}})"
                          "<extra></extra>",
        ), row=1, col=2)
    fig.update_yaxes(title_text="bytes", row=1, col=2)
    fig.update_layout(title=title or style.title(trace, "traffic"), barmode="group",
                      height=300 + 30 * p, margin={"t": 80})
    return fig


def memory(trace: Trace, title: str | None = None) -> go.Figure:
    """Bytes held per rank over time (or stashed micro-batches: ``analysis.memory_counts``), one
    panel per rank, stacked by memory-sample label."""
    p = trace.world_size
    unit = A.time_unit(trace)
    what = "micro-batches" if A.memory_counts(trace) else "bytes"
    series = [A.memory_series(trace, r) for r in range(p)]
    labels = list(dict.fromkeys(lab for s in series for lab in s.by_label))
    fig = make_subplots(rows=p, cols=1, shared_xaxes=True, vertical_spacing=0.3 / max(p, 1),
                        subplot_titles=[f"rank {r}: peak {A.fmt_memory(trace, s.peak)}"
                                        for r, s in enumerate(series)])
    lo, hi = A.window(trace)
    for s in series:
        if not s.times:
            continue
        times = s.times + [max(hi, s.times[-1])]
        for i, lab in enumerate(labels):
            vals = s.by_label.get(lab)
            if vals is None:
                continue
            fig.add_trace(go.Scatter(
                x=np.array(times), y=np.array(vals + vals[-1:]), name=lab, legendgroup=lab,
                showlegend=s.rank == 0,
                stackgroup=f"rank{s.rank}", line={"shape": "hv", "color": MEMORY_COLORS[i % 8]},
                hovertemplate=f"rank {s.rank} {lab}: %{{y}} {what} at %{{x:.4g}} {unit}<extra></extra>",
            ), row=s.rank + 1, col=1)
    fig.update_yaxes(title_text=what)
    if what == "micro-batches":  # whole micro-batches: integer ticks
        fig.update_yaxes(tick0=0, dtick=max(1, max(s.peak for s in series) // 4))
    fig.update_xaxes(title_text=f"time ({unit})", row=p, col=1)
    fig.update_layout(title=title or style.title(trace, "memory"), height=140 + 150 * p, margin={"t": 80})
    return fig


def measured_bars(x: list[str], series: list[tuple[str, list[float], list[float]]], title: str,
                  yaxis_title: str, xaxis_title: str | None = None) -> go.Figure:
    """Grouped bars, a group per ``x``: each series ``(name, measured, formula)`` drawn as its measured
    values, each bar labelled with its formula's value (``= N`` when equal; red ``formula N`` when not).
    Colours: ``MEMORY_COLORS`` in order."""
    fig = go.Figure()
    for (name, got, want), colour in zip(series, MEMORY_COLORS):
        fig.add_bar(name=name, x=x, y=got, marker_color=colour, textposition="outside",
                    text=[f"= {w:g}" if g == w else f"formula {w:g}" for g, w in zip(got, want)],
                    textfont={"color": ["#333333" if g == w else FORMULA_COLOR for g, w in zip(got, want)]})
    fig.update_layout(barmode="group", height=420, title=title, yaxis_title=yaxis_title, xaxis_title=xaxis_title)
    return fig


def clock_toggle(first: go.Figure, second: go.Figure, labels: tuple[str, str]) -> go.Figure:
    """``first`` with ``second``'s traces beside it, hidden, and two buttons (``labels``) above the plot
    that show one or the other: traces (a legend-only trace stays legend-only), title, annotations
    (idle totals, subplot titles), shapes and every time axis's range swap with them. Both figures
    must draw the same subplots (one run on two clocks)."""
    fig = go.Figure(first)
    fig.add_traces(list(second.data))
    n = len(fig.data)

    def view(f: go.Figure, offset: int) -> list[dict]:
        visible: list[bool | str] = [False] * n
        for i, t in enumerate(f.data):
            visible[offset + i] = True if t.visible is None else t.visible
        axes = {f"{k}.range": list(f.layout[k].range) for k in f.layout if k.startswith("xaxis")
                and f.layout[k].range is not None}
        return [{"visible": visible}, {"title.text": f.layout.title.text, **axes,
                                       "annotations": [a.to_plotly_json() for a in f.layout.annotations],
                                       "shapes": [sh.to_plotly_json() for sh in f.layout.shapes]}]

    on_first = view(first, 0)
    for i, v in enumerate(on_first[0]["visible"]):
        fig.data[i].visible = v
    top = (fig.layout.margin.t or 80) + BUTTONS_HEIGHT
    fig.update_layout(height=(fig.layout.height or 450) + BUTTONS_HEIGHT, margin={"t": top}, updatemenus=[{
        "type": "buttons", "direction": "right", "active": 0, "showactive": True, "x": 1.0, "xanchor": "right",
        "y": 1.0, "yanchor": "bottom", "pad": {"b": 6}, "font": {"size": 12},
        "buttons": [{"label": labels[0], "method": "update", "args": on_first},
                    {"label": labels[1], "method": "update", "args": view(second, len(first.data))}]}])
    return fig


def _text(cell: object) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell or "")


def table(source: Table) -> go.Figure:
    """``source`` (a terminal table) as a Plotly table: its headers, its cells as text, its title above and its
    caption below the cells."""
    cols = [[_text(c) for c in col.cells] for col in source.columns]
    fig = go.Figure(go.Table(header={"values": [_text(col.header) for col in source.columns], "fill_color": "#E8EAF0",
                                     "align": "left"}, cells={"values": cols, "align": "left"}))
    caption = _text(source.caption)
    fig.update_layout(title=_text(source.title) or None, height=120 + 24 * source.row_count + (30 if caption else 0),
                      margin={"l": 20, "r": 20, "t": 50, "b": 40 if caption else 0})
    if caption:
        fig.add_annotation(text=caption, x=0, xref="paper", y=0, yref="paper", yshift=-8, yanchor="top",
                           showarrow=False, align="left", font={"size": 11})
    return fig


def weight_versions(traces: list[Trace]) -> go.Figure:
    """Per trace (an asynchronous schedule's step), the weight versions each stage holds over the step: the
    runtime's ``weight_versions`` samples (at each update and each release), one line per stage."""
    kinds = [str(t.meta.get("schedule", "?")) for t in traces]
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=kinds, shared_yaxes=True)
    for col, trace in enumerate(traces, 1):
        t0 = min(e.t0 for e in trace.events if e.kind == "compute")
        for s in range(trace.meta["p"]):
            held = trace.select("memory", name="weight_versions", stage=s)
            samples = sorted((e.t0, e.args["versions"]) for e in held)
            fig.add_scatter(x=[0.0] + [1e3 * (t - t0) for t, _ in samples], y=[1] + [v for _, v in samples],
                            mode="lines", line={"shape": "hv", "color": rank_color(s)}, name=f"stage {s}",
                            legendgroup=f"stage {s}", showlegend=col == 1, row=1, col=col)
        clock = style.clock(trace, short=True)
        fig.update_xaxes(title_text=f"time in the step (ms{', ' + clock if clock else ''})", row=1, col=col)
    fig.update_yaxes(title_text="weight versions held", dtick=1, row=1, col=1)
    fig.update_layout(height=330, margin={"l": 60, "r": 20, "t": 40, "b": 40})
    return fig
