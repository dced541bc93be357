"""Model states per rank, stacked, as the ZeRO paper draws them (Rajbhandari et al. 2020, Fig. 1:
one bar per device, parameters / gradients / optimizer states, shrinking from the baseline to
P_os, P_os+g and P_os+g+p), and FSDP's gathered units rising and falling unit by unit (Zhao et
al. 2023, Sec. 3.3-3.4).

Read from the trace's memory samples alone (``minipar.parallel.zero`` and the lesson's DDP driver
sample "parameters", "gradients", "optimizer state", in mixed precision "master parameters" (fp32)
and, for FSDP, "gathered units"; any other label,
such as DDP's "gradient buckets", is stacked on top). A label holds its latest sample's bytes until
its next sample (``analysis.memory_series``).

- ``states_at(trace, rank, t)``: bytes per label held at time ``t``.
- ``before_step(trace, rank)``: at the start of the rank's last "opt" span: every gradient has been
  computed (and, from stage 2, reduced to its shard), nothing is gathered: the model states the
  paper's Table 1 counts.
- ``at_peak(trace, rank)``: at the instant the rank held the most (transients included: a stage-2
  bucket not yet reduced, FSDP's current and prefetched units).
- ``stacks_figure(traces, titles)``: both, one stacked bar per (trace, rank), side by side.
- ``gathered_figure(trace, title)``: per rank, the bytes of gathered units over time, with each
  unit's forward span named above it.
- ``fsdp_step_figure(trace, title)``: the step's timeline (a forward span per unit, the all-gathers
  and reduce-scatters on the communication lanes) over the gathered bytes of every rank, on one time
  axis: the prefetched all-gather of the next unit runs while this one computes.
- ``totals_table(traces, want)``: the model states each run keeps per rank when its step begins, one
  row per run and a column per world size N, and whether each equals the formula's.
- ``fsdp_forward_table(trace, numels, n)``: the same forward on rank 0 as a table, unit by unit: the
  gathered bytes while it computes and after it reshards, the next unit's all-gather and how much of
  it ran inside this unit's span.

Cost: O(E log E) for E events.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Trace
from viz import analysis as A
from viz.style import MEMORY_COLORS, SPARE_COLORS, rank_color, with_clock
from viz.timeline import add_timeline, lanes
from viz.width import Table

MODEL_STATES = ("parameters", "gradients", "optimizer state", "master parameters", "gathered units")
GATHERED = "gathered units"
# DDP's "gradient buckets" in pink, apart from the master parameters' red (a spare colour was close to it)
STATE_COLORS = {**dict(zip(MODEL_STATES, MEMORY_COLORS[:5], strict=True)), "gradient buckets": MEMORY_COLORS[7]}
MANY_BARS = 12  # more bars than this in the model states chart: ranks named r0, r1, ...
PLOT_CHARS = 100  # characters of an 11 px label across the chart's plot area in a 1000 px wide page


def has_model_states(trace: Trace) -> bool:
    """True when the trace samples parameters and optimizer state (a data-parallel / ZeRO run)."""
    labels = {e.name for e in trace.events if e.kind == "memory"}
    return {"parameters", "optimizer state"} <= labels


def labels_of(traces: Sequence[Trace]) -> list[str]:
    """The model-state labels in the paper's order, then any other label in the order first seen."""
    seen = list(dict.fromkeys(e.name for t in traces for e in t.events if e.kind == "memory"))
    return [lab for lab in MODEL_STATES if lab in seen] + [lab for lab in seen if lab not in MODEL_STATES]


def states_at(trace: Trace, rank: int, t: float) -> dict[str, int]:
    """Bytes per label that ``rank`` held at time ``t`` (the samples up to and including ``t``)."""
    s = A.memory_series(trace, rank)
    held = dict.fromkeys(s.by_label, 0)
    for i, when in enumerate(s.times):
        if when > t:
            break
        held = {lab: vals[i] for lab, vals in s.by_label.items()}
    return held


def before_step(trace: Trace, rank: int) -> dict[str, int]:
    """Bytes per label at the start of ``rank``'s last "opt" span (the latest sample when there is none)."""
    opts = [e.t0 for e in trace.events if e.kind == "compute" and e.rank == rank and e.name == "opt"]
    return states_at(trace, rank, max(opts) if opts else float("inf"))


