"""Viewer numbers and Plotly figures on hand-made traces (tests/viz_traces.py): bars sit at the
event times, heat-map cells hold the bytes of the events, bubble totals equal the idle time, a
collective call is one span per rank holding the bytes of its messages, formulas sit over the
measured bar they predict, and a simulated schedule becomes the papers' unit grid with the
simulator's own unit timing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from viz_traces import (
    ACT_BYTES,
    GRAD_BYTES,
    SCHEDULE_1F1B,
    one_f_one_b,
    ring_allreduce,
    ring_allreduce_twice,
    ring_and_naive,
    simulated,
)

from minipar.parallel.pipeline import make_schedule, simulate
from minipar.trace import Event, Trace
from viz import analysis as A
from viz import figures, pipeline_grid, report
from viz import messages as M


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
    assert set(bars) == {"forward", "backward", "send", "recv", "messages (steps)"}
    lane = {0: 0, 1: 2}  # compute lanes; each rank's comm lane sits 1 below its compute lane
    for kind, letter in (("forward", "F"), ("backward", "B")):
        bar = bars[kind]
        got = sorted(zip(bar.y, bar.base, bar.x, bar.text, strict=True))
        want = sorted((lane[r], float(t0), float(t1 - t0), f"{letter}{mb}")
                      for r, spans in SCHEDULE_1F1B.items() for name, mb, t0, t1 in spans if name == letter)
        assert got == want
    ticks = fig.layout.yaxis
    assert list(ticks.tickvals) == [0, 1, 2, 3]
    assert list(ticks.ticktext) == ["rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    idle_notes = sorted(a.text.strip() for a in fig.layout.annotations)
    assert idle_notes == ["idle 3 units (20%)", "idle 3 units (20%)"]
    # each point-to-point message is its own span on its comm lane: activations 0 -> 1, gradients 1 -> 0
    send, recv = bars["send"], bars["recv"]  # unlabelled: a send and a receive may overlap on a lane
    assert sorted(zip(send.y, send.text, strict=True)) == [(1, "")] * 4 + [(3, "")] * 4
    assert sorted(zip(recv.y, recv.text, strict=True)) == [(1, "")] * 4 + [(3, "")] * 4
    assert sorted(h.split("<br>")[1] for h in send.hovertext) == (
        ["sent 1000 B, received 0 B"] * 4 + ["sent 600 B, received 0 B"] * 4)
    arrows = next(tr for tr in fig.data if tr.type == "scatter")
    assert len(arrows.x) == 3 * 8  # 4 activations + 4 gradients, one segment (and a gap) each
    assert arrows.visible == "legendonly" and bars["messages (steps)"].visible == "legendonly"  # asked for
    assert len(bars["messages (steps)"].x) == 2 * 8  # each message on its sender's and receiver's lane


def test_chunks_are_shades_with_a_legend_not_label_suffixes():
    ev = [Event(0, "compute", "F", 0.0, 1.0, microbatch=2, chunk=0),
          Event(0, "compute", "F", 1.0, 2.0, microbatch=2, chunk=1), Event(0, "compute", "F", 2.0, 3.0, microbatch=3)]
    fig = figures.timeline(Trace({"world_size": 1, "v": 2}, ev))
    assert [(tr.name, list(tr.text)) for tr in fig.data] == [("forward", ["F2", "F3"]), ("forward, chunk 1", ["F2"])]
    # chunk 1 of 2: #4C78A8 mixed 65% towards white, channel by channel: 76 + 0.65 * 179 = 192 (C0), ...
    assert [tr.marker.color for tr in fig.data] == ["#4C78A8", "#C0D0E1"]
    assert list(fig.layout.yaxis.ticktext) == ["rank 0"]  # only compute: one lane per rank
    one = figures.timeline(Trace({"world_size": 1}, [Event(0, "compute", "B", 0.0, 1.0, microbatch=0)]))
    assert list(one.data[0].text) == ["B"]  # a single micro-batch is not worth a number


def test_one_ring_allreduce_is_one_span_per_rank_with_its_bytes():
    p, n = 4, 4000
    spans = M.collective_spans(ring_allreduce(p, n))
    assert [s.rank for s in spans] == [0, 1, 2, 3]
    steps = 2 * (p - 1)  # reduce-scatter then all-gather, one chunk of n/p bytes out and in per step
    for s in spans:
        assert (s.op, s.algorithm, s.title, s.key) == ("allreduce", "ring", "allreduce ring", "allreduce/ring")
        assert len(s.events) == 2 * steps and s.steps == list(range(steps))
        assert s.sent == s.received == 2 * (p - 1) / p * n == 6000 and s.hidden == 0
        assert (s.t0, s.t1) == (0.0, steps * 1e-3)


def test_a_step_going_back_or_another_algorithm_starts_a_new_span():
    twice = M.collective_spans(ring_allreduce_twice(4, 4000))
    assert [(s.rank, s.sent, round(s.t0, 6)) for s in twice] == [
        (r, 6000, t) for r in range(4) for t in (0.0, 0.006)]
    p, n = 3, 3000
    spans = M.collective_spans(ring_and_naive(p, n))
    got = [(s.rank, s.algorithm, s.sent, s.received) for s in spans]
    assert got == [(0, "ring", 4000, 4000), (0, "naive", (p - 1) * n, (p - 1) * n),
                   (1, "ring", 4000, 4000), (1, "naive", n, n), (2, "ring", 4000, 4000), (2, "naive", n, n)]
    messages = M.collective_spans(one_f_one_b())  # point-to-point: one span per message, named by side
    assert sorted((s.rank, s.title, s.sent, s.received) for s in messages) == sorted(
        [(0, "send", ACT_BYTES, 0)] * 4 + [(0, "recv", 0, GRAD_BYTES)] * 4
        + [(1, "send", GRAD_BYTES, 0)] * 4 + [(1, "recv", 0, ACT_BYTES)] * 4)
    native = M.collective_spans(Trace({"world_size": 1}, [
        Event(0, "comm", "native", 0.0, 1.0, nbytes=800, op="allreduce", algorithm="native"),
        Event(0, "comm", "native", 1.0, 2.0, nbytes=800, op="allreduce", algorithm="native")]))
    assert [(s.sent, s.received, s.hidden) for s in native] == [(0, 0, 800), (0, 0, 800)]


def test_collective_spans_drawn_on_the_comm_lane_with_their_steps_on_hover():
    p, n = 4, 4000
    fig = figures.timeline(ring_allreduce(p, n))
    ring = next(tr for tr in fig.data if tr.name == "allreduce ring")
    assert list(ring.y) == [2 * r + 1 for r in range(p)]  # the ring trace also has compute (opt)
    assert list(ring.base) == [0.0] * p and list(ring.x) == [6e-3] * p
    assert list(ring.text) == ["allreduce ring 5.9 KiB"] * p  # 6000 B = 5.86 KiB
    hover = ring.hovertext[0]
    assert "sent 5.9 KiB, received 5.9 KiB in 6 steps" in hover
    assert "step 0: send -> rank 1 1000 B" in hover and "step 5: recv <- rank 3 1000 B" in hover


def test_traffic_heatmap_cells_are_bytes_sent():
    t = one_f_one_b()
    fig = figures.traffic(t)
    heat = next(tr for tr in fig.data if tr.type == "heatmap")
    assert [list(row) for row in heat.z] == [[0, 4 * ACT_BYTES], [4 * GRAD_BYTES, 0]]
    r = ring_allreduce(p=3, n=3000)
    fig = figures.traffic(r)
    heat = next(tr for tr in fig.data if tr.type == "heatmap")
    assert [list(row) for row in heat.z] == [[0, 4000, 0], [0, 0, 4000], [4000, 0, 0]]
    measured = [tr for tr in fig.data if tr.type == "bar" and tr.legendgroup == "measured"]
    assert [tr.name for tr in measured] == ["rank 0", "rank 1", "rank 2"]
    assert [list(tr.y) for tr in measured] == [[4000]] * 3
    assert len({tr.marker.color for tr in measured}) == 3  # one distinct colour per rank
    outlines = [tr for tr in fig.data if tr.legendgroup == "formula"]  # the scalar formula, on every bar
    assert [(tr.offsetgroup, list(tr.x), list(tr.y)) for tr in outlines] == [
        (f"rank {k}", ["allreduce/ring"], [4000.0]) for k in range(3)]  # 2(p-1)/p * n


def test_formula_key_without_algorithm_matches_the_op():
    r = ring_allreduce(p=4, n=4000)
    r.meta["expected_bytes"] = {"allreduce": 6000}
    assert A.measured_vs_formula(r) == [("allreduce", [6000] * 4, 6000.0)]


def test_a_bare_op_formula_sits_on_the_measured_bar_of_that_op():
    r = ring_allreduce(p=4, n=4000)
    r.meta["expected_bytes"] = {"allreduce": 6000}  # as lesson 04 writes it: no algorithm in the key
    assert A.traffic_rows(r) == [("allreduce/ring", [6000] * 4, [6000.0] * 4)]
    fig = figures.traffic(r)
    assert {tuple(tr.x) for tr in fig.data if tr.type == "bar"} == {("allreduce/ring",)}  # no extra category
    both = ring_and_naive(3, 3000)  # two algorithms of the op: the formula keeps its own category
    both.meta = {"world_size": 3, "expected_bytes": {"allreduce": 1.0}}
    assert A.traffic_rows(both) == [("allreduce/ring", [4000] * 3, None), ("allreduce/naive", [6000, 3000, 3000], None),
                                    ("allreduce", [10000, 7000, 7000], [1.0] * 3)]


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
    assert list(fig.layout.yaxis2.ticktext) == [f"rank {r} {lane}" for r in range(3) for lane in ("compute", "comm")]
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
    outlines = [tr for tr in fig.data if tr.legendgroup == "formula"]
    assert [tr.offsetgroup for tr in outlines] == ["rank 0", "rank 1", "rank 2"]  # over its own bar
    assert [list(tr.x) for tr in outlines] == [["allreduce/ring", "allreduce/naive"]] * 3
    assert [list(tr.y) for tr in outlines] == [[4000.0, 2.0 * n], [4000.0, 1.0 * n], [4000.0, 1.0 * n]]
    assert [tr.showlegend for tr in outlines] == [True, False, False]
    assert all(tr.marker.color == "rgba(0,0,0,0)" for tr in outlines)  # an outline, not a filled bar


def test_per_rank_formula_wins_over_the_scalar_and_is_not_the_measurement():
    t = ring_and_naive(3, 3000)
    t.meta["expected_bytes"]["allreduce/naive"] = 4000.0  # the rank mean, as data.py also writes
    t.meta["expected_bytes_by_rank"]["allreduce/naive"] = [5000, 1000, 2000]  # deliberately off
    fig = figures.traffic(t)
    outlines = [tr for tr in fig.data if tr.legendgroup == "formula"]
    assert [tr.y[1] for tr in outlines] == [5000.0, 1000.0, 2000.0]
    assert [tr.customdata[1][0] for tr in outlines] == [6000, 3000, 3000]  # measured, in the hover


def test_per_rank_formula_of_the_wrong_length_says_what_to_give():
    t = ring_and_naive(3, 3000)
    t.meta["expected_bytes_by_rank"] = {"allreduce/naive": [1, 2]}
    with pytest.raises(ValueError, match=r"expected_bytes_by_rank\['allreduce/naive'\] must be a list of 3"):
        figures.traffic(t)


def test_stash_counts_are_micro_batches_not_bytes():
    sim = simulated("1f1b", p=4, m=8)
    assert A.memory_counts(sim) and not A.memory_counts(one_f_one_b())  # there: 100 bytes per micro-batch
    fig = figures.memory(sim)  # 1F1B stashes p - r micro-batches on rank r
    assert fig.layout.yaxis.title.text == "micro-batches"
    peaks = [a.text for a in fig.layout.annotations]
    assert peaks == [f"rank {r}: peak {4 - r} micro-batches" for r in range(3)] + ["rank 3: peak 1 micro-batch"]
    assert A.fmt_memory(sim, 1) == "1 micro-batch" and A.fmt_memory(one_f_one_b(), 1536) == "1.5 KiB"
    rows = report.summary_rows([sim], ["sim"])
    assert rows[0]["peak memory per rank"] == "4, 3, 2, 1 micro-batches stashed"


def test_unit_grid_of_1f1b_is_the_hand_written_schedule():
    want = sorted((r, name, mb, t0, t1) for r, spans in SCHEDULE_1F1B.items() for name, mb, t0, t1 in spans)
    cells = pipeline_grid.unit_cells(one_f_one_b())
    assert cells is not None
    assert sorted((c.rank, c.name, c.microbatch, c.t0, c.t1) for c in cells) == want
    # the same order recorded with uneven durations gives the same grid: only the order matters
    t = one_f_one_b()
    for e in t.events:
        e.t0, e.t1 = e.t0 * 0.37 + 0.01 * e.rank, e.t1 * 0.37 + 0.01 * e.rank
    cells = pipeline_grid.unit_cells(t)
    assert cells is not None and sorted((c.rank, c.name, c.microbatch, c.t0, c.t1) for c in cells) == want


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_unit_grid_equals_the_simulator_with_unit_times(kind, v):
    p, m = 4, 8
    unit = simulated(kind, p, m, v)  # forward 1, backward 2: the papers' figures
    want = sorted((e.rank, e.name, e.stage, e.microbatch, e.t0, e.t1) for e in unit.events if e.kind == "compute")
    uneven = simulated(kind, p, m, v, forward=[1.0 + 0.3 * s for s in range(p * v)],
                       backward=[2.5 - 0.1 * s for s in range(p * v)])  # as lesson 2: measured durations
    for t in (unit, uneven):
        cells = pipeline_grid.unit_cells(t)
        assert cells is not None
        assert sorted((c.rank, c.name, c.stage, c.microbatch, c.t0, c.t1) for c in cells) == want
    fig = pipeline_grid.schedule_grid(uneven)
    makespan = int(unit.meta["makespan"])
    idle = makespan - 3 * v * m  # each rank runs v m forwards (1 cell) and v m backwards (2 cells)
    assert idle / makespan == pytest.approx((p - 1) / (v * m + p - 1))  # the paper's bubble share
    assert [a.text.strip() for a in fig.layout.annotations if "idle" in a.text] == [
        f"idle {idle} of {makespan} ({100 * idle / makespan:.0f}%)"] * p
    bars = [tr for tr in fig.data if tr.type == "bar"]
    assert [tr.name for tr in bars] == (["forward", "backward"] if v == 1 else
                                        ["forward, chunk 0", "forward, chunk 1", "backward, chunk 0",
                                         "backward, chunk 1"])
    texts = sorted(x for tr in bars for x in tr.text)
    assert texts == sorted(str(mb) for mb in range(m) for _ in range(2 * v * p))  # micro-batch numbers only
    # under the grid, each rank's stash: its peak is the simulator's own count of stashed micro-batches
    peaks = simulate(make_schedule(kind, p, m, v)).peak_stash
    stash = [tr for tr in fig.data if tr.type == "scatter"]
    assert [tr.name for tr in stash] == [f"rank {r} stash" for r in range(p)]
    assert [max(tr.y) for tr in stash] == [peaks[r] for r in range(p)]
    if kind != "interleaved":  # GPipe holds all m micro-batches, 1F1B p - r (Narayanan et al. 2.2.1)
        assert [max(tr.y) for tr in stash] == ([m] * p if kind == "gpipe" else [p - r for r in range(p)])


def test_report_of_a_simulated_schedule_has_no_empty_traffic_panel_and_folds_its_metadata():
    sim = simulated("interleaved", 4, 8, 2)
    sim.meta["latency"] = 1 / 3
    sim.meta["expected_bytes"] = {"send": 12582912.0}
    kinds = [(kind, fig is not None) for kind, fig, _ in report.figures_for(sim, "sim")]
    assert kinds == [("schedule", True), ("traffic", False)]  # its stash is drawn under the grid
    measured = [(kind, fig is not None) for kind, fig, _ in report.figures_for(ring_allreduce(), "ring")]
    assert measured == [("timeline", True), ("traffic", True), ("memory", True)]
    block = report.metadata(sim)
    assert block.startswith('<details class="meta">') and block.endswith("</details>")
    assert "0.3333" in block and "0.33333" not in block  # rounded to 4 significant digits
    assert "send: 12582912<" in block  # a whole number of bytes stays exact
    assert "<b>rank 0</b>: <code>0F0 0SEND_F0-&gt;1" in block  # the actions, one line per rank


def test_a_category_without_bytes_or_formula_is_left_out_of_the_bar_chart():
    t = ring_allreduce(p=3, n=3000)
    t.events += [Event(r, "comm", "send", 0.0, 1e-3, src=r, dst=(r + 1) % 3, nbytes=0, op="barrier",
                       algorithm="dissemination", step=0) for r in range(3)]
    assert [k for k, _, _ in A.traffic_rows(t)][-1] == "barrier/dissemination"
    fig = figures.traffic(t)
    assert {tuple(tr.x) for tr in fig.data if tr.type == "bar"} == {("allreduce/ring",)}


def test_a_native_collective_says_why_there_is_no_traffic_panel():
    native = Trace({"world_size": 2}, [Event(r, "comm", "native", 0.0, 1.0, nbytes=800, op="allreduce",
                                             algorithm="native") for r in range(2)])
    (_, fig, note), = [row for row in report.figures_for(native, "n") if row[0] == "traffic"]
    assert fig is None and "inside the MPI library" in note


def test_hover_names_only_the_fields_a_span_has_and_simulated_traces_are_recognised():
    fig = figures.timeline(one_f_one_b())
    forward = next(tr for tr in fig.data if tr.name == "forward")
    first = sorted(zip(forward.base, forward.y, forward.hovertext, strict=True))[0][2]
    assert first.endswith("<br>stage 0, micro-batch 0")  # no "chunk None"
    opt = next(tr for tr in figures.timeline(ring_allreduce()).data if tr.name == "optimizer")
    assert "stage" not in opt.hovertext[0] and "None" not in opt.hovertext[0]
    assert A.is_simulated(simulated()) and A.is_simulated(Trace({"schedule": "gpipe (simulated)"}, []))
    assert not A.is_simulated(one_f_one_b())


def test_a_terminal_table_is_the_same_table_in_the_report():
    from viz.width import Table

    table = Table(title="idle per rank", caption="formula: (p-1)(F+I+W)")
    for col in ("schedule", "idle"):
        table.add_column(col)
    table.add_row("1f1b", "9 9 9 9")
    table.add_row("zb-h1", "3 3 3 3")
    fig = figures.table(table)
    assert list(fig.data[0].header.values) == ["schedule", "idle"]
    assert [list(c) for c in fig.data[0].cells.values] == [["1f1b", "zb-h1"], ["9 9 9 9", "3 3 3 3"]]
    assert fig.layout.title.text == "idle per rank" and fig.layout.annotations[0].text == "formula: (p-1)(F+I+W)"


def test_weight_versions_are_drawn_per_stage_as_sampled():
    def held(stage: int, t: float, versions: int) -> Event:
        return Event(stage, "memory", "weight_versions", t, t, stage=stage, args={"versions": versions})

    trace = Trace({"schedule": "pipedream", "p": 2, "world_size": 2},
                  [Event(0, "compute", "F", 1.0, 1.5), held(0, 2.0, 2), held(0, 3.0, 1), held(1, 2.5, 1)])
    fig = figures.weight_versions([trace])
    lines = {t.name: (list(t.x), list(t.y)) for t in fig.data}
    assert lines == {"stage 0": ([0.0, 1000.0, 2000.0], [1, 2, 1]), "stage 1": ([0.0, 1500.0], [1, 1])}
    assert fig.layout.annotations[0].text == "pipedream"


def test_side_by_side_groups_traces_of_like_length():
    # lesson 3's report: four DDP steps (~15 ms) and four parameter-server runs (~370 ms) on one time axis
    # left the DDP steps a sliver; each group gets its own axis, and a lone length draws no comparison
    def of(ms: float) -> Trace:
        return Trace({"world_size": 1}, [Event(0, "compute", "F", 0.0, ms / 1e3)])

    traces = [of(18), of(14), of(366), of(13), of(370), of(5000)]
    assert report.time_scales(traces) == [[0, 1, 3], [2, 4], [5]]
    assert report.time_scales([of(10), of(50), of(51)]) == [[0, 1], [2]]  # 51 > 5 x 10
    units = Trace({"world_size": 1, "time_unit": "units"}, [Event(0, "compute", "F", 0.0, 0.015)])
    assert report.time_scales([of(15), units]) == [[0], [1]]  # seconds and unit costs share no axis
    page = report.render(traces, [f"t{i}" for i in range(6)])
    assert page.count("<h2>side by side</h2>") == 2 and 'id="fig-compare-1"' in page
