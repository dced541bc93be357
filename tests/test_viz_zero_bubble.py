"""The viewer tells a split backward's halves apart: on a hand-made ZB-H1 trace, the input-gradient
spans ("I") and the weight-gradient spans ("W") each get their own kind, colour and legend entry in
the Plotly timeline, the papers' unit grid and the terminal timeline, and the grid's stash falls
when a micro-batch's W ends (Qi et al. 2024, Fig. 3: the W's fill 1F1B's cool-down).

The trace is ZB-H1 for p = 2 ranks and m = 2 micro-batches with F = I = W = 1 time unit, written
out by hand from the paper's rule (rank r runs, for x = 0, 1, 2: F_x, I_{x-(p-1-r)}, W_{x-(p-1)}):

    rank 0: F0[0,1] F1[1,2] I0[3,4] W0[4,5] I1[5,6] W1[6,7]
    rank 1: F0[1,2] I0[2,3] F1[3,4] I1[4,5] W0[5,6] W1[6,7]

Makespan 7, each rank computes 6: idle 1 = (p - 1)(F + I - W).
"""

from __future__ import annotations

import io

import numpy as np
from rich.console import Console

from minipar.parallel.pipeline import make_schedule, simulate
from minipar.trace import Event, Trace
from viz import analysis as A
from viz import figures, pipeline_grid, terminal
from viz.style import COLORS

ZB_H1 = {
    0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("I", 0, 3, 4), ("W", 0, 4, 5), ("I", 1, 5, 6), ("W", 1, 6, 7)],
    1: [("F", 0, 1, 2), ("I", 0, 2, 3), ("F", 1, 3, 4), ("I", 1, 4, 5), ("W", 0, 5, 6), ("W", 1, 6, 7)],
}
RED, TEAL = "#E45756", "#72B7B2"  # input gradient, weight gradient (viz/style.py)


def zb_h1_trace() -> Trace:
    events = [Event(r, "compute", name, float(t0), float(t1), stage=r, microbatch=mb, chunk=0)
              for r, spans in ZB_H1.items() for name, mb, t0, t1 in spans]
    meta = {"paradigm": "pipeline", "schedule": "zb-h1", "p": 2, "m": 2, "v": 1, "world_size": 2,
            "backend": "simulator", "time_unit": "units"}
    return Trace(meta, events)


def test_the_hand_made_trace_is_the_simulators():
    sim = simulate(make_schedule("zb-h1", 2, 2), forward=1.0, backward=2.0, weight=1.0)
    got = {r: [(e.name, e.microbatch, e.t0, e.t1) for e in A.compute_spans(sim.trace, r)] for r in (0, 1)}
    assert got == ZB_H1
    assert sim.makespan == 7.0 and sim.idle == {0: 1.0, 1: 1.0}


def test_each_half_has_its_kind_and_colour():
    kinds = {e.name: A.kind_of(e) for e in zb_h1_trace().events}
    assert kinds == {"F": "forward", "I": "input gradient", "W": "weight gradient"}
    assert (COLORS["input gradient"], COLORS["weight gradient"]) == (RED, TEAL)
    assert len(set(COLORS.values())) == len(COLORS)  # every kind its own colour


def test_plotly_timeline_has_one_legend_entry_and_colour_per_half():
    t = zb_h1_trace()
    fig = figures.timeline(t)
    bars = {tr.name: tr for tr in fig.data if tr.type == "bar"}
    assert list(bars) == ["forward", "input gradient", "weight gradient"]  # A.KINDS order
    assert [bars[k].marker.color for k in bars] == ["#4C78A8", RED, TEAL]
    for kind, letter in (("input gradient", "I"), ("weight gradient", "W")):
        got = sorted(zip(bars[kind].y, bars[kind].base, bars[kind].x, bars[kind].text, strict=True))
        want = sorted((r, float(t0), 1.0, f"{letter}{mb}") for r, spans in ZB_H1.items()
                      for name, mb, t0, _ in spans if name == letter)
        assert got == want
    assert sorted(a.text.strip() for a in fig.layout.annotations) == ["idle 1 units (14%)"] * 2  # 1 of 7


def test_stacked_timelines_list_each_half_once():
    fig = figures.compare([zb_h1_trace(), zb_h1_trace()], ["a", "b"])
    shown = [tr.name for tr in fig.data if tr.type == "bar" and tr.showlegend]
    assert shown == ["forward", "input gradient", "weight gradient"]
    assert [tr.name for tr in fig.data if tr.type == "bar"] == shown * 2