def at_peak(trace: Trace, rank: int) -> dict[str, int]:
    """Bytes per label at the first instant ``rank``'s total was largest."""
    s = A.memory_series(trace, rank)
    if not s.times:
        return {}
    total = s.total
    i = total.index(max(total))
    return {lab: vals[i] for lab, vals in s.by_label.items()}


def _color(label: str) -> str:
    return STATE_COLORS.get(label) or SPARE_COLORS[sum(map(ord, label)) % len(SPARE_COLORS)]


def stacks_figure(traces: Sequence[Trace], titles: Sequence[str]) -> go.Figure:
    """Top: model states per rank when the optimizer step begins (the paper's Fig. 1); bottom: at
    the rank's peak. One stacked bar per (trace, rank), grouped by trace, the total over each group."""
    labels = labels_of(traces)
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.2, subplot_titles=(
        "model states when the optimizer step begins (every gradient computed, nothing gathered)",
        "at the rank's peak (gradients not yet reduced, units gathered, buckets in flight)"))
    bars = sum(t.world_size for t in traces)
    many = bars > MANY_BARS  # "rank 0" under each of many bars would run into its neighbours: "r0"
    names = [_wrapped(title, t.world_size, bars) for title, t in zip(titles, traces, strict=True)]
    xs = [[name for name, t in zip(names, traces, strict=True) for _ in range(t.world_size)],
          [f"r{r}" if many else f"rank {r}" for t in traces for r in range(t.world_size)]]
    lines = max(name.count("<br>") + 1 for name in names)
    for row, pick in ((1, before_step), (2, at_peak)):
        states = [pick(t, r) for t in traces for r in range(t.world_size)]
        for lab in labels:
            ys = [s.get(lab, 0) for s in states]
            fig.add_trace(go.Bar(
                x=xs, y=ys, name=lab, legendgroup=lab, showlegend=row == 1, marker={"color": _color(lab)},
                customdata=[A.fmt_bytes(y) for y in ys],
                hovertemplate=f"%{{x}}: {lab} %{{customdata}}<extra></extra>"), row=row, col=1)
        totals = [sum(s.values()) for s in states]
        first = [i for i, r in enumerate(xs[1]) if r in ("r0", "rank 0")]  # one total per trace: its rank 0
        fig.add_trace(go.Scatter(x=[[xs[0][i] for i in first], [xs[1][i] for i in first]],
                                 y=[totals[i] for i in first], mode="text", textposition="top right",
                                 text=[f"{xs[1][i]}: {A.fmt_bytes(totals[i])}" for i in first], textfont={"size": 11},
                                 showlegend=False, hoverinfo="skip"), row=row, col=1)
        fig.update_yaxes(title_text="bytes per rank", range=[0, 1.15 * max(totals, default=1)], row=row, col=1)
    fig.update_xaxes(tickangle=0)
    height = 710 + 2 * 14 * lines
    fig.update_layout(title={"text": "model states per rank, stacked (ZeRO, Rajbhandari et al. 2020, Fig. 1)",
                             "yref": "container", "y": 1 - 12 / height,
                             "yanchor": "top"}, barmode="stack", bargap=0.15, height=height,
                      margin={"t": 140, "b": 40 + 14 * lines},  # room for the legend in two rows over the plot
                      legend={"orientation": "h", "yref": "container", "y": 1 - 44 / height, "yanchor": "top",
                              "x": 0})
    return fig


