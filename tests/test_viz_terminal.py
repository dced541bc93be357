"""The terminal timeline rendered at a fixed width: exact lanes for 1F1B p=2 m=4 (F=1, B=2)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from viz_traces import one_f_one_b, ring_allreduce, ring_and_naive

from minipar.trace import Event, Trace, save
from viz import terminal

# 48 characters = "rank r " (7) + 30 cells (half a time unit each, makespan 15) + "  idle  20%" (11).
HEADER = ["pipeline, 1f1b, 2 ranks, {}", "step 15 units, bubble 20.0%"]
HAND_MADE = [
    "rank 0 F0F1....B0  F2B1  F3B2  ..B3    idle  20%",
    "rank 1 ..F0B0  F1B1  F2B2  F3B3  ....  idle  20%",
]
# The simulator records the time a rank waits inside a receive as a "recv" message: shown as "~".
SIMULATED = [
    "rank 0 F0F1~~~~B0  F2B1  F3B2  ~~B3    idle  20%",
    "rank 1 ~~F0B0  F1B1  F2B2  F3B3  ....  idle  20%",
]


def _plain(trace_or_path, width: int = 48) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    terminal.print_timeline(trace_or_path, console=console, width=width)
    return buf.getvalue().splitlines()


def _simulated_1f1b() -> Trace:
    try:
        from minipar.parallel.pipeline import make_schedule, simulate
    except ImportError:  # package __init__ not exporting them yet: same functions, module paths
        from minipar.parallel.pipeline.generators import make_schedule
        from minipar.parallel.pipeline.simulate import simulate
    return simulate(make_schedule("1f1b", 2, 4), forward=1.0, backward=2.0).trace


def test_hand_made_1f1b_lanes_exact(tmp_path):
    path = tmp_path / "1f1b.json"
    save(one_f_one_b(), path)
    out = _plain(path)
    assert out[:4] == [HEADER[0].format("hand-made"), HEADER[1], *HAND_MADE]


def test_simulator_1f1b_lanes_exact():
    out = _plain(_simulated_1f1b())
    assert out[:4] == [HEADER[0].format("simulator"), HEADER[1], *SIMULATED]


def test_lanes_scale_to_width():
    lanes = [t.plain for t in terminal.lanes(one_f_one_b(with_messages=False), 15)]  # one cell per unit
    assert lanes == ["FF..B0FB1FB2.B3", ".FB0FB1FB2FB3.."]


def test_short_span_still_shown_and_colours_by_kind():
    ev = [Event(0, "compute", "F", 0.0, 4.0), Event(0, "compute", "opt", 4.5, 4.6),
          Event(0, "compute", "B", 6.0, 10.0)]
    (lane,) = terminal.lanes(Trace({"world_size": 1}, ev), 10)
    assert lane.plain == "F   o.B   "
    styles = [(s.start, s.end, s.style) for s in lane.spans]
    assert styles == [(0, 4, terminal.STYLES["forward"]), (4, 5, terminal.STYLES["optimizer"]),
                      (5, 6, terminal.IDLE_STYLE), (6, 10, terminal.STYLES["backward"])]


def test_colour_codes_under_forced_terminal():
    buf = io.StringIO()
    console = Console(file=buf, width=48, force_terminal=True, color_system="standard")
    terminal.print_timeline(one_f_one_b(), console=console)
    text = buf.getvalue()
    assert "\x1b[1;37;44mF0" in text  # bold white on blue: a forward block
    assert "\x1b[1;30;101mB0" in text or "\x1b[1;30;43mB0" in text  # backward on orange


def test_traffic_table_bytes_and_formula():
    out = "\n".join(_plain(ring_allreduce(p=3, n=3000), width=70))
    rows = [line for line in out.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert cells == [["0", "4,000", "4,000"], ["1", "4,000", "4,000"], ["2", "4,000", "4,000"],
                     ["formula", "4,000", ""]]
    assert "allreduce/ring" in out


def test_traffic_table_per_rank_formula_column_next_to_its_measured_column():
    t = ring_and_naive(p=3, n=3000)
    out = "\n".join(_plain(t, width=90))
    rows = [line for line in out.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    # columns: rank | allreduce/ring | allreduce/naive | formula (naive, per rank) | total
    assert cells == [["0", "4,000", "6,000", "6,000", "10,000"], ["1", "4,000", "3,000", "3,000", "7,000"],
                     ["2", "4,000", "3,000", "3,000", "7,000"], ["formula", "4,000", "", "", ""]]
    t.meta["expected_bytes_by_rank"] = {"allreduce": [1, 2, 3]}  # a bare op: after its last column
    cells = [[c.strip() for c in row.strip("│").split("│")]
             for row in "\n".join(_plain(t, width=90)).splitlines() if row.startswith("│")]
    assert [row[3] for row in cells] == ["1", "2", "3", ""]
    assert "allreduce formula" in "\n".join(_plain(t, width=120))


def test_too_narrow_width_says_what_to_change():
    with pytest.raises(ValueError, match="use a width of at least 22"):
        _plain(one_f_one_b(), width=21)


def test_width_wider_than_a_non_terminal_console_is_kept():
    buf = io.StringIO()
    console = Console(file=buf, width=30, color_system=None)  # narrower than the lanes asked for
    terminal.print_timeline(one_f_one_b(), console=console, width=48)
    assert buf.getvalue().splitlines()[2:4] == HAND_MADE
