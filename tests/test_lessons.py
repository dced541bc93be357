"""Every lesson starts alike: its natural number of ranks in-process (said in one line), ``--ranks``,
and a wrong world size reported once, by rank 0, before any work, under mpiexec and in-process. And
every lesson whose walkthrough notebook (threads) shows its ``mpiexec`` command runs under it here, its
output within 80 columns and no number cut (``widths``; the other lessons: ``test_lesson_widths``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from strategies import thorough_only
from widths import length_problems, width_problems

from minipar.testing import ROOT, mpiexec_path

WIDTH = 80  # COLUMNS of every run: an 80-column terminal (test_the_notebooks_mpiexec_command_runs checks the fit)

LESSONS = {"01_collectives": 1, "02_pipeline": 3, "02b_zero_bubble": 1, "03_data_parallel": 2, "04_tensor_parallel": 3,
           "05_sequence_parallel": 3, "06_zero": 3, "07_offload": 3, "08_hybrid": 3, "09_sharding": 4, "10_faults": 3,
           "11_precision": 3}


# lesson: (mpiexec ranks, arguments, what the run writes, relative to the run's folder); the commands
# the notebooks show in their last section ("{out}" is the run's folder)
MPI_RUNS = {"01_collectives": (4, ("--n", "65536", "--reps", "2", "--out", "{out}"), "trace.json"),
            "03_data_parallel": (4, ("--steps", "4", "--out", "{out}"), "report.html"),
            "04_tensor_parallel": (4, ("--steps", "2"), "runs/04_tensor_parallel/report.html"),
            "05_sequence_parallel": (4, (), "runs/05_sequence_parallel/report.html"),
            "06_zero": (4, ("--steps", "2"), "runs/06_zero/report.html"),
            "07_offload": (2, (), "runs/07_offload/report.html"),
            "08_hybrid": (8, (), "runs/08_hybrid/report.html"),
            "09_sharding": (8, (), "runs/09_sharding/report.html"),
            "10_faults": (4, ("--out", "{out}"), "report.html"),
            "11_precision": (2, (), "runs/11_precision/report.html")}


def lesson(name: str, *args: str, ranks: int | None = None, cwd: Path = ROOT,
           timeout: float = 120, width: int = WIDTH) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "lessons" / name / "lesson.py"), *args]
    if ranks is not None:
        cmd = [str(mpiexec_path()), "-n", str(ranks), *cmd]
    env = {**{k: v for k, v in os.environ.items() if k != "FORCE_COLOR"}, "OPENBLAS_NUM_THREADS": "1", "NO_COLOR": "1",
           "COLUMNS": str(width)}  # under mpiexec too: the ranks get the environment
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


# every lesson checks its world size through lessons.common.parse_lesson_args / run_ranks: by default three
# lessons prove it under mpiexec (one rank, two, and lesson 10's own launcher), all of them in-process below
UNDER_MPIEXEC = ("02b_zero_bubble", "03_data_parallel", "10_faults")


@pytest.mark.mpi
@pytest.mark.parametrize("name,bad", [pytest.param(n, b, marks=[] if n in UNDER_MPIEXEC else [thorough_only(
    "the same lessons.common check as the three lessons run by default")]) for n, b in LESSONS.items()])
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


def test_a_lesson_runs_blas_on_one_thread_per_rank_unless_told() -> None:
    code = "from lessons.common import blas_threads; print(blas_threads(1), blas_threads(2))"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert alone.stdout.split() == ["1", "2"], alone.stderr  # numpy's OpenBLAS took each setting
    told = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**env, "OPENBLAS_NUM_THREADS": "3"})
    assert told.stdout.split() == ["None", "None"], told.stderr  # the variable wins


def test_in_process_run_says_so_in_one_line(tmp_path) -> None:
    proc = lesson("01_collectives", "--n", "64", "--reps", "0", "--out", str(tmp_path), "--ranks", "3")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("(no mpiexec: 3 ranks run as threads of this process")
    assert "on 3 ranks" in proc.stdout and (tmp_path / "report.html").exists()


def test_times_are_replayed_by_default_and_the_wall_clock_one_flag_away(tmp_path) -> None:
    base = ("--n", "64", "--reps", "1", "--out", str(tmp_path), "--ranks", "2")
    # wide enough that the table's "ms / formula" header is one line (at 80 columns it wraps)
    replayed, wall = (lesson("01_collectives", *base, width=160),
                      lesson("01_collectives", *base, "--clock", "wall", width=160))
    assert replayed.returncode == wall.returncode == 0, replayed.stderr + wall.stderr
    assert "time replayed: one core per rank, network local" in " ".join(replayed.stdout.split())
    assert "ms / formula" in replayed.stdout and "; replayed: one core per rank" in replayed.stdout
    assert "time wall clock, as recorded" in " ".join(wall.stdout.split()) and "ms / formula" not in wall.stdout
    page = (tmp_path / "report.html").read_text()  # the last run's (wall clock): the replay a button away
    assert '"method":"update"' in page and "replayed on local" in page


@pytest.mark.parametrize("name", ["02_pipeline", "03_data_parallel", "08_hybrid"])
def test_an_unknown_cluster_is_one_line_before_any_work(name: str) -> None:
    proc = lesson(name, "--cluster", "warp-drive")
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "no cluster preset 'warp-drive'" in proc.stderr.splitlines()[-1]


# what each lesson's replayed comparison prints (its formula beside it), under mpiexec
REPLAYED = {"03_data_parallel": ("after B", "replayed: one core per rank, network local"),
            "05_sequence_parallel": ("the formula's wait for it", "replayed, no rank waited more than"),
            "07_offload": ("step replayed", "the steps waited"),
            "08_hybrid": ("predicted / replayed", "Goal: predicted / replayed within 15 %")}


# lessons whose default output is checked to be short (widths.MAX_LINES lines at 80 columns) on the run below
SHORT = ("01_collectives", "03_data_parallel", "04_tensor_parallel", "05_sequence_parallel", "06_zero", "07_offload",
         "08_hybrid", "11_precision")


# lessons whose mpiexec run is a long demonstration of what other tests prove under mpiexec
LONG = {"10_faults": "real SIGKILLs of a parameter-server worker, a DDP rank and an elastic job's rank are "
                     "tests/test_faults.py, test_elastic.py and test_chaos.py (19 CPU-seconds, 4 mpiexec jobs)"}


@pytest.mark.mpi
@pytest.mark.parametrize("name", [pytest.param(n, marks=([pytest.mark.mpi8] if MPI_RUNS[n][0] == 8 else [])
                                               + ([thorough_only(LONG[n])] if n in LONG else []))
                                  for n in MPI_RUNS])
def test_the_notebooks_mpiexec_command_runs(name: str, tmp_path) -> None:
    ranks, args, written = MPI_RUNS[name]
    proc = lesson(name, *(a.format(out=tmp_path) for a in args), ranks=ranks, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert (tmp_path / written).exists()
    assert not width_problems(proc.stdout, WIDTH), "\n".join(width_problems(proc.stdout, WIDTH))  # fits 80 columns
    if name in SHORT:
        assert not length_problems(proc.stdout), "\n".join(length_problems(proc.stdout)) + "\n" + proc.stdout
    text = " ".join(proc.stdout.split())
    assert all(words in text for words in REPLAYED.get(name, ())), proc.stdout[-3000:]
    if name == "06_zero":  # FSDP1 beside FSDP2: both as cost.zero's formulas
        assert "All as cost.zero's formulas." in text, proc.stdout[-3000:]
    if name == "08_hybrid":
        assert "Every rank's bytes on every axis equal the formula." in proc.stdout
    if name == "09_sharding":  # the seed table, Megatron as annotations, 1-D / 2.5-D / 3-D: all as the formulas
        text = " ".join(proc.stdout.split())
        for sentence in ("All 16 pairs run;", "Every product equals numpy's and every rank's measured bytes the "
                         "prediction.",
                         "Annotated and hand-written send the same bytes, the formula's.",
                         "Measured equals the formula for every layout.",
                         "16,384 bytes per rank; dynamic programming over the chain moves X to rows first: 1,024. "
                         "Both sent as predicted, both equal numpy's."):
            assert sentence in text, proc.stdout[-3000:]
    if name == "10_faults":  # real SIGKILLs: updates accounted, survivors stopped in time, the restart exact
        text = " ".join(proc.stdout.split())
        assert "No lost and no doubled update" in text and "naming rank 2." in text, proc.stdout[-3000:]
        assert float(re.search(r"max \|difference\| (\S+) ", text).group(1)) < 1e-10