def _wrapped(title: str, ranks: int, bars: int) -> str:
    """``title`` broken into lines (``<br>``) as wide as its group of ``ranks`` bars out of ``bars``, so
    that neighbouring group labels do not run into each other: at spaces, and a word longer than a line
    after its "_" or "/"."""
    width = max(8, PLOT_CHARS * ranks // bars)
    words = [piece for word in title.split() for piece in
             (re.split(r"(?<=[_/])", word) if len(word) > width else [word])]
    lines = [""]
    for word in words:
        gap = " " if lines[-1] and not lines[-1].endswith(("_", "/")) else ""
        if lines[-1] and len(lines[-1]) + len(gap) + len(word) > width:
            lines.append("")
            gap = ""
        lines[-1] += gap + word
    return "<br>".join(lines)


def gathered_figure(trace: Trace, title: str = "FSDP") -> go.Figure:
    """Per rank, the bytes of gathered units over time (a step line) with each unit's forward "F"
    span shaded and named above it: the curve rises when a unit (and the prefetched next one) is
    gathered and falls when it is resharded."""
    p = trace.world_size
    unit = A.time_unit(trace)
    scale, shown = (1e3, "ms") if unit == "s" else (1.0, unit)
    lo = A.window(trace)[0]
    fig = make_subplots(rows=p, cols=1, shared_xaxes=True, vertical_spacing=0.25 / max(p, 1),
                        subplot_titles=[f"rank {r}" for r in range(p)])
    for r in range(p):
        s = A.memory_series(trace, r)
        vals = s.by_label.get(GATHERED)
        if vals is None:
            continue
        xs = [(t - lo) * scale for t in s.times]
        fig.add_trace(go.Scatter(x=xs, y=vals, mode="lines", line={"shape": "hv", "color": _color(GATHERED)},
                                 fill="tozeroy", name=GATHERED, showlegend=r == 0,
                                 hovertemplate=f"rank {r}: %{{y}} B gathered at %{{x:.3g}} {shown}<extra></extra>"),
                      row=r + 1, col=1)
        top = max(vals, default=0)
        for i, e in enumerate(sorted((e for e in trace.events if e.kind == "compute" and e.rank == r
                                      and e.name in ("F", "B")), key=lambda e: e.t0)):
            name = str(e.args.get("unit", "backward" if e.name == "B" else "F"))
            fig.add_vrect(x0=(e.t0 - lo) * scale, x1=(e.t1 - lo) * scale, fillcolor="#4C78A8" if e.name == "F"
                          else "#F58518", opacity=0.08 + 0.06 * (i % 2), line_width=0, row=r + 1, col=1)
            fig.add_annotation(x=((e.t0 + e.t1) / 2 - lo) * scale, y=top * 1.08, text=name, showarrow=False,
                               font={"size": 9}, textangle=-60 if e.name == "F" else 0, row=r + 1, col=1)
        fig.update_yaxes(title_text="bytes", range=[0, top * 1.35 or 1], row=r + 1, col=1)
    fig.update_xaxes(title_text=f"time ({shown})", row=p, col=1)
    fig.update_layout(title=f"gathered units over the step: {title} (shaded: each unit's forward, then backward)",
                      height=160 + 170 * p, margin={"t": 80}, plot_bgcolor="#FAFAFA")
    return fig


def has_gathered(trace: Trace) -> bool:
    """True when the trace samples FSDP's gathered units."""
    return any(e.kind == "memory" and e.name == GATHERED for e in trace.events)


def fsdp_step_figure(trace: Trace, title: str = "FSDP") -> go.Figure:
    """Top: the timeline (``viz.timeline``: per rank a compute lane, one "F" per unit, and a comm lane,
    one bar per all-gather or reduce-scatter call); bottom, on the same time axis: the bytes of
    gathered units on each rank."""
    p = trace.world_size
    count = lanes(trace).count
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.08,
                        subplot_titles=("compute (F per unit) and collectives per rank",
                                        "gathered units per rank (this unit + the prefetched next one)"))
    add_timeline(fig, trace, row=1)
    for r in range(p):
        s = A.memory_series(trace, r)
        if GATHERED in s.by_label:
            fig.add_trace(go.Scatter(x=s.times, y=s.by_label[GATHERED], mode="lines", name=f"rank {r} gathered",
                                     line={"shape": "hv", "color": rank_color(r), "width": 1.5},
                                     hovertemplate=f"rank {r}: %{{y}} B gathered at %{{x:.4g}}<extra></extra>"),
                          row=2, col=1)
    fig.update_yaxes(title_text="bytes", row=2, col=1)
    fig.update_xaxes(title_text=None, row=1, col=1)
    fig.update_xaxes(title_text=f"time ({A.time_unit(trace)})", row=2, col=1)
    height = 260 + 30 * count + 220
    fig.update_layout(title={"text": f"FSDP step: {title}", "yref": "container", "y": 1 - 12 / height,
                             "yanchor": "top"}, barmode="overlay", bargap=0, height=height,
                      margin={"r": 150, "l": 120, "t": 120, "b": 50}, plot_bgcolor="#F4F5F7",
                      legend={"orientation": "h", "yref": "container", "y": 1 - 44 / height, "yanchor": "top",
                              "x": 0}, uniformtext={"minsize": 8, "mode": "hide"})
    return fig


