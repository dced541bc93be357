"""A tiny GPT trained with DDP or ZeRO-3 (FSDP), a sharded checkpoint after every step, resumable at
any world size with the global batch kept, and able to kill one of its ranks on purpose::

    minipar run --elastic -n 3 examples/elastic_train.py --paradigm zero3 --ckpt /tmp/ck \\
        --kill-rank 1 --kill-step 2

The first run loses rank 1 at step 2 (SIGKILL, as a pre-empted machine); the survivors stop
(``PeerLost``, or the watchdog's ``CommTimeout`` without a failure detector) and exit non-zero;
``minipar run`` restarts 2 ranks, which load the last complete checkpoint re-cut for 2 ranks and
run 3 micro-batches per rank where 3 ranks ran 2: the same global batch of 12, the same steps.

Step s trains on the global batch ``batch(s)`` (drawn from ``(seed, s)`` alone, so a restart sees
the same data); rank r takes rows ``[r G/W, (r+1) G/W)`` in micro-batches of ``--micro-batch``.
``--kill-phase save`` kills the rank inside step s's checkpoint, after half its shard file is
written: the checkpoint of step s is then never committed (the last complete one is step s-1's).
Kills happen on the first run only (``MINIPAR_RESTART_COUNT`` 0). Rank 0 prints
``resumed at step K on W ranks ...`` / ``fresh start ...`` and, at the end, writes every parameter
whole to ``--out`` (an ``.npz``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

from minipar import nn
from minipar.comm import world
from minipar.elastic import accumulation, checkpoint_exists, load_ddp, restart_info, save_ddp
from minipar.optim import AdamW
from minipar.parallel.zero import checkpoint

MODEL = {"vocab_size": 7, "seq_len": 4, "d_model": 8, "n_heads": 2, "n_layers": 1}
LR, WEIGHT_DECAY = 1e-2, 0.01


def batch(seed: int, step: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch: tokens and next-token targets, ``(global_batch, seq_len)`` each."""
    x, y = np.random.default_rng([seed, step]).integers(0, MODEL["vocab_size"], (2, global_batch, MODEL["seq_len"]))
    return x, y


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paradigm", choices=("ddp", "zero3"), default="ddp")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", required=True, help="checkpoint directory (replaced after every step)")
    p.add_argument("--out", help="write the final parameters here (.npz, rank 0)")
    p.add_argument("--kill-rank", type=int, help="this rank SIGKILLs itself (first run only)")
    p.add_argument("--kill-step", type=int, default=0, help="... at this step")
    p.add_argument("--kill-phase", choices=("step", "save"), default="step",
                   help="before the step's compute, or half-way through writing its checkpoint file")
    return p.parse_args(argv)


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_save() -> None:
    """The next checkpoint file this rank writes is cut in half, then the rank dies."""
    write = checkpoint._write_file

    def half_then_die(path: Path, data: bytes) -> None:
        write(path, data[:len(data) // 2])
        die()

    checkpoint._write_file = half_then_die


class Trainer:
    """DDP (a replica + AdamW, ``save_ddp``) or FSDP (``save_checkpoint``) behind one interface."""

    def __init__(self, paradigm: str, comm: Any, seed: int) -> None:
        self.model = nn.GPT(**MODEL, seed=seed)
        self.paradigm, self.comm = paradigm, comm
        if paradigm == "ddp":
            from minipar.parallel.ddp import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.model, comm)
            self.opt = AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            from minipar.parallel.zero import FullyShardedDataParallel

            self.fsdp = FullyShardedDataParallel(self.model, comm, lr=LR, weight_decay=WEIGHT_DECAY)

    def step(self, xs: np.ndarray, ys: np.ndarray, micro: int) -> None:
        """One optimizer step on this rank's rows, ``micro`` at a time (each loss scaled by 1/m)."""
        m = len(xs) // micro
        for i in range(m):
            loss = self.model.loss(xs[i * micro:(i + 1) * micro], ys[i * micro:(i + 1) * micro]) * (1.0 / m)
            if self.paradigm == "zero3":
                self.fsdp.backward(loss)  # reduce-scatters every micro-batch; the shard's grad accumulates
            elif i < m - 1:
                with self.ddp.no_sync():
                    self.ddp.backward(loss)
            else:
                self.ddp.backward(loss)
        if self.paradigm == "zero3":
            self.fsdp.step()
        else:
            self.opt.step()
            self.opt.zero_grad()

    def save(self, directory: str, step: int) -> None:
        if self.paradigm == "zero3":
            self.fsdp.save_checkpoint(directory)  # its meta["step"]: AdamW's step count = steps done
        else:
            save_ddp(directory, self.ddp, self.opt, {"step": step})

    def load(self, directory: str) -> int:
        """Load ``directory``; returns the steps it had done."""
        if self.paradigm == "zero3":
            self.fsdp.load_checkpoint(directory)
            return int(self.fsdp.optimizer.adam.state[0].get("step", 0))
        return int(load_ddp(directory, self.ddp, self.opt)["step"])

    def full_params(self) -> dict[str, np.ndarray]:
        if self.paradigm == "zero3":
            return self.fsdp.full_state_dict()
        return {n: p.data.copy() for n, p in self.model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    info = restart_info()
    comm = world()
    try:  # the global batch kept: refused before any message when it does not divide
        micro_per_rank = accumulation(args.global_batch, comm.size, args.micro_batch)
    except ValueError as exc:
        if comm.rank == 0:
            print(f"elastic_train: refused: {exc}", file=sys.stderr, flush=True)
        return 2
    trainer = Trainer(args.paradigm, comm, args.seed)
    start = 0
    if checkpoint_exists(args.ckpt, comm):  # leftovers of crashed saves tidied up first
        start = trainer.load(args.ckpt)
        if comm.rank == 0:
            print(f"resumed at step {start} on {comm.size} ranks, {micro_per_rank} micro-batches of "
                  f"{args.micro_batch} per rank (restart {info.count}, lost {list(info.lost)})", flush=True)
    elif comm.rank == 0:
        print(f"fresh start on {comm.size} ranks, {micro_per_rank} micro-batches of {args.micro_batch} per rank "
              f"(restart {info.count})", flush=True)
    victim = info.count == 0 and comm.rank == args.kill_rank
    rows = args.global_batch // comm.size
    for step in range(start, args.steps):
        if victim and step == args.kill_step:
            if args.kill_phase == "step":
                die()
            kill_inside_save()
        x, y = batch(args.seed, step, args.global_batch)
        lo = comm.rank * rows
        trainer.step(x[lo:lo + rows], y[lo:lo + rows], args.micro_batch)
        trainer.save(args.ckpt, step + 1)
    params = trainer.full_params()
    if comm.rank == 0 and args.out:
        np.savez(args.out, **params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
