"""The HTML report in a real browser: headless Debian chromium renders it and we read the DOM.

Checks: every figure drew its plot SVG (``main-svg``); a timeline has a compute lane and a comm
lane per rank (y tick labels "rank r compute" / "rank r comm"), its compute bars carry the
micro-batch labels and its comm lane one labelled span per collective call ("allreduce ring 5.9
KiB"), with the individual messages and arrows in the legend but hidden; a simulated schedule is a
grid of micro-batch numbers with its stash counts under it and no traffic panel; each trace's
metadata is a folded ``<details>`` block; and no JavaScript error was raised (the page writes them
into ``<html data-js-errors>``; a page with a deliberate error proves that check can fail). A
screenshot is saved to ``runs/report.png`` as an artefact.
Skipped only when /usr/bin/chromium is absent (``bash scripts/install-chromium.sh`` installs it).
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess

import pytest
from viz_traces import one_f_one_b, ring_allreduce, simulated

from viz import report

CHROMIUM = "/usr/bin/chromium"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In CI the browser must be there (make test installs it): a silent skip would hide a broken report.
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                reason="Debian chromium not installed; run: bash scripts/install-chromium.sh")


def _chromium(tmp_path, url: str, *mode: str) -> str:
    profile = tmp_path / f"profile{len(list(tmp_path.iterdir()))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--virtual-time-budget=10000", *mode, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _errors(dom: str) -> list[str]:
    attr = re.search(r'<html[^>]*\bdata-js-errors="([^"]*)"', dom)
    assert attr is not None, "the page lost its data-js-errors attribute"
    return json.loads(html.unescape(attr.group(1)))


def _figures(dom: str) -> dict[str, str]:
    """Each figure's DOM, from its div to the next figure's div."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'<div id="(fig-[^"]+)"', dom)]
    ends = [s for s, _ in starts[1:]] + [len(dom)]
    return {name: dom[s:e] for (s, name), e in zip(starts, ends, strict=True)}


def _ticks(fig_dom: str, axis: str = "y") -> list[str]:
    return re.findall(rf'class="{axis}tick"><text[^>]*>([^<]*)</text>', fig_dom)


def _bar_texts(fig_dom: str) -> list[str]:
    return re.findall(r'class="bartext[^"]*"[^>]*>(?:<tspan[^>]*>)?([^<]*)<', fig_dom)


def _legend(fig_dom: str) -> dict[str, bool]:
    """Legend entry -> shown (Plotly draws a legend-only trace's entry at half opacity)."""
    item = r'<g class="traces"[^>]*style="opacity: ([0-9.]+);">.*?class="legendtext"[^>]*>([^<]*)<'
    items = re.findall(item, fig_dom)
    return {html.unescape(text): float(opacity) == 1.0 for opacity, text in items}


def test_report_renders_in_chromium(tmp_path):
    out = tmp_path / "report.html"
    traces = [one_f_one_b(), ring_allreduce(p=4, n=4000), simulated("interleaved", 4, 8, 2)]
    report.write_report(traces, out, titles=["1F1B p=2 m=4", "ring p=4", "interleaved simulated"])
    dom = _chromium(tmp_path, out.as_uri(), "--window-size=1280,4000", "--dump-dom")
    assert _errors(dom) == []
    figs = _figures(dom)
    assert sorted(figs) == sorted(["fig-compare", "fig-2-schedule"]
                                  + [f"fig-{i}-{k}" for i in (0, 1) for k in ("timeline", "traffic", "memory")])
    for name, fig_dom in figs.items():
        assert 'class="main-svg"' in fig_dom, f"{name} drew no plot SVG"
    # each rank has a compute lane and a communication lane when it does both
    assert _ticks(figs["fig-0-timeline"]) == [f"rank {r} {lane}" for r in range(2) for lane in ("compute", "comm")]
    assert _ticks(figs["fig-1-timeline"]) == [f"rank {r} {lane}" for r in range(4) for lane in ("compute", "comm")]
    assert _ticks(figs["fig-compare"], "y") == _ticks(figs["fig-0-timeline"])
    # side by side: the two schedules in unit costs (the ring, in seconds, shares no axis with them)
    assert _ticks(figs["fig-compare"], "y2") == [f"rank {r}" for r in range(4)]  # simulated: no comm lane
    assert sorted(t for t in _bar_texts(figs["fig-0-timeline"]) if t[0] in "FB") == sorted(
        f"{k}{mb}" for k in "FB" for mb in range(4) for _ in range(2))
    # one labelled span per rank for the ring all-reduce: op, algorithm and the 6000 B each rank sent
    assert [t for t in _bar_texts(figs["fig-1-timeline"]) if "allreduce" in t] == ["allreduce ring 5.9 KiB"] * 4
    legend = _legend(figs["fig-1-timeline"])  # messages and arrows: legend entries, drawn when clicked
    assert legend == {"optimizer": True, "allreduce ring": True, "messages (steps)": False,
                      "send -> recv arrows": False}
    heat_labels = re.findall(r'>(3\.9 KiB|2\.3 KiB)<', figs["fig-0-traffic"])
    assert sorted(heat_labels) == ["2.3 KiB", "3.9 KiB"]  # 4 x 600 B and 4 x 1000 B
    # the simulated schedule: a unit grid of micro-batch numbers, no empty traffic panel, stash counts
    cells = _bar_texts(figs["fig-2-schedule"])
    assert len(cells) == 2 * 2 * 4 * 8 and set(cells) == {str(mb) for mb in range(8)}  # F and B, v p m
    assert re.search(r'id="note-2-traffic">[^<]*carry no bytes', dom)  # a note instead of a heat map of zeros
    assert re.search(r">stashed chunk micro-batches \(1/2 of a micro-batch's activations on the rank each\) per rank",
                     html.unescape(figs["fig-2-schedule"]))  # counts of (micro-batch, chunk), under the grid
    assert 'id="note-2-memory"' not in dom  # no second stash chart, in seconds
    details = re.findall(r"<details[^>]*>\s*<summary>([^<]*)</summary>", dom)
    assert len(details) == 3 and all(d.startswith("run metadata") for d in details)
    assert "<details open" not in dom  # folded until asked for

    os.makedirs(os.path.join(ROOT, "runs"), exist_ok=True)
    png = os.path.join(ROOT, "runs", "report.png")
    if os.path.exists(png):
        os.remove(png)
    _chromium(tmp_path, out.as_uri(), "--hide-scrollbars", "--window-size=1400,4000", f"--screenshot={png}")
    with open(png, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(head[16:20], "big") == 1400  # width from the IHDR chunk


def test_error_hook_catches_a_javascript_error(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(f'<!DOCTYPE html><html data-js-errors="[]"><head>{report._ERROR_HOOK}</head>'
                    "<body><script>undefinedFunction();</script></body></html>")
    errors = _errors(_chromium(tmp_path, page.as_uri(), "--dump-dom"))
    assert len(errors) == 1 and "undefinedFunction" in errors[0]