def test_unit_grid_places_I_and_W_and_frees_at_W():
    t = zb_h1_trace()
    cells = pipeline_grid.unit_cells(t)
    got = sorted((c.rank, c.name, c.microbatch, c.t0, c.t1) for c in cells)
    assert got == sorted((r, name, mb, t0, t1) for r, spans in ZB_H1.items() for name, mb, t0, t1 in spans)
    # stash: +1 when a forward ends, -1 when the micro-batch's W ends (its I keeps what W needs)
    assert pipeline_grid.unit_stash(cells, 0) == ([0, 1, 2, 5, 7], [0, 1, 2, 1, 0])
    assert pipeline_grid.unit_stash(cells, 1) == ([0, 2, 4, 6, 7], [0, 1, 2, 1, 0])
    fig = pipeline_grid.schedule_grid(t)
    bars = {tr.name: tr.marker.color for tr in fig.data if tr.type == "bar"}
    assert bars == {"forward": "#4C78A8", "input gradient": RED, "weight gradient": TEAL}
    assert "I and W 1 cell each" in fig.layout.xaxis2.title.text


def test_terminal_lanes_label_and_paint_each_half():
    t = zb_h1_trace()
    (lanes,) = terminal.lanes(t, 21)  # 3 cells per time unit: every label fits, one cell after the last
    assert [lane.plain for lane in lanes] == ["F0 F1 ...I0 W0 I1 W1 ", "...F0 I0 F1 I1 W0 W1 "]
    styles = [(s.start, s.end, s.style) for s in lanes[1].spans]
    assert styles == [(0, 3, terminal.IDLE_STYLE), (3, 6, terminal.STYLES["forward"]),
                      (6, 9, "bold white on red3"), (9, 12, terminal.STYLES["forward"]),
                      (12, 15, "bold white on red3"), (15, 18, "bold black on dark_cyan"),
                      (18, 21, "bold black on dark_cyan")]
    (short,) = terminal.lanes(t, 7)  # 1 cell per unit: no label fits, each block shows its kind's character
    assert [lane.plain for lane in short] == [">>.(=(=", ".>(>(=="]


def test_terminal_legend_names_both_halves():
    buf = io.StringIO()
    terminal.print_timeline(zb_h1_trace(), console=Console(file=buf, width=100, color_system=None))
    text = buf.getvalue()
    assert " F0 >> forward   I0 (( input gradient   W0 == weight gradient" in text
    assert "(>, (, =: too short for a label)" in text
    assert "backward" not in text  # no B span: no backward entry


def test_an_asynchronous_stage_update_is_drawn_as_the_optimizer():
    """PipeDream's ``U`` (a stage's update inside the step) is optimizer work: green, labelled U (one
    micro-batch: Plotly drops the number) and U3 in the terminal."""
    t = Trace({"world_size": 1, "time_unit": "units"},
              [Event(0, "compute", "B", 0.0, 2.0, stage=0, microbatch=3), Event(0, "compute", "U", 2.0, 3.0,
                                                                                stage=0, microbatch=3)])
    assert [A.kind_of(e) for e in t.events] == ["backward", "optimizer"]
    bars = {tr.name: tr for tr in figures.timeline(t).data if tr.type == "bar"}
    assert (bars["optimizer"].marker.color, tuple(bars["optimizer"].text)) == ("#54A24B", ("U",))
    ((lane,),) = terminal.lanes(t, 6)
    assert lane.plain == "B3  U3"  # 2 cells per unit: B3 in cells 0-3, U3 in 4-5


# ---- Chimera's two directions (Li & Hoefler 2021) ------------------------------------------------
# p = 2, m = 2, F = B = 1 by hand from the paper's slot rule (micro-batch i of a direction at stage s:
# forward in slot s + 2i, backward in slot 2p - 1 - s + 2i; down stage r and up stage p-1-r on rank r;
# down runs micro-batch 0, up micro-batch 1): no idle (p - 2 = 0 slots per rank).
CHIMERA = {  # rank: (name, micro-batch, direction, t0)
    0: [("F", 0, "down", 0), ("F", 1, "up", 1), ("B", 1, "up", 2), ("B", 0, "down", 3)],
    1: [("F", 1, "up", 0), ("F", 0, "down", 1), ("B", 0, "down", 2), ("B", 1, "up", 3)],
}
LIGHT_BLUE = "#C0D0E1"  # #4C78A8 mixed 65% towards white: 76 + 0.65 * 179, 120 + 0.65 * 135, 168 + 0.65 * 87


def chimera_trace() -> Trace:
    events = [Event(r, "compute", name, float(t0), t0 + 1.0, stage=r if d == "down" else 1 - r, microbatch=mb,
                    chunk=int(d == "up"), args={"direction": d}) for r, spans in CHIMERA.items()
              for name, mb, d, t0 in spans]
    meta = {"paradigm": "pipeline", "schedule": "chimera", "p": 2, "m": 2, "v": 2, "world_size": 2,
            "backend": "simulator", "time_unit": "units", "chunk_names": ["down", "up"]}
    return Trace(meta, events)


def test_the_hand_made_chimera_trace_is_the_simulators():
    from minipar.parallel.pipeline import simulate_chimera

    sim = simulate_chimera(2, 2, forward=1.0, backward=1.0)
    got = {r: [(e.name, e.microbatch, e.args["direction"], e.t0) for e in A.compute_spans(sim.trace, r)]
           for r in (0, 1)}
    assert got == CHIMERA
    assert all(e.chunk == int(e.args["direction"] == "up") for e in sim.trace.events if e.kind == "compute")


