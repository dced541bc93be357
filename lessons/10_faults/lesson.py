"""Lesson 10: faults. A worker is killed on purpose, three times: the parameter server carries on, DDP
stops at once naming the dead rank, and the elastic job restarts smaller from its last checkpoint.

    python lessons/10_faults/lesson.py            # ranks as threads in one process
    python lessons/10_faults/lesson.py --mpi      # real processes: a rank SIGKILLs itself
    mpiexec -n 4 python lessons/10_faults/lesson.py   # the same as --mpi (rank 0 starts the runs)

Why the lesson starts mpiexec itself: under a plain ``mpiexec`` MPICH's Hydra kills every rank when
one dies. ``faults.mpiexec_command`` runs ``mpiexec -disable-auto-cleanup`` with each rank under a
small shell, so the survivors outlive the dead one; ``minipar run --elastic`` does the same and
restarts the job (``minipar.elastic``). A survivor learns of the death from its failure detector
(``minipar.comm.detector``): a peer whose heartbeats stop for ``MINIPAR_PEER_DEADLINE`` seconds
(0.5 s on threads, 1 s under mpiexec unless set; heartbeats every fifth of it) is declared dead, so
detection takes the deadline, give or take a heartbeat period.

1. Asynchronous parameter server (Li et al., OSDI 2014; staleness bound k = 2, Ho et al. 2013): rank
   0 serves, ranks 1-3 work; worker 2 is killed before pushing step 4. The others may run k steps
   ahead of its frozen clock, then wait until the server's detector declares it dead and drops it;
   then they go on alone. Printed: every worker's pushes against the server's applied updates (each
   (worker, step) applied exactly once: no lost, no doubled update), the loss still falling, and the
   stall. 2. DDP (synchronous): rank 2 is killed before step 2; every survivor stops inside the
   all-reduce with ``PeerLost`` naming rank 2 and the operation, within the deadline (measured from
   the trace: the kill, each "peer declared dead"); the checkpoint on disk is the last complete one.
3. The elastic job (torchrun's restart, DeepSpeed's fixed global batch): 3 ranks lose rank 1 before
   step 2; the loop restarts 2 ranks, which load the sharded checkpoint re-cut for 2 and run 3
   micro-batches of 2 where 3 ranks ran 2: the same global batch of 12, so the final parameters equal
   an uninterrupted run's (max difference printed). Timelines: a dead lane ends in X, a survivor's
   "peer declared dead" is !; the HTML report draws them as a red cross and red ticks.
With ``--mpi`` three lines ``Killed`` appear among the output, one per part: the shell each rank runs
under (above) reports that its rank died by SIGKILL. The lesson says so before they appear.
Writes runs/10_faults/*.json and report.html (``--out`` to choose the folder).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from lessons.common import MAX_RANKS, finish, parse_lesson_args, time_sharing
from lessons.common import console as make_console
from minipar import elastic, launch
from minipar.cli_args import int_in
from minipar.comm import faults
from minipar.comm.mpi import under_mpiexec
from viz.width import terminal_width

P = importlib.import_module("lessons.10_faults.parts")
show = importlib.import_module("lessons.10_faults.show")
RANKS = 4  # parts 1 and 2 (part 3 starts on P.EL_RANKS)
KILLED_NOTE = ("Three lines 'Killed' will appear below, one per part: each is printed by the small shell that "
               "mpiexec starts a rank under (faults.mpiexec_command, minipar run --elastic), when the rank it "
               "runs dies by SIGKILL. They are the lesson's own kills, on purpose: the launcher's words, not a "
               "crash of the lesson.")
OUT = Path("runs/10_faults")
HERE = Path(__file__).resolve()


def check_ranks(p: int) -> str | None:
    if p != RANKS:
        return (f"lesson 10 runs 1 parameter server + 3 workers, then DDP, on {RANKS} ranks: run it on {RANKS} "
                f"(the elastic part starts on {P.EL_RANKS}), got {p}")
    return None


def clear(out: Path) -> None:
    """Remove an earlier run's checkpoints and pickles from ``out`` (traces are replaced whole)."""
    for p in [*out.glob("*_ckpt*"), *out.glob("*.pkl")]:
        shutil.rmtree(p) if p.is_dir() else os.remove(p)


# ---- the runs on threads, or as real processes ---------------------------------------------------------
def run_threads(out: Path, log: Any = print) -> dict[str, Any]:
    """Every part on the threads backend (deadline ``P.DEADLINE``): rank 0's dicts."""
    clear(out)
    ps_res = launch(P.ps_part, RANKS, "threads", deadline=P.DEADLINE, out=out)[0]
    ddp_res = launch(P.ddp_part, RANKS, "threads", deadline=P.DEADLINE, out=out)[0]
    runs, reference = P.elastic_threads(out, log)
    return {"ps": ps_res, "ddp": ddp_res, "runs": runs, "reference": reference, "backend": "threads"}