def allgather_calls(trace: Trace, n: int, rank: int = 0) -> list[tuple[float, float]]:
    """(start, end) of each all-gather call of ``rank`` on ``n`` ranks, in order. The calls run one
    after another and each sends and receives one block per ring step (n - 1 of each), so the k-th
    n - 1 sends and the k-th n - 1 receives in time order are call k."""
    mine = trace.select("comm", rank=rank, op="allgather")
    sends = sorted((e for e in mine if e.src == rank), key=lambda e: e.t0)
    recvs = sorted((e for e in mine if e.src != rank), key=lambda e: e.t0)
    calls = []
    for k in range(0, len(sends), n - 1):
        events = sends[k:k + n - 1] + recvs[k:k + n - 1]
        calls.append((min(e.t0 for e in events), max(e.t1 for e in events)))
    return calls


def fsdp_forward_table(trace: Trace, numels: Sequence[int], n: int, itemsize: int = 8) -> Table:
    """Rank 0's FSDP forward on ``n`` ranks, unit by unit (units of ``numels`` elements, unpadded):
    gathered bytes while it computes and after, against the padded sizes ``L_i + L_i+1``, and the next
    unit's all-gather (call k + 1) with the part of it inside this unit's span."""
    spans = sorted(trace.select("compute", rank=0, name="F"), key=lambda e: e.t0)
    samples = sorted(trace.select("memory", rank=0, name=GATHERED), key=lambda e: e.t0)
    calls, t0 = allgather_calls(trace, n), spans[0].t0
    table = Table(title=with_clock(f"FSDP forward on rank 0, unit by unit (N = {n}; ms from the first unit; bytes)",
                                   trace), title_justify="left",
                  caption="gathered while computing: this unit + the next one already on its way (prefetch); "
                          "formula: padded sizes L_i + L_i+1 in bytes. After: this unit resharded, only the next one "
                          "left. The next unit's all-gather runs on the communicator's background thread; overlap: "
                          "ms of it inside this unit's span, hidden behind its compute (the rest runs into the "
                          "next unit's span, which waits for it).",
                  caption_justify="left")
    for col in ("unit", "compute span", "gathered while computing", "formula", "after reshard",
                "next unit's all-gather", "overlap"):
        table.add_column(col, justify="right")
    sizes = [-(-k // n) * n * itemsize for k in numels]
    for i, span in enumerate(spans):
        inside = [e.nbytes for e in samples if span.t0 <= e.t0 <= span.t1]
        nxt = calls[i + 1] if i + 1 < len(spans) else None
        table.add_row(str(span.args.get("unit")), f"{(span.t0 - t0) * 1e3:.2f}-{(span.t1 - t0) * 1e3:.2f}",
                      f"{max(inside):,}", f"{sizes[i] + (sizes[i + 1] if i + 1 < len(sizes) else 0):,}",
                      f"{inside[-1]:,}",
                      "-" if nxt is None else f"{(nxt[0] - t0) * 1e3:.2f}-{(nxt[1] - t0) * 1e3:.2f}",
                      "-" if nxt is None else f"{max(0.0, min(span.t1, nxt[1]) - max(span.t0, nxt[0])) * 1e3:.2f}")
    return table


def totals_table(traces: Mapping[tuple[str, int], Trace], want: Mapping[tuple[str, int], int],
                 title: str) -> tuple[Table, bool]:
    """Rank 0's model states (parameters, gradients, optimizer state, master parameters: bytes) when its
    optimizer step begins, for each run ``(name, N)``: a row per name, a column per N; and whether
    every total equals ``want``'s."""
    names, degrees = list(dict.fromkeys(k for k, _ in traces)), sorted({n for _, n in traces})
    table = Table(title=title, title_justify="left")
    for col in ("run", *(f"N = {n}" for n in degrees)):
        table.add_column(col, justify="right")
    equal = True
    for name in names:
        cells = []
        for n in degrees:
            got = sum(v for k, v in before_step(traces[(name, n)], 0).items() if k != GATHERED)
            equal &= got == want[(name, n)]
            cells.append(f"{got:,}")
        table.add_row(name, *cells)
    return table, equal
