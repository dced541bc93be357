"""A hybrid run's device mesh drawn from its trace: who sits where, and the bytes each mesh axis carried.

A trace of a run on a mesh holds ``meta["mesh"] = {"axes": ["pp", "dp", "sp", "tp"], "shape": [...]}``
(``minipar.mesh.MeshShape.meta``): world rank ``r`` sits at ``np.unravel_index(r, shape)``, the last
axis varying fastest (tp innermost, Megatron-LM's order; Narayanan et al. 2021, Sec. 3). That is all
the viewer needs: it rebuilds the coordinates itself and imports nothing of minipar but the trace.

- ``mesh_of(trace)``: ``{axis: degree}`` in grid order, or None for a trace without a mesh.
- ``coords(mesh, rank)``, ``axis_of(mesh, a, b)``: a rank's coordinates; the axes two ranks differ in,
  joined by ``+`` ("tp", "dp+sp"; "" for a rank and itself). A message between members of one
  sub-communicator differs in that communicator's axes only, so ``axis_of(src, dst)`` names the
  communicator that carried it.
- ``bytes_by_axis(trace)``: bytes each rank sent, per axis (messages counted once, on the sender).
- ``axis_rows(trace)``: the same as ``viz.figures.traffic(..., group="axis")`` draws it, with the
  formula ``meta["expected_bytes_by_axis"]`` (``{axis: bytes per rank}``, one number for every rank or a
  list, one per rank) over the measured bars.
- ``grid_figure(mesh, holds=None)``: the grid, one panel per axis of degree > 1. Each rank is a box
  placed by its pipeline stage (column block), data-parallel replica (row) and its sp / tp slice
  (position inside the block), labelled with its rank and coordinates; in each panel the boxes of
  one sub-communicator of that axis share a colour. ``holds`` (rank -> text) goes in the hover.
- ``axis_traffic_figure(trace)``: bytes per rank stacked by axis, the formula as a tick at the top of
  each axis's segment.
- ``groups_text(mesh)``, ``holdings_table(mesh, held, expected)``, ``axis_table(trace, want)``,
  ``states_table(trace, states, peaks)``: for the terminal, every sub-communicator as rank sets; what
  each rank holds (``HybridGPT.holdings``), its parameters against ``expected``; its bytes per axis
  against the formula's; its model states and activation peak against the formula's.

Cost: O(E) for E events, O(P) shapes per panel for P ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minipar.trace import Trace
from viz import analysis as A
from viz import style
from viz.memory_stack import before_step
from viz.width import Table

AXIS_COLORS = {"tp": "#B279A2", "sp": "#72B7B2", "dp": "#F58518", "pp": "#54A24B"}  # compute keeps blue elsewhere
GROUP_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#72B7B2", "#EECA3B", "#9D755D", "#FF9DA6",
                "#BAB0AC", "#79706E", "#D6616B", "#5254A3"]
ROLES = {"tp": "Megatron's all-reduces inside every layer", "sp": "attention's all-to-alls or K/V ring",
         "dp": "the gradients, once per step", "pp": "activations, point to point"}
Mesh = dict[str, int]


def mesh_of(trace: Trace) -> Mesh | None:
    """``{axis: degree}`` from ``meta["mesh"]``, or None when the trace has no mesh (or a malformed one)."""
    meta = trace.meta.get("mesh")
    if not isinstance(meta, Mapping):
        return None
    axes, shape = meta.get("axes"), meta.get("shape")
    if not isinstance(axes, list) or not isinstance(shape, list) or len(axes) != len(shape) or not axes:
        return None
    return {str(a): int(d) for a, d in zip(axes, shape, strict=True)}


def coords(mesh: Mesh, rank: int) -> dict[str, int]:
    """The coordinates of world rank ``rank`` (the last axis fastest)."""
    return {a: int(i) for a, i in zip(mesh, np.unravel_index(rank, tuple(mesh.values())), strict=True)}


def axis_of(mesh: Mesh, a: int, b: int) -> str:
    """The axes in which ranks ``a`` and ``b`` differ, in grid order, joined by ``+``."""
    ca, cb = coords(mesh, a), coords(mesh, b)
    return "+".join(ax for ax in mesh if ca[ax] != cb[ax])


def _require(trace: Trace) -> Mesh:
    mesh = mesh_of(trace)
    if mesh is None:
        raise ValueError("this trace has no mesh in its metadata (meta['mesh'] = {'axes': [...], 'shape': [...]}); "
                         "traffic by mesh axis needs one: record the run with HybridGPT.trace_meta()")
    return mesh


def bytes_by_axis(trace: Trace) -> dict[str, list[int]]:
    """Bytes each rank sent, per axis the message crossed (axes in grid order; combinations such as
    "dp+tp" after them, as first seen)."""
    mesh = _require(trace)
    p = trace.world_size
    out: dict[str, list[int]] = {}
    for e in A.sends(trace):
        if e.dst is None or not (0 <= e.src < p and 0 <= e.dst < p):
            continue
        out.setdefault(axis_of(mesh, e.src, e.dst), [0] * p)[e.src] += e.nbytes or 0
    order = [a for a in mesh if a in out] + [a for a in out if a not in mesh]
    return {a: out[a] for a in order}


def expected_by_axis(trace: Trace) -> dict[str, list[float]]:
    """``meta["expected_bytes_by_axis"]`` as a list per axis (a single number holds for every rank)."""
    p = trace.world_size
    raw = trace.meta.get("expected_bytes_by_axis") or {}
    return {str(a): [float(x) for x in v] if isinstance(v, list | tuple) else [float(v)] * p for a, v in raw.items()}


def axis_rows(trace: Trace) -> list[tuple[str, list[int], list[float] | None]]:
    """(axis, measured bytes sent per rank, formula per rank or None), as ``analysis.traffic_rows``
    gives them per op; an axis with a formula and no message measures zero."""
    measured, formulas = bytes_by_axis(trace), expected_by_axis(trace)
    zero = [0] * trace.world_size
    rows = [(a, got, formulas.get(a)) for a, got in measured.items()]
    return rows + [(a, zero, f) for a, f in formulas.items() if a not in measured]


# ---- the grid -------------------------------------------------------------------------------------
def _place(mesh: Mesh, rank: int) -> tuple[float, float]:
    """(x, y) of a rank's box: pipeline stages are blocks of columns, one column per sp x tp slice,
    with a gap between stages; one row per data-parallel replica."""
    c = coords(mesh, rank)
    inner = [a for a in mesh if a not in ("pp", "dp")]
    width = int(np.prod([mesh[a] for a in inner])) if inner else 1
    slot = int(np.ravel_multi_index(tuple(c[a] for a in inner), tuple(mesh[a] for a in inner))) if inner else 0
    return c.get("pp", 0) * (width + 0.5) + slot, float(c.get("dp", 0))


def _group_index(mesh: Mesh, rank: int, axis: str) -> int:
    """Which sub-communicator of ``axis`` the rank belongs to: its coordinates on the other axes, as a number."""
    c = coords(mesh, rank)
    others = [a for a in mesh if a != axis]
    return int(np.ravel_multi_index(tuple(c[a] for a in others), tuple(mesh[a] for a in others))) if others else 0


def _short(mesh: Mesh, rank: int, sep: str = " ") -> str:
    """``"pp1 dp0 tp1"``: the rank's coordinates on the axes of degree > 1."""
    return sep.join(f"{a}{i}" for a, i in coords(mesh, rank).items() if mesh[a] > 1) or "-"


