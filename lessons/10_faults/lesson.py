"""Lesson 10: faults. A rank is killed on purpose, three times: the parameter server carries on, DDP
stops at once naming the dead rank, and the elastic job restarts smaller from its last checkpoint.

    python lessons/10_faults/lesson.py            # ranks as threads in one process
    python lessons/10_faults/lesson.py --mpi      # real processes: a rank SIGKILLs itself
    mpiexec -n 4 python lessons/10_faults/lesson.py   # the same as --mpi (rank 0 starts the runs)

A plain ``mpiexec`` (MPICH's Hydra) kills every rank when one dies, so the lesson starts its own:
``faults.mpiexec_command`` (``-disable-auto-cleanup``, each rank under a small shell) for part 1,
``minipar run --elastic`` for parts 2 and 3. A survivor's failure detector (``minipar.comm.detector``)
declares a peer dead after ``MINIPAR_PEER_DEADLINE`` seconds without its heartbeat (0.5 s on threads,
1 s under mpiexec; a heartbeat every fifth of it).

1. Asynchronous parameter server (Li et al. 2014; staleness k = 2, Ho et al. 2013): worker 2 of 3 dies
   before pushing step 4; the others run k steps ahead of its clock, wait until the server drops it,
   then go on: every (worker, step) applied exactly once, the loss still falling.
2. DDP on 4 ranks, a checkpoint after every step: rank 2 dies before step 2; every survivor stops in
   the all-reduce with ``PeerLost`` naming it, within the deadline.
3. The same job under the elastic loop (torchrun's restart; DeepSpeed's fixed global batch) restarts on
   2 ranks (``--restart-n 2``: the batch of 8 splits over 4 or 2 ranks, not 3), which load step 2's
   checkpoint re-cut for 2 and run 2 micro-batches of 2 where 4 ranks ran 1. Recursive doubling adds
   micro-batch pairs, then pairs of pairs, on 4 ranks as on 2, and every scale is a power of two: the
   final parameters equal an uninterrupted run's exactly.
By default one table of the three parts, the DDP timeline (a dead lane ends in X, a survivor's "peer
declared dead" is !) and the conclusion; ``--verbose`` adds the workers' updates, the other timelines,
the elastic loop's log and, with ``--mpi``, the launchers' ``Killed`` lines (a rank's shell reporting
its SIGKILL). Writes runs/10_faults/*.json and report.html (``--out`` to choose the folder).
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from lessons import common
from lessons.common import console as make_console
from minipar import elastic, launch, trace
from minipar.cli_args import int_in
from minipar.comm import faults
from minipar.comm.detector import detection_window, heartbeat_period, wait_heard
from minipar.comm.errors import PeerLost
from minipar.comm.mpi import under_mpiexec
from minipar.comm.startup import outside_mpiexec_env
from minipar.nn import GPT
from minipar.optim import SGD, AdamW
from minipar.parallel import param_server as ps
from minipar.parallel.ddp import DistributedDataParallel, train_step
from viz.faults import after_kill, longest_wait
from viz.terminal import print_timeline
from viz.width import Table, terminal_width

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH = 16, 8, 16, 2, 1, 12
DEADLINE, MPI_DEADLINE = 0.5, 1.0  # MINIPAR_PEER_DEADLINE (s) on threads / under mpiexec (cores time-shared)
RANKS = 4  # every part's first run
PS_STEPS, PS_VICTIM, PS_KILL, STALENESS, PS_LR, SLOW = 14, 2, 4, 2, 0.5, 0.02  # SLOW: seconds of work a step
STEPS, VICTIM, KILL, RESTART, GLOBAL_BATCH, MICRO = 4, 2, 2, 2, 8, 2  # parts 2 and 3: one DDP job
LR, WD = 1e-2, 0.01
OUT = Path("runs/10_faults")
HERE = Path(__file__).resolve()


def model() -> GPT:
    """The tiny GPT every run starts from (seed 0)."""
    return GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, seed=0)


# ---- the three runs: every rank calls them (threads or mpiexec alike); rank 0 returns a plain dict ------
def ps_part(comm: Any, out: Path) -> dict[str, Any]:
    """1 server, 3 workers, async with staleness ``STALENESS``; worker ``PS_VICTIM`` dies before pushing ``PS_KILL``."""
    path = out / "ps_async.json"
    meta = {k: v for k, v in ps.run_meta(model(), comm.size, 1, PS_STEPS, "async", STALENESS).items()
            if not k.startswith("expected")}  # the no-failure bytes formula: a killed worker pushes less
    workers = range(1, comm.size)
    wait_heard(comm)  # every peer heard once: the lesson measures the steady-state detection
    with trace.record(path, comm, lesson="10_faults", victim=PS_VICTIM, kill_step=PS_KILL, **meta):
        result = ps.train(comm, model(), GPT.loss, lambda s: common.lm_batch(s, VOCAB, BATCH, SEQ), PS_STEPS,
                          n_servers=1, mode="async", staleness=STALENESS, optimizer=lambda w: SGD(w, lr=PS_LR),
                          slow=dict.fromkeys(workers, SLOW), die_at={PS_VICTIM: PS_KILL})
    rows = comm.gather_object(result, survivors=True)
    if comm.rank != 0:
        return {}
    return {"applied": rows[0].applied, "updates": rows[0].updates(), "dropped": rows[0].dropped, "trace": str(path),
            "losses": ps.merge([r for r in rows if r is not None])[1],
            "pushed": {r: len(rows[r].losses) for r in workers if rows[r] is not None}}


def ddp_job(comm: Any, out: Path, ckpt: Path, info: elastic.Restart, kill: bool = True) -> dict[str, Any]:
    """One run of the DDP job (parts 2 and 3): resume from ``ckpt`` if complete, train to ``STEPS`` keeping
    the global batch (``elastic.accumulation``), checkpoint every step. With ``kill`` its first run loses
    rank ``VICTIM`` before step ``KILL`` and the survivors stop on ``PeerLost``. Returns this rank's
    ``status`` (1 after ``PeerLost``), where the run resumed, the parameters when done and, on rank 0,
    where each survivor ``stopped``."""
    acc = elastic.accumulation(GLOBAL_BATCH, comm.size, MICRO)
    m = model()
    ddp = DistributedDataParallel(m, comm, algorithm="recursive_doubling")
    opt = AdamW(m.parameters(), lr=LR, weight_decay=WD)
    start = int(elastic.load_ddp(ckpt, ddp, opt)["step"]) if elastic.checkpoint_exists(ckpt, comm) else 0
    path = out / f"ddp_run{info.count}.json" if kill else None
    stopped, losses = None, []
    wait_heard(comm)
    with trace.record(path, comm, lesson="10_faults", paradigm=f"DDP, run {info.count}", accumulation=acc,
                      resumed_at=start):
        for step in range(start, STEPS):
            if kill and info.count == 0 and comm.rank == VICTIM and step == KILL:
                faults.kill(comm)
            try:
                x, y = common.lm_batch(step, VOCAB, GLOBAL_BATCH, SEQ)  # the global batch, the same in every run
                losses.append(train_step(ddp, opt, GPT.loss, x, y, accumulation=acc))
                elastic.save_ddp(ckpt, ddp, opt, {"step": step + 1})
            except PeerLost as exc:
                trace.mark("PeerLost", dead=exc.rank, operation=exc.operation)
                stopped = {"rank": comm.rank, "dead": exc.rank, "operation": exc.operation, "message": str(exc)}
                break
    rows = [r for r in comm.gather_object(stopped, survivors=True) or [] if r is not None]
    return {"status": int(stopped is not None), "run": info.count, "ranks": comm.size, "start": start,
            "accumulation": acc, "losses": losses, "trace": None if path is None else str(path), "stopped": rows,
            "params": {n: p.data.copy() for n, p in m.named_parameters()} if stopped is None else None}


def clear(out: Path) -> None:
    """Remove an earlier run's checkpoints and pickles from ``out`` (traces are replaced whole)."""
    for p in [*out.glob("*_ckpt*"), *out.glob("*.pkl")]:
        shutil.rmtree(p) if p.is_dir() else os.remove(p)


