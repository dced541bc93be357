"""viz.tiers' figures on small hand-made inputs (every expected number worked out by hand below), and
the report hook ``lessons.common.finish(extra_figures=...)``.

The trace ``tiered()`` (2 ranks, seconds):

    rank 0 memory: device 100 and cpu 50 at t=0, device 300 at t=1, nvme 20 at t=2; a "step" mark at t=1
    rank 0 moves:  cpu->device 200 B [0.5, 0.75] modelled 0.1; device->nvme 40 B [1.5, 2.5] modelled 0.02;
                   cpu->device 100 B [2.0, 2.25] modelled 0.05
    rank 1 memory: device 10 at t=0
    rank 1 moves:  cpu->device 100 B [0.0, 0.5] modelled 0.05
"""

from __future__ import annotations

import io
from pathlib import Path

import plotly.graph_objects as go
import pytest
from rich.console import Console

from lessons.common import finish
from minipar.trace import Event, Trace
from viz.tiers import budget_figure, links, per_step_moves, residency_figure, transfers_figure


def _move(rank: int, src: str, dst: str, nbytes: int, t0: float, t1: float, modelled: float) -> Event:
    return Event(rank, "transfer", f"{src}->{dst}", t0, t1, nbytes=nbytes,
                 args={"src": src, "dst": dst, "modelled_s": modelled})


def tiered() -> Trace:
    events = [
        Event(0, "memory", "device", 0.0, 0.0, nbytes=100), Event(0, "memory", "cpu", 0.0, 0.0, nbytes=50),
        Event(0, "memory", "device", 1.0, 1.0, nbytes=300), Event(0, "memory", "nvme", 2.0, 2.0, nbytes=20),
        Event(0, "mark", "step", 1.0, 1.0),
        _move(0, "cpu", "device", 200, 0.5, 0.75, 0.1), _move(0, "device", "nvme", 40, 1.5, 2.5, 0.02),
        _move(0, "cpu", "device", 100, 2.0, 2.25, 0.05),
        Event(1, "memory", "device", 0.0, 0.0, nbytes=10),
        _move(1, "cpu", "device", 100, 0.0, 0.5, 0.05),
    ]
    return Trace({"world_size": 2, "paradigm": "offload test", "time_unit": "s"}, events)


def _by(fig: go.Figure, name: str, yaxis: str) -> go.Scatter:
    found = [t for t in fig.data if t.name == name and t.yaxis == yaxis]
    assert len(found) == 1, (name, yaxis, [(t.name, t.yaxis) for t in fig.data])
    return found[0]


def test_links_and_per_step_moves() -> None:
    got = links(tiered())
    assert set(got) == {("cpu", "device"), ("device", "nvme")}
    assert got["cpu", "device"]["bytes"] == 400 and got["cpu", "device"]["moves"] == 3
    assert got["cpu", "device"]["measured_s"] == pytest.approx(0.25 + 0.25 + 0.5, abs=1e-12)
    assert got["cpu", "device"]["modelled_s"] == pytest.approx(0.2, abs=1e-12)
    assert got["device", "nvme"] == pytest.approx({"bytes": 40, "moves": 1, "measured_s": 1.0, "modelled_s": 0.02})
    assert per_step_moves(tiered(), 0) == [{"cpu->device": 200}, {"device->nvme": 40, "cpu->device": 100}]
    assert per_step_moves(tiered(), 1) == [{"cpu->device": 100}]  # rank 1 has no mark: one window


