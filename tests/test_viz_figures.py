"""Viewer numbers and Plotly figures on hand-made traces (tests/viz_traces.py): bars sit at the
event times, heat-map cells hold the bytes of the events, bubble totals equal the idle time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from viz_traces import ACT_BYTES, GRAD_BYTES, SCHEDULE_1F1B, one_f_one_b, ring_allreduce, ring_and_naive

from minipar.trace import Event, Trace
from viz import analysis as A
from viz import figures


def test_idle_of_1f1b_equals_pipeline_bubble_formula():
    t = one_f_one_b()
    assert A.window(t) == (0.0, 15.0)
    assert [A.busy(t, r) for r in range(2)] == [12.0, 12.0]
    assert [A.idle(t, r) for r in range(2)] == [3.0, 3.0]
    p, m = 2, 4
    assert A.bubble_fractions(t) == [(p - 1) / (m + p - 1)] * 2


def test_idle_counts_overlaps_once_and_comm_as_idle():
    ev = [Event(0, "compute", "F", 0.0, 4.0), Event(0, "compute", "layer", 1.0, 2.0),  # nested
          Event(0, "compute", "B", 3.0, 6.0),  # overlaps F
          Event(1, "compute", "F", 2.0, 3.0), Event(1, "comm", "send", 8.0, 10.0, src=1, dst=0, nbytes=8),
          Event(0, "comm", "recv", 8.0, 10.0, src=1, dst=0, nbytes=8), Event(0, "mark", "end", 20.0, 20.0)]
    t = Trace({"world_size": 2}, ev)
    assert A.window(t) == (0.0, 10.0)  # the mark does not stretch the step
    assert A.busy(t, 0) == 6.0 and A.idle(t, 0) == 4.0
    assert A.busy(t, 1) == 1.0 and A.idle(t, 1) == 9.0
    assert A.bubble_fractions(t) == [0.4, 0.9]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 8)), min_size=1, max_size=8))
def test_union_length_matches_counting_unit_cells(spans):
    intervals = [(float(a), float(a + d)) for a, d in spans]
    cells = {c for a, d in spans for c in range(a, a + d)}
    assert A.union_length(intervals, 0.0, 100.0) == len(cells)
    assert A.union_length(intervals, 5.0, 10.0) == len(cells & set(range(5, 10)))


def test_no_compute_means_no_bubble():
    t = Trace({"world_size": 2}, [Event(0, "comm", "send", 0.0, 1.0, src=0, dst=1, nbytes=4, op="send")])
    assert A.bubble_fractions(t) is None and A.summary(t)["bubble_fraction"] is None


def test_timeline_bars_are_the_event_times():
    t = one_f_one_b()
    fig = figures.timeline(t)
    bars = {tr.name: tr for tr in fig.data if tr.type == "bar"}
    assert set(bars) == {"forward", "backward", "message"}
    for kind, letter in (("forward", "F"), ("backward", "B")):
        bar = bars[kind]
        assert list(bar.y).count(0) == 4 and list(bar.y).count(1) == 4  # 4 micro-batches per rank
        got = sorted(zip(bar.y, bar.base, bar.x, bar.text, strict=True))
        want = sorted((r, float(t0), float(t1 - t0), f"{letter}{mb}")
                      for r, spans in SCHEDULE_1F1B.items() for name, mb, t0, t1 in spans if name == letter)
        assert got == want
    ticks = fig.layout.yaxis
    assert list(ticks.tickvals) == [0, 1] and list(ticks.ticktext) == ["rank 0", "rank 1"]
    idle_notes = sorted(a.text.strip() for a in fig.layout.annotations)
    assert idle_notes == ["idle 3 units (20%)", "idle 3 units (20%)"]
    arrows = next(tr for tr in fig.data if tr.type == "scatter")
    assert len(arrows.x) == 3 * 8  # 4 activations + 4 gradients, one segment (and a gap) each


def test_chunk_labels_when_interleaved():
    ev = [Event(0, "compute", "F", 0.0, 1.0, microbatch=2, chunk=0),
          Event(0, "compute", "F", 1.0, 2.0, microbatch=2, chunk=1)]
    fig = figures.timeline(Trace({"world_size": 1, "v": 2}, ev))
    assert list(fig.data[0].text) == ["F2.0", "F2.1"]


def test_traffic_heatmap_cells_are_bytes_sent():
    t = one_f_one_b()
    fig = figures.traffic(t)
    heat = next(tr for tr in fig.data if tr.type == "heatmap")
    assert [list(row) for row in heat.z] == [[0, 4 * ACT_BYTES], [4 * GRAD_BYTES, 0]]
    r = ring_allreduce(p=3, n=3000)
    fig = figures.traffic(r)
    heat = next(tr for tr in fig.data if tr.type == "heatmap")
    assert [list(row) for row in heat.z] == [[0, 4000, 0], [0, 0, 4000], [4000, 0, 0]]
    measured = [tr for tr in fig.data if tr.type == "bar" and tr.name.endswith("measured")]
    assert [list(tr.y) for tr in measured] == [[4000]] * 3
    formula = next(tr for tr in fig.data if tr.name == "formula (per rank)")
    assert list(formula.x) == ["allreduce/ring"] and list(formula.y) == [4000.0]  # 2(p-1)/p * n


def test_formula_key_without_algorithm_matches_the_op():
    r = ring_allreduce(p=4, n=4000)
    r.meta["expected_bytes"] = {"allreduce": 6000}
    assert A.measured_vs_formula(r) == [("allreduce", [6000] * 4, 6000.0)]


def test_memory_curves_follow_the_samples():
    t = one_f_one_b()
    s = A.memory_series(t, 0)
    assert s.times == [0.0, 1.0, 2.0, 6.0, 7.0, 9.0, 10.0, 12.0, 15.0]
    assert s.by_label["activations"] == [0, 100, 200, 100, 200, 100, 200, 100, 0]
    assert s.by_label["parameters"] == [5000] * 9
    assert s.peak == 5200 and A.summary(t)["peak_memory"] == [5200, 5100]
    fig = figures.memory(t)
    act0 = next(tr for tr in fig.data if tr.name == "activations" and tr.stackgroup == "rank0")
    assert list(act0.x) == s.times + [15.0] and list(act0.y) == s.by_label["activations"] + [0]


def test_compare_puts_traces_on_one_time_axis():
    fig = figures.compare([one_f_one_b(), ring_allreduce()], ["a", "b"])
    assert fig.layout.xaxis2.matches == "x" or fig.layout.xaxis.matches == "x2"
    assert list(fig.layout.yaxis2.ticktext) == ["rank 0", "rank 1", "rank 2"]
    names = [tr.name for tr in fig.data if tr.showlegend is not False]
    assert sorted(names) == sorted(set(names))  # each legend entry once
    assert "careful, time units differ" in fig.layout.title.text


def test_summary_numbers():
    s = A.summary(one_f_one_b())
    assert s["step_time"] == 15.0 and s["bubble_fraction"] == 0.2
    assert s["bytes_moved"] == 4 * (ACT_BYTES + GRAD_BYTES) and s["world_size"] == 2


def test_per_rank_formula_drawn_as_an_outline_on_each_ranks_bar():
    p, n = 3, 3000
    t = ring_and_naive(p, n)
    assert A.formula_by_rank(t) == [("allreduce/naive", [2 * n, n, n], [2.0 * n, n, n])]
    assert A.measured_vs_formula(t) == [("allreduce/ring", [4000] * 3, 4000.0)]
    fig = figures.traffic(t)
    measured = {tr.offsetgroup: tr for tr in fig.data if tr.type == "bar" and tr.legendgroup == "measured"}
    assert {g: list(tr.y) for g, tr in measured.items()} == {
        "rank 0": [4000, 2 * n], "rank 1": [4000, n], "rank 2": [4000, n]}
    assert list(measured["rank 0"].x) == ["allreduce/ring", "allreduce/naive"]
    outlines = [tr for tr in fig.data if tr.legendgroup == "formula by rank"]
    assert [tr.offsetgroup for tr in outlines] == ["rank 0", "rank 1", "rank 2"]  # over its own bar
    assert [list(tr.x) for tr in outlines] == [["allreduce/naive"]] * 3
    assert [list(tr.y) for tr in outlines] == [[2.0 * n], [1.0 * n], [1.0 * n]]  # root sends (p-1) n
    assert [tr.showlegend for tr in outlines] == [True, False, False]
    assert all(tr.marker.color == "rgba(0,0,0,0)" for tr in outlines)  # an outline, not a filled bar
    scalar = [tr for tr in fig.data if tr.name == "formula (per rank)"]
    assert len(scalar) == 1 and list(scalar[0].x) == ["allreduce/ring"] and list(scalar[0].y) == [4000.0]


def test_per_rank_formula_wins_over_the_scalar_and_is_not_the_measurement():
    t = ring_and_naive(3, 3000)
    t.meta["expected_bytes"]["allreduce/naive"] = 4000.0  # the rank mean, as data.py also writes
    t.meta["expected_bytes_by_rank"]["allreduce/naive"] = [5000, 1000, 2000]  # deliberately off
    fig = figures.traffic(t)
    scalar = next(tr for tr in fig.data if tr.name == "formula (per rank)")
    assert list(scalar.x) == ["allreduce/ring"]  # the naive key is drawn per rank only
    outlines = [tr for tr in fig.data if tr.legendgroup == "formula by rank"]
    assert [tr.y[0] for tr in outlines] == [5000.0, 1000.0, 2000.0]
    assert [tr.customdata[0][0] for tr in outlines] == [6000, 3000, 3000]  # measured, in the hover


def test_per_rank_formula_of_the_wrong_length_says_what_to_give():
    t = ring_and_naive(3, 3000)
    t.meta["expected_bytes_by_rank"] = {"allreduce/naive": [1, 2]}
    with pytest.raises(ValueError, match=r"expected_bytes_by_rank\['allreduce/naive'\] must be a list of 3"):
        figures.traffic(t)
