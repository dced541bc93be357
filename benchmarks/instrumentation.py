"""What measurement costs: a training step untraced, traced, and as the plain model, side by side.

    python benchmarks/instrumentation.py [--repeats 15]

Measurement (trace spans, activation bytes walked from the autograd graph, memory samples) runs
only while a trace records (``minipar.trace.current()``). On one rank, so the numbers are compute
alone, each variant runs the tiny GPT (float64, d_model 64, 4 layers, seq 32, batch 16) for one
step, interleaved, median of ``--repeats``:

- pipeline: ``Pipeline.step`` with GPipe over 4 micro-batches on one stage, untraced and traced,
  against the plain loop a user would write (the single-process model, 4 micro-batches, each
  ``loss / 4`` backward);
- tensor parallel: ``TensorParallelGPT`` on t = 1, untraced and traced, against the same model's
  untraced step (its block math, ``ParallelBlock.math``, is what runs untraced; the comparison is
  with ``nn.GPT`` too, whose ops differ: unfused bias and residual adds).

Prints the ratios untraced / plain and traced / plain. Untraced should be plain within noise
(about +-3% here); traced pays the graph walks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from minipar import datasets, trace
from minipar.comm import launch
from minipar.nn import GPT
from minipar.parallel.pipeline import Pipeline
from minipar.parallel.pipeline.partition import gpt
from minipar.parallel.tensor import TensorParallelGPT

VOCAB, SEQ, D, HEADS, LAYERS, BATCH, M = 64, 32, 64, 4, 4, 16, 4


def timed(fn: Callable[[], Any], traced: bool, rank: int = 0) -> float:
    t0 = time.perf_counter()
    if traced:
        with trace.recording(rank):
            fn()
    else:
        fn()
    return time.perf_counter() - t0


def bench(comm: Any, repeats: int) -> dict[str, dict[str, float]]:
    stream = datasets.token_stream(10_000, VOCAB, seed=0)
    x, y = datasets.lm_batch(stream, BATCH, SEQ, step=0)
    plain = GPT(VOCAB, SEQ, D, HEADS, LAYERS, seed=0)

    def plain_step() -> None:
        plain.zero_grad()
        for xs, ys in zip(np.split(x, M), np.split(y, M), strict=True):
            (plain.loss(xs, ys) * (1.0 / M)).backward()

    def plain_whole() -> None:
        plain.zero_grad()
        plain.loss(x, y).backward()

    pipe = Pipeline(comm, gpt(VOCAB, SEQ, D, HEADS, LAYERS, seed=0), "gpipe", microbatches=M)
    tp = TensorParallelGPT(VOCAB, SEQ, D, HEADS, LAYERS, comm, seed=0)

    def tp_step() -> None:
        tp.zero_grad()
        tp.loss(x, y).backward()

    variants = {
        "pipeline": {"plain": (plain_step, False), "untraced": (lambda: pipe.step(x, y), False),
                     "traced": (lambda: pipe.step(x, y), True)},
        "tensor": {"plain": (plain_whole, False), "untraced": (tp_step, False), "traced": (tp_step, True)},
    }
    out: dict[str, dict[str, float]] = {}
    for name, runs in variants.items():
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn, traced in runs.values():
            timed(fn, traced)  # warm-up
        for _ in range(repeats):
            for key, (fn, traced) in runs.items():
                times[key].append(timed(fn, traced))
        out[name] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    result = launch(bench, 1, "threads", repeats=args.repeats)[0]
    print(f"one rank, float64, d_model {D}, {LAYERS} layers, seq {SEQ}, batch {BATCH}; median of {args.repeats}")
    for name, t in result.items():
        plain_label = "nn.GPT, 4 micro-batches" if name == "pipeline" else "nn.GPT, whole batch"
        print(f"{name:9s} plain ({plain_label}) {t['plain'] * 1e3:7.1f} ms   untraced {t['untraced'] * 1e3:7.1f} ms"
              f" ({t['untraced'] / t['plain']:.2f}x)   traced {t['traced'] * 1e3:7.1f} ms"
              f" ({t['traced'] / t['plain']:.2f}x)")


if __name__ == "__main__":
    main()
