"""Clocks in the viewer (issue 27, item 4): every figure and table names the clock its times are on
(replayed on a cluster, simulated, wall clock), and a report given a trace with its run on another
clock draws the timeline with a button for each clock, which swaps the bars, the title, the idle
totals and the time axis (checked on the figure, and by clicking the button in headless chromium).

The two clocks here are the hand-made 1F1B trace as a "replay" and the same events with every time
doubled as its "wall clock": known numbers, no run timed.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console
from viz_traces import one_f_one_b, simulated

from minipar import cli, launch
from minipar import trace as mtrace
from minipar.trace import Event, Trace
from viz import report, style
from viz.terminal import print_timeline

CHROMIUM = "/usr/bin/chromium"
REPLAY = {"clock": "replay", "cluster": "local", "replay": {"label": "replayed: one core per rank, network local"}}


def two_clocks() -> tuple[Trace, Trace]:
    """(the hand-made 1F1B as a replay, the same run on a "wall clock" twice as slow)."""
    base = one_f_one_b()
    replayed = Trace({**base.meta, **REPLAY}, base.events)
    wall = Trace({**base.meta, "clock": "wall"}, [replace(e, t0=2 * e.t0, t1=2 * e.t1) for e in base.events])
    return replayed, wall


def test_every_clock_has_a_name():
    replayed, wall = two_clocks()
    assert style.clock(replayed) == "replayed: one core per rank, network local"
    assert style.clock(replayed, short=True) == "replayed on local"
    assert style.clock(wall) == "wall clock, as recorded"  # the lessons' words (lessons.common.Clock.label)
    assert style.clock(wall, short=True) == "wall clock"
    assert style.clock(simulated("1f1b", 2, 4)) == "simulated, unit costs: forward 1, backward 2"
    assert style.clock(simulated("1f1b", 2, 4), short=True) == "simulated"
    assert style.clock(one_f_one_b()) == "" and style.with_clock("x", one_f_one_b()) == "x"  # made by hand


def test_the_toggle_shows_one_clock_at_a_time():
    replayed, wall = two_clocks()
    fig = report.timeline_figure(replayed, "1F1B", wall)
    (menu,) = fig.layout.updatemenus
    assert [b.label for b in menu.buttons] == ["replayed on local", "wall clock"]
    n = len(fig.data) // 2
    for b, shown in zip(menu.buttons, (range(n), range(n, 2 * n)), strict=True):
        trace_args, layout_args = b.args
        on = [i for i, v in enumerate(trace_args["visible"]) if v is not False]
        assert on == list(shown)  # each button shows its own drawing (legend-only entries stay legend-only)
        assert "legendonly" in [trace_args["visible"][i] for i in shown]
        idle = [a["text"] for a in layout_args["annotations"]]
        assert idle == ([" idle 3 units (20%)"] * 2 if b.label != "wall clock" else [" idle 6 units (20%)"] * 2)
    assert menu.buttons[0].args[1]["title.text"] == "timeline: 1F1B (replayed: one core per rank, network local)"
    assert menu.buttons[1].args[1]["title.text"] == "timeline: 1F1B (wall clock, as recorded)"
    assert menu.buttons[0].args[1]["xaxis.range"][1] < menu.buttons[1].args[1]["xaxis.range"][1]
    assert [v for v in (t.visible for t in fig.data) if v is not False] == list(menu.buttons[0].args[0]["visible"][:n])


def test_report_names_the_clock_and_toggles_only_traces_with_another(tmp_path):
    replayed, wall = two_clocks()
    sim = simulated("1f1b", 2, 4)
    out = tmp_path / "r.html"
    report.write_report([replayed, sim], out, titles=["1F1B", "simulated"], others=[wall, None])
    page = out.read_text()
    assert page.count('"method":"update"') == 2 * 2  # the 1F1B timeline and the side-by-side view
    rows = report.summary_rows([replayed, sim, wall, one_f_one_b()], ["a", "b", "c", "d"])
    assert [r["times"] for r in rows] == ["replayed on local", "simulated", "wall clock", "-"]
    with pytest.raises(ValueError, match="got 1 others for 2 traces"):
        report.write_report([replayed, sim], out, others=[wall])


def test_a_replay_shows_the_moves_between_tiers_as_recorded():
    # a replay places a move between its thread's neighbours without timing it: the seconds come from the
    # recorded run; the bytes per tier over time follow the replay's clock
    move = Event(0, "transfer", "cpu->device", 1.0, 3.0, nbytes=800, args={"src": "cpu", "dst": "device",
                                                                          "modelled_s": 0.5})
    wall = Trace({"world_size": 1, "clock": "wall"}, [Event(0, "memory", "device", 0.0, 0.0, nbytes=8), move])
    replayed = Trace({**wall.meta, **REPLAY}, [replace(e, t0=e.t0 / 4, t1=e.t1 / 4) for e in wall.events])
    (_, tiers, _), (_, moves, _) = report.tier_figures(replayed, "offload", wall)
    assert tiers.layout.title.text.startswith("bytes per tier over time, per rank: offload (replayed")
    assert "offload (wall clock, as recorded)" in moves.layout.title.text
    assert list(next(t for t in moves.data if t.name == "measured").y) == [2000.0]  # ms: the recorded 2 s


def test_the_terminal_timeline_names_its_clock():
    replayed, _ = two_clocks()
    console = Console(width=80, record=True)
    print_timeline(replayed, console=console)
    assert "; replayed: one core per rank, network local" in console.export_text()


@pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"), reason="Debian chromium not installed")
def test_clicking_wall_clock_in_chromium_redraws_the_timeline(tmp_path):
    replayed, wall = two_clocks()
    out = tmp_path / "r.html"
    report.write_report([replayed], out, titles=["1F1B"], others=[wall])
    click = """<script>window.addEventListener('load', function () { setTimeout(function () {
      var b = document.querySelectorAll('#fig-0-timeline .updatemenu-button')[1];
      b.dispatchEvent(new MouseEvent('click', {bubbles: true}));
    }, 500); });</script></body>"""
    out.write_text(out.read_text().replace("</body>", click))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           "--disable-background-networking", "--disable-component-update", f"--user-data-dir={tmp_path / 'p'}",
           "--virtual-time-budget=10000", "--window-size=1280,2000", "--dump-dom", out.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    fig = dom[dom.index('id="fig-0-timeline"'):]
    assert re.search(r'class="gtitle"[^>]*>timeline: 1F1B \(wall clock, as recorded\)<', fig)  # the wall clock's
    assert ">30<" in fig and " idle 6 units (20%)" in fig  # its time axis reaches 30, its idle totals
    assert 'data-js-errors="[]"' in dom


def _ring(comm) -> list:
    with mtrace.record(None, comm) as rec:
        comm.allreduce(np.ones(64))
    return rec.events


def test_minipar_view_reports_the_replay_with_a_button_for_the_recorded_times(tmp_path, capsys):
    events = [e for rank in launch(_ring, 2, "threads") for e in rank]
    mtrace.save(Trace({"world_size": 2, "clock": "wall"}, events), tmp_path / "t.json")
    for argv, buttons in ((["view", str(tmp_path / "t.json")], 2), (["view", str(tmp_path / "t.json"), "--clock",
                                                                     "wall"], 0)):
        assert cli.main([*argv, "-o", str(tmp_path / "r.html")]) == 0
        page = (tmp_path / "r.html").read_text()
        assert page.count('"method":"update"') == buttons
        assert ("replayed on local" in page) == bool(buttons)
    capsys.readouterr()
