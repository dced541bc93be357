"""One self-contained HTML report for one or more traces.

The page embeds plotly.js once (no CDN: it renders offline), then a summary table (world size, paradigm, the
clock its times are on (``style.clock``: replayed on a cluster, simulated, wall clock), time traced (and over how
many steps, when the trace's meta says: ``steps``), idle share (the bubble, for a pipeline), bytes moved (per step
too, with ``steps``), peak memory per rank). Then the figure of what the run is about, so that each lesson's
report opens with its own: the first trace of a run on a device mesh: the grid and the bytes each rank sent
stacked by mesh axis (``viz.mesh``), then the caller's ``extra_figures`` (a section each: title and figure),
then every simulated pipeline schedule as the papers draw it (``viz.pipeline_grid``, unit costs; not repeated in
its section), then the first Ring Attention trace's ring step by step (``viz.ring``; the others' in their
sections), then the first trace with moves between memory tiers: bytes per tier over time and the moves as links
(``viz.tiers``; the others' in their sections), then, for a ZeRO or FSDP run, the model states per rank of every
trace that samples them, stacked as in ZeRO's Fig. 1, and the first FSDP trace's timeline over its gathered
units (``viz.memory_stack``), then, when there are several traces, their timelines on one shared time axis
(traces of like length together: ``time_scales``)
(then the model states of a run that samples them but shards none: data parallelism, a parameter server),
then per trace: its metadata folded into a ``<details>`` block (numbers rounded), its
timeline (a simulated pipeline schedule: the papers' unit grid, its stash counts under it), its traffic (left
out when no message carries a byte; per mesh axis when the trace has a mesh), its memory (with moves between
memory tiers: ``viz.tiers``' two figures instead) and, for FSDP, its gathered units over time. The page
records JavaScript errors into the ``data-js-errors`` attribute of ``<html>`` (a JSON list) so a headless
browser can check that it rendered cleanly. Every figure on a time axis names its clock in its title; a trace
given with its run on another clock (``others``: the recorded run beside its replay) gets a button for each
clock on its timelines (``figures.clock_toggle``).
Cost: about 4.5 MB of plotly.js plus O(E) per trace.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from minipar.trace import Trace, load
from viz import analysis as A
from viz import figures, style
from viz.memory_stack import fsdp_step_figure, gathered_figure, has_gathered, has_model_states, stacks_figure
from viz.mesh import axis_traffic_figure, grid_figure, mesh_of
from viz.pipeline_grid import is_grid
from viz.ring import is_ring, ring_figure
from viz.tiers import has_transfers, residency_figure, transfers_figure

TraceLike = Trace | str | os.PathLike[str]

_ERROR_HOOK = """<script>
window.__errors = [];
function __minipar_err(msg) {
  window.__errors.push(String(msg));
  document.documentElement.setAttribute('data-js-errors', JSON.stringify(window.__errors));
}
window.onerror = function (msg, src, line) { __minipar_err(msg + ' (line ' + line + ')'); };
window.addEventListener('unhandledrejection', function (ev) { __minipar_err(ev.reason); });
</script>"""

_STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
table.summary { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
table.summary th, table.summary td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
table.summary th { background: #f0f0f0; } table.summary td:first-child { text-align: left; }
.note { color: #777; font-style: italic; }
details.meta { color: #555; font-size: 13px; margin: 0.5em 0; } details.meta summary { cursor: pointer; }
table.meta { border-collapse: collapse; margin: 0.4em 0; } table.meta th { text-align: left; padding: 2px 10px 2px 0;
  vertical-align: top; font-weight: 600; } table.meta td { padding: 2px 0; } table.meta code { font-size: 12px; }
h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
</style>"""


def _load_all(items: Sequence[TraceLike]) -> list[Trace]:
    return [t if isinstance(t, Trace) else load(t) for t in items]


def _default_title(item: TraceLike, trace: Trace) -> str:
    if isinstance(item, Trace):
        return style.title(trace, "")
    return os.path.basename(os.fspath(item))


