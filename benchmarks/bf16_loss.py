"""How far bf16 mixed precision's loss curve strays from float32's: a tiny GPT trained for ``--steps``
steps on the same batches in float32 (one process, AdamW) and in bf16 (``minipar.parallel.bf16``) on
one process and under ZeRO-2 on 2 thread ranks with the gradients reduced in bf16 and in fp32.

    .venv/bin/python benchmarks/bf16_loss.py [--steps 50]

Prints each recipe's final loss and its distance to float32's curve: the largest and the mean
|loss_bf16 - loss_fp32| over the steps (the loss of each step's batch before its update; the mean
of the two ranks' losses under ZeRO). Measured (d_model 64, 2 layers, 4 heads, vocab 64, seq 32,
global batch 16, lr 3e-3, 50 steps, ~2 minutes on the 2-core machine)::

    50 steps; float32: loss 4.3175 -> 1.0495
    recipe                                      final   max |d|  mean |d|
    bf16, one process                          1.0469    0.0163    0.0027
    bf16, ZeRO-2 on 2 ranks, reduce bf16       1.0508    0.0053    0.0015
    bf16, ZeRO-2 on 2 ranks, reduce fp32       1.0508    0.0053    0.0014
"""

from __future__ import annotations

import argparse

import numpy as np

from minipar import nn
from minipar.autograd import BF16
from minipar.comm import launch
from minipar.datasets import lm_batch, token_stream
from minipar.optim import AdamW
from minipar.parallel.bf16 import MasterAdamW
from minipar.parallel.zero import ZeroDataParallel

VOCAB, SEQ, D, HEADS, LAYERS, BATCH, LR = 64, 32, 64, 4, 2, 16, 3e-3
STREAM = token_stream(20_000, VOCAB, seed=0)


def gpt(dtype: object) -> nn.GPT:
    return nn.GPT(VOCAB, SEQ, D, HEADS, LAYERS, seed=0, dtype=dtype)


def one_process(dtype: object, steps: int) -> list[float]:
    """Losses of ``steps`` steps in ``dtype`` (float32: AdamW; bfloat16: AdamW on an fp32 master)."""
    model = gpt(dtype)
    opt = MasterAdamW(model.parameters(), LR) if dtype == BF16 else AdamW(model.parameters(), LR)
    out = []
    for step in range(steps):
        x, y = lm_batch(STREAM, BATCH, SEQ, step)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.data))
    return out


def zero2(comm, reduce_dtype: str, steps: int) -> list[float]:
    """This rank's losses under ZeRO-2, bf16, gradients reduced in ``reduce_dtype``."""
    model = gpt(BF16)
    zero = ZeroDataParallel(model, comm, stage=2, lr=LR, precision="bf16", reduce_dtype=reduce_dtype)
    half = BATCH // comm.size
    out = []
    for step in range(steps):
        x, y = lm_batch(STREAM, BATCH, SEQ, step)
        rows = slice(comm.rank * half, (comm.rank + 1) * half)
        loss = model.loss(x[rows], y[rows])
        zero.backward(loss)
        zero.step()
        out.append(float(loss.data))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    steps = parser.parse_args().steps
    fp32 = np.array(one_process(np.float32, steps))
    curves = {"bf16, one process": np.array(one_process(BF16, steps))}
    for reduce in ("bf16", "fp32"):
        ranks = launch(zero2, 2, reduce_dtype=reduce, steps=steps)
        curves[f"bf16, ZeRO-2 on 2 ranks, reduce {reduce}"] = np.mean(ranks, axis=0)
    print(f"{steps} steps; float32: loss {fp32[0]:.4f} -> {fp32[-1]:.4f}")
    print(f"{'recipe':40s} {'final':>8s} {'max |d|':>9s} {'mean |d|':>9s}")
    for name, curve in curves.items():
        d = np.abs(curve - fp32)
        print(f"{name:40s} {curve[-1]:8.4f} {d.max():9.4f} {d.mean():9.4f}")


if __name__ == "__main__":
    main()
