"""What measurement costs: a training step untraced, traced, and as the plain math, side by side.

    python benchmarks/instrumentation.py [--repeats 15]

Measurement (trace spans, activation bytes walked from the autograd graph, memory samples) runs
only while a trace records (``minipar.trace.current()``). On one rank, so the numbers are compute
alone, each variant runs the tiny GPT (float64, d_model 64, 4 layers, seq 32, batch 16) for one
forward and backward, interleaved, median of ``--repeats``:

- pipeline: ``Pipeline.step`` (GPipe, 4 micro-batches, one stage) untraced and traced, against the
  same stage's modules called by hand in the same order (all forwards, then all backwards);
- tensor parallel: ``TensorParallelGPT.loss`` on t = 1 untraced and traced, against the same
  model's pieces called by hand (``embed``, each block's ``math``, ``ln_f``, ``head``, the loss).

Prints the ratios untraced / plain and traced / plain: untraced is plain within noise (the runtime
adds a dictionary of stashed micro-batches and a check of ``trace.current()`` per action); traced
pays the graph walks and the spans.

Measured on the quiet 2-core machine (OPENBLAS_NUM_THREADS=1, two runs, 15 and 21 repeats): pipeline
untraced / plain 0.94x and 0.97x, traced 0.97x and 0.95x (plain 65-69 ms); tensor parallel untraced /
plain 0.99x and 1.00x, traced 1.02x and 1.05x (plain 67-69 ms). Before measurement was switched off
when no trace records, every untraced pipeline step walked each stashed micro-batch's graph and every
tensor-parallel block walked its own.
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
from minipar.parallel.pipeline import Pipeline
from minipar.parallel.pipeline.partition import gpt
from minipar.parallel.tensor import TensorParallelGPT, vocab_parallel_cross_entropy

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
    pipe = Pipeline(comm, gpt(VOCAB, SEQ, D, HEADS, LAYERS, seed=0), "gpipe", microbatches=M)
    stage = pipe.stages[0]

    def plain_pipeline() -> None:  # GPipe by hand: every forward, then every backward
        stage.zero_grad()
        losses = [pipe.model.loss(stage(xs), ys) * (1.0 / M)
                  for xs, ys in zip(np.split(x, M), np.split(y, M), strict=True)]
        for loss in losses:
            loss.backward()

    tp = TensorParallelGPT(VOCAB, SEQ, D, HEADS, LAYERS, comm, seed=0)

    def plain_tensor() -> None:  # the model's math, no spans, no meter
        tp.zero_grad()
        h = tp.embed(x)
        for block in tp.blocks:
            h = block.math(h)
        logits = tp.head(tp.ln_f(h))
        vocab_parallel_cross_entropy(logits, np.ascontiguousarray(y.T), comm).backward()

    def tp_step() -> None:
        tp.zero_grad()
        tp.loss(x, y).backward()

    variants = {
        "pipeline": {"plain": (plain_pipeline, False), "untraced": (lambda: pipe.step(x, y), False),
                     "traced": (lambda: pipe.step(x, y), True)},
        "tensor": {"plain": (plain_tensor, False), "untraced": (tp_step, False), "traced": (tp_step, True)},
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
        print(f"{name:9s} plain {t['plain'] * 1e3:7.1f} ms   untraced {t['untraced'] * 1e3:7.1f} ms"
              f" ({t['untraced'] / t['plain']:.2f}x)   traced {t['traced'] * 1e3:7.1f} ms"
              f" ({t['traced'] / t['plain']:.2f}x)")


if __name__ == "__main__":
    main()