def run_threads(out: Path, verbose: bool = False) -> dict[str, Any]:
    """Every part on the threads backend (deadline ``DEADLINE``): rank 0's dicts."""
    clear(out)
    ps_res = launch(ps_part, RANKS, "threads", deadline=DEADLINE, out=out)[0]
    runs: list[dict[str, Any]] = []
    say = (lambda line: print(textwrap.fill(f"minipar run (threads): {line}", terminal_width(), subsequent_indent="  "))
           ) if verbose else (lambda line: None)
    launcher = elastic.threads_launcher(ddp_job, runs, deadline=DEADLINE, out=out, ckpt=out / "ddp_ckpt")
    elastic.elastic_loop(RANKS, launcher, max_restarts=1, restart_n=RESTART, log=say)
    reference = launch(ddp_job, RANKS, "threads", deadline=DEADLINE, out=out, ckpt=out / "reference_ckpt",
                       info=elastic.restart_info({}), kill=False)[0]
    return {"ps": ps_res, "runs": runs, "reference": reference}


# ---- as real processes ------------------------------------------------------------------------------------
def run_mpi(out: Path, verbose: bool = False) -> dict[str, Any]:
    """Part 1 under ``faults.mpiexec_command``, the DDP job under ``minipar run --elastic`` and its
    uninterrupted reference under a plain ``mpiexec``. Their output (the shells' ``Killed`` lines, the
    loop's log) is shown with ``--verbose``, or when a part wrote no result."""
    clear(out)
    if verbose:
        print(textwrap.fill("Two lines 'Killed' will appear below, one per kill, printed by the shell mpiexec "
                            "starts each rank under when its rank dies by SIGKILL: the lesson's own kills.",
                            terminal_width()), flush=True)
    env = {"MINIPAR_PEER_DEADLINE": str(MPI_DEADLINE), **outside_mpiexec_env()}  # the lesson's deadline unless set
    me, bindir, said = [sys.executable, str(HERE), "--out", str(out)], Path(sys.executable).parent, []
    for cmd in (faults.mpiexec_command(RANKS, [*me, "--part", "ps"]),
                [str(bindir / "minipar"), "run", "--elastic", "-n", str(RANKS), "--max-restarts", "1",
                 "--restart-n", str(RESTART), str(HERE), "--out", str(out), "--part", "ddp"],
                [str(bindir / "mpiexec"), "-n", str(RANKS), *me, "--part", "ddp", "--no-kill"]):
        proc = subprocess.run(cmd, env=env, timeout=180, capture_output=not verbose, text=True)
        said.append((proc.stdout or "") + (proc.stderr or ""))
    try:
        got = {name: pickle.loads((out / f"{name}.pkl").read_bytes()) for name in ("ps", "reference")}
    except FileNotFoundError as exc:
        print("".join(said), file=sys.stderr)
        raise SystemExit(f"error: a part wrote no result ({exc.filename}); its output is above") from None
    return {**got, "runs": [pickle.loads(p.read_bytes()) for p in sorted(out.glob("ddp_run*.pkl"))]}


