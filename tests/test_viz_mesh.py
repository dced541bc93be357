"""The device mesh in the viewer, on a hand-made trace of a pp 2 x dp 2 x tp 2 run (8 ranks, tp
innermost: rank = (pp * 2 + dp) * 2 + tp): coordinates rebuilt from ``meta["mesh"]`` alone, every
message put on the axis its two ranks differ in, bytes per rank per axis equal to the hand sums, the
formula ticks where the hand sums end, the traffic figure's "group by mesh axis" bars, and the grid's
boxes placed by stage, replica and tp slice with one colour per sub-communicator."""

from __future__ import annotations

import os
import re

import pytest
from test_viz_browser import CHROMIUM, _chromium, _errors, _figures

from minipar.trace import Event, Trace
from viz import figures, report
from viz import mesh as V

MESH = {"axes": ["pp", "dp", "sp", "tp"], "shape": [2, 2, 1, 2]}
TP, DP, PP, CROSS = 100, 30, 500, 7  # bytes of each kind of message below


def message(src: int, dst: int, nbytes: int, t: float) -> list[Event]:
    return [Event(rank, "comm", name, t, t + 1.0, src=src, dst=dst, nbytes=nbytes, op="send")
            for rank, name in ((src, "send"), (dst, "recv"))]


def mesh_trace(**meta: object) -> Trace:
    """Every rank sends TP bytes to its tp partner (r ^ 1) and DP to its dp partner (r ^ 2); stage 0's
    ranks send PP to the rank below them in stage 1 (r + 4); rank 0 sends CROSS to rank 3 (dp and tp
    both differ)."""
    events: list[Event] = []
    for r in range(8):
        events += message(r, r ^ 1, TP, 0.0) + message(r, r ^ 2, DP, 1.0)
    for r in range(4):
        events += message(r, r + 4, PP, 2.0)
    events += message(0, 3, CROSS, 3.0)
    return Trace({"paradigm": "hybrid", "world_size": 8, "mesh": MESH, **meta}, events)


# by hand: per rank, what it sent on each axis
HAND = {"pp": [PP] * 4 + [0] * 4, "dp": [DP] * 8, "tp": [TP] * 8, "dp+tp": [CROSS] + [0] * 7}


def test_coordinates_and_axes_from_the_metadata_alone() -> None:
    mesh = V.mesh_of(mesh_trace())
    assert mesh == {"pp": 2, "dp": 2, "sp": 1, "tp": 2}
    assert V.coords(mesh, 5) == {"pp": 1, "dp": 0, "sp": 0, "tp": 1}
    assert V.coords(mesh, 6) == {"pp": 1, "dp": 1, "sp": 0, "tp": 0}
    assert [V.axis_of(mesh, 4, q) for q in (5, 6, 0, 3, 4)] == ["tp", "dp", "pp", "pp+dp+tp", ""]
    assert V.mesh_of(Trace({"world_size": 2}, [])) is None
    assert V.mesh_of(Trace({"world_size": 2, "mesh": {"axes": ["tp"], "shape": [2, 1]}}, [])) is None


def test_bytes_by_axis_are_the_hand_sums_in_grid_order() -> None:
    got = V.bytes_by_axis(mesh_trace())
    assert got == HAND
    assert list(got) == ["pp", "dp", "tp", "dp+tp"]  # the mesh's axes first, combinations after


def test_formula_rows_sit_on_their_axis_and_a_silent_axis_measures_zero() -> None:
    trace = mesh_trace(expected_bytes_by_axis={"tp": TP, "pp": [PP] * 4 + [0] * 4, "sp": 64})
    rows = {axis: (got, formula) for axis, got, formula in V.axis_rows(trace)}
    assert rows["tp"] == ([TP] * 8, [100.0] * 8)
    assert rows["pp"] == ([PP] * 4 + [0] * 4, [500.0] * 4 + [0.0] * 4)
    assert rows["dp"] == ([DP] * 8, None)
    assert rows["sp"] == ([0] * 8, [64.0] * 8)


