"""ZeRO stages 0-3 on 2 ranks: step time and peak memory per rank of one GPT, side by side.

    OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/zero.py [--rounds 5]

Stage 0 is DDP (``minipar.parallel.ddp``, ring all-reduce, AdamW on every rank); stages 1 and 2 are
``ZeroDataParallel`` (buckets of ``--cap`` bytes); stage 3 is ``FullyShardedDataParallel`` (one unit
per block, embeddings, final norm and head; prefetch on, reshard after forward), built under
``nn.deferred()``. Every configuration trains the same GPT (float64) on the same batches, each rank
on its half of the global batch.

Peak memory per rank: the most bytes numpy and Python held at once (``tracemalloc``, all threads) from
building the model to the end of two steps, on the larger rank, configurations one after another.
"states" is what ZeRO's paper counts, the model states by ``minipar.cost.zero.zero_state_bytes``
(float64 and AdamW: 8 + 8 + 16 bytes per parameter; at N = 2 stage 1 saves 8 Psi, stage 2 12 Psi,
stage 3 16 Psi); "rest" is the peak minus the states: activations and temporaries of a step, DDP's
flat bucket buffers, FSDP's gathered units (the current and the prefetched one) and a unit's full
gradients before their reduce-scatter. Step time: the slowest rank's forward + backward + optimizer
step, configurations taking turns round by round (load from elsewhere hits them alike), median over
``--rounds``.

Measured on the 2-core machine (d_model 256, 4 layers, vocab 512, seq 32, global batch 4, float64,
Psi = 3.43 M, buckets of 4 MiB), three runs (5, 5 and 9 rounds, load 2.6-4.3 from other jobs);
memory the same in every run, times moved by up to 50% with the load:

    configuration     peak MiB/rank  vs DDP  states MiB  rest MiB  step ms   vs DDP
    stage 0 (DDP)             144.5   1.00x       104.7      39.9  80-142    1.00x
    stage 1 (P_os)             96.8   0.67x        78.5      18.3  77-176    0.97-1.25x
    stage 2 (P_os+g)           86.3   0.60x        65.4      20.9  80-197    0.92-1.39x
    stage 3 (FSDP)             93.0   0.64x        52.3      40.6  121-244   1.51-1.73x

Re-measured on a quiet machine (load 0.1) after the review fixes (the background thread no longer
keeps a gathered unit, gradients divided before the sum), 5 rounds:

    configuration     peak MiB/rank  vs DDP  states MiB  rest MiB  step ms  vs DDP
    stage 0 (DDP)             143.1   1.00x       104.7      38.4     72.7   1.00x
    stage 1 (P_os)             96.8   0.68x        78.5      18.3     72.3   1.00x
    stage 2 (P_os+g)           86.3   0.60x        65.4      20.9     71.2   0.98x
    stage 3 (FSDP)             90.0   0.63x        52.3      37.6     99.9   1.37x

The states fall by the formula's steps, 26.2 MiB (8 Psi: the optimizer state halved), then 13.1
(the gradients halved), then 13.1 (the parameters halved). The measured peak falls by 47.7 MiB at
stage 1 (DDP's rest also holds its 26.2 MiB of flat bucket buffers), by 10.5 more at stage 2, and
rises by 6.7 at stage 3: FSDP's states are the smallest, but its rest holds two gathered blocks
(6 MiB each) and a block's full gradients with their flat copy while the reduce-scatter runs, so at
N = 2 with 4 layers the 13 MiB of parameters it saves are spent again; the saving grows with N and
with the number of units. Stages 1 and 2 cost DDP's time (the same bytes, 2 (N-1)/N Psi); FSDP
about 1.5-1.7x: 1.5x the bytes, every unit gathered twice, and the prefetch thread competes with
the compute for the GIL and the 2 cores (communication here is memory copies done by the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from minipar import datasets, nn
from minipar.comm import Communicator, launch
from minipar.cost import zero as formulas
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.ddp import DistributedDataParallel, local_batch
from minipar.parallel.zero import FullyShardedDataParallel, ZeroDataParallel

NAMES = {0: "stage 0 (DDP)", 1: "stage 1 (P_os)", 2: "stage 2 (P_os+g)", 3: "stage 3 (FSDP)"}


def make_step(comm: Communicator, stage: int, args: argparse.Namespace) -> tuple[Callable[[int], None], list[int]]:
    """One training step of ``stage`` on ``comm`` (a function of the step index) and the sizes of its
    buckets or units (the formula's ``numels``)."""
    shape = (args.vocab, args.seq, args.d_model, args.heads, args.layers)
    stream = datasets.token_stream(50_000, args.vocab, seed=0)
    if stage == 3:
        with nn.deferred():
            model = GPT(*shape, seed=0)
        wrapper: Any = FullyShardedDataParallel(model, comm)
        numels = [u.layout.numel for u in wrapper.units]
    else:
        model = GPT(*shape, seed=0)
        if stage == 0:
            ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=args.cap)
            opt = AdamW(model.parameters())
            numels = [b.numel for b in ddp.buckets]
        else:
            wrapper = ZeroDataParallel(model, comm, stage=stage, bucket_cap_bytes=args.cap)
            numels = [b.layout.numel for b in wrapper.buckets]

    def step(i: int) -> None:
        x, y = local_batch(comm, *datasets.lm_batch(stream, args.batch, args.seq, step=i))
        loss = model.loss(x, y)
        if stage == 0:
            ddp.backward(loss)
            opt.step()
            opt.zero_grad()
        else:
            wrapper.backward(loss)
            wrapper.step()
    return step, numels


