"""Memory tiers: the NVMe tier's bandwidth against the disk's own, and (on 2 ranks) one GPT's step time
offloaded (ZeRO-Offload, with and without DPU) vs in memory (ZeRO-2).

    .venv/bin/python benchmarks/offload.py --nvme-only [--rounds 7] [--workers 8]
    OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/offload.py [--rounds 5]

NVMe (rank 0 alone, the other rank waiting), at 64 KiB and 16 MiB requests (``--small-kib``,
``--large-mib``), ``--span-mib`` bytes per round: the disk's own (``minipar.tiers.rates.disk_seconds``:
one preallocated file, ``O_DIRECT``, one request at a time, one ``fdatasync`` after the writes) and
the tier (``Tiers.write_nvme(in_place=True)`` of every array, then ``sync_nvme``; ``read_nvme(out=)``
into preallocated buffers; the arrays in page-aligned memory, DeepNVMe's pinned buffers; every request
submitted at once, ``--workers`` in flight), taking turns round by round (who goes first alternating);
median MB/s (10^6 bytes) over ``--rounds``, with the load average printed beside. Goal: the tier at
>= 70 % of the disk at both sizes.

Before (the tier of commit fae1519: ``np.save`` of each tensor to a temporary file, fsync, rename;
``np.load``; 2 workers) and after (this tier, 8 workers), 7 rounds, tier / disk, two runs each:

    request   before: write / read (load 1.0-1.1)       after: write / read (load 1.1-1.4)
    64 KiB    13-18 % / 49-59 %                         76-80 % / 130-145 %
    16 MiB    39-41 % / 158-228 % (the page cache)      107-114 % / 88-93 %

(the disk: 630-790 MB/s at 64 KiB, 1.3-2.1 GB/s at 16 MiB.) The old reads came from the page cache
(the files just written, no O_DIRECT), so above 100 % at 16 MiB; the new ones come from the disk.
The tier passes the disk's own at times because several requests are in flight where the reference
has one. At load 11-15 (other jobs on the 2 cores) the 64 KiB writes fell to 34-54 %: each request
costs ~45 us of Python (submit, lock, bookkeeping) on a core shared with everything else.

Step time (both ranks): the tiny benchmark GPT of ``benchmarks/zero.py`` (float64, Psi = 3.4 M) under
``ZeroDataParallel`` stage 2 (everything in memory) and ``ZeroOffload`` (device budget exactly
``offload_device_need``; gradient partitions down, CPU AdamW, parameters up: 8 Psi / N bytes each
way per step), without and with the delayed parameter update. Each round times ``--block`` steps of
each configuration in turn (with DPU its last update flushed inside the block, so its background
AdamW never runs into another configuration's timing); the slowest rank's time per step, median over
``--rounds`` after a warm-up round.

Step times measured on the 2-core machine while other jobs ran (load 1.5-4), three runs of 5 rounds
(block 3), one line per run (with the tier of fae1519; the step uses no NVMe):

    ZeRO-2 in memory 178 / 233 / 177 ms; ZeRO-Offload 169 / 194 / 159 ms (0.95 / 0.84 / 0.90x);
    ZeRO-Offload + DPU 168 / 160 / 169 ms (0.94 / 0.69 / 0.96x)

Offloading costs nothing measurable here: a step moves 8 Psi / N = 13.7 MB each way per rank, memory
copies of a few ms, and ZeroOffload's CPU AdamW is the same numpy work ZeRO-2 does; ZeRO-2 in memory
even came out 5-16% slower in every run (not investigated; same buckets, same collectives). DPU hides
the CPU AdamW (about 10 ms on 1.7 M elements) behind the next forward/backward only when a core is
free: with 2 ranks and their 2 AdamW threads on 2 cores and other jobs, its gain ranges from none to
0.69x (lesson 7 asks the replayed clock, where each has a core).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minipar import datasets
from minipar.comm import Communicator, launch
from minipar.nn import GPT
from minipar.parallel.ddp import local_batch
from minipar.parallel.offload import ZeroOffload, offload_device_need
from minipar.parallel.zero import ZeroDataParallel
from minipar.tiers import Tiers
from minipar.tiers.files import aligned_empty
from minipar.tiers.rates import disk_seconds


# ---- NVMe ---------------------------------------------------------------------------------------------
def tier_round(tiers: Tiers, arrays: list[np.ndarray], into: list[np.ndarray]) -> tuple[float, float]:
    """Seconds to write every array in place (then ``sync_nvme``) and to read every one back into
    ``into``, all submitted at once (the pool keeps ``--workers`` requests in flight); checked."""
    t0 = time.perf_counter()
    for f in [tiers.write_nvme(f"t{i}", a, copy=False, in_place=True) for i, a in enumerate(arrays)]:
        f.result()
    tiers.sync_nvme()
    t1 = time.perf_counter()
    for f in [tiers.read_nvme(f"t{i}", out=b) for i, b in enumerate(into)]:
        f.result()
    t2 = time.perf_counter()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, into, strict=True))
    return t1 - t0, t2 - t1


def nvme(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    """Per request size: seconds per round of the disk's own and the tier's writes and reads, taking
    turns (the first of each pair alternating round by round)."""
    directory = Path(args.dir) / f"pid{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[int, dict[str, list[float]]] = {}
    try:
        for size in (args.small_kib << 10, args.large_mib << 20):
            count = max(2, (args.span_mib << 20) // size)
            arrays = [aligned_empty((size // 4,)) for _ in range(count)]  # DeepNVMe's pinned buffers
            into = [aligned_empty((size // 4,)) for _ in range(count)]
            for i, a in enumerate(arrays):
                a[:] = np.random.default_rng(i).standard_normal(a.size)
            times: dict[str, list[float]] = {k: [] for k in ("disk write", "tier write", "disk read", "tier read")}
            with Tiers(0, directory / f"tier{size}", workers=args.workers) as tiers:
                tier_round(tiers, arrays, into)  # makes the files (atomic writes); every timed write is in place
                for r in range(args.rounds):
                    if r % 2:
                        tier = tier_round(tiers, arrays, into)
                    disk = disk_seconds(str(directory), size, count)[:2]
                    if not r % 2:
                        tier = tier_round(tiers, arrays, into)
                    for who, (w, rd) in (("disk", disk), ("tier", tier)):
                        times[f"{who} write"].append(w)
                        times[f"{who} read"].append(rd)
            out[size] = times
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def print_nvme(io: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> None:
    print(f"NVMe tier vs the disk's own requests under {args.dir} ({args.workers} I/O threads; the disk: one "
          f"request at a time, O_DIRECT), median MB/s of {args.rounds} rounds taking turns; load {load()}")
    for size, times in io.items():
        count = max(2, (args.span_mib << 20) // size)
        rate = {k: count * size / statistics.median(v) / 1e6 for k, v in times.items()}
        what = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        for op in ("write", "read"):
            print(f"  {what:>7} x {count:<4} {op:5}  tier {rate[f'tier {op}']:7.0f}   disk {rate[f'disk {op}']:7.0f}   "
                  f"tier / disk {rate[f'tier {op}'] / rate[f'disk {op}']:4.0%}")


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# ---- step time ------------------------------------------------------------------------------------------
def make_step(comm: Communicator, kind: str, args: argparse.Namespace) -> Callable[[int], None]:
    """``step(i)``: ``--block`` training steps of ``kind`` from step ``i`` on; with DPU the last update
    is flushed inside it (the pending CPU step never runs into another configuration's timing)."""
    shape = (args.vocab, args.seq, args.d_model, args.heads, args.layers)
    stream = datasets.token_stream(50_000, args.vocab, seed=0)
    model = GPT(*shape, seed=0)
    if kind == "ZeRO-2 in memory":
        wrapper: Any = ZeroDataParallel(model, comm, stage=2, bucket_cap_bytes=args.cap)
    else:
        tiers = Tiers(offload_device_need(model, comm.size, args.cap)["total"])
        wrapper = ZeroOffload(model, comm, tiers, bucket_cap_bytes=args.cap, delayed_update=kind.endswith("DPU"))

    def step(i: int) -> None:
        for j in range(i, i + args.block):
            x, y = local_batch(comm, *datasets.lm_batch(stream, args.batch, args.seq, step=j))
            wrapper.backward(model.loss(x, y))
            wrapper.step()
        if kind.endswith("DPU"):
            wrapper.flush()
    return step


def timed(comm: Communicator, step: Callable[[int], None], i: int, step_block: int) -> float:
    """Seconds per step of one block (the slowest rank)."""
    comm.barrier()
    t0 = time.perf_counter()
    step(i)
    return max(comm.allgather_object(time.perf_counter() - t0)) / step_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="runs/bench_offload", help="directory on the disk to measure")
    ap.add_argument("--small-kib", type=int, default=64, help="the small request size")
    ap.add_argument("--large-mib", type=int, default=16, help="the large request size")
    ap.add_argument("--span-mib", type=int, default=32, help="bytes per round and size")
    ap.add_argument("--workers", type=int, default=8, help="the NVMe tier's I/O threads")
    ap.add_argument("--nvme-only", action="store_true", help="the NVMe comparison alone (one process)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    ap.add_argument("--cap", type=int, default=4 * 2**20, help="bucket cap in bytes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=3, help="steps timed together per configuration and round")
    args = ap.parse_args()
    if args.nvme_only:
        print_nvme(nvme(args), args)
        return

    def body(comm: Communicator) -> None:
        io = nvme(args) if comm.rank == 0 else None
        comm.barrier()
        kinds = ("ZeRO-2 in memory", "ZeRO-Offload", "ZeRO-Offload + DPU")
        steps = {k: make_step(comm, k, args) for k in kinds}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds + 1):  # round 0 warms up
            for k, step in steps.items():
                t = timed(comm, step, args.block * r, args.block)
                if r:
                    times[k].append(t)
        if comm.rank or io is None:
            return
        print_nvme(io, args)
        psi = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers).num_parameters()
        base = statistics.median(times[kinds[0]])
        print(f"step time, GPT d_model={args.d_model}, {args.layers} layers, float64, Psi = {psi:,}, "
              f"{comm.size} ranks, median of {args.rounds} rounds (slowest rank)")
        for k in kinds:
            t = statistics.median(times[k])
            print(f"  {k:20} {t * 1e3:8.1f} ms  {t / base:5.2f}x")

    launch(body, 2, "auto")


if __name__ == "__main__":
    main()
