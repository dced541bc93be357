"""Timelines on a real time axis: each rank has a compute lane and a communication lane, as
profilers draw a GPU's compute and communication streams, so communication that overlaps compute
(DDP's all-reduce during backward) shows as two bars one above the other.

- Compute lane: horizontal bars (x = start, length = duration) coloured by kind (forward,
  backward, optimizer; chunks of an interleaved schedule in shades of the kind) and labelled
  ``F3`` / ``B3`` (micro-batch 3; Chimera's two pipelines: ``F3↓`` full colour, ``F3↑`` lighter and
  hatched, from the spans' ``args["direction"]``); the lane ends with the rank's idle total (``viz.analysis``).
- Communication lane: one labelled bar per collective call (``messages.collective_spans``), e.g.
  "allreduce ring 12.0 MiB", one colour per op/algorithm; its steps are listed on hover. The
  individual messages ("messages (steps)") and the send -> receive arrows are legend entries,
  hidden until clicked. Only calls that run beside the computation sit there (a communicator's
  worker thread: DDP's bucket all-reduces, FSDP's prefetch; Ring Attention's K/V pass): a call the
  rank's own thread made inside a compute span (``messages.inside_compute``: tensor parallelism's
  all-reduces inside F, ZeRO-1's collectives inside opt) is drawn inside that span, a hatched strip
  in the call's colour along the compute bar's lower half ("allreduce ring, inside compute"), since
  the computation waited in it; a rank with no call beside its computation gets no comm lane.
- A run that lost a rank (``viz.faults``): its lanes end with a red cross, hatched grey after;
  each survivor's "peer declared dead" is a red tick on its lane, a server's "worker dropped" a diamond.
- A trace with only compute (or only messages) gets one lane per rank, named "rank r". The
  simulator's messages carry no payload and take no rank time: simulated traces get no comm lane.

Cost: O(E log E) for E events; one bar trace per kind or per collective keeps the legend short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Event, Trace
from viz import analysis as A
from viz import faults, style
from viz import messages as M
from viz.style import COLORS, comm_color, shade

COMPUTE_WIDTH = 0.88  # bar thickness on the compute lane (lanes are 1 apart: rank r at 2r and 2r + 1)
COMM_WIDTH = 0.62
STEP_WIDTH = 0.18  # individual messages: a thin strip along the comm lane's bottom edge
HOVER_STEPS = 12  # steps listed in a collective's hover before "... more"


INSIDE_WIDTH = 0.3  # a call inside a compute span: a strip along the compute bar's lower half
INSIDE_OFFSET = 0.27  # its centre below the lane's centre (the y axis points down), clear of the span's label
INSIDE_PATTERN = {"shape": "/", "fgcolor": "white", "solidity": 0.25, "size": 6}


@dataclass
class Lanes:
    """Where each rank's lanes sit on the y axis (top to bottom) and their tick labels; ``spans``: the
    trace's collective calls, ``inside[i]``: whether call i runs inside a compute span (drawn there)."""

    compute: dict[int, int] = field(default_factory=dict)
    comm: dict[int, int] = field(default_factory=dict)
    ticks: list[tuple[int, str]] = field(default_factory=list)
    spans: list[M.CommSpan] = field(default_factory=list)
    inside: list[bool] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.ticks)

    @property
    def bottom(self) -> int:
        return max((y for y, _ in self.ticks), default=0)


def lanes(trace: Trace) -> Lanes:
    """Compute and comm lanes per rank: both ("rank r compute" / "rank r comm") when the trace has
    both compute and calls beside it (not all inside compute spans), else one lane per rank named "rank r"."""
    has_compute = any(e.kind == "compute" for e in trace.events)
    spans = [] if A.is_simulated(trace) else M.collective_spans(trace)
    inside = M.inside_compute(trace, spans)
    has_comm = not all(inside)
    out = Lanes(spans=spans, inside=inside)
    for r in range(trace.world_size):
        if has_compute and has_comm:
            out.compute[r], out.comm[r] = 2 * r, 2 * r + 1
            out.ticks += [(2 * r, f"rank {r} compute"), (2 * r + 1, f"rank {r} comm")]
        else:
            (out.comm if has_comm else out.compute)[r] = r
            out.ticks.append((r, f"rank {r}"))
    return out


