"""The chaos tests' training script (``tests/test_chaos.py``), run by ``minipar run --elastic``: DDP or
ZeRO-3 (``examples/elastic_train.py``'s trainer, a checkpoint after every step), a 1F1B pipeline, or
an asynchronous parameter server, with one fault on the first attempt (``MINIPAR_RESTART_COUNT`` 0):
rank ``--victim`` gets ``--signal`` (KILL or STOP) at ``--moment`` number ``--at``:

    start       at import, before MPI (at % 3 == 0); inside MPI's start-up, the start-up watch running (1);
                or after world(), before the first collective (2)
    step        inside a step's compute: the at-th F.linear (or, on a parameter server, SGD step)
    collective  inside the at-th wait of a communication: its messages posted, not complete
    file        between a checkpoint's files: its shard of checkpoint ``at`` written, the others not
    rename      rank 0, right after the at-th rename of a checkpoint commit (ckpt -> old, tmp -> ckpt)
    finalize    at exit: before the goodbye (at even) or after it, inside MPI_Finalize (odd)

The victim writes ``killed`` (the time, ``time.time()``) to ``--out`` before the signal. Rank 0 of
each attempt that finishes writes ``attempt<k>.pkl``: the whole parameters (and the step it resumed
at), or the parameter server's applied updates and dropped workers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--paradigm", choices=("ddp", "zero3", "pipeline", "ps"), required=True)
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--moment", choices=("start", "step", "collective", "file", "rename", "finalize"), required=True)
    p.add_argument("--at", type=int, default=0)
    p.add_argument("--signal", choices=tuple(SIGNALS), default="KILL")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


ARGS = parse()
FIRST = os.environ.get("MINIPAR_RESTART_COUNT", "0") == "0"
VICTIM = FIRST and int(os.environ.get("PMI_RANK", "-1")) == ARGS.victim


def die(*_: object) -> None:
    """Note the time, then the signal (SIGSTOP: the process freezes here until minipar run kills it)."""
    Path(ARGS.out, "killed").write_text(repr(time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), SIGNALS[ARGS.signal])


if VICTIM and ARGS.moment == "start" and ARGS.at % 3 == 0:
    die()  # before minipar, numpy or MPI are even imported

import importlib.util  # noqa: E402 -- after the fault at import
import pickle  # noqa: E402
from typing import Any  # noqa: E402

from fault_helpers import PIPE_LR, PIPE_SIZES, SIZES, pipe_batch, ps_batch, ps_loss  # noqa: E402

from minipar import functional as F  # noqa: E402
from minipar.comm import startup, world  # noqa: E402
from minipar.comm.mpi import MpiCommunicator  # noqa: E402
from minipar.elastic import accumulation, checkpoint_exists, restart_info  # noqa: E402
from minipar.optim import SGD  # noqa: E402
from minipar.parallel.zero import checkpoint  # noqa: E402
from minipar.testing import ROOT  # noqa: E402

_spec = importlib.util.spec_from_file_location("elastic_train", ROOT / "examples" / "elastic_train.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)
GLOBAL, MICRO = 12, 2


def after(count: int, fn: Any) -> Any:
    """``fn`` that dies once it has been called ``count + 1`` times (after the call it dies in)."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        calls[0] += 1
        if calls[0] == count + 1:
            die()
        return out

    return wrapped


def arm() -> None:
    """Install the victim's fault (after ``world()``; ``start`` at import is done above)."""
    moment, at = ARGS.moment, ARGS.at
    if moment == "start":
        die()  # at % 3 == 2: after world()
    elif moment == "step":
        F.linear = after(at, F.linear)
        SGD.step = after(at, SGD.step)  # a parameter server's compute
    elif moment == "collective":
        wait = MpiCommunicator._wait

        def dying_wait(self: Any, test: Any, *args: Any, **kwargs: Any) -> None:
            calls[0] += 1
            if calls[0] == at + 1:
                die()
            wait(self, test, *args, **kwargs)

        calls = [0]
        MpiCommunicator._wait = dying_wait
    elif moment == "file":
        write = checkpoint._write_file

        def counted(path: Path, data: bytes) -> None:
            write(path, data)
            if path.name.startswith("rank"):
                files[0] += 1
                if files[0] == at + 1:
                    die()

        files = [0]
        checkpoint._write_file = counted
    elif moment == "rename":
        checkpoint._rename = after(at, checkpoint._rename)
    elif at % 2 == 0:
        import atexit

        atexit.register(die)  # runs before minipar's own exit handler: before the goodbye
    else:
        startup.finalize = lambda *a: die()  # after the goodbye, where MPI_Finalize would run


def train_checkpointed(comm: Any) -> dict[str, Any]:
    """DDP or ZeRO-3 as ``examples/elastic_train.py``: resume, keep the global batch, save every step."""
    micro = accumulation(GLOBAL, comm.size, MICRO)
    trainer = EX.Trainer(ARGS.paradigm, comm, 0)
    ckpt = str(Path(ARGS.out, "ckpt"))
    start = trainer.load(ckpt) if checkpoint_exists(ckpt, comm) else 0
    rows = GLOBAL // comm.size
    for step in range(start, ARGS.steps):
        x, y = EX.batch(0, step, GLOBAL)
        lo = comm.rank * rows
        trainer.step(x[lo:lo + rows], y[lo:lo + rows], MICRO)
        trainer.save(ckpt, step + 1)
    return {"params": trainer.full_params(), "start": start, "micro": micro}


def train_pipeline(comm: Any) -> dict[str, Any]:
    from minipar.parallel.pipeline import Pipeline, mlp

    pipe = Pipeline(comm, mlp(PIPE_SIZES, seed=4), "1f1b", microbatches=4)
    opt = SGD(pipe.parameters(), lr=PIPE_LR)
    for step in range(ARGS.steps):
        pipe.step(*pipe_batch(step), opt)
    return {"params": pipe.full_state_dict()}


def train_ps(comm: Any) -> dict[str, Any]:
    from minipar.nn import MLP
    from minipar.parallel import param_server as ps

    res = ps.train(comm, MLP(SIZES, seed=1), ps_loss, ps_batch, ARGS.steps, n_servers=1, mode="async",
                   optimizer=lambda params: SGD(params, lr=0.1), silence_timeout=4.0)
    return {"applied": [(a[0], a[1]) for a in res.applied], "dropped": res.dropped, "workers": comm.size - 1}


class DyingWatch(startup.StartupWatch):
    """The start-up watch, then the fault: inside MPI's start-up (the ``alive`` file there, then stale)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        die()


def main() -> int:
    in_startup = VICTIM and ARGS.moment == "start" and ARGS.at % 3 == 1
    if in_startup:
        startup.StartupWatch = DyingWatch
    comm = world()
    if VICTIM and not in_startup:
        arm()
    run = {"ddp": train_checkpointed, "zero3": train_checkpointed, "pipeline": train_pipeline, "ps": train_ps}
    result = run[ARGS.paradigm](comm)
    if comm.rank == 0:
        path = Path(ARGS.out, f"attempt{restart_info().count}.pkl")
        path.write_bytes(pickle.dumps({**result, "size": comm.size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
