"""A pipeline schedule as the papers draw it: one row per rank, time in unit cells, the micro-batch
number in each cell, forward and backward in two colours, model chunks in shades (GPipe, Huang et
al. 2019, Fig. 2; Narayanan et al. 2021, Fig. 4, where "dark colors show the first chunk and light
colors show the second chunk").

``unit_cells`` replays the trace's own order of actions on each rank with the papers' unit times:
forward 1 cell, backward 2 cells (1 + 1 when the trace splits it into B and W, as zero-bubble
schedules do). An action starts when its rank is free and its inputs exist: the forward of the
previous stage (same micro-batch) for F; the backward of the next stage, or its own forward on
the last stage, for B; its B for W. Stages are the events' (virtual) ``stage`` numbers. With equal
stage times this is the simulator's timing (``minipar.parallel.pipeline.simulate`` with forward 1,
backward 2, zero latency), whatever durations the trace was recorded with, so the grid shows the
schedule's shape and its bubble, e.g. (p - 1) of (m + p - 1) forward-plus-backward slots for 1F1B.

Cost: O(A * p) for A actions on p ranks (one pass per placed action at worst; usually O(A)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from minipar.trace import Trace
from viz import analysis as A
from viz import style
from viz.style import COLORS, shade

KIND = {"F": "forward", "B": "backward", "W": "backward"}


@dataclass(frozen=True)
class Cell:
    """One action on the unit grid: cells [t0, t1) of ``rank``'s row."""

    rank: int
    name: str
    stage: int
    microbatch: int
    chunk: int
    t0: int
    t1: int


def _inputs(name: str, stage: int, microbatch: int, last: int) -> list[tuple[str, int, int]]:
    if name == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if name == "B":
        return [("B", stage + 1, microbatch)] if stage < last else [("F", stage, microbatch)]
    return [("B", stage, microbatch)]


def unit_cells(trace: Trace) -> list[Cell] | None:
    """The trace's F/B/W actions replayed on unit time (see the module docstring), in placement
    order; None when the trace is no single pipeline step (an action without stage or micro-batch,
    an action recorded twice, or an order that cannot run)."""
    events = [e for e in trace.events if e.kind == "compute" and e.name in KIND]
    if not events or any(e.stage is None or e.microbatch is None for e in events):
        return None
    # (t0, rank, name, stage, micro-batch, chunk), in each rank's recorded order
    actions = sorted((e.t0, e.rank, e.name, int(e.stage or 0), int(e.microbatch or 0), e.chunk or 0) for e in events)
    if len({a[2:5] for a in actions}) != len(actions):
        return None
    length = {"F": 1, "B": 1 if any(a[2] == "W" for a in actions) else 2, "W": 1}
    last = max(a[3] for a in actions)
    order = {r: [a for a in actions if a[1] == r] for r in range(trace.world_size)}
    pos = dict.fromkeys(order, 0)
    clock = dict.fromkeys(order, 0)
    done: dict[tuple[str, int, int], int] = {}
    cells: list[Cell] = []
    while len(cells) < len(actions):
        placed = len(cells)
        for r, todo in order.items():
            while pos[r] < len(todo):
                _, _, name, stage, mb, chunk = todo[pos[r]]
                needs = _inputs(name, stage, mb, last)
                if any(n not in done for n in needs):
                    break
                t0 = max([clock[r]] + [done[n] for n in needs])
                clock[r] = done[(name, stage, mb)] = t0 + length[name]
                cells.append(Cell(r, name, stage, mb, chunk, t0, t0 + length[name]))
                pos[r] += 1
        if len(cells) == placed:
            return None
    return cells


def schedule_grid(trace: Trace, title: str | None = None) -> go.Figure | None:
    """The unit-time grid of ``unit_cells`` (None when the trace has no such schedule)."""
    cells = unit_cells(trace)
    if cells is None:
        return None
    p = trace.world_size
    n_chunks = max(int(trace.meta.get("v", 1) or 1), 1 + max(c.chunk for c in cells))
    end = max(c.t1 for c in cells)
    fig = go.Figure()
    for kind in ("forward", "backward"):
        for chunk in range(n_chunks):
            group = [c for c in cells if KIND[c.name] == kind and c.chunk == chunk]
            if not group:
                continue
            fig.add_trace(go.Bar(
                orientation="h", name=f"{kind}, chunk {chunk}" if n_chunks > 1 else kind, textangle=0,
                y=np.array([c.rank for c in group]), base=np.array([c.t0 for c in group]),
                x=np.array([c.t1 - c.t0 for c in group]), width=0.8,
                marker={"color": shade(COLORS[kind], chunk, n_chunks), "line": {"color": "white", "width": 1.5}},
                text=[str(c.microbatch) for c in group], textposition="inside", insidetextanchor="middle",
                textfont={"color": "black" if chunk else "white"},
                hovertext=[f"rank {c.rank}: {c.name} of micro-batch {c.microbatch}, stage {c.stage} "
                           f"(chunk {c.chunk})<br>cells {c.t0}-{c.t1}" for c in group],
                hovertemplate="%{hovertext}<extra></extra>",
            ))
    for r in range(p):
        busy = sum(c.t1 - c.t0 for c in cells if c.rank == r)
        fig.add_annotation(x=1.0, xref="paper", y=r, yref="y", xanchor="left", showarrow=False,
                           font={"size": 11}, text=f" idle {end - busy} of {end} ({100 * (end - busy) / end:.0f}%)")
    meta = trace.meta
    what = ", ".join(f"{k}={meta[k]}" for k in ("p", "m", "v") if meta.get(k) is not None)
    split = "B and W 1 cell each" if any(c.name == "W" for c in cells) else "backward = 2 cells"
    fig.update_layout(
        title=title or style.title(trace, "schedule"), barmode="overlay", bargap=0, height=200 + 42 * p,
        margin={"r": 150, "l": 70, "t": 110, "b": 60}, plot_bgcolor="white",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        uniformtext={"minsize": 7, "mode": "hide"},
    )
    fig.update_yaxes(tickmode="array", tickvals=list(range(p)), ticktext=[f"rank {r}" for r in range(p)],
                     range=[p - 0.5, -0.5], zeroline=False, showgrid=False)
    fig.update_xaxes(title_text=f"time in unit cells (forward = 1 cell, {split}; number = micro-batch"
                                f"{'; ' + what if what else ''})",
                     tickmode="array", tickvals=list(range(end + 1)),
                     ticktext=[str(t) if t % 5 == 0 else "" for t in range(end + 1)],
                     range=[0, end], showgrid=True, gridcolor="#DDDDDD", zeroline=False)
    return fig


def is_grid(trace: Trace) -> bool:
    """Whether the report draws ``trace`` as a unit grid: a simulated pipeline schedule."""
    return A.is_simulated(trace) and unit_cells(trace) is not None