def span_text(span: M.CommSpan) -> str:
    """Label on a collective's bar: op, algorithm and the bytes this rank sent (else received).
    Point-to-point messages (no algorithm: send, recv, push, pull, ring_kv, ...) get none: a send and a
    receive overlap on the lane, and their labels would print over each other (their hover says it all)."""
    if span.algorithm is None:
        return ""
    moved = span.sent or span.received or span.hidden
    return f"{span.title} {A.fmt_bytes(moved)}"


def span_hover(span: M.CommSpan, unit: str, name: str = "") -> str:
    """Hover of a collective: totals, then one line per message (step, direction, peer, bytes)."""
    steps = span.steps
    head = [f"{name}rank {span.rank}: <b>{span.title}</b>",
            f"sent {A.fmt_bytes(span.sent)}, received {A.fmt_bytes(span.received)}"
            + (f" in {len(steps)} steps" if steps else "")
            + (f", {A.fmt_bytes(span.hidden)} inside the library" if span.hidden else ""),
            f"start {span.t0:.6g} {unit}, duration {A.fmt_time(span.t1 - span.t0, unit)}"]
    lines = []
    for e in span.events[:HOVER_STEPS]:
        where = "" if e.step is None else f"step {e.step}: "
        if e.src is None:
            lines.append(f"{where}{e.name} {A.fmt_bytes(e.nbytes or 0)}")
        else:
            arrow = f"-> rank {e.dst}" if e.src == span.rank else f"<- rank {e.src}"
            lines.append(f"{where}{e.name} {arrow} {A.fmt_bytes(e.nbytes or 0)}, "
                         f"{A.fmt_time(e.duration, unit)}")
    if len(span.events) > HOVER_STEPS:
        lines.append(f"... {len(span.events) - HOVER_STEPS} more messages")
    return "<br>".join(head + lines)


def _label(e: Event, microbatches: bool) -> str:
    """``F3`` (forward of micro-batch 3) when the trace has several micro-batches, else ``F``; ``F3↑``
    for a span of Chimera's up pipeline."""
    return A.label(e) if microbatches else e.name + A.ARROWS.get(A.direction(e) or "", "")


def _where(e: Event) -> str:
    """"<br>stage 1, micro-batch 3, chunk 0" for the fields a span has (pipeline work), else ""."""
    parts = [f"{k} {v}" for k, v in (("stage", e.stage), ("micro-batch", e.microbatch), ("chunk", e.chunk))
             if v is not None]
    return "<br>" + ", ".join(parts) if parts else ""


def _compute_groups(trace: Trace, chunks: bool) -> dict[tuple[str, int, str], list[Event]]:
    """Compute spans by (kind, chunk, direction or "")."""
    groups: dict[tuple[str, int, str], list[Event]] = {}
    for e in trace.events:
        if e.kind == "compute":
            groups.setdefault((A.kind_of(e), (e.chunk or 0) if chunks else 0, A.direction(e) or ""), []).append(e)
    return {k: groups[k] for k in sorted(groups, key=lambda k: (A.KINDS.index(k[0]), k[1], k[2]))}


def _marker(kind: str, chunk: int, n_chunks: int, direction: str) -> dict:
    """A bar's fill: the kind's colour, later chunks lighter; Chimera's up pipeline (``direction``
    "up") lighter still and hatched in the kind's colour, so the two directions differ at a glance."""
    if direction == "up":
        return {"color": shade(COLORS[kind], 1, 2), "line": {"color": "white", "width": 1},
                "pattern": {"shape": "/", "fgcolor": COLORS[kind], "solidity": 0.3, "size": 7}}
    return {"color": shade(COLORS[kind], chunk, n_chunks), "line": {"color": "white", "width": 1}}


