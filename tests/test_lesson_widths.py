"""Lessons fit the terminal (issue 28): the width is the terminal's (``COLUMNS``, a standard stream,
the controlling terminal, else 80), no printed line is longer, and no number is cut (``widths``).

The lessons that ``test_lessons.test_the_notebooks_mpiexec_command_runs`` runs under mpiexec (01, 03 to
09) are checked there, at 80 columns, on the same runs. Here: the others (00, 02, 02b, and 10, whose
mpiexec run is ``make thorough`` only) in-process at 80 columns with small settings, every lesson
in-process at 120, and ``viz.width`` on its own (tables at 40 to 120 columns). About 70 CPU-seconds
in all. The lessons in
``SHORT`` also print at most ``widths.MAX_LINES`` lines by default (``widths.length_problems``; those run under
mpiexec: ``test_lessons.SHORT``)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console
from widths import length_problems, width_problems

from lessons import load
from minipar.testing import ROOT
from viz.width import Table, is_number, terminal_width

# (lesson, arguments, width): every lesson not run under mpiexec by test_lessons at 80; every lesson at 120
RUNS = [("00_autograd", ("--steps", "20"), 80),
        ("02_pipeline", ("--steps", "1", "--ranks", "2", "--microbatches", "4"), 80),
        ("02b_zero_bubble", ("--steps", "1", "--ranks", "2", "--microbatches", "4"), 80),
        ("10_faults", (), 80),
        ("00_autograd", ("--steps", "20"), 120),
        ("01_collectives", (), 120),
        ("02_pipeline", ("--steps", "1", "--ranks", "2", "--microbatches", "4"), 120),
        ("02b_zero_bubble", ("--steps", "1", "--ranks", "2", "--microbatches", "4"), 120),
        ("03_data_parallel", ("--steps", "2"), 120),
        ("04_tensor_parallel", (), 120),
        ("05_sequence_parallel", (), 120),
        ("06_zero", ("--steps", "2"), 120),
        ("07_offload", ("--steps", "2"), 120),
        ("08_hybrid", ("--steps", "2"), 120),
        ("09_sharding", (), 120),
        ("10_faults", (), 120),
        ("11_precision", (), 120)]
SHORT = ("00_autograd", "02_pipeline", "02b_zero_bubble")  # default output within widths.MAX_LINES lines at 80


@pytest.mark.parametrize("name,args,width", RUNS)
def test_a_lesson_fits_the_terminal(name: str, args: tuple[str, ...], width: int, tmp_path, monkeypatch,
                                    capsys) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.chdir(tmp_path)  # the lesson writes runs/<lesson>/ here
    monkeypatch.setattr(sys, "argv", [f"lessons/{name}/lesson.py", *args])
    load(name).main()
    out = capsys.readouterr().out
    assert "report:" in out
    assert not width_problems(out, width), "\n".join(width_problems(out, width))
    if name in SHORT and width == 80:
        assert not length_problems(out), "\n".join(length_problems(out)) + "\n" + out


def test_the_width_is_columns_else_the_terminal_else_80() -> None:
    code = "from viz.width import terminal_width; print(terminal_width())"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    # no terminal at all: pipes and a new session (no controlling terminal)
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                           stdin=subprocess.DEVNULL, start_new_session=True, timeout=60)
    assert alone.stdout.strip() == "80", alone.stderr
    told = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "COLUMNS": "97"},
                          cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True, timeout=60)
    assert told.stdout.strip() == "97", told.stderr


def test_columns_is_honoured_in_process(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "123")
    assert terminal_width() == 123


def _states_table() -> Table:
    table = Table(title="model states per rank (bytes) when the optimizer step begins", caption="the caption",
                  key=2)
    for col in ("method", "N", "parameters measured", "gradients measured", "optimizer measured", "total",
                "formula"):
        table.add_column(col, justify="left" if col == "method" else "right")
    table.add_row("ZeRO-3 / FSDP, units gathered with prefetch", "2", "157,286,400", "39,321,600", "1,887,436,800",
                  "2,084,044,800", "2,084,044,800")
    table.add_row("DDP", "4", "314,572,800", "314,572,800", "3,774,873,600", "4,404,019,200", "4,404,019,200")
    return table


def _printed(table: Table, width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(table)
    return buf.getvalue()


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_a_table_keeps_its_numbers_whole_wraps_its_text_and_splits_when_it_must(width: int) -> None:
    text = _printed(_states_table(), width)
    assert not width_problems(text, width), "\n".join(width_problems(text, width))
    for number in ("157,286,400", "1,887,436,800", "4,404,019,200"):
        assert number in text, text
    parts = text.count("(continued)")
    assert (parts == 0) == (width >= 120), text  # split only when the numbers do not fit side by side
    assert text.count("the caption") == 1 and text.rstrip().endswith("the caption")
    if parts:  # each part repeats the key columns
        assert text.count("DDP") == parts + 1


def test_a_number_wider_than_the_line_is_cut_and_the_check_sees_it() -> None:
    text = _printed(_states_table(), 14)
    assert any("a number cut" in p for p in width_problems(text, 14)), text


def test_what_counts_as_a_number() -> None:
    for text in ("157,286,400", "0.5 ms", "3.2x", "1,024 / 1,024", "4 3 2 1", "3 (3)", "1.2e-05", "12.3%", "10.1 MB"):
        assert is_number(text), text
    for text in ("pipedream", "F0 B0", "1F1B", "r0-2 1,572,864", "yes", "v=2", ""):
        assert not is_number(text), text