def test_traffic_figure_groups_by_mesh_axis() -> None:
    fig = figures.traffic(mesh_trace(expected_bytes_by_axis={"tp": TP}), group="axis")
    bars = [t for t in fig.data if t.type == "bar" and t.legendgroup == "measured"]
    assert list(bars[0].x) == ["pp", "dp", "tp", "dp+tp"]
    assert [list(b.y) for b in bars[:4]] == [[PP, DP, TP, CROSS], [PP, DP, TP, 0], [PP, DP, TP, 0], [PP, DP, TP, 0]]
    assert [list(b.y) for b in bars[4:]] == [[0, DP, TP, 0]] * 4
    outlines = [t for t in fig.data if t.type == "bar" and t.legendgroup == "formula"]
    assert len(outlines) == 8 and all(list(t.x) == ["tp"] and list(t.y) == [100.0] for t in outlines)
    assert "per mesh axis" in fig.layout.annotations[1].text
    heat = fig.data[0]
    assert heat.z[0][1] == TP and heat.z[0][2] == DP and heat.z[0][4] == PP and heat.z[0][3] == CROSS


def test_group_by_axis_needs_a_mesh_and_a_known_grouping() -> None:
    plain = Trace({"world_size": 2}, message(0, 1, 10, 0.0))
    with pytest.raises(ValueError, match=r"meta\['mesh'\]"):
        figures.traffic(plain, group="axis")
    with pytest.raises(ValueError, match="choose 'op'"):
        figures.traffic(mesh_trace(), group="rank")
    assert [t.x[0] for t in figures.traffic(plain).data if t.type == "bar"] == ["send", "send"]  # default: by op


def test_stacked_bytes_per_rank_and_formula_ticks() -> None:
    trace = mesh_trace(expected_bytes_by_axis={"tp": TP + 1})
    fig = V.axis_traffic_figure(trace)
    bars = {t.name.split(" ")[0]: list(t.y) for t in fig.data if t.type == "bar"}
    assert bars == HAND
    assert fig.layout.barmode == "stack"
    tick = next(t for t in fig.data if t.type == "scatter" and t.customdata is not None)
    # tp's segment sits on pp and dp: it should end at PP + DP + (TP + 1) on stage 0, DP + TP + 1 on stage 1
    assert list(tick.y) == [PP + DP + TP + 1] * 4 + [DP + TP + 1] * 4
    assert list(tick.customdata) == [101.0] * 8


def test_grid_places_ranks_by_stage_replica_and_slice_and_colours_groups() -> None:
    fig = V.grid_figure(mesh_trace())
    titles = [a.text for a in fig.layout.annotations]
    assert [t.split("</b>")[0] for t in titles] == ["<b>pp", "<b>dp", "<b>tp"]
    assert all("4 of 2 ranks" in t for t in titles)
    panels = [t for t in fig.data if t.mode == "text"]
    # x = stage * (2 tp slices + 0.5 gap) + tp slice, y = replica
    assert list(panels[0].x) == [0, 1, 0, 1, 2.5, 3.5, 2.5, 3.5]
    assert list(panels[0].y) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert panels[0].text[5].startswith("<b>rank 5</b>") and "p1 d0 t1" in panels[0].text[5]
    fills = [[s.fillcolor for s in fig.layout.shapes[8 * i:8 * i + 8]] for i in range(3)]
    pp, dp, tp = fills
    assert len(fig.layout.shapes) == 24
    assert tp[4] == tp[5] and tp[4] != tp[6] and len(set(tp)) == 4  # tp pairs (4, 5), (6, 7), ...
    assert dp[4] == dp[6] and dp[4] != dp[5] and len(set(dp)) == 4  # dp pairs (4, 6), (5, 7), ...
    assert pp[1] == pp[5] and pp[1] != pp[3] and len(set(pp)) == 4  # pp chains (1, 5), (3, 7), ...
    assert "tp group: ranks [4, 5]" in panels[2].hovertext[5]


