"""Every lesson starts alike: its natural number of ranks in-process (said in one line), ``--ranks``,
and a wrong world size reported once, by rank 0, before any work, under mpiexec and in-process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minipar.testing import ROOT, mpiexec_path

LESSONS = {"01_collectives": 1, "02_pipeline": 3, "02b_zero_bubble": 1, "03_data_parallel": 2, "04_tensor_parallel": 3,
           "05_sequence_parallel": 3, "06_zero": 3, "07_offload": 3, "08_hybrid": 3}


def lesson(name: str, *args: str, ranks: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "lessons" / name / "lesson.py"), *args]
    if ranks is not None:
        cmd = [str(mpiexec_path()), "-n", str(ranks), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.mpi
@pytest.mark.parametrize("name,bad", LESSONS.items())
def test_a_wrong_world_size_is_reported_once_under_mpiexec(name: str, bad: int) -> None:
    proc = lesson(name, ranks=bad)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert f"got {bad}" in errors[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("name,bad", LESSONS.items())
def test_a_wrong_ranks_option_is_reported_once_in_process(name: str, bad: int) -> None:
    proc = lesson(name, "--ranks", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.count("error: ") == 1 and f"got {bad}" in proc.stderr
    assert "threads" not in proc.stdout  # rejected before any rank starts


def test_in_process_run_says_so_in_one_line(tmp_path) -> None:
    proc = lesson("01_collectives", "--n", "64", "--reps", "0", "--out", str(tmp_path), "--ranks", "3")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("(no mpiexec: 3 ranks run as threads of this process")
    assert "on 3 ranks" in proc.stdout and (tmp_path / "report.html").exists()
