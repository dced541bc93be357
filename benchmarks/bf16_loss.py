"""How far bf16 mixed precision's loss curve strays from float32's: a tiny GPT trained for ``--steps``
steps on the same batches in float32 (one process, AdamW) and in bf16 (``minipar.parallel.bf16``) on
one process, under ZeRO-2 on 2 thread ranks with the gradients reduced in bf16 and in fp32, and
tensor-parallel (``TensorParallelGPT``, t = 2 with sequence parallelism and t = 4).

    .venv/bin/python benchmarks/bf16_loss.py [--steps 50]

Prints each recipe's final loss and its distance to float32's curve: the largest and the mean
|loss_bf16 - loss_fp32| over the steps (the loss of each step's batch before its update; the mean
of the two ranks' losses under ZeRO), and the largest distance to bf16 on one process (``|d1|``:
the loss is a bf16 number, so 0.0078 is one bf16 step between 1 and 2, 0.0156 one between 2 and 4).
Measured (d_model 64, 2 layers, 4 heads, vocab 64, seq 32, global batch 16, lr 3e-3, 50 steps, ~2
minutes on the 2-core machine)::

    50 steps; float32: loss 4.3175 -> 1.0495
    recipe                                      final   max |d|  mean |d|  max |d1|
    bf16, one process                          1.0469    0.0163    0.0027    0.0000
    bf16, ZeRO-2 on 2 ranks, reduce bf16       1.0508    0.0053    0.0015    0.0156
    bf16, ZeRO-2 on 2 ranks, reduce fp32       1.0508    0.0053    0.0014    0.0156
    bf16, tensor parallel t=2 SP               1.0469    0.0163    0.0027    0.0078
    bf16, tensor parallel t=4                  1.0469    0.0163    0.0026    0.0156

No bound on the tensor-parallel curve's distance to one process's is derived: the two differ first in
the cross-rank sums (each partial rounded to bf16, within 2 gamma_{t-1} sum |p_r| of one process's
sum, ``tests/test_bf16_tensor.py``), and such a difference then passes through layer norms (whose
slope grows as 1 / the input's spread), softmax and GELU, and every op's rounding to bf16, which a
difference below half a bf16 step may or may not flip; after a step AdamW divides the gradients by
their own root (``tests/tolerances.py``: up to lr D / eps where a gradient is rounding noise), and
the next step's gradients differ by the loss's curvature times the parameter difference, which
nothing bounds. Measured on step 0 (same parameters, t = 2 and 4): equal losses, 62-64 % of the
110,336 gradient elements differ (the largest relative difference is on elements one process
computes as ~0), 316 parameters differ after the step, by at most 0.0078 (one bf16 step near 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from minipar import nn
from minipar.autograd import BF16
from minipar.comm import launch
from minipar.datasets import lm_batch, token_stream
from minipar.optim import AdamW
from minipar.parallel.bf16 import MasterAdamW
from minipar.parallel.tensor import TensorParallelGPT
from minipar.parallel.zero import ZeroDataParallel

VOCAB, SEQ, D, HEADS, LAYERS, BATCH, LR = 64, 32, 64, 4, 2, 16, 3e-3
STREAM = token_stream(20_000, VOCAB, seed=0)


def gpt(dtype: object) -> nn.GPT:
    return nn.GPT(VOCAB, SEQ, D, HEADS, LAYERS, seed=0, dtype=dtype)


def train(model: nn.Module, opt: AdamW, steps: int, sync: Callable[[], None] = lambda: None) -> list[float]:
    """Losses of ``steps`` steps of ``model`` on the whole batch (``sync`` between backward and step)."""
    out = []
    for step in range(steps):
        x, y = lm_batch(STREAM, BATCH, SEQ, step)
        loss = model.loss(x, y)
        loss.backward()
        sync()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.data))
    return out


def one_process(dtype: object, steps: int) -> list[float]:
    """Losses of ``steps`` steps in ``dtype`` (float32: AdamW; bfloat16: AdamW on an fp32 master)."""
    model = gpt(dtype)
    return train(model, MasterAdamW(model.parameters(), LR) if dtype == BF16 else AdamW(model.parameters(), LR),
                 steps)


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


def tensor_parallel(comm, sp: bool, steps: int) -> list[float]:
    """The losses of the bf16 GPT split over ``comm``'s ranks by Megatron's tensor parallelism (bf16 on
    the wire, the vocabulary-parallel loss in fp32), MasterAdamW on every rank's slices."""
    model = TensorParallelGPT(VOCAB, SEQ, D, HEADS, LAYERS, comm, sequence_parallel=sp, seed=0, dtype=BF16)
    return train(model, MasterAdamW(model.parameters(), LR), steps, model.sync_grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    steps = parser.parse_args().steps
    fp32 = np.array(one_process(np.float32, steps))
    curves = {"bf16, one process": np.array(one_process(BF16, steps))}
    for reduce in ("bf16", "fp32"):
        ranks = launch(zero2, 2, reduce_dtype=reduce, steps=steps)
        curves[f"bf16, ZeRO-2 on 2 ranks, reduce {reduce}"] = np.mean(ranks, axis=0)
    for t, sp in ((2, True), (4, False)):
        curves[f"bf16, tensor parallel t={t}{' SP' if sp else ''}"] = np.array(launch(tensor_parallel, t, sp=sp,
                                                                                      steps=steps)[0])
    one = curves["bf16, one process"]
    print(f"{steps} steps; float32: loss {fp32[0]:.4f} -> {fp32[-1]:.4f}")
    print(f"{'recipe':40s} {'final':>8s} {'max |d|':>9s} {'mean |d|':>9s} {'max |d1|':>9s}")
    for name, curve in curves.items():
        d = np.abs(curve - fp32)
        print(f"{name:40s} {curve[-1]:8.4f} {d.max():9.4f} {d.mean():9.4f} {np.abs(curve - one).max():9.4f}")


if __name__ == "__main__":
    main()
