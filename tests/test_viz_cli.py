"""``minipar view``: outputs, and bad input -> one clear line on stderr, exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from viz_traces import one_f_one_b, ring_allreduce

from minipar import cli
from minipar.trace import VERSION, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def traces(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save(one_f_one_b(), a)
    save(ring_allreduce(), b)
    return str(a), str(b)


def _bad_files(tmp_path):
    truncated = tmp_path / "truncated.json"
    good = tmp_path / "good.json"
    save(one_f_one_b(), good)
    truncated.write_text(good.read_text()[:200])
    newer = tmp_path / "newer.json"
    doc = json.loads(good.read_text())
    doc["version"] = VERSION + 1
    newer.write_text(json.dumps(doc))
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    bad_meta = tmp_path / "bad_meta.json"
    bad_meta.write_text(json.dumps({**json.loads(good.read_text()), "meta": [1, 2]}))
    bad_field = tmp_path / "bad_field.json"
    doc = json.loads(good.read_text())
    doc["events"][3]["t0"] = "soon"
    bad_field.write_text(json.dumps(doc))
    return {
        "missing": (str(tmp_path / "nope.json"), "no such trace file"),
        "truncated": (str(truncated), "truncated or corrupt"),
        "newer": (str(newer), f"version {VERSION + 1} is newer"),
        "not a trace": (str(other), "not a minipar trace"),
        "bad metadata": (str(bad_meta), "malformed trace metadata"),
        "bad field type": (str(bad_field), "malformed trace event #3 (rank must be an int, name a string"),
    }


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    for path, words in _bad_files(tmp_path).values():
        outputs = (["--terminal"], ["-o", str(tmp_path / "r.html")], ["--chrome", str(tmp_path / "c.json")])
        for extra in outputs:
            assert cli.main(["view", path, *extra]) == 2
            out, err = capsys.readouterr()
            assert out == ""
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("minipar: error: ") and words in lines[0], err
            assert path in lines[0]
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "c.json").exists()


def test_bad_options_are_one_line_and_exit_2(traces, tmp_path, capsys):
    cases = [
        ([], "no command given"),
        (["view"], "the following arguments are required: TRACE"),
        (["view", *traces, "--chrome", str(tmp_path / "c.json")], "--chrome exports one trace, got 2"),
        (["view", traces[0], "--width", "abc"], "invalid int value"),
        (["view", traces[0], "--width", "10"], "too narrow"),
        (["view", *traces, "--title", "x"], "got 1 --title for 2 traces"),
        (["view", traces[0], "-o", str(tmp_path / "no" / "dir" / "r.html")], "cannot write output"),
    ]
    for argv, words in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (argv, err)


def test_no_traceback_from_the_console_entry(tmp_path):
    bad = tmp_path / "truncated.json"
    bad.write_text('{"format": "minipar-trace", "version": 1, "events": [')
    proc = subprocess.run([sys.executable, "-m", "minipar.cli", "view", str(bad), "--terminal"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"minipar: error: {bad}: not a readable trace (truncated or corrupt JSON: ")


def test_view_writes_report_chrome_and_terminal(traces, tmp_path, capsys):
    html, chrome = tmp_path / "r.html", tmp_path / "c.json"
    assert cli.main(["view", *traces, "-o", str(html)]) == 0
    page = html.read_text()
    assert re.search(r"<script[^>]*\bsrc=", page) is None  # plotly.js inline, nothing fetched
    # 3 figures per trace; a schedule in unit costs and a ring in seconds share no time axis (no side by side)
    assert page.count('class="plotly-graph-div"') == 3 + 3 and "side by side" not in page
    assert cli.main(["view", traces[0], "--chrome", str(chrome)]) == 0
    events = json.loads(chrome.read_text())["traceEvents"]
    assert sum(e.get("name") in ("F0", "F1", "F2", "F3") for e in events) == 8
    capsys.readouterr()
    assert cli.main(["view", traces[0], "--terminal", "--width", "48"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["pipeline, 1f1b, 2 ranks, hand-made", "step 15 units, bubble 20.0%"]
    assert sum(line.startswith("rank 0 F0") for line in out) == 1 and max(map(len, out)) <= 48


def test_a_directory_names_the_traces_inside(traces, tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    save(one_f_one_b(), tmp_path / "sub" / "c.json")
    (tmp_path / "notes.json").write_text('{"not": "a trace"}')
    assert cli.main(["view", str(tmp_path), "--terminal"]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert out == "" and line.startswith(f"minipar: error: {tmp_path} is a directory; give one or more trace files")
    listed = line.split("traces inside: ")[1].rstrip(")").split(", ")
    assert listed == [traces[0], traces[1], str(tmp_path / "sub" / "c.json")]  # notes.json is no trace
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["view", str(empty)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no minipar traces in it; give a trace file, e.g. runs/02_pipeline/1f1b.json" in line


def test_unwritable_outputs_fail_before_anything_is_written(traces, tmp_path, capsys):
    html = tmp_path / "r.html"
    cases = [
        (["-o", str(html), "--chrome", str(tmp_path / "no" / "c.json")],
         f"cannot write output {tmp_path / 'no' / 'c.json'} (--chrome): directory {tmp_path / 'no'} does not exist"),
        (["-o", str(tmp_path)], f"cannot write output {tmp_path} (-o): {tmp_path} is a directory; give a file name"),
    ]
    for extra, words in cases:
        assert cli.main(["view", traces[0], *extra]) == 2
        out, err = capsys.readouterr()
        (line,) = err.strip().splitlines()
        assert out == "" and words in line, line
    assert not html.exists()  # the report, which could be written, was not: nothing half done


def test_a_directory_gives_no_traceback_from_the_console_entry(traces, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minipar.cli", "view", str(tmp_path), "--terminal"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"minipar: error: {tmp_path} is a directory")
