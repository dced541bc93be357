"""A pipeline schedule as the papers draw it: one row per rank, time in unit cells, the micro-batch
number in each cell, forward and backward in two colours (a split backward's input gradient I and
weight gradient W in colours of their own, as Qi et al. 2024 draw zero bubble's Fig. 3), model
chunks in shades (GPipe, Huang et al. 2019, Fig. 2; Narayanan et al. 2021, Fig. 4, where "dark
colors show the first chunk and light colors show the second chunk").

``unit_cells`` replays the trace's own order of actions on each rank with the papers' unit times:
forward 1 cell, backward 2 cells (1 + 1 when the trace splits it into I and W, as zero-bubble
schedules do). An action starts when its rank is free and its inputs exist: the forward of the
previous stage (same micro-batch) for F; the backward (B or I) of the next stage, or its own
forward on the last stage, for B or I; its I for W. Stages are the events' (virtual) ``stage`` numbers. With equal
stage times this is the simulator's timing (``minipar.parallel.pipeline.simulate`` with forward 1,
backward 2, zero latency), whatever durations the trace was recorded with, so the grid shows the
schedule's shape and its bubble, e.g. (p - 1) of (m + p - 1) forward-plus-backward slots for 1F1B.

Under the grid, each rank's stash on the same cells (``unit_stash``): the micro-batches whose
forward ended and backward (a split one's W) has not, m for GPipe against p - r for 1F1B (Narayanan et al. 2021,
section 2.2.1).

Cost: O(A * p) for A actions on p ranks (one pass per placed action at worst; usually O(A)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Trace
from viz import analysis as A
from viz import style
from viz.style import COLORS, rank_color, shade

KIND = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
DEPENDS = {"F": "F", "B": "B", "I": "B", "W": "W"}  # I sends the input gradient as B does


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
    """The (op, stage, micro-batch) actions whose end an action waits for (module docstring)."""
    if name == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if name in ("B", "I"):
        return [("B", stage + 1, microbatch)] if stage < last else [("F", stage, microbatch)]
    return [("B", stage, microbatch)]  # W after its own I


def unit_cells(trace: Trace) -> list[Cell] | None:
    """The trace's F/B/I/W actions replayed on unit time (see the module docstring), in placement
    order; None when the trace is no single pipeline step (an action without stage or micro-batch,
    an action recorded twice, or an order that cannot run)."""
    events = [e for e in trace.events if e.kind == "compute" and e.name in KIND]
    if not events or any(e.stage is None or e.microbatch is None for e in events):
        return None
    # (t0, rank, name, stage, micro-batch, chunk), in each rank's recorded order
    actions = sorted((e.t0, e.rank, e.name, int(e.stage or 0), int(e.microbatch or 0), e.chunk or 0) for e in events)
    if len({a[2:5] for a in actions}) != len(actions):
        return None
    length = {"F": 1, "B": 2, "I": 1, "W": 1}
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
                clock[r] = done[(DEPENDS[name], stage, mb)] = t0 + length[name]
                cells.append(Cell(r, name, stage, mb, chunk, t0, t0 + length[name]))
                pos[r] += 1
        if len(cells) == placed:
            return None
    return cells


def unit_stash(cells: list[Cell], rank: int) -> tuple[list[int], list[int]]:
    """Stashed micro-batches on ``rank`` over the grid: (times, counts), a step function that
    rises when a forward ends and falls when its backward (a split one's W) ends, as the simulator
    counts them."""
    change: dict[int, int] = {0: 0}
    for c in cells:
        if c.rank == rank and c.name in ("F", "B", "W"):
            change[c.t1] = change.get(c.t1, 0) + (1 if c.name == "F" else -1)
    times = sorted(change)
    counts, held = [], 0
    for t in times:
        held += change[t]
        counts.append(held)
    return times, counts


def schedule_grid(trace: Trace, title: str | None = None) -> go.Figure | None:
    """The unit-time grid of ``unit_cells`` and, under it, each rank's stash (``unit_stash``) on
    the same cells; None when the trace has no such schedule. The default title names the schedule and
    its costs: unit costs, whatever durations the trace was recorded or simulated with."""
    cells = unit_cells(trace)
    if cells is None:
        return None
    p = trace.world_size
    n_chunks = max(int(trace.meta.get("v", 1) or 1), 1 + max(c.chunk for c in cells))
    end = max(c.t1 for c in cells)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.1,
                        subplot_titles=("", f"stashed {A.stash_unit(trace)} per rank (forward done, backward or W "
                                            "not yet)"))
    names = trace.meta.get("chunk_names")  # Chimera: ["down", "up"], the chunk a direction
    for kind in A.PIPELINE_KINDS:
        for chunk in range(n_chunks):
            group = [c for c in cells if KIND[c.name] == kind and c.chunk == chunk]
            if not group:
                continue
            way = names[chunk] if names and chunk < len(names) and names[chunk] in A.ARROWS else ""
            marker = {"color": shade(COLORS[kind], chunk, n_chunks), "line": {"color": "white", "width": 1.5}}
            if way == "up":  # hatched in the kind's colour, as the timeline draws Chimera's up pipeline
                marker["pattern"] = {"shape": "/", "fgcolor": COLORS[kind], "solidity": 0.3, "size": 7}
            fig.add_trace(go.Bar(
                orientation="h", name=f"{kind} {A.ARROWS[way]} {way}" if way else f"{kind}, chunk {chunk}"
                if n_chunks > 1 else kind, textangle=0,
                y=np.array([c.rank for c in group]), base=np.array([c.t0 for c in group]),
                x=np.array([c.t1 - c.t0 for c in group]), width=0.8, marker=marker,
                text=[f"{c.microbatch}{A.ARROWS.get(way, '')}" for c in group], textposition="inside",
                insidetextanchor="middle",
                textfont={"color": "black" if chunk else "white"},
                hovertext=[f"rank {c.rank}: {c.name} of micro-batch {c.microbatch}, stage {c.stage} "
                           f"(chunk {c.chunk})<br>cells {c.t0}-{c.t1}" for c in group],
                hovertemplate="%{hovertext}<extra></extra>",
            ), row=1, col=1)
    peak = 1
    for r in range(p):
        times, counts = unit_stash(cells, r)
        peak = max([peak, *counts])
        fig.add_trace(go.Scatter(
            x=np.array([*times, end]), y=np.array([*counts, counts[-1]]), mode="lines", name=f"rank {r} stash",
            line={"shape": "hv", "color": rank_color(r), "width": 2},
            hovertemplate=f"rank {r}: %{{y}} stashed after cell %{{x}}<extra></extra>",
        ), row=2, col=1)
    for r in range(p):
        busy = sum(c.t1 - c.t0 for c in cells if c.rank == r)
        fig.add_annotation(x=1.0, xref="paper", y=r, yref="y", xanchor="left", showarrow=False,
                           font={"size": 11}, text=f" idle {end - busy} of {end} ({100 * (end - busy) / end:.0f}%)")
    meta = trace.meta
    what = ", ".join(f"{k}={meta[k]}" for k in ("p", "m", "v") if meta.get(k) is not None)
    split = "I and W 1 cell each" if any(c.name == "W" for c in cells) else "backward = 2 cells"
    kind = str(meta.get("schedule") or "schedule").removesuffix(" (simulated)")
    costs = f"unit costs: forward 1 cell, {split.replace(' = ', ' ')}, not the trace's times"
    height = 360 + 42 * p
    fig.update_layout(
        title={"text": title or f"{kind} as the papers draw it, {style.ranks(p)} ({costs})", "yref": "container",
               "y": 1 - 12 / height,
               "yanchor": "top"},
        barmode="overlay", bargap=0, height=height, margin={"r": 150, "l": 70, "t": 100, "b": 60},
        plot_bgcolor="white", uniformtext={"minsize": 7, "mode": "hide"},
        legend={"orientation": "h", "yref": "container", "y": 1 - 44 / height, "yanchor": "top", "x": 0,
                "xanchor": "left"},
    )
    fig.update_yaxes(tickmode="array", tickvals=list(range(p)), ticktext=[f"rank {r}" for r in range(p)],
                     range=[p - 0.5, -0.5], zeroline=False, showgrid=False, row=1, col=1)
    fig.update_yaxes(range=[0, peak + 0.5], dtick=max(1, peak // 4), zeroline=False, gridcolor="#EEEEEE",
                     row=2, col=1)
    fig.update_xaxes(tickmode="array", tickvals=list(range(end + 1)),
                     ticktext=[str(t) if t % 5 == 0 else "" for t in range(end + 1)],
                     range=[0, end], showgrid=True, gridcolor="#DDDDDD", zeroline=False)
    fig.update_xaxes(title_text=f"time in unit cells (forward = 1 cell, {split}; number = micro-batch"
                                f"{'; ' + what if what else ''})", row=2, col=1)
    return fig


def is_grid(trace: Trace) -> bool:
    """Whether the report draws ``trace`` as a unit grid: a simulated pipeline schedule."""
    return A.is_simulated(trace) and unit_cells(trace) is not None
