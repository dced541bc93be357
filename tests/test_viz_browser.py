"""The HTML report in a real browser: headless Debian chromium renders it and we read the DOM.

Checks: every figure drew its plot SVG (``main-svg``), each timeline has one row per rank
(y tick labels "rank 0".."rank N-1") and its bars carry the micro-batch labels, and no JavaScript
error was raised (the page writes them into ``<html data-js-errors>``; a page with a deliberate
error proves that check can fail). A screenshot is saved to ``runs/report.png`` as an artefact.
Skipped only when /usr/bin/chromium is absent (``bash scripts/install-chromium.sh`` installs it).
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess

import pytest
from viz_traces import one_f_one_b, ring_allreduce

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


def test_report_renders_in_chromium(tmp_path):
    out = tmp_path / "report.html"
    report.write_report([one_f_one_b(), ring_allreduce(p=3)], out, titles=["1F1B p=2 m=4", "ring p=3"])
    dom = _chromium(tmp_path, out.as_uri(), "--dump-dom")
    assert _errors(dom) == []
    figs = _figures(dom)
    assert sorted(figs) == sorted(["fig-compare"] + [f"fig-{i}-{k}" for i in (0, 1)
                                                     for k in ("timeline", "traffic", "memory")])
    for name, fig_dom in figs.items():
        assert 'class="main-svg"' in fig_dom, f"{name} drew no plot SVG"
    assert _ticks(figs["fig-0-timeline"]) == ["rank 0", "rank 1"]
    assert _ticks(figs["fig-1-timeline"]) == ["rank 0", "rank 1", "rank 2"]
    assert _ticks(figs["fig-compare"], "y") == ["rank 0", "rank 1"]
    assert _ticks(figs["fig-compare"], "y2") == ["rank 0", "rank 1", "rank 2"]
    bar_labels = re.findall(r'class="bartext[^"]*"[^>]*>([^<]*)<', figs["fig-0-timeline"])
    assert sorted(bar_labels) == sorted(f"{k}{mb}" for k in "FB" for mb in range(4) for _ in range(2))
    heat_labels = re.findall(r'>(3\.9 KiB|2\.3 KiB)<', figs["fig-0-traffic"])
    assert sorted(heat_labels) == ["2.3 KiB", "3.9 KiB"]  # 4 x 600 B and 4 x 1000 B

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
