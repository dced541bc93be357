"""Helpers for tests/test_tensor_parallel.py: arrays sliced like a rank's shard, the graph's arrays,
and what a rank's trace says (collective calls, bytes sent, peak memory samples)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from minipar.autograd import Tensor
from viz.analysis import sent_by_op

TOL = {"rtol": 1e-8, "atol": 1e-10}


def batch(c: dict, step: int) -> np.ndarray:
    """Tokens and targets ``(2, batch, seq)`` of configuration ``c`` at ``step``."""
    rng = np.random.default_rng([c["seed"], step])
    return rng.integers(0, c["vocab"], (2, c["batch"], c["seq"]))


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


def rows(a: np.ndarray, comm, sp: bool) -> np.ndarray:
    """This rank's sequence shard (axis 0) under SP, else everything."""
    k = a.shape[0] // comm.size
    return a[comm.rank * k:(comm.rank + 1) * k] if sp else a


def cols(a: np.ndarray, comm) -> np.ndarray:
    k = a.shape[-1] // comm.size
    return a[..., comm.rank * k:(comm.rank + 1) * k]


def graph_arrays(t: Tensor) -> list[np.ndarray]:
    """Every array in the autograd graph that produced ``t``."""
    seen, stack, out = set(), [t], []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node.data)
        stack.extend(node._parents)
    return out


def summarise(events: list, rank: int) -> dict:
    """From one rank's trace events: collective calls (first messages) and bytes sent per block and
    phase, bytes sent by op over the step, peak activation bytes by memory-sample label, the number of
    sequence-parallel re-gathers (marks)."""
    sends = [e for e in events if e.kind == "comm" and e.src == rank]
    calls: dict[tuple, Counter] = {}
    block_bytes: Counter = Counter()
    for span in (e for e in events if e.kind == "compute" and isinstance(e.args.get("layer"), int)):
        inside = [e for e in sends if span.t0 <= e.t0 <= span.t1]
        calls[(span.args["layer"], span.name)] = Counter(e.op for e in inside if e.step == 0)
        for e in inside:
            block_bytes[(span.args["layer"], e.op)] += e.nbytes
    total = sent_by_op(events, rank)
    peaks: dict[str, int] = {}
    for e in events:
        if e.kind == "memory":
            peaks[e.name] = max(peaks.get(e.name, 0), e.nbytes)
    regathers = sum(1 for e in events if e.kind == "mark" and e.name == "re-gather")
    return {"calls": calls, "block_bytes": block_bytes, "bytes": total, "peaks": peaks, "regathers": regathers}
