"""Lesson 10's three runs, each a function every rank calls (threads or mpiexec alike), returning on
rank 0 a plain dict the lesson prints; and the elastic loop's launcher on the threads backend.

- ``ps_part``: asynchronous parameter server, rank 0 the server, ranks 1-3 workers; worker
  ``PS_VICTIM`` killed (``die_at``) before pushing step ``PS_KILL``.
- ``ddp_part``: DDP on every rank with a checkpoint after each step; rank ``DDP_VICTIM`` killed
  before step ``DDP_KILL``; the survivors catch ``PeerLost`` and say where they were.
- ``elastic_part``: one run of the elastic job (DDP + AdamW, a sharded checkpoint per step, the global
  batch kept by gradient accumulation); the first run loses rank ``EL_VICTIM`` before step ``EL_KILL``.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

from minipar import datasets, elastic, launch, trace
from minipar.comm import faults
from minipar.comm.errors import PeerLost
from minipar.nn import GPT
from minipar.optim import SGD, AdamW
from minipar.parallel import param_server as ps
from minipar.parallel.ddp import DistributedDataParallel, train_step
from viz.width import terminal_width

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH = 16, 8, 16, 2, 1, 12
DEADLINE = 0.5  # MINIPAR_PEER_DEADLINE on threads (seconds): one heartbeat thread beats for all, no false alarm
MPI_DEADLINE = 1.0  # under mpiexec: processes time-share the cores, a heartbeat may be late (the tests' 1 s)
PS_STEPS, PS_VICTIM, PS_KILL, STALENESS, PS_LR, SLOW = 14, 2, 4, 2, 0.5, 0.02  # SLOW: seconds of work per step
DDP_STEPS, DDP_VICTIM, DDP_KILL = 4, 2, 2
EL_STEPS, EL_RANKS, EL_VICTIM, EL_KILL, MICRO = 4, 3, 1, 2, 2
LR, WD = 1e-2, 0.01
STREAM = datasets.token_stream(20_000, VOCAB, seed=0)


def model() -> GPT:
    """The tiny GPT every run starts from (seed 0); its loss ``GPT.loss(model, x, y)``."""
    return GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, seed=0)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (the same on every rank and in every run)."""
    return datasets.lm_batch(STREAM, BATCH, SEQ, step=step)


def heard_everyone(comm: Any, limit: float = 5.0) -> None:
    """Wait until this rank's failure detector has heard every peer once: a peer never heard yet gets
    twice the deadline (it may still be starting), and the lesson measures the steady-state detection."""
    det, end = comm.state.detector, time.monotonic() + limit
    while det is not None and len(det.met) < len(det.last) and time.monotonic() < end:
        time.sleep(0.01)


# ---- (a) the asynchronous parameter server ------------------------------------------------------------
def ps_part(comm: Any, out: Path) -> dict[str, Any]:
    """1 server, 3 workers, async with staleness ``STALENESS``; every worker works ``SLOW`` s a step."""
    path = out / "ps_async.json"
    meta = {k: v for k, v in ps.run_meta(model(), comm.size, 1, PS_STEPS, "async", STALENESS).items()
            if not k.startswith("expected")}  # the no-failure bytes formula: a killed worker pushes less
    workers = range(1, comm.size)
    heard_everyone(comm)
    with trace.record(path, comm, lesson="10_faults", victim=PS_VICTIM, kill_step=PS_KILL, **meta):
        result = ps.train(comm, model(), GPT.loss, batch, PS_STEPS, n_servers=1, mode="async", staleness=STALENESS,
                          optimizer=lambda params: SGD(params, lr=PS_LR), slow=dict.fromkeys(workers, SLOW),
                          die_at={PS_VICTIM: PS_KILL})
    rows = comm.gather_object(result, survivors=True)
    if comm.rank != 0:
        return {}
    server = rows[0]
    _, losses = ps.merge([r for r in rows if r is not None])
    return {"applied": server.applied, "dropped": server.dropped, "losses": losses, "trace": str(path),
            "pushed": {r: len(rows[r].losses) for r in workers if rows[r] is not None}}


# ---- (b) synchronous DDP: fail fast ---------------------------------------------------------------------
def ddp_part(comm: Any, out: Path) -> dict[str, Any]:
    """DDP + AdamW with a sharded checkpoint after each step; rank ``DDP_VICTIM`` dies before step
    ``DDP_KILL``; each survivor stops with ``PeerLost`` (a "PeerLost" mark: operation, dead rank)."""
    path, ckpt = out / "ddp.json", out / "ddp_ckpt"
    m = model()
    ddp, opt = DistributedDataParallel(m, comm), AdamW(m.parameters(), lr=LR, weight_decay=WD)
    stopped = None
    heard_everyone(comm)
    with trace.record(path, comm, lesson="10_faults", paradigm="DDP", victim=DDP_VICTIM, kill_step=DDP_KILL):
        for step in range(DDP_STEPS):
            if comm.rank == DDP_VICTIM and step == DDP_KILL:
                faults.kill(comm)
            try:
                train_step(ddp, opt, GPT.loss, *batch(step))
                elastic.save_ddp(ckpt, ddp, opt, {"step": step + 1})
            except PeerLost as exc:
                trace.mark("PeerLost", dead=exc.rank, operation=exc.operation)
                stopped = {"rank": comm.rank, "dead": exc.rank, "operation": exc.operation, "message": str(exc)}
                break
    rows = comm.gather_object(stopped, survivors=True)
    if comm.rank != 0:
        return {}
    return {"stopped": [r for r in rows if r is not None], "trace": str(path), "ckpt": str(ckpt)}


