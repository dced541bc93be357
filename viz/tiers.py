"""Memory tiers (``minipar.tiers``): where every byte lives over time, and what moved between tiers.

Read from the trace alone: the "device", "cpu" and "nvme" memory samples (the device pool and the
NVMe files sample themselves, ZeRO-Offload samples its host bytes) and the "transfer" events, one per
copy between tiers, with ``args = {"src", "dst", "modelled_s"}`` (``modelled_s``: the ``Bandwidth``
model's time for the link) beside the measured ``t0``/``t1``.

- ``moves(trace, rank=None)``: the transfer events in time order.
- ``per_step_moves(trace, rank)``: bytes per ``"src->dst"`` before the first "step" mark (setup),
  then between consecutive "step" / "flush" marks.
- ``links(trace)``: per ``(src, dst)``: bytes, moves, measured and modelled seconds, over all ranks.
- ``residency_figure(trace, title)``: per rank, each tier's bytes over time stacked (a label keeps its
  latest sample's value until its next one), with every move marked above the stack: a triangle
  pointing up for a move towards the device, down for one away from it, coloured by destination.
- ``transfers_figure(trace, title)``: the moves as links between the tiers (a Sankey diagram, sources
  left, destinations right, width = bytes over all ranks) and, per link, the measured and the
  modelled time per rank.
- ``budget_figure(rows, title)``: a device-budget sweep (rows of ``method``, ``budget`` bytes, ``step_s``,
  ``modelled_s``, ``bytes``): per method the measured step time against the budget (solid) and the
  modelled time of its moves (dotted).

Cost: O(E) for E events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Event, Trace
from viz import analysis as A

TIERS = ("device", "cpu", "nvme")  # fastest first: a move to a lower index goes "up"
TIER_COLORS = {"device": "#4C78A8", "cpu": "#54A24B", "nvme": "#F58518"}
STEP_MARKS = ("step", "flush")


def has_transfers(trace: Trace) -> bool:
    """True when the trace holds at least one move between memory tiers."""
    return any(e.kind == "transfer" for e in trace.events)


def moves(trace: Trace, rank: int | None = None) -> list[Event]:
    """The transfer events (of ``rank``, or of every rank), in time order."""
    return sorted((e for e in trace.events if e.kind == "transfer" and (rank is None or e.rank == rank)),
                  key=lambda e: e.t0)


def per_step_moves(trace: Trace, rank: int, marks: Sequence[str] = STEP_MARKS) -> list[dict[str, int]]:
    """Bytes per ``"src->dst"`` on ``rank`` in each window: before the first mark named in ``marks``
    (setup), then from each such mark to the next (the last window runs to the end)."""
    starts = sorted(e.t0 for e in trace.events if e.kind == "mark" and e.rank == rank and e.name in marks)
    out: list[dict[str, int]] = [{} for _ in range(len(starts) + 1)]
    for e in moves(trace, rank):
        i = sum(1 for s in starts if s <= e.t0)
        key = f"{e.args['src']}->{e.args['dst']}"
        out[i][key] = out[i].get(key, 0) + (e.nbytes or 0)
    return out


def links(trace: Trace) -> dict[tuple[str, str], dict[str, float]]:
    """Per ``(src, dst)`` over all ranks: ``bytes``, ``moves``, ``measured_s`` and ``modelled_s``."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for e in moves(trace):
        link = out.setdefault((e.args["src"], e.args["dst"]), {"bytes": 0, "moves": 0, "measured_s": 0.0,
                                                                 "modelled_s": 0.0})
        link["bytes"] += e.nbytes or 0
        link["moves"] += 1
        link["measured_s"] += e.duration
        link["modelled_s"] += float(e.args.get("modelled_s", 0.0))
    return out


def _up(e: Event) -> bool:
    src, dst = e.args["src"], e.args["dst"]
    return TIERS.index(dst) < TIERS.index(src) if src in TIERS and dst in TIERS else False


def residency_figure(trace: Trace, title: str = "") -> go.Figure:
    """Per rank: device, cpu and nvme bytes over time, stacked, and every move marked above them."""
    p = trace.world_size
    fig = make_subplots(rows=p, cols=1, shared_xaxes=True, vertical_spacing=0.3 / max(p, 1),
                        subplot_titles=[f"rank {r}" for r in range(p)])
    for r in range(p):
        s = A.memory_series(trace, r)
        mine = moves(trace, r)
        end = max([*s.times, *(e.t1 for e in mine)], default=0.0)
        top = 0
        for tier in TIERS:
            vals = s.by_label.get(tier)
            if vals is None:
                continue
            top += max(vals)
            fig.add_trace(go.Scatter(
                x=[*s.times, end], y=[*vals, vals[-1]], name=tier, legendgroup=tier, showlegend=r == 0,
                stackgroup=f"rank{r}", line={"shape": "hv", "color": TIER_COLORS[tier]},
                hovertemplate=f"rank {r} {tier}: %{{y:,}} B at %{{x:.4g}} s<extra></extra>"), row=r + 1, col=1)
        y = 1.08 * (top or 1)
        for direction, pick in (("towards the device", True), ("away from the device", False)):
            picked = [e for e in mine if _up(e) == pick]
            if not picked:
                continue
            fig.add_trace(go.Scatter(
                x=[e.t0 for e in picked], y=[y] * len(picked), mode="markers", name=f"move {direction}",
                legendgroup=f"move {direction}", showlegend=r == 0,
                marker={"symbol": "triangle-up" if pick else "triangle-down", "size": 9,
                        "color": [TIER_COLORS.get(e.args["dst"], "#777") for e in picked]},
                customdata=[[e.name, e.args["src"], e.args["dst"], e.nbytes, e.duration * 1e3,
                             float(e.args.get("modelled_s", 0.0)) * 1e3] for e in picked],
                hovertemplate="%{customdata[0]}: %{customdata[1]} -> %{customdata[2]}, %{customdata[3]:,} B, "
                              "measured %{customdata[4]:.3f} ms, modelled %{customdata[5]:.3f} ms<extra></extra>"),
                row=r + 1, col=1)
        fig.update_yaxes(title_text="bytes", range=[0, 1.2 * (top or 1)], row=r + 1, col=1)
    fig.update_xaxes(title_text="time (s)", row=p, col=1)
    fig.update_layout(title=f"bytes per tier over time, per rank: {title} (triangles: moves between tiers)",
                      height=160 + 200 * p, margin={"t": 80}, legend={"orientation": "h", "y": -0.12})
    return fig


