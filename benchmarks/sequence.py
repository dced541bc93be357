"""Sequence parallelism on 2 ranks: one attention layer's forward + backward at a long sequence,
against the same attention in one process.

    OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/sequence.py [--seq 2048]

The point of splitting attention along the sequence is memory: a sequence too long for one worker
trains on P. The baseline is what a user would run without it, ``minipar.functional.attention`` (one
numpy matmul per head pair, the whole (S x S) softmax kept for backward) on rank 0 while rank 1
waits; and the fastest single-process way, blockwise attention that skips the blocks a causal mask
hides (FlashAttention-style: Ring Attention on a one-rank ring with its block cut into 2P pieces).
Then both ranks run Ulysses, Ring Attention (contiguous split) and Ring Attention (zigzag
split) on their S/2 positions. Configurations take turns round by round; the table gives medians.

Per configuration: the peak bytes numpy allocated on a rank during forward + backward (tracemalloc,
the largest rank) and its ratio to one process, the step time (the slowest rank) and the speed-up
over one process (2.0 would be perfect strong scaling; one rank per core, no time-sharing). With a
causal mask the contiguous split gives rank 1 three times rank 0's score blocks, so it runs at the
speed of its slowest rank; the zigzag split evens them out.

Measured on the 2-core machine (S = 2048, H = 4, d_head = 32, float64), two runs (3 rounds with
other jobs running, 5 rounds quieter); times moved by up to 10% between runs, memory not at all:

    configuration        peak MiB/rank  vs 1 process  step ms   speed-up    vs blockwise
    one process                  270.0         1.00x  473-516   1.00x       0.47-0.52x
    1 proc. blockwise             34.8         0.13x  240-244   1.94-2.15x  1.00x
    Ulysses                      138.0         0.51x  227-230   2.06-2.27x  1.06x
    Ring, contiguous              76.2         0.28x  243-249   1.90-2.12x  0.98-0.99x
    Ring, zigzag                  27.7         0.10x  140-147   3.23-3.68x  1.67-1.71x

Quiet machine (load 0.2), after the ring's backward keeps one accumulator and polls its transfers,
5 rounds: one process 531 ms; blockwise 253 ms (1.00x); Ulysses 1.07x, ring contiguous 0.99x, ring
zigzag 1.74x of blockwise; memory unchanged.

Against the fair baseline (blockwise, one process) only the zigzag ring gains from the second core
(1.71x of an ideal 2x): Ulysses computes every masked score of its H/P heads, and the contiguous
ring waits for its last rank. Memory per rank: Ulysses keeps the (S x S) softmax of H/P heads, the
ring one score block at a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from minipar import functional as F
from minipar.autograd import Tensor
from minipar.comm import Communicator, launch
from minipar.parallel.sequence import SequenceGroup, check_sequence_config, ring_attention


def one_process(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, heads: int) -> Callable[[], None]:
    def step() -> None:
        ts = [Tensor(x, requires_grad=True) for x in (q, k, v)]
        (F.attention(*ts, heads, True) * Tensor(g)).sum().backward()
    return step


def one_process_blockwise(comm: Communicator, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                          heads: int, pieces: int) -> Callable[[], None] | None:
    """Ring Attention on a ring of one rank whose block is cut into ``pieces``: FlashAttention-style
    blockwise attention in one process, hidden causal blocks skipped (on rank 0; None elsewhere)."""
    alone = comm.split(comm.rank)  # every rank calls split
    if comm.rank:
        return None
    c = q.shape[1] // pieces
    blocks = [[(i * c, (i + 1) * c) for i in range(pieces)]]

    def step() -> None:
        ts = [Tensor(x, requires_grad=True) for x in (q, k, v)]
        (ring_attention(*ts, heads, alone, blocks, True) * Tensor(g)).sum().backward()
    return step


def split(comm: Communicator, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, heads: int,
          method: str, zigzag: bool) -> Callable[[], None]:
    layout = check_sequence_config(comm, q.shape[1], heads, q.shape[2], method, zigzag=zigzag)
    group = SequenceGroup(comm, layout, method)
    local = [np.ascontiguousarray(x[:, group.positions]) for x in (q, k, v, g)]

    def step() -> None:
        ts = [Tensor(x, requires_grad=True) for x in local[:3]]
        (group.attention(*ts, heads, True) * Tensor(local[3])).sum().backward()
    return step


def measure(comm: Communicator, step: Callable[[], None] | None) -> tuple[float, int]:
    """(slowest rank's seconds, largest rank's peak bytes) of one call; ranks without a step wait."""
    comm.barrier()
    tracemalloc.start()
    t0 = time.perf_counter()
    if step is not None:
        step()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return max(comm.allgather_object(seconds)), max(comm.allgather_object(peak))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    def body(comm: Communicator) -> None:
        rng = np.random.default_rng(0)
        q, k, v, g = (rng.standard_normal((1, args.seq, args.heads * args.head_size)) for _ in range(4))
        steps = {"one process": one_process(q, k, v, g, args.heads) if comm.rank == 0 else None,
                 "1 proc. blockwise": one_process_blockwise(comm, q, k, v, g, args.heads, 2 * comm.size)}
        for name, method, zigzag in (("Ulysses", "ulysses", False), ("Ring, contiguous", "ring", False),
                                     ("Ring, zigzag", "ring", True)):
            steps[name] = split(comm, q, k, v, g, args.heads, method, zigzag)
        results: dict[str, list[tuple[float, int]]] = {name: [] for name in steps}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, step in steps.items():
                results[name].append(measure(comm, step))
        if comm.rank:
            return
        base_t = statistics.median(t for t, _ in results["one process"][1:])
        base_m = results["one process"][1][1]
        print(f"attention forward + backward, causal, S={args.seq}, H={args.heads}, d_head={args.head_size}, "
              f"float64, {comm.size} ranks (one per core), median of {args.rounds} rounds")
        print(f"{'':18} {'peak MiB/rank':>14} {'vs 1 process':>13} {'step ms':>9} {'speed-up':>9} "
              f"{'vs blockwise':>13}")
        block_t = statistics.median(t for t, _ in results["1 proc. blockwise"][1:])
        for name, rows in results.items():
            t = statistics.median(s for s, _ in rows[1:])
            m = rows[1][1]
            print(f"{name:18} {m / 2**20:14.1f} {m / base_m:12.2f}x {t * 1e3:9.1f} {base_t / t:8.2f}x "
                  f"{block_t / t:12.2f}x")

    launch(body, 2, "auto")


if __name__ == "__main__":
    main()
