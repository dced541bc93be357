"""Plotly figures of one trace (or several on one time axis).

- ``timeline``: one row per rank (y = rank, labelled "rank r"); compute spans are horizontal bars
  (x = start, length = duration) coloured by kind and labelled with micro-batch (and chunk);
  messages are thin bars on the sender's and receiver's rows plus an arrow from the send's start
  on the sender to the receive's end on the receiver; each row ends with its idle (bubble) total.
- ``traffic``: rank x rank heat map of bytes sent (cell [src][dst]) and, per ``op/algorithm``,
  bytes sent per rank next to what the formula predicts: one red bar per key for the scalar
  ``meta["expected_bytes"]`` (the same for every rank), or, for a key of
  ``meta["expected_bytes_by_rank"]``, a red outline on each rank's own bar at that rank's formula
  (drawn in the rank's offset group, so it sits exactly over the measured bar it predicts).
- ``memory``: bytes held per rank over time, stacked by the labels of the memory samples.
- ``compare``: several traces' timelines stacked on one shared time axis.

The drawn numbers come from ``viz.analysis`` (see its docstring for the bubble definition).
Cost: O(E) Plotly points for E events; one bar trace per kind keeps the legend short.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Trace
from viz import analysis as A

COLORS = {"forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "other": "#9D9D9D"}
COMM_COLOR = "#B279A2"
FORMULA_COLOR = "#E45756"
MEMORY_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6"]
ROW_HEIGHT = 0.7  # compute bar thickness in rank rows
COMM_HEIGHT = 0.18  # message bar thickness, drawn along the bottom edge of the row


def _unit(trace: Trace) -> str:
    return A.time_unit(trace)


def add_timeline(fig: go.Figure, trace: Trace, row: int | None = None, name: str = "",
                 legend_seen: set[str] | None = None) -> None:
    """Draw ``trace``'s timeline into ``fig`` (into subplot ``row`` when given).

    ``legend_seen``: legend entries already shown by earlier rows (updated here), so stacked
    timelines list each kind once.
    """
    seen = legend_seen if legend_seen is not None else set()

    def show_legend(entry: str) -> bool:
        new = entry not in seen
        seen.add(entry)
        return new

    unit = _unit(trace)
    where = {"row": row, "col": 1} if row is not None else {}
    chunks = A.shows_chunks(trace)
    # numpy arrays and one hover string per bar: Plotly validates those fast (lists of lists are slow)
    for kind in A.KINDS:
        spans = [e for e in trace.events if e.kind == "compute" and A.kind_of(e) == kind]
        if not spans:
            continue
        fig.add_trace(go.Bar(
            orientation="h", name=kind, legendgroup=kind, showlegend=show_legend(kind),
            y=np.array([e.rank for e in spans]), base=np.array([e.t0 for e in spans]),
            x=np.array([e.duration for e in spans]),
            width=ROW_HEIGHT, marker={"color": COLORS[kind], "line": {"color": "white", "width": 1}},
            text=[A.label(e, chunks) for e in spans], textposition="inside", insidetextanchor="middle",
            hovertext=[f"{name}rank {e.rank} {e.name}<br>start {e.t0:.6g} {unit}, duration "
                       f"{A.fmt_time(e.duration, unit)}<br>stage {e.stage}, micro-batch {e.microbatch}, "
                       f"chunk {e.chunk}" for e in spans],
            hovertemplate="%{hovertext}<extra></extra>",
        ), **where)
    msgs = [e for e in trace.events if e.kind == "comm"]
    if msgs:
        fig.add_trace(go.Bar(
            orientation="h", name="message", legendgroup="message", showlegend=show_legend("message"),
            y=np.array([e.rank + (ROW_HEIGHT - COMM_HEIGHT) / 2 for e in msgs]),
            base=np.array([e.t0 for e in msgs]), x=np.array([e.duration for e in msgs]),
            width=COMM_HEIGHT, marker={"color": COMM_COLOR},
            hovertext=[f"{name}{e.name} {e.op} {e.algorithm or ''}<br>rank {e.src} -> rank {e.dst}, "
                       f"{A.fmt_bytes(e.nbytes or 0)}<br>duration {A.fmt_time(e.duration, unit)}"
                       for e in msgs],
            hovertemplate="%{hovertext}<extra></extra>",
        ), **where)
    pairs = [(s, r) for s, r in A.pair_messages(trace) if r is not None]
    if pairs:  # one polyline: send start on the sender -> receive end on the receiver, NaN between
        xs = np.array([[s.t0, r.t1, np.nan] for s, r in pairs]).ravel()
        ys = np.array([[s.rank, r.rank, np.nan] for s, r in pairs]).ravel()
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name="send -> recv", legendgroup="message",
            showlegend=show_legend("arrow"), hoverinfo="skip", line={"color": COMM_COLOR, "width": 1},
            marker={"symbol": "arrow", "angleref": "previous", "size": 8, "color": COMM_COLOR},
            opacity=0.6,
        ), **where)
    lo, hi = A.window(trace)
    fractions = A.bubble_fractions(trace)
    if fractions is not None:
        for r, frac in enumerate(fractions):
            fig.add_annotation(
                x=1.0, xref="paper" if row is None else "x domain" if row == 1 else f"x{row} domain",
                y=r, yref="y" if row in (None, 1) else f"y{row}", xanchor="left", showarrow=False,
                text=f" idle {A.fmt_time(frac * (hi - lo), unit)} ({100 * frac:.0f}%)",
                font={"size": 11},
            )
    p = trace.world_size
    fig.update_yaxes(tickmode="array", tickvals=list(range(p)), ticktext=[f"rank {r}" for r in range(p)],
                     range=[p - 0.5, -0.5], zeroline=False, **where)
    fig.update_xaxes(title_text=f"time ({unit})", range=[lo, hi + 0.01 * (hi - lo)], **where)


def timeline(trace: Trace, title: str | None = None) -> go.Figure:
    """Per-rank timeline of compute spans, messages and idle totals (zoomable)."""
    fig = go.Figure()
    add_timeline(fig, trace)
    fig.update_layout(
        title=title or _title(trace, "timeline"), barmode="overlay", bargap=0,
        height=170 + 45 * trace.world_size, margin={"r": 150, "l": 70, "t": 90, "b": 50},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        uniformtext={"minsize": 8, "mode": "hide"},
    )
    return fig


def compare(traces: Sequence[Trace], titles: Sequence[str] | None = None) -> go.Figure:
    """Several timelines stacked on one shared time axis (e.g. simulator vs measured)."""
    titles = list(titles or [_title(t, "") for t in traces])
    heights = [t.world_size + 1 for t in traces]
    fig = make_subplots(rows=len(traces), cols=1, shared_xaxes=True, subplot_titles=titles,
                        row_heights=heights, vertical_spacing=0.08)
    seen: set[str] = set()
    for i, t in enumerate(traces):
        add_timeline(fig, t, row=i + 1, name=f"{titles[i]}: ", legend_seen=seen)
    hi = max(A.window(t)[1] for t in traces)
    fig.update_xaxes(range=[0, hi * 1.01])
    for i in range(1, len(traces)):  # one time-axis title, under the last row
        fig.update_xaxes(title_text=None, row=i, col=1)
    units = sorted({_unit(t) for t in traces})
    warn = "" if len(units) == 1 else f" - careful, time units differ: {', '.join(units)}"
    fig.update_layout(
        title=f"side by side (shared time axis){warn}",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        barmode="overlay", bargap=0,
        height=150 + sum(45 * h for h in heights), margin={"r": 150, "l": 70, "t": 110, "b": 50},
        uniformtext={"minsize": 8, "mode": "hide"},
    )
    return fig


def traffic(trace: Trace, title: str | None = None) -> go.Figure:
    """Heat map of bytes sent src -> dst, and bytes per op/algorithm vs the formula."""
    p = trace.world_size
    m = A.traffic_matrix(trace)
    by_op = A.bytes_by_op(trace)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.15,
                        subplot_titles=("bytes sent (row = sender, column = receiver)",
                                        "bytes sent per rank, per op/algorithm"))
    names = [f"rank {r}" for r in range(p)]
    fig.add_trace(go.Heatmap(
        z=m, x=names, y=names, colorscale="Blues", colorbar={"x": 0.4, "title": "bytes"},
        text=[[A.fmt_bytes(v) for v in row] for row in m], texttemplate="%{text}",
        hovertemplate="%{y} -> %{x}: %{z} bytes<extra></extra>",
    ), row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_xaxes(side="bottom", row=1, col=1)
    for r in range(p):
        keys = list(by_op)
        fig.add_trace(go.Bar(
            x=keys, y=[by_op[k][r] for k in keys], name=f"rank {r} measured", legendgroup="measured",
            offsetgroup=f"rank {r}",
            marker={"color": COLORS["forward"], "opacity": 0.45 + 0.55 * (r + 1) / p},
            hovertemplate=f"rank {r}: %{{x}} %{{y}} bytes<extra></extra>",
        ), row=1, col=2)
    by_rank = A.formula_by_rank(trace)
    ranked = {k for k, _, _ in by_rank}
    formula = [row for row in A.measured_vs_formula(trace) if row[0] not in ranked]
    if formula:
        fig.add_trace(go.Bar(
            x=[k for k, _, _ in formula], y=[v for _, _, v in formula], name="formula (per rank)",
            offsetgroup="formula", marker={"color": FORMULA_COLOR},
            hovertemplate="formula: %{x} %{y:.0f} bytes<extra></extra>",
        ), row=1, col=2)
    for r in range(p if by_rank else 0):  # an outline over rank r's measured bar (same offset group)
        fig.add_trace(go.Bar(
            x=[k for k, _, _ in by_rank], y=[f[r] for _, _, f in by_rank], name="formula by rank (outline)",
            legendgroup="formula by rank", showlegend=r == 0, offsetgroup=f"rank {r}",
            marker={"color": "rgba(0,0,0,0)", "line": {"color": FORMULA_COLOR, "width": 2.5}},
            customdata=[[got[r]] for _, got, _ in by_rank],
            hovertemplate=f"rank {r} formula: %{{x}} %{{y:.0f}} bytes (measured %{{customdata[0]}})"
                          "<extra></extra>",
        ), row=1, col=2)
    fig.update_yaxes(title_text="bytes", row=1, col=2)
    fig.update_layout(title=title or _title(trace, "traffic"), barmode="group",
                      height=260 + 30 * p, margin={"t": 80})
    return fig


def memory(trace: Trace, title: str | None = None) -> go.Figure:
    """Bytes held per rank over time, one panel per rank, stacked by memory-sample label."""
    p = trace.world_size
    unit = _unit(trace)
    series = [A.memory_series(trace, r) for r in range(p)]
    labels = list(dict.fromkeys(lab for s in series for lab in s.by_label))
    fig = make_subplots(rows=p, cols=1, shared_xaxes=True, vertical_spacing=0.3 / max(p, 1),
                        subplot_titles=[f"rank {r}: peak {A.fmt_bytes(s.peak)}"
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
                hovertemplate=f"rank {s.rank} {lab}: %{{y}} bytes at %{{x:.4g}} {unit}<extra></extra>",
            ), row=s.rank + 1, col=1)
    fig.update_yaxes(title_text="bytes")
    fig.update_xaxes(title_text=f"time ({unit})", row=p, col=1)
    fig.update_layout(title=title or _title(trace, "memory"), height=140 + 150 * p, margin={"t": 80})
    return fig


def _title(trace: Trace, what: str) -> str:
    meta = trace.meta
    parts = [str(meta.get("paradigm", "trace"))]
    if meta.get("schedule"):
        parts.append(str(meta["schedule"]))
    parts.append(f"{trace.world_size} ranks")
    if meta.get("backend"):
        parts.append(str(meta["backend"]))
    return f"{what}: {', '.join(parts)}" if what else ", ".join(parts)