# ---- (c) the elastic restart ------------------------------------------------------------------------------
def elastic_part(comm: Any, out: Path, ckpt: Path, info: elastic.Restart, kill: bool = True) -> dict[str, Any]:
    """One run of the elastic job: resume from ``ckpt`` if it holds a complete checkpoint, train to
    ``EL_STEPS`` with the global batch kept (``elastic.accumulation``), checkpoint after every step.
    ``kill``: the first run (``info.count == 0``) loses rank ``EL_VICTIM`` before step ``EL_KILL``.
    Returns ``status`` (0, or 1 after ``PeerLost``), where it resumed and, when done, the parameters."""
    acc = elastic.accumulation(BATCH, comm.size, MICRO)
    m = model()
    ddp, opt = DistributedDataParallel(m, comm), AdamW(m.parameters(), lr=LR, weight_decay=WD)
    start = int(elastic.load_ddp(ckpt, ddp, opt)["step"]) if elastic.checkpoint_exists(ckpt, comm) else 0
    victim = kill and info.count == 0 and comm.rank == EL_VICTIM
    path = out / f"elastic_run{info.count}.json" if kill else None
    status, losses = 0, []
    heard_everyone(comm)
    with trace.record(path, comm, lesson="10_faults", paradigm=f"DDP, elastic run {info.count}",
                      accumulation=acc, resumed_at=start):
        for step in range(start, EL_STEPS):
            if victim and step == EL_KILL:
                faults.kill(comm)
            try:
                losses.append(train_step(ddp, opt, GPT.loss, *batch(step), accumulation=acc))
                elastic.save_ddp(ckpt, ddp, opt, {"step": step + 1})
            except PeerLost as exc:
                trace.mark("PeerLost", dead=exc.rank, operation=exc.operation)
                status = 1
                break
    return {"status": status, "run": info.count, "ranks": comm.size, "start": start, "accumulation": acc,
            "losses": losses, "trace": None if path is None else str(path),
            "params": {n: p.data.copy() for n, p in m.named_parameters()} if status == 0 else None}


def threads_launcher(out: Path, ckpt: Path, kill: bool, runs: list[dict[str, Any]]) -> elastic.Launcher:
    """``elastic.elastic_loop``'s launcher on the threads backend: one ``launch`` per run; a rank that
    ``faults.kill`` ended returns nothing and is recorded as killed by SIGKILL (status 137), as the
    status shell records a killed process under ``minipar run --elastic``. Rank 0's dict of each run is
    appended to ``runs``."""

    def run(n: int, env: dict[str, str]) -> elastic.RunResult:
        t0 = time.monotonic()
        rows = launch(elastic_part, n, "threads", deadline=DEADLINE, out=out, ckpt=ckpt,
                      info=elastic.restart_info(env), kill=kill)
        runs.append(rows[0])
        statuses = {r: elastic.LOST_STATUS + 9 if row is None else row["status"] for r, row in enumerate(rows)}
        return elastic.RunResult(n, max(statuses.values()), statuses, time.monotonic() - t0)

    return run


def elastic_threads(out: Path, log: Any = print) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The elastic job on threads: ``elastic_loop`` from ``EL_RANKS`` ranks (a kill, then a restart on the
    survivors), and the uninterrupted run on ``EL_RANKS`` ranks; rank 0's dict of every run."""
    runs: list[dict[str, Any]] = []
    for name in ("elastic_ckpt", "reference_ckpt"):
        _clear(out / name)
    elastic.elastic_loop(EL_RANKS, threads_launcher(out, out / "elastic_ckpt", True, runs), max_restarts=1,
                         log=lambda line: log(textwrap.fill(f"minipar run (threads): {line}", terminal_width(),
                                                            subsequent_indent="  ")))
    reference = launch(elastic_part, EL_RANKS, "threads", deadline=DEADLINE, out=out, ckpt=out / "reference_ckpt",
                       info=elastic.restart_info({}), kill=False)[0]
    return runs, reference


def _clear(ckpt: Path) -> None:
    """Remove an earlier lesson run's checkpoint (and its siblings) so the job starts fresh."""
    import shutil

    for p in ckpt.parent.glob(f"{ckpt.name}*"):
        shutil.rmtree(p) if p.is_dir() else os.remove(p)