def add_timeline(fig: go.Figure, trace: Trace, row: int | None = None, name: str = "",
                 legend_seen: set[str] | None = None) -> None:
    """Draw ``trace``'s lanes into ``fig`` (into subplot ``row`` when given).

    ``legend_seen``: legend entries already shown by earlier rows (updated here), so stacked
    timelines list each entry once.
    """
    seen = legend_seen if legend_seen is not None else set()

    def show_legend(entry: str) -> bool:
        new = entry not in seen
        seen.add(entry)
        return new

    unit = A.time_unit(trace)
    where = {"row": row, "col": 1} if row is not None else {}
    lane = lanes(trace)
    chunks = A.shows_chunks(trace)
    n_chunks = 1 + max((e.chunk or 0 for e in trace.events if e.kind == "compute"), default=0)
    several = len({e.microbatch for e in trace.events if e.kind == "compute" and e.microbatch is not None}) > 1
    # numpy arrays and one hover string per bar: Plotly validates those fast (lists of lists are slow)
    for (kind, chunk, direction), spans in _compute_groups(trace, chunks).items():
        entry = f"{kind}, chunk {chunk}" if chunk else kind  # chunk 0 is the kind's full colour
        if direction:  # Chimera: "forward ↓ down", "forward ↑ up"
            entry = f"{kind} {A.ARROWS[direction]} {direction}"
        fig.add_trace(go.Bar(
            orientation="h", name=entry, legendgroup=entry, showlegend=show_legend(entry), legendrank=100,
            y=np.array([lane.compute[e.rank] for e in spans]), base=np.array([e.t0 for e in spans]),
            x=np.array([e.duration for e in spans]), width=COMPUTE_WIDTH,
            marker=_marker(kind, chunk, n_chunks, direction),
            text=[_label(e, several) for e in spans], textposition="inside", insidetextanchor="middle", textangle=0,
            hovertext=[f"{name}rank {e.rank} {e.name}<br>start {e.t0:.6g} {unit}, duration "
                       f"{A.fmt_time(e.duration, unit)}{_where(e)}" for e in spans],
            hovertemplate="%{hovertext}<extra></extra>",
        ), **where)
    if lane.spans:
        _add_comm(fig, trace, lane, where, name, show_legend)
    _add_idle(fig, trace, lane, row)
    faults.add_faults(fig, trace, lane.compute, lane.comm, where, show_legend)  # a lost rank's lane stops
    lo, hi = A.window(trace)
    fig.update_yaxes(tickmode="array", tickvals=[y for y, _ in lane.ticks], ticktext=[t for _, t in lane.ticks],
                     range=[lane.bottom + 0.6, -0.6], zeroline=False, showgrid=False, **where)
    fig.update_xaxes(title_text=f"time ({unit})", range=[lo, hi + 0.01 * (hi - lo)], **where)


def _add_comm(fig: go.Figure, trace: Trace, lane: Lanes, where: dict[str, int], name: str,
              show_legend: Callable[[str], bool]) -> None:
    """Collective spans (one trace per op/algorithm, and one per op/algorithm drawn inside compute
    spans), then the hidden messages and arrows; the legend lists compute kinds, then collectives, then
    messages and arrows (``legendrank``)."""
    unit = A.time_unit(trace)
    at: dict[int, tuple[float, float]] = {}  # id(message) -> (centre, width) of its call's bar
    for inside in (False, True):
        spans = [s for s, i in zip(lane.spans, lane.inside, strict=True) if i == inside]
        for key in dict.fromkeys(s.key for s in spans):
            group = [s for s in spans if s.key == key]
            entry = f"comm {key}" + (" inside" if inside else "")
            ys = [lane.compute[s.rank] + INSIDE_OFFSET if inside else lane.comm[s.rank] for s in group]
            width = INSIDE_WIDTH if inside else COMM_WIDTH
            for s, y in zip(group, ys, strict=True):
                at.update((id(e), (y, width)) for e in s.events)
            marker = {"color": comm_color(key), "line": {"width": 0}}  # a white edge would pale thin spans
            fig.add_trace(go.Bar(
                orientation="h", name=group[0].title + (", inside compute" if inside else ""), legendgroup=entry,
                legendrank=200, showlegend=show_legend(entry), y=np.array(ys), base=np.array([s.t0 for s in group]),
                x=np.array([s.t1 - s.t0 for s in group]), width=width,
                marker={**marker, "pattern": INSIDE_PATTERN} if inside else marker,
                text=[span_text(s) for s in group], textposition="inside", insidetextanchor="middle", textangle=0,
                hovertext=[span_hover(s, unit, name) + ("<br>inside a compute span: the computation waits in it"
                                                         if inside else "") for s in group],
                hovertemplate="%{hovertext}<extra></extra>",
            ), **where)
    msgs = [e for e in trace.events if e.kind == "comm"]
    fig.add_trace(go.Bar(
        orientation="h", name="messages (steps)", legendgroup="messages", showlegend=show_legend("messages"),
        legendrank=300, visible="legendonly",  # a strip along the bottom edge of the call's bar
        y=np.array([at[id(e)][0] + (at[id(e)][1] - STEP_WIDTH) / 2 for e in msgs]),
        base=np.array([e.t0 for e in msgs]), x=np.array([e.duration for e in msgs]), width=STEP_WIDTH,
        marker={"color": "#333333"},
        hovertext=[f"{name}{e.op} {e.algorithm or ''}{'' if e.step is None else f' step {e.step}'}: {e.name}"
                   f"<br>rank {e.src} -> rank {e.dst}, {A.fmt_bytes(e.nbytes or 0)}, {A.fmt_time(e.duration, unit)}"
                   for e in msgs],
        hovertemplate="%{hovertext}<extra></extra>",
    ), **where)
    pairs = [(s, r) for s, r in M.pair_messages(trace) if r is not None]
    if pairs:  # one polyline: send start on the sender -> receive end on the receiver, NaN between
        xs = np.array([[s.t0, r.t1, np.nan] for s, r in pairs]).ravel()
        ys = np.array([[at[id(s)][0], at[id(r)][0], np.nan] for s, r in pairs]).ravel()
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name="send -> recv arrows", legendgroup="arrows", legendrank=300,
            showlegend=show_legend("arrows"), visible="legendonly", hoverinfo="skip",
            line={"color": "#555555", "width": 1},
            marker={"symbol": "arrow", "angleref": "previous", "size": 8, "color": "#555555"}, opacity=0.6,
        ), **where)