def _tiny(mesh: Mesh, rank: int) -> str:
    """``"p1 d0 t1"``: ``_short`` with one letter per axis, to fit in a box."""
    return " ".join(f"{a[0]}{i}" for a, i in coords(mesh, rank).items() if mesh[a] > 1)


def grid_figure(mesh: Mesh | Trace, holds: Mapping[int, str] | None = None, title: str | None = None) -> go.Figure:
    """The mesh, one panel per axis of degree > 1 (module docstring): boxes placed by stage, replica
    and slice; in each panel one colour per sub-communicator of that axis. Panels sit side by side
    while a stage row is at most 6 boxes wide, else one above the other; boxes lose their
    coordinates past 12 columns and their text past 256 ranks (the hover keeps everything)."""
    if isinstance(mesh, Trace):
        mesh = _require(mesh)
    world = int(np.prod(list(mesh.values())))
    axes = [a for a in mesh if mesh[a] > 1] or list(mesh)[-1:]
    places = {r: _place(mesh, r) for r in range(world)}
    stages, width = mesh.get("pp", 1), max(x for x, _ in places.values()) + 1
    wide, replicas = width > 6, mesh.get("dp", 1)
    titles = [f"<b>{a}</b> groups: {world // mesh[a]} of {mesh[a]} ranks<br><sup>{ROLES.get(a, '')}</sup>"
              for a in axes]
    fig = make_subplots(rows=len(axes) if wide else 1, cols=1 if wide else len(axes), subplot_titles=titles,
                        horizontal_spacing=0.04, vertical_spacing=0.3 / len(axes))
    for i, axis in enumerate(axes):
        at = {"row": i + 1, "col": 1} if wide else {"row": 1, "col": i + 1}
        gid = {r: _group_index(mesh, r, axis) for r in range(world)}
        members: dict[int, list[int]] = {}
        for r, g in gid.items():
            members.setdefault(g, []).append(r)
        for r, (x, y) in places.items():
            fig.add_shape(type="rect", x0=x - 0.45, x1=x + 0.45, y0=y - 0.4, y1=y + 0.4,
                          fillcolor=GROUP_COLORS[gid[r] % len(GROUP_COLORS)], opacity=0.85,
                          line={"color": "white", "width": 2 if width <= 24 else 0}, layer="below", **at)
        text = [("" if world > 256 else f"<b>{r}</b>" if width > 12 else
                 f"<b>rank {r}</b><br><span style='font-size:10px'>{_tiny(mesh, r)}</span>") for r in places]
        hover = [f"rank {r}: {_short(mesh, r)}<br>{axis} group: ranks {members[gid[r]]}"
                 + (f"<br>{holds[r]}" if holds and r in holds else "") for r in places]
        fig.add_trace(go.Scatter(x=[x for x, _ in places.values()], y=[y for _, y in places.values()],
                                 mode="text", text=text, hovertext=hover, hoverinfo="text",
                                 textfont={"color": "white", "size": 12}, showlegend=False), **at)
        block = (width + 0.5) / stages
        fig.update_xaxes(tickvals=[s * block + (block - 1.5) / 2 for s in range(stages)],
                         ticktext=[f"stage {s}" for s in range(stages)], range=[-0.6, width - 0.4],
                         showgrid=False, zeroline=False, **at)
        fig.update_yaxes(tickvals=list(range(replicas)), ticktext=[f"replica {d}" for d in range(replicas)],
                         autorange="reversed", showgrid=False, zeroline=False, showticklabels=wide or i == 0, **at)
    shape = " x ".join(f"{a} {d}" for a, d in mesh.items() if d > 1) or "1 rank"
    key = ", ".join(f"{a[0]} = {a}" for a in mesh if mesh[a] > 1)
    panel = 85 * min(replicas, 8) + 90
    fig.update_layout(title=title or f"the device mesh: {shape} = {world} ranks<br><sup>columns: pipeline stages, "
                                     f"each split in its slices; rows: data-parallel replicas; in each box {key} "
                                     "coordinate; one colour per sub-communicator</sup>",
                      height=80 + panel * (len(axes) if wide else 1), margin={"t": 120, "b": 40},
                      plot_bgcolor="white")
    return fig