def summary_rows(traces: Sequence[Trace], titles: Sequence[str]) -> list[dict[str, Any]]:
    """The summary table's rows (one per trace), already formatted as strings; a trace of several steps
    (``meta["steps"]``) says over how many its time and bytes are, and its bytes per step."""
    rows = []
    for title, t in zip(titles, traces, strict=True):
        s = A.summary(t)
        unit = A.time_unit(t)
        steps, moved = A.traced_steps(t), s["bytes_moved"]
        rows.append({
            "trace": title,
            "paradigm": str(s["paradigm"]),
            "schedule": str(s["schedule"] or ""),
            "backend": str(s["backend"]),
            "world size": str(s["world_size"]),
            "times": style.clock(t, short=True) or "-",
            "time traced": A.fmt_time(s["step_time"], unit) + (f" for {steps} steps" if steps else ""),
            "idle (bubble of a pipeline)": "-" if s["bubble_fraction"] is None
            else f"{100 * s['bubble_fraction']:.1f}%",
            "bytes moved": A.fmt_bytes(moved) + (f" in {steps} steps, {A.fmt_bytes(moved / steps)} per step"
                                                 if steps else ""),
            "peak memory per rank": _peaks(t, s["peak_memory"]),
        })
    return rows


def _peaks(trace: Trace, peaks: list[int]) -> str:
    if not any(peaks):
        return "-"
    if A.memory_counts(trace):
        return ", ".join(str(b) for b in peaks) + f" {A.stash_unit(trace)} stashed"
    return ", ".join(A.fmt_bytes(b) for b in peaks)


def _plain(value: Any) -> str:
    """A metadata value as text: whole floats as integers (byte counts stay exact), other floats
    to 4 significant digits, inside lists and dicts too."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}"
    return str(value)


def _meta_value(key: str, value: Any) -> str:
    """One metadata value as HTML: a schedule's ``actions`` one line per rank, a dict one line per
    key, the rest as ``_plain`` text."""
    if key == "actions" and isinstance(value, dict):
        return "".join(f"<div><b>rank {html.escape(str(r))}</b>: <code>{html.escape(' '.join(map(str, acts)))}"
                       "</code></div>" for r, acts in value.items())
    if isinstance(value, dict):
        return "<br>".join(html.escape(f"{k}: {_plain(v)}") for k, v in value.items())
    return html.escape(_plain(value))


def metadata(trace: Trace) -> str:
    """The trace's metadata folded into a ``<details>`` block (closed), floats rounded."""
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_meta_value(str(k), v)}</td></tr>"
                   for k, v in trace.meta.items())
    return (f'<details class="meta"><summary>run metadata ({len(trace.meta)} entries)</summary>'
            f'<table class="meta">{rows}</table></details>')


