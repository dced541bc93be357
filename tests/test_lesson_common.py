"""The lesson plumbing ``lessons/common.py`` holds so that no lesson copies it (issue 28, item 7): the
world-size refusal, the threads line, the shared output folder, a lesson's main, the yellow note and
the largest difference between two state dicts."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from lessons import common
from minipar.comm import launch


def test_max_difference_is_the_largest_element_gap_over_every_name() -> None:
    a = {"w": np.array([1.0, 2.0, 3.0]), "b": np.array([[0.5]])}
    b = {"w": np.array([1.0, 2.25, 3.0]), "b": np.array([[-0.5]])}
    assert common.max_difference(a, b) == 1.0
    assert common.max_difference(a, a) == 0.0
    with pytest.raises(AssertionError):
        common.max_difference(a, {"w": a["w"]})


def test_print_note_prints_one_yellow_line_only_when_there_is_a_note() -> None:
    buf = io.StringIO()
    out = Console(file=buf, width=80, color_system=None)
    common.print_note(out, None, " (the wall times).")
    assert buf.getvalue() == ""
    common.print_note(out, "4 ranks time-share 2 cores", " (the wall times).")
    common.print_note(out, "again")
    assert buf.getvalue() == "note: 4 ranks time-share 2 cores (the wall times).\nnote: again.\n"


def test_exit_if_wrong_exits_2_on_every_rank_and_rank_0_says_it(capsys: pytest.CaptureFixture[str]) -> None:
    common.exit_if_wrong(None, 0)  # nothing wrong: returns
    for rank in (0, 1):
        with pytest.raises(SystemExit) as exc:
            common.exit_if_wrong("run it on 4 ranks (got 3)", rank)
        assert exc.value.code == 2
    assert capsys.readouterr().err == "error: run it on 4 ranks (got 3)\n"


def test_say_threads_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    common.say_threads(4, "--mpi for real processes")
    assert capsys.readouterr().out == "(no mpiexec: 4 ranks run as threads of this process; --mpi for real processes)\n"


def test_shared_folder_exists_on_every_rank_once_it_returns(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b"

    def body(comm):
        return common.shared_folder(comm, folder).is_dir()

    assert launch(body, 3, "threads") == [True, True, True]


def test_run_lesson_passes_the_parsed_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = common.parse_lesson_args(common.lesson_parser(None, steps=3, ranks=2), ["--steps", "5", "--clock", "wall"])

    def run(comm, steps, clock, verbose, extra):
        return comm.size, steps, clock, verbose, extra

    got = common.run_lesson(run, args, lambda p: None, extra="x")
    assert got == (2, 5, common.Clock("wall", "local"), False, "x")
    assert common.run_lesson(run, args, lambda p: None, ranks=3, extra="y")[0] == 3
    with pytest.raises(SystemExit):
        common.run_lesson(run, args, lambda p: f"got {p}")
    assert capsys.readouterr().err == "error: got 2\n"


def test_rerun_outside_mpiexec_checks_the_size_everywhere_and_reruns_on_rank_0_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "child.py"  # exits with its argument count, 9 if it sees the enclosing job
    script.write_text("import os, sys\nsys.exit(9 if 'PMI_RANK' in os.environ else len(sys.argv) - 1)\n")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("PMI_RANK", "1")
    assert common.rerun_outside_mpiexec(script, ["--mpi"], lambda p: None) == 0  # not rank 0: nothing run
    monkeypatch.setenv("PMI_RANK", "0")
    assert common.rerun_outside_mpiexec(script, ["--out", "x", "--mpi"], lambda p: None) == 3
    with pytest.raises(SystemExit) as exc:
        common.rerun_outside_mpiexec(script, [], lambda p: f"run it on 2 ranks, got {p}")
    assert exc.value.code == 2 and capsys.readouterr().err == "error: run it on 2 ranks, got 4\n"