def axis_traffic_figure(trace: Trace, title: str | None = None) -> go.Figure:
    """Bytes each rank sent, stacked by mesh axis; the formula (``expected_bytes_by_axis``) as a black
    tick where each axis's segment should end."""
    mesh = _require(trace)
    rows = axis_rows(trace)
    p = trace.world_size
    names = [f"rank {r}<br>{_short(mesh, r)}" for r in range(p)]
    fig = go.Figure()
    for axis, got, _ in rows:
        fig.add_trace(go.Bar(x=names, y=got, name=f"{axis} ({ROLES.get(axis, 'several axes')})",
                             marker={"color": AXIS_COLORS.get(axis, style.comm_color(axis))},
                             hovertemplate=f"%{{x}}: {axis} %{{y}} bytes<extra></extra>"))
    below = [0.0] * p
    tops: dict[str, list[float]] = {}
    for axis, got, formula in rows:  # the formula's segment ends where the measured one should
        tops[axis] = [b + (f if formula is not None else g) for b, g, f in
                      zip(below, got, formula or [0.0] * p, strict=True)]
        if formula is not None:
            fig.add_trace(go.Scatter(
                x=names, y=tops[axis], mode="markers", name="formula" if axis == rows[0][0] else None,
                showlegend=False, marker={"symbol": "line-ew-open", "size": 34, "color": "black",
                                          "line": {"width": 3, "color": "black"}},
                customdata=formula, hovertemplate=f"formula {axis}: %{{customdata:.0f}} bytes<extra></extra>"))
        below = tops[axis]
    if any(f is not None for _, _, f in rows):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="formula (tick: end of each segment)",
                                 marker={"symbol": "line-ew-open", "size": 20, "color": "black",
                                         "line": {"width": 3, "color": "black"}}))
    fig.update_layout(title=title or style.title(trace, "bytes sent per rank, by mesh axis"), barmode="stack",
                      yaxis_title="bytes sent", height=460, legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
                      margin={"t": 110})
    return fig