def _table(rows: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f'<table class="summary"><tr>{head}</tr>{body}</table>'


def _is_zero(trace: Trace) -> bool:
    """A ZeRO or FSDP run (its paradigm says so): the model states chart is its figure."""
    paradigm = str(trace.meta.get("paradigm", ""))
    return "ZeRO" in paradigm or "FSDP" in paradigm


def _fig_html(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def figures_for(trace: Trace, title: str, ring: bool = True, tiers: bool = True, other: Trace | None = None,
                grid: bool = True) -> list[tuple[str, go.Figure | None, str]]:
    """(kind, figure or None, note) for the per-trace figures; None with a note when there is
    nothing to draw. Every figure drawn on a time axis names the trace's clock (``style.clock``); with
    ``other`` (the same run on the other clock) the timeline gets a button for each clock. A simulated
    pipeline schedule is drawn as the papers' unit grid (``viz.pipeline_grid``) with its stash counts
    under it, and has no traffic panel when its messages carry no bytes. A Ring Attention trace gets
    ``viz.ring``'s figure (unless ``ring`` is False: the page already shows it at the top); one with
    moves between memory tiers gets ``viz.tiers``' two figures in place of the memory panel (none
    when ``tiers`` is False: shown at the top). A simulated schedule's grid is titled with its unit costs
    (not the trace's title: the grid does not use its times); ``grid=False``: a note that it is at the top."""
    out: list[tuple[str, go.Figure | None, str]] = []
    is_unit_grid = is_grid(trace)
    timed = style.with_clock(title, trace)
    if is_unit_grid:
        out.append(("schedule", figures.schedule_grid(trace), "") if grid else
                   ("schedule", None, "Its schedule as the papers draw it (unit costs) is at the top of the page."))
    else:
        out.append(("timeline", timeline_figure(trace, title, other), ""))
    if ring and is_ring(trace):  # Ring Attention: the K/V blocks step by step
        out.append(("ring", ring_figure(trace, timed), ""))
    moved = sum(e.nbytes or 0 for e in A.sends(trace))
    if moved:
        group = "axis" if mesh_of(trace) else "op"
        steps = A.traced_steps(trace)
        what = f"traffic: {title}" + (f" (bytes of all {steps} traced steps)" if steps else "")
        out.append(("traffic", figures.traffic(trace, what, group=group), ""))
    elif A.sends(trace):
        why = " (a simulated schedule)" if A.is_simulated(trace) else ""
        out.append(("traffic", None, f"Its messages carry no bytes{why}: no traffic panel."))
    elif any(e.kind == "comm" for e in trace.events):
        out.append(("traffic", None, "Its collectives ran inside the MPI library (native): their messages "
                                     "are not visible, so there is no traffic panel."))
    else:
        out.append(("traffic", None, "No messages in this trace."))
    if is_unit_grid and A.memory_counts(trace):
        return out  # its stash counts are drawn under the grid, on the same cells
    if has_transfers(trace):  # memory tiers: bytes per tier over time and the moves between tiers (viz.tiers)
        return [*out, *tier_figures(trace, title, other)] if tiers else out
    if any(e.kind == "memory" for e in trace.events):
        what = "stashed micro-batches" if A.memory_counts(trace) else "memory"
        out.append(("memory", figures.memory(trace, f"{what}: {timed}"), ""))
    else:
        out.append(("memory", None, "No memory samples in this trace."))
    if has_gathered(trace):  # FSDP: units gathered per layer
        out.append(("gathered", gathered_figure(trace, timed), ""))
    return out


def timeline_figure(trace: Trace, title: str, other: Trace | None = None) -> go.Figure:
    """The timeline titled with its clock; with ``other``, both clocks and a button for each."""
    fig = figures.timeline(trace, style.with_clock(f"timeline: {title}", trace))
    if other is None:
        return fig
    back = figures.timeline(other, style.with_clock(f"timeline: {title}", other))
    return figures.clock_toggle(fig, back, (style.clock(trace, short=True), style.clock(other, short=True)))


SCALE = 5.0  # traces drawn on one time axis differ at most this much in length


def time_scales(traces: Sequence[Trace]) -> list[list[int]]:
    """The traces' indices in groups to draw side by side, in order: a trace joins the group it fits
    in (the same time unit, every member's length within ``SCALE`` of its own), else starts one.
    Lesson 3's DDP steps (~20 ms) and its parameter server's 10 steps (~400 ms) are two groups; a
    schedule in unit costs and a run in seconds share no axis."""
    groups: list[list[int]] = []
    length = [max(1e-12, hi - lo) for lo, hi in map(A.window, traces)]
    unit = [A.time_unit(t) for t in traces]

    def fits(i: int, j: int) -> bool:
        return unit[i] == unit[j] and max(length[i], length[j]) <= SCALE * min(length[i], length[j])

    for i in range(len(traces)):
        fit = next((g for g in groups if all(fits(i, j) for j in g)), None)
        if fit is None:
            groups.append([i])
        else:
            fit.append(i)
    return groups


def compare_figure(traces: Sequence[Trace], titles: Sequence[str], others: Sequence[Trace | None]) -> go.Figure:
    """The traces on one time axis, the title naming their clocks (a simulated schedule's costs are in its
    own title); a button for each clock when some trace has another (the others' traces keep theirs)."""
    def drawn(ts: Sequence[Trace]) -> go.Figure:
        fig = figures.compare(ts, titles)
        clocks = ", ".join(dict.fromkeys(c for c in (style.clock(t, short=A.is_simulated(t)) for t in ts) if c))
        fig.update_layout(title_text=f"{fig.layout.title.text}; times {clocks}" if clocks else fig.layout.title.text)
        return fig

    fig = drawn(traces)
    if all(o is None for o in others):
        return fig
    alt = [t if o is None else o for t, o in zip(traces, others, strict=True)]
    first = next(i for i, o in enumerate(others) if o is not None)
    return figures.clock_toggle(fig, drawn(alt), (style.clock(traces[first], short=True),
                                                  style.clock(alt[first], short=True)))


def tier_figures(trace: Trace, title: str, other: Trace | None = None) -> list[tuple[str, go.Figure | None, str]]:
    """Bytes per tier over time, on the trace's clock, and the moves between tiers with their seconds as
    measured: from the recorded run (``other``) of a replay, which places a move between its thread's
    neighbouring events but does not time it."""
    moved = other if other is not None and trace.meta.get("clock") == "replay" else trace
    return [("tiers", residency_figure(trace, style.with_clock(title, trace)), ""),
            ("transfers", transfers_figure(moved, style.with_clock(title, moved)), "")]


def render(traces: Sequence[Trace], titles: Sequence[str], extra_figures: Sequence[tuple[str, go.Figure]] = (),
           others: Sequence[Trace | None] | None = None) -> str:
    """The whole HTML page as a string; ``extra_figures`` (title, figure) follow the summary table (and
    the mesh, for a hybrid run), each as its own section; ``others[i]``: trace ``i``'s run on the
    other clock (or None), which its timelines can switch to."""
    others = list(others) if others is not None else [None] * len(traces)
    parts = ["<!DOCTYPE html>", "<html data-js-errors=\"[]\"><head><meta charset=\"utf-8\">",
             "<title>minipar report</title>", _ERROR_HOOK, _STYLE,
             f'<script type="text/javascript">{get_plotlyjs()}</script>', "</head><body>",
             "<h1>minipar report</h1>", _table(summary_rows(traces, titles))]
    first_mesh = next((i for i, t in enumerate(traces) if mesh_of(t)), None)
    if first_mesh is not None:  # a hybrid run: where each rank sits, and what each axis carried
        parts.append(f"<h2>device mesh: {html.escape(titles[first_mesh])}</h2>")
        parts.append(_fig_html(grid_figure(traces[first_mesh]), "fig-mesh-grid"))
        if A.sends(traces[first_mesh]):
            parts.append(_fig_html(axis_traffic_figure(traces[first_mesh], f"bytes sent per rank, by mesh axis: "
                                                       f"{titles[first_mesh]}"), "fig-mesh-traffic"))
    for j, (heading, fig) in enumerate(extra_figures):  # figures the caller made: after the summary and the mesh
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        parts.append(_fig_html(fig, f"fig-extra-{j}"))
    grids = [i for i, t in enumerate(traces) if is_grid(t)]
    if grids:  # a pipeline schedule: the papers' figure of it comes first
        parts.append("<h2>the schedules as the papers draw them (unit costs)</h2>")
        parts.extend(_fig_html(figures.schedule_grid(traces[i]), f"fig-{i}-schedule") for i in grids)
    first_ring = next((i for i, t in enumerate(traces) if is_ring(t)), None)
    if first_ring is not None:  # the ring is the point of a Ring Attention run: show it first
        parts.append(f"<h2>Ring Attention step by step: {html.escape(titles[first_ring])}</h2>")
        ring = traces[first_ring]
        parts.append(_fig_html(ring_figure(ring, style.with_clock(titles[first_ring], ring)), "fig-ring"))
    first_tiers = next((i for i, t in enumerate(traces) if has_transfers(t)), None)
    if first_tiers is not None:  # offload: where the bytes live, tier by tier, and what moved between tiers
        parts.append(f"<h2>memory tiers: {html.escape(titles[first_tiers])}</h2>")
        parts.extend(_fig_html(fig, f"fig-top-{kind}") for kind, fig, _ in tier_figures(
            traces[first_tiers], titles[first_tiers], others[first_tiers]))
    states = [i for i, t in enumerate(traces) if has_model_states(t)]
    stack = [] if not states else [
        "<h2>model states per rank</h2>",
        _fig_html(stacks_figure([traces[i] for i in states], [titles[i] for i in states]), "fig-model-states")]
    zero = any(_is_zero(traces[i]) for i in states)
    if zero:  # ZeRO / FSDP: the paper's picture of model states per rank is the point of the run
        parts.extend(stack)
    first_fsdp = next((i for i, t in enumerate(traces) if has_gathered(t)), None)
    if first_fsdp is not None:  # the overlap FSDP is built for: the next unit's all-gather under this one's compute
        parts.append(f"<h2>FSDP step: {html.escape(titles[first_fsdp])}</h2>")
        parts.append(_fig_html(fsdp_step_figure(traces[first_fsdp], style.with_clock(titles[first_fsdp],
                                                                                     traces[first_fsdp])),
                               "fig-fsdp-step"))
    drawn = [g for g in time_scales(traces) if len(g) > 1]  # a 20 ms step beside a 400 ms one: a sliver
    for k, group in enumerate(drawn):
        parts.append("<h2>side by side</h2>")
        parts.append(_fig_html(compare_figure([traces[i] for i in group], [titles[i] for i in group],
                                              [others[i] for i in group]), "fig-compare" + (f"-{k}" if k else "")))
    if not zero:  # data parallelism, a parameter server: their model states, after their timelines
        parts.extend(stack)
    for i, (title, t) in enumerate(zip(titles, traces, strict=True)):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(metadata(t))
        for kind, fig, note in figures_for(t, title, ring=i != first_ring, tiers=i != first_tiers, other=others[i],
                                           grid=False):
            if fig is None:
                parts.append(f'<p class="note" id="note-{i}-{kind}">{html.escape(note)}</p>')
            else:
                parts.append(_fig_html(fig, f"fig-{i}-{kind}"))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(paths_or_traces: TraceLike | Sequence[TraceLike], out_html: str | os.PathLike[str],
                 titles: Sequence[str] | None = None, extra_figures: Sequence[tuple[str, go.Figure]] = (),
                 others: Sequence[TraceLike | None] | None = None) -> str:
    """Write one self-contained HTML report of the given traces, with ``extra_figures`` (title,
    figure) as sections after the summary; returns the path written. ``others`` (one per trace, or
    None): the same run on another clock (the recorded run beside its replay), which the trace's
    timelines switch to with a button. The page is written whole (a temporary file renamed over
    ``out_html``) or not at all.

    Raises ``minipar.trace.TraceError`` for an unreadable trace and ``ValueError`` for a titles
    list of the wrong length, before anything is written.
    """
    items: list[TraceLike] = (
        [paths_or_traces] if isinstance(paths_or_traces, Trace | str | os.PathLike) else list(paths_or_traces)
    )
    if not items:
        raise ValueError("write_report needs at least one trace")
    traces = _load_all(items)
    if titles is None:
        titles = [_default_title(item, t) for item, t in zip(items, traces, strict=True)]
    elif len(titles) != len(traces):
        raise ValueError(f"got {len(titles)} titles for {len(traces)} traces; pass one title per trace")
    if others is not None and len(others) != len(traces):
        raise ValueError(f"got {len(others)} others for {len(traces)} traces; pass one (or None) per trace")
    alt = [None if o is None else _load_all([o])[0] for o in others] if others is not None else None
    page = render(traces, list(titles), extra_figures, alt)
    out = os.fspath(out_html)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, out)
    return out