def child(part: str, out: Path, kill: bool) -> int:
    """One part on this mpiexec rank; rank 0 pickles its dict into ``out``. Returns the exit status."""
    from minipar.comm import world

    comm = world()
    if part == "ddp":
        info = elastic.restart_info()
        res = ddp_job(comm, out, out / ("ddp_ckpt" if kill else "reference_ckpt"), info, kill)
        name = f"ddp_run{info.count}" if kill else "reference"
    else:
        res, name = ps_part(comm, out), "ps"
    if comm.rank == 0:
        (out / f"{name}.pkl").write_bytes(pickle.dumps(res))
    return int(res.get("status", 0)) if part == "ddp" else 0


# ---- what the runs show (measured from their traces) --------------------------------------------------------
def lesson(res: dict[str, Any], out: Path, verbose: bool = False) -> list[str]:
    """Print the three parts' numbers, the DDP timeline and the conclusion; write the report. Returns what
    did not hold."""
    console = make_console()
    if verbose:
        common.print_note(console, common.time_sharing(RANKS))
    # 1. the parameter server
    pst = trace.load(res["ps"]["trace"])
    (declared, args), = after_kill(pst, "peer declared dead").values()
    d, got, pushed = args["deadline"], res["ps"]["updates"], res["ps"]["pushed"]
    beat, window = heartbeat_period(d), "{:.2f}..{:.2f}".format(*detection_window(d))  # when a detection is due
    workers = sorted({*pushed, PS_VICTIM})
    want = {w: PS_KILL if w == PS_VICTIM else PS_STEPS for w in workers}
    losses = res["ps"]["losses"]
    ok_ps = all(got.get(w, []) == list(range(want[w])) for w in workers) and losses[-1] < losses[0]
    waited, at = max(longest_wait(pst, w) for w in workers if w != PS_VICTIM)
    # 2. DDP, the job's first run
    runs = res["runs"]
    ddpt = trace.load(runs[0]["trace"])
    said, stopped = after_kill(ddpt, "peer declared dead"), after_kill(ddpt, "PeerLost")
    rows = sorted(runs[0]["stopped"], key=lambda r: r["rank"])
    ok_ddp = len(rows) == RANKS - 1 and all(
        r["dead"] == VICTIM and said[r["rank"]][0] <= stopped[r["rank"]][0] <= d + 2 * beat for r in rows)
    stops = [s for s, _ in stopped.values()]
    # 3. its restart
    diff = common.max_difference(runs[-1]["params"], res["reference"]["params"])
    shape = [(r["ranks"], r["start"]) for r in runs]
    left = sorted(p.name for p in out.glob("ddp_ckpt.*"))  # a crashed save's leftovers
    ok_el = diff == 0.0 and shape == [(RANKS, 0), (RESTART, KILL)] and not left
    console.print(Table.of(f"a rank killed three times (delays after the kill: seconds, wall clock; deadline {d} s, "
                           f"a heartbeat every {beat:.2f} s)", ("part", "killed", "then", "delay", "expected"), [
        ("1. async param. server", f"worker {PS_VICTIM} before step {PS_KILL}",
         f"dropped; {len(res['ps']['applied'])} updates applied in {PS_STEPS} steps", f"{declared:.3f}", window),
        ("2. DDP", f"rank {VICTIM} of {RANKS} before step {KILL}", f"{len(rows)} survivors stop (PeerLost)",
         f"{min(stops):.3f}..{max(stops):.3f}", window),
        ("3. elastic restart", "-", f"on {runs[-1]['ranks']} ranks from step {runs[-1]['start']}", "-", "-")], text=3))
    if verbose:
        console.print(Table.of("1. updates per worker: each (worker, step) applied once, in step order",
                               ("worker", "pushed", "applied", "expected", "steps applied"),
                               [(str(w), "killed" if w == PS_VICTIM else str(pushed.get(w)), str(len(got.get(w, []))),
                                 str(want[w]), f"{got[w][0]}..{got[w][-1]}" if got.get(w) else "-") for w in workers]))
        console.print("loss per step (mean over the workers that ran it): " + " ".join(f"{x:.3f}" for x in losses),
                      highlight=False)
        print_timeline(pst, console=console, title=f"1. async parameter server: worker {PS_VICTIM} killed (X), the "
                       "server's detector declares it dead (!)")
    titles = [f"2. DDP, rank {VICTIM} killed: every survivor stops", f"1. async parameter server, worker {PS_VICTIM} "
              f"killed", f"3. the DDP job restarted on {RESTART} ranks"]
    common.finish([runs[0]["trace"], res["ps"]["trace"], *(r["trace"] for r in runs[1:])], out / "report.html", console,
           titles=titles, brief=not verbose)
    for text in (
        "1. No lost and no doubled update: every worker's steps were applied exactly once, in order; the killed "
        f"worker's step {PS_KILL} was never pushed. The others ran up to k = {STALENESS} steps ahead of its clock, "
        f"then waited {waited:.2f} s (wall clock) before step {at}, until the server dropped it; the loss still "
        f"falls: {losses[0]:.3f} at step 0, {losses[-1]:.3f} at step {len(losses) - 1}." if ok_ps else
        "[red]1. updates missing or doubled, or the loss did not fall[/red] (--verbose shows them)",
        f"2. All {len(rows)} survivors stopped within the deadline, naming rank {VICTIM}." if ok_ddp else
        "[red]2. a DDP survivor did not stop in time[/red]",
        f"3. The loop restarted the job on {RESTART} ranks from step {runs[-1]['start']}'s checkpoint, the last "
        f"complete one (each shard's checksum verified as it loaded; leftovers of crashed saves: {len(left)}). Final "
        f"parameters after {STEPS} steps vs the uninterrupted run on {RANKS} ranks: max |difference| {diff:.1e} "
        "(equal: the same sums in the same order, scaled by powers of two)." if ok_el else
        f"[red]3. elastic: runs {shape}, max |difference| {diff:.1e} [/red]"):
        console.print(text, highlight=False)
    console.print(common.reading_path("10_faults"), highlight=False)
    problems = [what for what, ok in (("parameter server: updates lost or doubled, or the loss did not fall", ok_ps),
                                      ("DDP: a survivor did not stop in time", ok_ddp),
                                      (f"elastic: runs {shape}, max difference {diff:.1e}", ok_el)) if not ok]
    for problem in problems:
        console.print(f"[red]did not hold:[/red] {problem}", highlight=False)
    return problems