def groups_text(mesh: Mesh) -> str:
    """Every sub-communicator of every axis of degree > 1, as rank sets: ``tp: {0,1} {2,3}; ...``."""
    size, lines = int(np.prod(list(mesh.values()))), []
    for axis, degree in mesh.items():
        if degree > 1:
            key = [tuple(v for a, v in coords(mesh, r).items() if a != axis) for r in range(size)]
            groups = [[r for r in range(size) if key[r] == k] for k in dict.fromkeys(key)]
            lines.append(f"{axis}: " + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups))
    return "sub-communicators (one per group, mesh[axis] on each member): " + "; ".join(lines)


def holdings_table(mesh: Mesh, held: list[dict[str, object]], expected: list[int]) -> Table:
    """Per rank: its coordinates and what it holds (``layers``, tensor ``slices``, ``data``: its rows,
    ``params``), the parameters against ``expected`` (one per rank) in the caption."""
    same = all(h["params"] == e for h, e in zip(held, expected, strict=True))
    d = dict.fromkeys(("pp", "dp", "sp", "tp"), 1) | mesh
    table = Table(title=f"the mesh: rank = ((pp_i x {d['dp']} + dp_i) x {d['sp']} + sp_i) x {d['tp']} + tp_i",
                  title_justify="left",
                  caption="tp varies fastest (Megatron-LM's order). pp: the rank's pipeline stage and its "
                          "layers; tp: its slice of every weight matrix (Megatron: q, k, v and the MLP's fc by "
                          "columns, the projections by rows, the vocabulary split); dp: its replica's rows of the "
                          "global batch; parameters: float64 numbers held, "
                          + ("equal on every rank to" if same else "[red]NOT equal[/red] to")
                          + " cost.hybrid.parameters_per_rank.", caption_justify="left")
    for col in ("rank", "pp: stage", "tp: tensor slice", "dp: batch", "parameters"):
        table.add_column(col, justify="left" if ":" in col else "right")
    for r, h in enumerate(held):
        co = dict.fromkeys(("pp", "dp", "sp", "tp"), 0) | coords(mesh, r)
        table.add_row(str(r), f"{co['pp']}: {h['layers']}", f"{co['tp']}: {h['slices']}",
                      f"{co['dp']}: {h['data']}" if d["sp"] == 1 else f"{co['dp']}, sp {co['sp']}: {h['data']}",
                      f"{h['params']:,}")
    return table