def test_report_draws_the_mesh_and_groups_traffic_by_axis() -> None:
    page = report.render([mesh_trace()], ["hand-made mesh"])
    assert 'id="fig-mesh-grid"' in page and 'id="fig-mesh-traffic"' in page
    assert "device mesh: hand-made mesh" in page and "per mesh axis" in page
    plain = report.render([Trace({"world_size": 2}, message(0, 1, 10, 0.0))], ["plain"])
    assert "fig-mesh" not in plain and "per mesh axis" not in plain and "bytes sent per rank, per op" in plain


def test_the_mesh_comes_before_the_callers_figures() -> None:
    extra = [("grid again", V.grid_figure({"pp": 1, "dp": 2, "sp": 1, "tp": 2}))]
    page = report.render([mesh_trace()], ["m"], extra_figures=extra)
    assert page.index('id="fig-mesh-grid"') < page.index('id="fig-mesh-traffic"') < page.index('id="fig-extra-0"')


@pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"), reason="Debian chromium not installed")
def test_mesh_figures_render_in_chromium(tmp_path) -> None:
    out = tmp_path / "report.html"
    report.write_report([mesh_trace(expected_bytes_by_axis={"tp": TP})], out, titles=["hand-made mesh"])
    dom = _chromium(tmp_path, out.as_uri(), "--window-size=1280,3000", "--dump-dom")
    assert _errors(dom) == []
    figs = _figures(dom)
    for name in ("fig-mesh-grid", "fig-mesh-traffic", "fig-0-traffic"):
        assert 'class="main-svg"' in figs[name], f"{name} drew no plot SVG"
    # the grid's boxes carry their ranks: 3 panels (pp, dp, tp) x 8 ranks
    assert sorted(re.findall(r">rank (\d)<", figs["fig-mesh-grid"])) == sorted(str(r) for r in range(8) for _ in "pdt")


def test_groups_and_holdings_for_the_terminal() -> None:
    mesh = {"pp": 2, "dp": 2, "tp": 2}  # rank = (pp_i x 2 + dp_i) x 2 + tp_i
    assert V.groups_text(mesh).endswith("pp: {0,4} {1,5} {2,6} {3,7}; dp: {0,2} {1,3} {4,6} {5,7}; "
                                        "tp: {0,1} {2,3} {4,5} {6,7}")
    held = [{"layers": "embed", "slices": "heads 0-1", "data": "rows 0:4", "params": 10 + r} for r in range(8)]
    table = V.holdings_table(mesh, held, [10 + r for r in range(8)])
    assert list(table.columns[1].cells)[5] == "1: embed" and list(table.columns[3].cells)[2] == "1: rows 0:4"
    assert "equal on every rank to" in str(table.caption)
    assert "NOT equal" in str(V.holdings_table(mesh, held, [10] * 8).caption)


def test_axis_and_states_tables_set_each_rank_beside_the_formula() -> None:
    want = [{a: v[r] for a, v in HAND.items() if v[r]} for r in range(8)]
    table, equal = V.axis_table(mesh_trace(), want, detail=False)
    assert equal and list(table.columns[0].cells) == ["0", "1 2 3", "4 5 6 7"]  # ranks that sent alike
    assert list(table.columns[-1].cells) == ["yes"] * 3
    assert list(table.columns[-2].cells)[0] == f"{PP + DP + TP + CROSS:,}"  # rank 0's total
    want[5] = {**want[5], "tp": TP + 1}
    table, equal = V.axis_table(mesh_trace(), want)
    assert not equal and list(table.columns[4].cells)[5] == f"{TP:,} / {TP + 1:,}"  # rank, coords, pp, dp, tp
    states = {"parameters": 80, "gradients": 80, "optimizer state": 160}
    events = [Event(r, "memory", k, 0.0, 0.0, nbytes=v) for r in range(2) for k, v in states.items()]
    events += [Event(r, "memory", "activations", t, t, nbytes=n) for r in range(2) for t, n in ((0.1, 50), (0.2, 70))]
    events += [Event(r, "compute", "opt", 1.0, 2.0) for r in range(2)]
    trace = Trace({"world_size": 2}, events)
    table, equal = V.states_table(trace, [states] * 2, [70, 70])
    assert equal and list(table.columns[-1].cells) == ["70 / 70"] * 2
    assert not V.states_table(trace, [states] * 2, [70, 60])[1]
