"""One training step (forward, backward, SGD) of a 4-layer MLP, minipar against hand-written numpy.

    python benchmarks/autograd.py [--width 1024] [--batch 256] [--repeats 15]

Both run the same float32 maths (ReLU MLP, mean-squared error, plain SGD), interleaved, in one
process; the script prints the median step time of each and their ratio (target: minipar within
1.15x of numpy), and checks that both produced the same parameters.

Measured on the quiet 2-core machine (OPENBLAS_NUM_THREADS=1, 4 x 1024, batch 256, 25 steps, six
runs): numpy 71-84 ms/step, minipar 77-92 ms/step; median ratio 1.06x-1.15x, fastest-step ratio
1.09x-1.12x. A leaf keeps the gradient array backward made for it unless something else can see it
(``Tensor.backward``), so no 4 MB weight gradient is copied; what remains is matmul time (~90% of the
step, identical calls on both sides) and a few extra element-wise temporaries in the loss. With other
jobs on the machine the ratio wanders up to ~1.2x: compare runs made side by side only.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minipar import Tensor, functional
from minipar.nn import MLP
from minipar.optim import SGD


def numpy_step(ws: list[np.ndarray], bs: list[np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> float:
    acts, h = [x], x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ w + b
        if i < len(ws) - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    diff = h - y
    loss = float((diff * diff).mean())
    g = diff * np.float32(2.0 / diff.size)
    for i in reversed(range(len(ws))):
        gw, gb = acts[i].T @ g, g.sum(axis=0)
        if i > 0:
            g = (g @ ws[i].T) * (acts[i] > 0)
        ws[i] -= lr * gw
        bs[i] -= lr * gb
    return loss


def minipar_step(model: MLP, opt: SGD, x: np.ndarray, y: np.ndarray) -> float:
    loss = functional.mse_loss(model(Tensor(x)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    lr = 1e-3
    model = MLP([args.width] * (args.layers + 1), seed=0, dtype=np.float32)
    opt = SGD(model.parameters(), lr=lr)
    ws = [layer.weight.data.copy() for layer in model.layers]
    bs = [layer.bias.data.copy() for layer in model.layers]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype(np.float32)
    y = rng.normal(size=(args.batch, args.width)).astype(np.float32)
    t_np, t_mp = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        numpy_step(ws, bs, x, y, np.float32(lr))
        t1 = time.perf_counter()
        minipar_step(model, opt, x, y)
        t2 = time.perf_counter()
        t_np.append(t1 - t0)
        t_mp.append(t2 - t1)
    drift = max(float(np.abs(w - layer.weight.data).max()) for w, layer in zip(ws, model.layers))
    a, b = float(np.median(t_np)), float(np.median(t_mp))
    a_min, b_min = min(t_np), min(t_mp)
    print(f"MLP {args.layers}x{args.width}, batch {args.batch}, float32, median of {args.repeats} steps")
    print(f"  hand-written numpy : {a * 1e3:8.2f} ms/step")
    print(f"  minipar autograd   : {b * 1e3:8.2f} ms/step")
    print(f"  ratio minipar/numpy: {b / a:8.3f}x   (target <= 1.15x)")
    print(f"  fastest steps      : numpy {a_min * 1e3:.2f} ms, minipar {b_min * 1e3:.2f} ms, "
          f"ratio {b_min / a_min:.3f}x")
    print(f"  max |parameter difference| after {args.repeats} steps: {drift:.2e}")


if __name__ == "__main__":
    main()