def axis_table(trace: Trace, want: Sequence[Mapping[str, int]], detail: bool = True,
               caption: str | None = None) -> tuple[Table, bool]:
    """Bytes each rank sent by mesh axis (``bytes_by_axis``) beside ``want`` (per rank: axis -> bytes),
    and whether every rank's equal it. ``detail``: a row per rank, measured / formula; else a row per
    group of ranks that sent alike, measured, and whether that is the formula."""
    mesh, by_axis, p = _require(trace), bytes_by_axis(trace), trace.world_size
    got = [{a: v[r] for a, v in by_axis.items() if v[r]} for r in range(p)]
    axes = list(dict.fromkeys(a for r in range(p) for a in [*got[r], *want[r]]))
    same = [all(got[r].get(a, 0) == want[r].get(a, 0) for a in axes) for r in range(p)]
    table = Table(title="bytes each rank sent in one step, by mesh axis: measured (the trace)"
                        + (" / formula" if detail else ""), title_justify="left", caption=caption,
                  caption_justify="left")
    for col in ("rank" if detail else "ranks", *(("coords",) if detail else ()), *axes, "total",
                *(() if detail else ("= formula",))):
        table.add_column(col, justify="right")
    rows: dict[tuple, list[int]] = {}  # ranks that sent alike, in order (each alone with detail)
    for r in range(p):
        rows.setdefault((r,) if detail else (tuple(got[r].get(a, 0) for a in axes), same[r]), []).append(r)
    for ranks in rows.values():
        r = ranks[0]
        if detail:
            table.add_row(str(r), _short(mesh, r), *(f"{got[r].get(a, 0):,} / {want[r].get(a, 0):,}" for a in axes),
                          f"{sum(got[r].values()):,} / {sum(want[r].values()):,}")
        else:
            table.add_row(" ".join(map(str, ranks)), *(f"{got[r].get(a, 0):,}" for a in axes),
                          f"{sum(got[r].values()):,}", "yes" if all(same[q] for q in ranks) else "NO")
    return table, all(same)


def states_table(trace: Trace, states: Sequence[Mapping[str, int]], peaks: Sequence[int],
                 caption: str | None = None) -> tuple[Table, bool]:
    """Per rank: its model states when its optimizer step begins (``memory_stack.before_step``) and the
    most "activations" it kept at once, measured / the formula's ``states`` and ``peaks``, and whether
    every rank holds what the formula says."""
    table = Table(title="bytes each rank holds: model states when the optimizer step begins, and the most activations "
                        "kept at once; measured (the trace) / formula", title_justify="left", caption=caption,
                  caption_justify="left")
    for col in ("rank", *states[0], "activation peak"):
        table.add_column(col, justify="right")
    equal = True
    for r, (want, want_peak) in enumerate(zip(states, peaks, strict=True)):
        got = before_step(trace, r)
        peak = max((e.nbytes or 0 for e in trace.select("memory", rank=r, name="activations")), default=0)
        equal &= all(got.get(k) == v for k, v in want.items()) and peak == want_peak
        table.add_row(str(r), *(f"{got.get(k, 0):,} / {v:,}" for k, v in want.items()), f"{peak:,} / {want_peak:,}")
    return table, equal