def peak_bytes(comm: Communicator, stage: int, args: argparse.Namespace) -> tuple[int, list[int]]:
    """The larger rank's tracemalloc peak from building ``stage``'s model through two steps."""
    comm.barrier()
    tracemalloc.start()
    step, numels = make_step(comm, stage, args)
    for i in range(2):
        step(i)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return max(comm.allgather_object(peak)), numels


def timed(comm: Communicator, step: Callable[[int], None], i: int) -> float:
    comm.barrier()
    t0 = time.perf_counter()
    step(i)
    return max(comm.allgather_object(time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    ap.add_argument("--cap", type=int, default=4 * 2**20, help="bucket cap in bytes (DDP and ZeRO 1-2)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    def body(comm: Communicator) -> None:
        n = comm.size
        peaks = {stage: peak_bytes(comm, stage, args) for stage in NAMES}
        steps = {stage: make_step(comm, stage, args)[0] for stage in NAMES}
        times: dict[int, list[float]] = {stage: [] for stage in NAMES}
        for r in range(args.rounds + 1):  # round 0 warms up
            for stage, step in steps.items():
                t = timed(comm, step, 2 + r)
                if r:
                    times[stage].append(t)
        if comm.rank:
            return
        psi = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers).num_parameters()
        base_t, base_m = statistics.median(times[0]), peaks[0][0]
        print(f"GPT d_model={args.d_model}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, global batch "
              f"{args.batch}, float64, Psi = {psi:,}; {n} ranks, median of {args.rounds} rounds")
        print(f"{'':18} {'peak MiB/rank':>14} {'vs DDP':>7} {'states MiB':>11} {'rest MiB':>9} {'step ms':>9} "
              f"{'vs DDP':>7}")
        for stage, name in NAMES.items():
            peak, numels = peaks[stage]
            states = sum(formulas.zero_state_bytes(numels, stage, n).values())
            t = statistics.median(times[stage])
            print(f"{name:18} {peak / 2**20:14.1f} {peak / base_m:6.2f}x {states / 2**20:11.1f} "
                  f"{(peak - states) / 2**20:9.1f} {t * 1e3:9.1f} {t / base_t:6.2f}x")

    launch(body, 2, "auto")


if __name__ == "__main__":
    main()
