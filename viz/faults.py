"""A lost rank on the timelines: where its lane stops, and when each survivor noticed.

A trace of a run that lost ranks (``minipar.comm.faults``) names them in ``meta["lost_ranks"]``; a
rank killed on purpose left a "killed" mark as its last event (``faults.kill``), and every survivor
whose failure detector declared it dead a "peer declared dead" mark (``minipar.comm.detector``:
``args`` dead, by, silence, deadline); a parameter server that dropped a worker a "worker dropped"
mark. Definitions:

- **Lane end** of a lost rank (``lane_ends``): its "killed" mark, else the end of its last event (a
  rank killed from outside leaves no mark), else the start of the step window (no event at all).
- **Detection** (``detections``): one per "peer declared dead" mark, on the survivor that declared it.
- **Delay** (``after_kill``): per rank, seconds from the first "killed" mark to its first mark of a
  name (a detection, a drop, the "PeerLost" a survivor caught), with the mark's ``args``.
- **Wait** of a survivor (``longest_wait``): its longest gap between two forward spans (``F``), as a
  parameter-server worker waits for a dead one's clock until the server drops it.

The HTML timeline (``add_faults``) draws a lost rank's lanes from their end to the window's end as a
hatched grey "lost" bar with a red cross at the end, each detection as a red vertical tick on the
survivor's lane and each drop as a diamond; the terminal timeline (``mark_cells``) ends the lane with
``X`` and leaves it blank after, and writes ``!`` where a survivor declared a peer dead.
Cost: O(E) for E events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import plotly.graph_objects as go

from minipar.trace import Event, Trace
from viz import analysis as A

KILLED, DECLARED, DROPPED = "killed", "peer declared dead", "worker dropped"
KILL_CHAR, DETECT_CHAR, GONE_CHAR = "X", "!", " "
CHAR_STYLES = {KILL_CHAR: "bold white on red", DETECT_CHAR: "bold red", GONE_CHAR: ""}
RED, GREY = "#C62828", "#9E9E9E"


def lost_ranks(trace: Trace) -> list[int]:
    """The ranks the run lost (``meta["lost_ranks"]``), sorted."""
    return sorted(int(r) for r in trace.meta.get("lost_ranks", []))


def lane_ends(trace: Trace) -> dict[int, float]:
    """Each lost rank's lane end (see the module docstring)."""
    lo, _ = A.window(trace)
    out = {}
    for r in lost_ranks(trace):
        mine = trace.by_rank(r)
        killed = [e.t0 for e in mine if e.kind == "mark" and e.name == KILLED]
        out[r] = killed[-1] if killed else max((e.t1 for e in mine), default=lo)
    return out


def detections(trace: Trace) -> list[Event]:
    """The "peer declared dead" marks, by time."""
    return sorted(trace.select("mark", name=DECLARED), key=lambda e: e.t0)


def after_kill(trace: Trace, name: str) -> dict[int, tuple[float, dict[str, Any]]]:
    """Per rank: seconds from the first "killed" mark to that rank's first mark ``name``, and its args."""
    killed = min(e.t0 for e in trace.select("mark", name=KILLED))
    out: dict[int, tuple[float, dict[str, Any]]] = {}
    for e in sorted(trace.select("mark", name=name), key=lambda e: e.t0):
        out.setdefault(e.rank, (e.t0 - killed, e.args))
    return out


def longest_wait(trace: Trace, rank: int) -> tuple[float, int | None]:
    """``rank``'s longest gap between two forward spans, and the step of the span after it."""
    fs = sorted(trace.select("compute", name="F", rank=rank), key=lambda e: e.t0)
    return max(((b.t0 - a.t1, b.step) for a, b in zip(fs, fs[1:])), default=(0.0, None))