def transfers_figure(trace: Trace, title: str = "") -> go.Figure:
    """Left: the moves as links between tiers (sources left, destinations right, width = bytes over
    all ranks). Right: per link, the measured and the modelled seconds per rank (mean over ranks)."""
    found = links(trace)
    srcs = [t for t in TIERS if any(s == t for s, _ in found)]
    dsts = [t for t in TIERS if any(d == t for _, d in found)]
    out_of = {t: sum(v["bytes"] for (s, _), v in found.items() if s == t) for t in srcs}
    into = {t: sum(v["bytes"] for (_, d), v in found.items() if d == t) for t in dsts}
    nodes = ([f"from {t}: {A.fmt_bytes(out_of[t])}" for t in srcs]
             + [f"to {t}: {A.fmt_bytes(into[t])}" for t in dsts])
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.12,
                        specs=[[{"type": "domain"}, {"type": "xy"}]],
                        subplot_titles=("bytes moved between tiers, all ranks",
                                        "time per rank, measured and modelled (Bandwidth)"))
    items = sorted(found.items(), key=lambda kv: (TIERS.index(kv[0][0]), TIERS.index(kv[0][1])))
    info: list[Any] = [[A.fmt_bytes(v["bytes"]), int(v["moves"]), v["measured_s"] * 1e3, v["modelled_s"] * 1e3]
                       for _, v in items]
    fig.add_trace(go.Sankey(
        arrangement="fixed",
        node={"label": nodes, "color": [TIER_COLORS[t] for t in (*srcs, *dsts)], "pad": 18, "thickness": 16},
        link={"source": [srcs.index(s) for (s, _), _ in items],
              "target": [len(srcs) + dsts.index(d) for (_, d), _ in items],
              "value": [v["bytes"] for _, v in items], "customdata": info,
              "color": [_fade(TIER_COLORS[d]) for (_, d), _ in items],
              "label": [f"{s} -> {d}: {A.fmt_bytes(v['bytes'])}" for (s, d), v in items],
              "hovertemplate": "%{label} in %{customdata[1]} moves; measured %{customdata[2]:.3f} ms, "
                               "modelled %{customdata[3]:.3f} ms<extra></extra>"}), row=1, col=1)
    names = [f"{s} -> {d}" for (s, d), _ in items]
    p = max(trace.world_size, 1)
    for what, key, color in (("measured", "measured_s", "#9D9D9D"), ("modelled", "modelled_s", "#D62728")):
        ys = [v[key] * 1e3 / p for _, v in items]
        fig.add_trace(go.Bar(x=names, y=ys, name=what, marker={"color": color}, text=[f"{y:.3g}" for y in ys],
                             textposition="outside", hovertemplate=f"%{{x}} {what}: %{{y:.4f}} ms per rank"
                                                                   "<extra></extra>"), row=1, col=2)
    fig.update_yaxes(title_text="ms per rank", row=1, col=2)
    summary = "; ".join(f"{s} -> {d} {A.fmt_bytes(v['bytes'])}" for (s, d), v in items)
    fig.update_layout(title=f"transfers between tiers: {title}<br><sup>{summary}</sup>", barmode="group",
                      height=420, margin={"t": 100})
    return fig


METHOD_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2")


def budget_figure(rows: Sequence[dict[str, Any]], title: str = "") -> go.Figure:
    """Per method (in order of first appearance): measured step time (ms) against the device budget
    (KB), solid with markers, and the modelled time of the step's moves, dotted, same colour."""
    fig = go.Figure()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for i, method in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["budget"])
        xs, color = [r["budget"] / 1e3 for r in mine], METHOD_COLORS[i % len(METHOD_COLORS)]
        moved = [[A.fmt_bytes(int(r["bytes"]))] for r in mine]
        fig.add_trace(go.Scatter(x=xs, y=[r["step_s"] * 1e3 for r in mine], name=f"{method}: step measured",
                                 mode="lines+markers", line={"color": color}, customdata=moved,
                                 hovertemplate="budget %{x:.1f} KB: step %{y:.2f} ms, "
                                               "%{customdata[0]} moved<extra></extra>"))
        fig.add_trace(go.Scatter(x=xs, y=[r["modelled_s"] * 1e3 for r in mine], name=f"{method}: moves modelled",
                                 mode="lines+markers", line={"color": color, "dash": "dot"}, customdata=moved,
                                 hovertemplate="budget %{x:.1f} KB: moves %{y:.4f} ms modelled "
                                               "(%{customdata[0]})<extra></extra>"))
    fig.update_xaxes(title_text="device budget per rank (KB)")
    fig.update_yaxes(title_text="ms per step", rangemode="tozero")
    fig.update_layout(title=title, height=420, legend={"font": {"size": 11}})
    return fig


def _fade(color: str, alpha: float = 0.45) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"