def test_plotly_tells_chimeras_directions_apart():
    """Down: the kind's colour, no pattern, "F0↓"; up: lighter, hatched in the kind's colour, "F1↑"."""
    bars = {tr.name: tr for tr in figures.timeline(chimera_trace()).data if tr.type == "bar"}
    assert list(bars) == ["forward \u2193 down", "forward \u2191 up", "backward \u2193 down", "backward \u2191 up"]
    down, up = bars["forward \u2193 down"], bars["forward \u2191 up"]
    assert (down.marker.color, down.marker.pattern.shape) == ("#4C78A8", None)
    assert (up.marker.color, up.marker.pattern.shape, up.marker.pattern.fgcolor) == (LIGHT_BLUE, "/", "#4C78A8")
    assert sorted(zip(up.y, up.base, up.text, strict=True)) == [(0, 1.0, "F1\u2191"), (1, 0.0, "F1\u2191")]
    assert sorted(zip(down.y, down.base, down.text, strict=True)) == [(0, 0.0, "F0\u2193"), (1, 1.0, "F0\u2193")]


def test_unit_grid_tells_chimeras_directions_apart():
    """The papers' grid (B = 2 cells): legend by direction (meta chunk_names), up hatched, arrows on the numbers."""
    bars = {tr.name: tr for tr in pipeline_grid.schedule_grid(chimera_trace()).data if tr.type == "bar"}
    assert list(bars) == ["forward \u2193 down", "forward \u2191 up", "backward \u2193 down", "backward \u2191 up"]
    assert (bars["forward \u2191 up"].marker.color, bars["forward \u2191 up"].marker.pattern.shape) == (LIGHT_BLUE, "/")
    assert bars["forward \u2193 down"].marker.pattern.shape is None
    assert sorted(zip(bars["backward \u2191 up"].y, bars["backward \u2191 up"].text, strict=True)) == [
        (0, "1\u2191"), (1, "1\u2191")]


def test_terminal_tells_chimeras_directions_apart():
    (lanes,) = terminal.lanes(chimera_trace(), 16)  # 4 cells per unit: each label and a space
    down, up = "\u2193", "\u2191"
    assert [lane.plain for lane in lanes] == [f"F0{down} F1{up} B1{up} B0{down} ", f"F1{up} F0{down} B0{down} B1{up} "]
    blue, orange = terminal.STYLES["forward"], terminal.STYLES["backward"]
    assert [(s.start, s.end, s.style) for s in lanes[0].spans] == [
        (0, 4, blue), (4, 8, blue + " reverse"), (8, 12, orange + " reverse"), (12, 16, orange)]
    buf = io.StringIO()
    terminal.print_timeline(chimera_trace(), console=Console(file=buf, width=100, color_system=None))
    assert " F0\u2193  down pipeline   F2\u2191  up pipeline (reversed colours)" in buf.getvalue()


def test_measured_chimera_spans_say_their_direction():
    """``Chimera.step`` traced on threads, p = m = 2: each span and message carries its direction and
    the global micro-batch (up's 0 is 1), and the activations samples count both directions (peak
    p/2 + 1 + min(r, p-1-r) = 2 on both ranks)."""
    import minipar
    from minipar import trace as mtrace
    from minipar.parallel.pipeline import Chimera, mlp

    x = np.arange(32, dtype=np.float64).reshape(4, 8) / 32
    y = np.ones((4, 2))

    def body(comm):
        chimera = Chimera(comm, mlp([8, 6, 4, 3, 2], seed=0), 2)
        with mtrace.record(None, comm) as rec:
            chimera.step(x, y)
        spans = [(e.name, e.microbatch, e.args["direction"], e.chunk) for e in rec.events if e.kind == "compute"]
        sent = sorted((e.name, e.microbatch, e.args.get("direction")) for e in rec.events
                      if e.kind == "comm" and e.stage is not None)
        held = [e.args["stashed"] for e in rec.events if e.name == "activations"]
        return spans, sent, held

    (spans0, sent0, held0), (spans1, _, held1) = minipar.launch(body, 2, "threads")
    assert spans0 == [("F", 0, "down", 0), ("F", 1, "up", 1), ("B", 1, "up", 1), ("B", 0, "down", 0)]
    assert spans1 == [("F", 1, "up", 1), ("F", 0, "down", 0), ("B", 0, "down", 0), ("B", 1, "up", 1)]
    # rank 0 sends down's activation and receives its gradient; receives up's activation and sends its gradient
    assert sent0 == [("recv", 0, "down"), ("recv", 1, "up"), ("send", 0, "down"), ("send", 1, "up")]
    assert held0 == [0, 0, 1, 2, 1, 0] and held1 == [0, 0, 1, 2, 1, 0]  # two begins, then after each action