def _add_idle(fig: go.Figure, trace: Trace, lane: Lanes, row: int | None) -> None:
    """" idle 3 ms (20%)" to the right of each compute lane (see ``analysis`` for the definition)."""
    fractions = A.bubble_fractions(trace)
    if fractions is None:
        return
    lo, hi = A.window(trace)
    unit = A.time_unit(trace)
    for r, frac in enumerate(fractions):
        fig.add_annotation(
            x=1.0, xref="paper" if row is None else "x domain" if row == 1 else f"x{row} domain",
            y=lane.compute[r], yref="y" if row in (None, 1) else f"y{row}", xanchor="left", showarrow=False,
            text=f" idle {A.fmt_time(frac * (hi - lo), unit)} ({100 * frac:.0f}%)", font={"size": 11},
        )


def _layout(fig: go.Figure, heading: str, height: int, top: int) -> None:
    """Title, then the legend under it (placed in pixels from the top, so it never covers a
    subplot title), then the plot ``top`` pixels down."""
    fig.update_layout(
        title={"text": heading, "yref": "container", "y": 1 - 12 / height, "yanchor": "top"},
        barmode="overlay", bargap=0, height=height, margin={"r": 150, "l": 120, "t": top, "b": 50},
        legend={"orientation": "h", "yref": "container", "y": 1 - 44 / height, "yanchor": "top",
                "x": 0, "xanchor": "left"},
        uniformtext={"minsize": 8, "mode": "hide"}, plot_bgcolor="#F4F5F7",
    )


def timeline(trace: Trace, title: str | None = None) -> go.Figure:
    """Per-rank compute and communication lanes with idle totals (zoomable)."""
    fig = go.Figure()
    add_timeline(fig, trace)
    _layout(fig, title or style.title(trace, "timeline"), 200 + 36 * lanes(trace).count, 120)
    return fig


def compare(traces: Sequence[Trace], titles: Sequence[str] | None = None) -> go.Figure:
    """Several timelines stacked on one shared time axis (e.g. simulator vs measured)."""
    titles = list(titles or [style.title(t, "") for t in traces])
    heights = [lanes(t).count + 1.5 for t in traces]
    fig = make_subplots(rows=len(traces), cols=1, shared_xaxes=True, subplot_titles=titles,
                        row_heights=heights, vertical_spacing=0.25 / len(traces))
    seen: set[str] = set()
    for i, t in enumerate(traces):
        add_timeline(fig, t, row=i + 1, name=f"{titles[i]}: ", legend_seen=seen)
    hi = max(A.window(t)[1] for t in traces)
    fig.update_xaxes(range=[0, hi * 1.01])
    for i in range(1, len(traces)):  # one time-axis title, under the last row
        fig.update_xaxes(title_text=None, row=i, col=1)
    units = sorted({A.time_unit(t) for t in traces})
    warn = "" if len(units) == 1 else f" - careful, time units differ: {', '.join(units)}"
    _layout(fig, f"side by side (shared time axis){warn}", int(200 + 26 * sum(heights)), 150)
    return fig