def add_faults(fig: go.Figure, trace: Trace, compute: dict[int, int], comm: dict[int, int],
               where: dict[str, int], show_legend: Callable[[str], bool]) -> None:
    """Draw the lost lanes, kills, detections and drops (nothing when the trace lost no rank and has
    no detection). ``compute`` / ``comm``: the y of each rank's lanes (``viz.timeline.Lanes``)."""
    ends, found = lane_ends(trace), detections(trace)
    if not ends and not found:
        return
    _, hi = A.window(trace)
    unit = A.time_unit(trace)
    y_of = {r: compute.get(r, comm.get(r)) for r in range(trace.world_size)}
    if ends:
        rows = [(r, y) for r, t in ends.items() for y in {compute.get(r), comm.get(r)} - {None}]
        fig.add_trace(go.Bar(
            orientation="h", name="lost (killed)", legendgroup="lost", showlegend=show_legend("lost"), legendrank=50,
            y=np.array([y for _, y in rows]), base=np.array([ends[r] for r, _ in rows]),
            x=np.array([max(hi - ends[r], 0.0) for r, _ in rows]), width=0.88,
            marker={"color": "#ECEFF1", "line": {"width": 0},
                    "pattern": {"shape": "x", "fgcolor": GREY, "solidity": 0.15, "size": 8}},
            hovertext=[f"rank {r} lost: killed at {ends[r]:.6g} {unit}" for r, _ in rows],
            hovertemplate="%{hovertext}<extra></extra>"), **where)
        fig.add_trace(go.Scatter(
            x=np.array(list(ends.values())), y=np.array([y_of[r] for r in ends]), mode="markers+text",
            name="killed (its lane ends)", legendgroup="killed", showlegend=show_legend("killed"), legendrank=50,
            marker={"symbol": "x", "size": 16, "color": RED, "line": {"width": 1, "color": "white"}},
            text=[f"rank {r} killed" for r in ends], textposition="middle right",
            textfont={"color": RED, "size": 12}, hovertemplate="%{text} at %{x:.6g}<extra></extra>"), **where)
    if found:
        fig.add_trace(go.Scatter(
            x=np.array([e.t0 for e in found]), y=np.array([y_of.get(e.rank, e.rank) for e in found]),
            mode="markers+text", name="peer declared dead (detector)", legendgroup="declared",
            showlegend=show_legend("declared"), legendrank=50,
            marker={"symbol": "line-ns", "size": 26, "color": RED, "line": {"width": 3, "color": RED}},
            text=[f"rank {e.args.get('dead')} dead" for e in found], textposition="middle left",
            textfont={"color": RED, "size": 11},
            hovertext=[_declared_hover(e, unit) for e in found], hovertemplate="%{hovertext}<extra></extra>"), **where)
    drops = trace.select("mark", name=DROPPED)
    if drops:
        fig.add_trace(go.Scatter(
            x=np.array([e.t0 for e in drops]), y=np.array([y_of.get(e.rank, e.rank) for e in drops]),
            mode="markers", name="worker dropped (server)", legendgroup="dropped", showlegend=show_legend("dropped"),
            legendrank=50, marker={"symbol": "diamond", "size": 11, "color": "#6A1B9A"},
            hovertext=[f"rank {e.rank} dropped worker {e.args.get('worker')} at its step {e.args.get('step')} "
                       f"({e.args.get('reason')})" for e in drops],
            hovertemplate="%{hovertext}<extra></extra>"), **where)


def _declared_hover(e: Event, unit: str) -> str:
    a: dict[str, Any] = e.args
    return (f"rank {e.rank} declared rank {a.get('dead')} dead at {e.t0:.6g} {unit}<br>no heartbeat for "
            f"{a.get('silence')} s (peer deadline {a.get('deadline')} s, MINIPAR_PEER_DEADLINE)")


def mark_cells(trace: Trace, rank: int, cells: list[Any], lo: float, dt: float) -> list[Any]:
    """A terminal lane's cells with the faults drawn in: a lost rank's lane ends with ``KILL_CHAR``
    in the cell of its end and ``GONE_CHAR`` after; a survivor's detection is ``DETECT_CHAR``."""
    n = len(cells)

    def cell(t: float) -> int:
        return max(0, min(n - 1, int((t - lo) / dt))) if dt > 0 else 0

    end = lane_ends(trace).get(rank)
    if end is not None:
        c = cell(end)
        cells = [*cells[:c], KILL_CHAR, *[GONE_CHAR] * (n - c - 1)]
    for e in detections(trace):
        if e.rank == rank:
            cells[cell(e.t0)] = DETECT_CHAR
    return cells