def check_ranks(p: int) -> str | None:
    if p != RANKS:
        return (f"lesson 10 runs 1 parameter server + 3 workers, then DDP, on {RANKS} ranks: run it on {RANKS} "
                f"(mpiexec -n {RANKS}), got {p}")
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int_in(1, common.MAX_RANKS), default=RANKS,
                        help=f"ranks when not under mpiexec (threads; {RANKS})")
    parser.add_argument("--mpi", action="store_true", help="run the parts as real processes (mpiexec)")
    parser.add_argument("--out", default=str(OUT), help="folder for the traces and the report")
    parser.add_argument("--verbose", action="store_true", help="every part's table and timeline, the launchers' output")
    parser.add_argument("--part", choices=("ps", "ddp"), help=argparse.SUPPRESS)  # a child rank
    parser.add_argument("--no-kill", action="store_true", help=argparse.SUPPRESS)
    return common.parse_lesson_args(parser, argv, lambda a: None if a.part else check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out)
    if args.part:
        return child(args.part, out, not args.no_kill)
    if under_mpiexec():  # a plain mpiexec -n 4: rank 0 runs the lesson with --mpi, its own launchers
        return common.rerun_outside_mpiexec(HERE, [*argv, "--mpi"], check_ranks)
    out.mkdir(parents=True, exist_ok=True)
    if not args.mpi:
        common.say_threads(RANKS, "--mpi for real processes")
    res = run_mpi(out, args.verbose) if args.mpi else run_threads(out, args.verbose)
    return 1 if lesson(res, out, args.verbose) else 0


if __name__ == "__main__":
    sys.exit(main())