def test_residency_figure_values() -> None:
    fig = residency_figure(tiered(), "t")
    # rank 0: samples at 0, 1, 2, then held to the last move's end, 2.5
    assert list(_by(fig, "device", "y").x) == [0.0, 1.0, 2.0, 2.5]
    assert list(_by(fig, "device", "y").y) == [100, 300, 300, 300]
    assert list(_by(fig, "cpu", "y").y) == [50, 50, 50, 50]
    assert list(_by(fig, "nvme", "y").y) == [0, 0, 20, 20]
    up, down = _by(fig, "move towards the device", "y"), _by(fig, "move away from the device", "y")
    assert list(up.x) == [0.5, 2.0] and list(down.x) == [1.5]
    top = 300 + 50 + 20  # the stack's maxima
    assert list(up.y) == pytest.approx([1.08 * top] * 2) and list(down.y) == pytest.approx([1.08 * top])
    assert list(fig.layout.yaxis.range) == pytest.approx([0, 1.2 * top])
    # rank 1: only a device sample; its move ends at 0.5
    assert list(_by(fig, "device", "y2").x) == [0.0, 0.5] and list(_by(fig, "device", "y2").y) == [10, 10]
    assert list(_by(fig, "move towards the device", "y2").x) == [0.0]
    assert list(_by(fig, "move towards the device", "y2").y) == pytest.approx([10.8])
    assert [t.name for t in fig.data if t.yaxis == "y2"] == ["device", "move towards the device"]


def test_transfers_figure_values() -> None:
    fig = transfers_figure(tiered(), "t")
    sankey = next(t for t in fig.data if isinstance(t, go.Sankey))
    # nodes: sources in tier order (device, cpu), then destinations (device, nvme);
    # links sorted by (source tier, destination tier): device->nvme, then cpu->device
    assert list(sankey.node.label) == ["from device: 40 B", "from cpu: 400 B", "to device: 400 B", "to nvme: 40 B"]
    assert list(sankey.link.source) == [0, 1] and list(sankey.link.target) == [3, 2]
    assert list(sankey.link.value) == [40, 400]
    bars = {t.name: t for t in fig.data if isinstance(t, go.Bar)}
    assert list(bars["measured"].x) == ["device -> nvme", "cpu -> device"]
    # ms per rank over 2 ranks: measured 1.0 s and 1.0 s; modelled 0.02 s and 0.2 s
    assert list(bars["measured"].y) == pytest.approx([500.0, 500.0])
    assert list(bars["modelled"].y) == pytest.approx([10.0, 100.0])


def test_budget_figure_values() -> None:
    rows = [
        {"method": "A", "budget": 3000, "step_s": 0.003, "modelled_s": 0.0003, "bytes": 10},
        {"method": "B", "budget": 500, "step_s": 0.010, "modelled_s": 0.002, "bytes": 20},
        {"method": "A", "budget": 1000, "step_s": 0.005, "modelled_s": 0.0005, "bytes": 10},
        {"method": "A", "budget": 2000, "step_s": 0.004, "modelled_s": 0.0004, "bytes": 10},
    ]
    fig = budget_figure(rows, "sweep")
    assert [t.name for t in fig.data] == ["A: step measured", "A: moves modelled", "B: step measured",
                                          "B: moves modelled"]
    a_step, a_moves, b_step, b_moves = fig.data
    assert list(a_step.x) == [1.0, 2.0, 3.0] and list(a_moves.x) == [1.0, 2.0, 3.0]  # KB, budgets sorted
    assert list(a_step.y) == pytest.approx([5.0, 4.0, 3.0]) and list(a_moves.y) == pytest.approx([0.5, 0.4, 0.3])
    assert list(b_step.x) == [0.5] and list(b_step.y) == pytest.approx([10.0])
    assert list(b_moves.y) == pytest.approx([2.0])
    assert a_step.line.color == a_moves.line.color != b_step.line.color
    assert a_moves.line.dash == "dot" and a_step.line.dash is None


def test_finish_extra_figures(tmp_path: Path) -> None:
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    out = Console(file=io.StringIO(), width=100)
    path = finish([tiered()], tmp_path / "report.html", out, extra_figures=[("budget < 1 KB sweep", fig)])
    assert path == tmp_path / "report.html"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # written whole: no temporary file left
    page = path.read_text(encoding="utf-8")
    heading = "<h2>budget &lt; 1 KB sweep</h2>"
    assert page.count(heading) == 1 and 'id="fig-extra-0"' in page
    at = page.index(heading)
    assert page.index('<table class="summary">') < at < page.index("<h2>memory tiers:")  # right after the summary
    assert at < page.index('id="fig-extra-0"') < page.index("<h2>memory tiers:")
    plain = finish([tiered()], tmp_path / "plain.html", out).read_text(encoding="utf-8")
    assert heading not in plain and 'id="fig-extra-0"' not in plain
