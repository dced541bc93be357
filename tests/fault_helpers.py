"""Helpers for tests/test_faults.py: run a job whose ranks may die (``faults.mpiexec_command``), and
the rank functions of the chaos tests (parameter server, DDP, ZeRO-3 with checkpoints). A rank that
dies writes ``killed<rank>`` (the time it killed itself); a survivor that catches ``PeerLost``
writes ``lost<rank>`` (the time, the dead rank, the message) before it re-raises."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import minipar
from minipar import datasets
from minipar import functional as F
from minipar.comm import PeerLost, faults
from minipar.nn import MLP, Module
from minipar.optim import SGD
from minipar.testing import ROOT

SIZES = [4, 8, 2]
X, Y = datasets.regression(8 * 6, SIZES[0], SIZES[-1], seed=5)


@dataclass
class Job:
    """What one faulty job left: exit code, wall seconds, output, results and notes by rank."""

    returncode: int
    wall: float
    stdout: str
    stderr: str
    results: dict[int, Any] = field(default_factory=dict)
    killed: dict[int, float] = field(default_factory=dict)  # rank -> time.monotonic() of its kill
    lost: dict[int, tuple[float, int, str]] = field(default_factory=dict)  # rank -> (time, dead, message)
    ckpt_step: int | None = None  # meta "step" of the complete checkpoint in outdir/ckpt (consolidated)
    leftovers: list[str] = field(default_factory=list)  # outdir's ckpt.tmp-X / ckpt.old-X siblings


def run_job(fn: Any, n: int, deadline: float, timeout: float = 60, **kwargs: Any) -> Job:
    """``fn(comm, outdir=..., **kwargs)`` on ``n`` ranks under ``mpiexec -disable-auto-cleanup``."""
    with tempfile.TemporaryDirectory(prefix="minipar-faults-") as tmp:
        argsfile, outdir = Path(tmp) / "args.pkl", Path(tmp) / "out"
        outdir.mkdir()
        kwargs = {**kwargs, "outdir": str(outdir)}
        argsfile.write_bytes(pickle.dumps({"kwargs": pickle.dumps(kwargs), "path": [str(Path(__file__).parent)]}))
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", MINIPAR_PEER_DEADLINE=str(deadline),
                   MINIPAR_TIMEOUT=str(max(20.0, 4 * deadline)),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]))
        cmd = faults.mpiexec_command(n, [sys.executable, "-m", "minipar.testing", f"{fn.__module__}:{fn.__qualname__}",
                                         str(argsfile), str(outdir)])
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        job = Job(proc.returncode, time.monotonic() - start, proc.stdout, proc.stderr)
        for f in outdir.iterdir():
            if f.name.startswith("rank") and f.suffix == ".pkl":
                job.results[int(f.stem[4:])] = pickle.loads(f.read_bytes())
            elif f.name.startswith("killed"):
                job.killed[int(f.name[6:])] = float(f.read_text())
            elif f.name.startswith("lost"):
                job.lost[int(f.name[4:])] = pickle.loads(f.read_bytes())
        job.leftovers = sorted(f.name for f in outdir.iterdir() if f.name.startswith("ckpt."))
        if (outdir / "ckpt").exists():
            from minipar.parallel.zero import checkpoint

            job.ckpt_step = checkpoint.consolidate(outdir / "ckpt")[1]["step"]  # checks every file's sha256
        return job


def die(comm: Any, outdir: str) -> None:
    """Note the time, then SIGKILL this rank."""
    Path(outdir, f"killed{comm.rank}").write_text(repr(time.monotonic()))
    faults.kill(comm)


def noting_loss(comm: Any, outdir: str, body: Any) -> Any:
    """``body()``; a ``PeerLost`` is noted (time, dead rank, message) and re-raised."""
    try:
        return body()
    except PeerLost as exc:
        Path(outdir, f"lost{comm.rank}").write_bytes(pickle.dumps((time.monotonic(), exc.rank, str(exc))))
        raise


# ---- a busy rank ----------------------------------------------------------------------------------
def busy_rank(comm: Any, outdir: str, busy: float) -> tuple[float, float, dict[int, float]]:
    """Rank 0 computes for ``busy`` seconds (numpy matmuls in a Python loop: each BLAS call releases
    the GIL, and between calls the interpreter switches threads every 5 ms, so the heartbeat thread
    beats) while the others wait in an all-reduce; returns (the sum, rank 0's compute seconds, this
    rank's declared-dead table)."""
    comm.barrier()
    held = 0.0
    if comm.rank == 0:
        a = np.random.default_rng(0).normal(size=(120, 120))
        t = time.monotonic()
        while time.monotonic() - t < busy:
            a = np.tanh(a @ a.T / 120)
        held = time.monotonic() - t
    total = float(comm.allreduce(np.ones(2) * (comm.rank + 1))[0])
    det = comm.state.detector
    return total, held, {r: s for r, (_, _, s) in det.dead.items()}


# ---- parameter server ------------------------------------------------------------------------------
def ps_loss(model: Module, x: np.ndarray, y: np.ndarray) -> minipar.Tensor:
    return F.mse_loss(model(minipar.Tensor(x)), minipar.Tensor(y))


def ps_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    i = step % 4
    return X[12 * i:12 * (i + 1)], Y[12 * i:12 * (i + 1)]


def ps_rank(comm: Any, outdir: str, mode: str, n_servers: int, steps: int, victim: int, at: int,
            shrink: bool = False) -> Any:
    from minipar.parallel import param_server as ps

    def body() -> Any:
        return ps.train(comm, MLP(SIZES, seed=1), ps_loss, ps_batch, steps, n_servers=n_servers, mode=mode,
                        optimizer=lambda params: SGD(params, lr=0.1), silence_timeout=15.0, shrink=shrink,
                        die_at={victim: at}, slow=dict.fromkeys(range(n_servers, comm.size), 0.02))

    if comm.rank == victim:  # note the time of the kill that ps.train's die_at makes
        kill = faults.kill
        faults.kill = lambda c: (Path(outdir, f"killed{c.rank}").write_text(repr(time.monotonic())),  # type: ignore
                                 kill(c))
    result = noting_loss(comm, outdir, body)
    det = comm.state.detector
    return result, {r: t for r, (t, _, _) in det.dead.items()}


# ---- a pipeline (tests/chaos_train.py) --------------------------------------------------------------
PIPE_SIZES, PIPE_ROWS, PIPE_LR = [4, 6, 6, 6, 6, 2], 8, 0.05  # 5 layers: any 1-5 stages


def pipe_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s whole batch for the chaos pipeline (from the step alone: a restart sees the same)."""
    rng = np.random.default_rng([7, step])
    return rng.normal(size=(PIPE_ROWS, PIPE_SIZES[0])), rng.normal(size=(PIPE_ROWS, PIPE_SIZES[-1]))


# ---- DDP ------------------------------------------------------------------------------------------
def ddp_rank(comm: Any, outdir: str, steps: int, victim: int, at: int) -> list[float]:
    from minipar.parallel.ddp import DistributedDataParallel, train_step

    model = MLP(SIZES, seed=2)
    ddp = DistributedDataParallel(model, comm)
    opt = SGD(model.parameters(), lr=0.05)
    losses = []

    def body() -> list[float]:
        for step in range(steps):
            if comm.rank == victim and step == at:
                die(comm, outdir)
            losses.append(train_step(ddp, opt, ps_loss, *ps_batch(step)))
        return losses

    return noting_loss(comm, outdir, body)


# ---- ZeRO-3 with a checkpoint per step --------------------------------------------------------------
def zero3_rank(comm: Any, outdir: str, steps: int, victim: int, at: int, mid_save: bool) -> int:
    """FSDP on a tiny GPT, a checkpoint into ``outdir/ckpt`` after every step; the victim dies at step
    ``at``: in the middle of writing its checkpoint file when ``mid_save``, else before the step."""
    from minipar import nn
    from minipar.parallel.zero import checkpoint
    from minipar.parallel.zero.fsdp import FullyShardedDataParallel

    model = nn.GPT(5, 3, 4, 2, 1, seed=3)
    fsdp = FullyShardedDataParallel(model, comm, lr=1e-2)
    ckpt = str(Path(outdir, "ckpt"))
    if comm.rank == victim and mid_save:
        write = checkpoint._write_file

        def half_then_die(path: Path, data: bytes) -> None:
            if fsdp_step[0] == at:
                write(path, data[:len(data) // 2])
                die(comm, outdir)
            write(path, data)

        checkpoint._write_file = half_then_die
    fsdp_step = [0]

    def body() -> int:
        for step in range(steps):
            fsdp_step[0] = step
            if comm.rank == victim and step == at and not mid_save:
                die(comm, outdir)
            x, y = np.random.default_rng([3, step]).integers(0, 5, (2, 2 * comm.size, 3))
            k = 2
            loss = model.loss(x[comm.rank * k:(comm.rank + 1) * k], y[comm.rank * k:(comm.rank + 1) * k])
            fsdp.backward(loss)
            fsdp.step()
            fsdp.save_checkpoint(ckpt)
        return steps

    return noting_loss(comm, outdir, body)


# ---- pipeline, tensor and sequence parallelism ---------------------------------------------------------
def model_parallel_rank(comm: Any, outdir: str, paradigm: str, steps: int, victim: int, at: int) -> int:
    """Train ``steps`` steps of a tiny model split across the ranks (``paradigm``: "pipeline" 1F1B on an
    MLP, "tensor" Megatron with sequence parallelism, "sequence" ring attention); the victim dies
    before step ``at``."""
    from minipar.optim import AdamW

    rng = np.random.default_rng(4)
    if paradigm == "pipeline":
        from minipar.parallel.pipeline import Pipeline, mlp

        pipe = Pipeline(comm, mlp([4] + [6] * comm.size + [2], seed=4), "1f1b", microbatches=2 * comm.size)
        opt = SGD(pipe.parameters(), lr=0.05)

        def one(step: int) -> None:
            pipe.step(rng.normal(size=(4 * comm.size, 4)), rng.normal(size=(4 * comm.size, 2)), opt)
    else:
        if paradigm == "tensor":
            from minipar.parallel.tensor.model import TensorParallelGPT

            model: Any = TensorParallelGPT(6, 3, 6, 3, 1, comm, sequence_parallel=True, seed=4)
        else:
            from minipar.parallel.sequence.model import SequenceParallelGPT

            model = SequenceParallelGPT(6, 2 * comm.size, 6, 3, 1, comm, method="ring", seed=4)
        adam = AdamW(model.parameters(), lr=1e-2)

        def one(step: int) -> None:
            x, y = rng.integers(0, 6, (2, 2, model.seq_len if paradigm == "tensor" else 2 * comm.size))
            if paradigm == "sequence":
                x, y = model.shard(x), model.shard(y)
            adam.zero_grad()
            model.loss(x, y).backward()
            model.sync_grads()
            adam.step()

    def body() -> int:
        for step in range(steps):
            if comm.rank == victim and step == at:
                die(comm, outdir)
            one(step)
        return steps

    return noting_loss(comm, outdir, body)