def _env() -> dict[str, str]:
    """This environment without the variables of an enclosing mpiexec (a nested one must not see
    them), with the lesson's peer deadline unless one is set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDI_", "HYDRA_"))}
    env.setdefault("MINIPAR_PEER_DEADLINE", str(P.MPI_DEADLINE))
    return env


def run_mpi(out: Path) -> dict[str, Any]:
    """Every part as real processes: ``faults.mpiexec_command`` for parts 1 and 2, ``minipar run
    --elastic`` for part 3 and a plain ``mpiexec`` for its uninterrupted reference."""
    clear(out)
    print(textwrap.fill(KILLED_NOTE, terminal_width()), flush=True)
    me, env = [sys.executable, str(HERE), "--out", str(out)], _env()
    for part in ("ps", "ddp"):
        subprocess.run(faults.mpiexec_command(RANKS, [*me, "--part", part]), env=env, timeout=180)
    bindir = Path(sys.executable).parent
    subprocess.run([str(bindir / "minipar"), "run", "--elastic", "-n", str(P.EL_RANKS), "--max-restarts", "1",
                    str(HERE), "--out", str(out), "--part", "elastic"], env=env, timeout=300)
    subprocess.run([str(bindir / "mpiexec"), "-n", str(P.EL_RANKS), *me, "--part", "elastic", "--no-kill"],
                   env=env, timeout=180)
    got = {name: pickle.loads((out / f"{name}.pkl").read_bytes()) for name in ("ps", "ddp", "reference")}
    runs = [pickle.loads(p.read_bytes()) for p in sorted(out.glob("elastic_run*.pkl"))]
    return {**got, "runs": runs, "backend": "mpi"}


def child(part: str, out: Path, kill: bool) -> int:
    """One part on this mpiexec rank; rank 0 pickles its dict into ``out``. Returns the exit status."""
    from minipar.comm import world

    comm = world()
    if part == "elastic":
        info = elastic.restart_info()
        res = P.elastic_part(comm, out, out / ("elastic_ckpt" if kill else "reference_ckpt"), info, kill)
        name = f"elastic_run{info.count}" if kill else "reference"
    else:
        res, name = (P.ps_part if part == "ps" else P.ddp_part)(comm, out), part
    if comm.rank == 0:
        (out / f"{name}.pkl").write_bytes(pickle.dumps(res))
    return int(res.get("status", 0)) if part == "elastic" else 0


# ---- the lesson -------------------------------------------------------------------------------------------
def lesson(res: dict[str, Any], out: Path) -> list[str]:
    """Print the three parts' numbers and timelines; write the report. Returns what did not hold."""
    console = make_console()
    note = time_sharing(RANKS)
    if note:
        console.print(f"[yellow]note:[/yellow] {note}.", highlight=False)
    problems: list[str] = []
    traces = show.parameter_server(console, res["ps"], problems)
    traces += show.ddp(console, res["ddp"], problems)
    traces += show.elastic_restart(console, res["runs"], res["reference"], problems)
    console.rule("[bold]the restarted run's timeline (2 ranks, 3 micro-batches each)")
    titles = ["1. async parameter server, worker 2 killed", "2. DDP, rank 2 killed: every survivor stops",
              "3a. elastic run 0 (3 ranks), rank 1 killed", "3b. elastic run 1 (2 ranks), resumed"]
    finish(traces, out / "report.html", console, timeline=traces[-1], titles=titles[:len(traces)])
    for problem in problems:
        console.print(f"[red]did not hold:[/red] {problem}", highlight=False)
    return problems


def relaunch_under_mpiexec(argv: list[str]) -> int:
    """Started by a plain ``mpiexec -n 4``: rank 0 runs the lesson with ``--mpi`` (its own mpiexec, outside
    this one's environment); the other ranks only check the size and exit."""
    size = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    problem = check_ranks(size)
    if problem:
        if rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    if rank != 0:
        return 0
    return subprocess.run([sys.executable, str(HERE), *argv, "--mpi"], env=_env()).returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=RANKS,
                        help=f"ranks when not under mpiexec (threads; {RANKS})")
    parser.add_argument("--mpi", action="store_true", help="run the parts as real processes (mpiexec)")
    parser.add_argument("--out", default=str(OUT), help="folder for the traces and the report")
    parser.add_argument("--part", choices=("ps", "ddp", "elastic"), help=argparse.SUPPRESS)  # a child rank
    parser.add_argument("--no-kill", action="store_true", help=argparse.SUPPRESS)
    return parse_lesson_args(parser, argv, lambda a: None if a.part else check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out)
    if args.part:
        return child(args.part, out, not args.no_kill)
    if under_mpiexec():
        return relaunch_under_mpiexec(argv)
    out.mkdir(parents=True, exist_ok=True)
    if not args.mpi:
        print(textwrap.fill(f"(no mpiexec: {RANKS} ranks run as threads of this process; --mpi for real processes)",
                            terminal_width()))
    return 1 if lesson(run_mpi(out) if args.mpi else run_threads(out), out) else 0


if __name__ == "__main__":
    sys.exit(main())
