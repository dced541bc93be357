"""Lesson 7: memory tiers and ZeRO-Offload: a budgeted device, the CPU and NVMe, and every byte moved.

    mpiexec -n 2 python lessons/07_offload/lesson.py [--steps 4]
    python lessons/07_offload/lesson.py [--ranks 2]      # same, ranks as threads in one process

minipar has no accelerator, so the device is modelled strictly (``minipar.tiers``): a pool with a byte
budget; going past it raises ``DeviceOutOfMemory``; compute runs only on device-resident arrays. The
CPU is numpy memory, NVMe is real files written by a thread pool. Every copy between tiers is a
"transfer" trace event with its measured time and the time of the ``Bandwidth`` model (PCIe 16 GB/s,
NVMe 3 GB/s read, 2 GB/s write; ``minipar.cost.offload.transfer_seconds``).

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", Sec. 3-5;
code ``minipar/parallel/offload/zero_offload.py``) keeps the parameters and forward/backward on the
device and moves the rest to the CPU: the gradients stream down as backward produces them (reduce-
scattered first: ZeRO stage 2, each of the N ranks offloads its 1/N), the CPU holds the master
parameters and Adam's moments and runs AdamW, and the updated parameters go back up. Per step and
rank that moves the fewest bytes possible (Sec. 3): P items of gradients down and P of parameters up,
P = Psi / N (padded per bucket): in fp16 the paper's "2 Psi down, 2 Psi up" (divided by N). With the
one-step delayed parameter update (DPU, Sec. 5.2) the CPU's AdamW of step i runs beside the device's
forward and backward of step i + 1, on parameters one update older.

Printed: 1. the tiers alone: one tensor device -> cpu -> nvme -> cpu -> device, each move measured and
modelled. 2. ZeRO-Offload trains to exactly ZeRO-2's parameters (float64, bit for bit). 3. Bytes between
tiers per step and rank, measured from the trace, vs ``zero_offload_bytes`` (float64 and mixed
precision). 4. The device: budget = ``offload_device_need``, the measured peak, the model states it
leaves off the device, and the ``DeviceOutOfMemory`` a budget one byte short raises (every rank, before
anything is placed). 5. Step time with and without DPU, replayed (``--clock``, ``--cluster``:
lessons/common.py's ``Clock``: each span at its CPU time, each thread, the AdamW thread too, on a core
of its own) and modelled: the CPU step after forward and backward, or beside the next ones, max(F+B,
AdamW); the AdamW time hidden against its formula, min(AdamW, the next F+B). 6. ZeRO-Infinity
(parameters and optimizer state on NVMe, one unit at a time on the device): the same parameters, bytes
per step by tier vs ``zero_infinity_bytes``. 7. PatrickStar's chunks on one rank: bytes per step
evicting by recency (LRU) or by the warm-up's order, on the GPT (alike) and on a model that reuses its
first layer (the order wins), and the device budget each method needs (``infinity_chunks.py``). 8. Step
time vs device budget per method, from its minimum to everything fits: measured on the wall clock (the
NVMe files' and copies' own time, which a replay does not model), bytes per step vs formula, modelled at
``Bandwidth`` (``sweep.py``). The HTML report draws every tier's bytes over time per rank, the transfers
as links between the tiers (``viz.tiers``) and, after its summary, step time vs budget per method.
Writes runs/07_offload/*.json, sweep/*.json and report.html.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from lessons import load
from lessons.common import REPLAY, Clock, finish, lesson_parser, parse_lesson_args, run_ranks, time_sharing
from lessons.common import console as make_console
from minipar import datasets
from minipar import trace as mtrace
from minipar.cost import zero as zero_formulas
from minipar.cost.offload import zero_offload_bytes
from minipar.nn import GPT
from minipar.parallel.ddp import local_batch
from minipar.parallel.offload import ZeroOffload, offload_device_need
from minipar.parallel.zero import ZeroDataParallel
from minipar.tiers import Bandwidth, DeviceOutOfMemory, Tiers
from viz.tiers import moves, per_step_moves
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, LR = 32, 16, 32, 4, 2, 64, 8, 3e-3
CAP = 32 * 1024  # bytes per bucket: the GPT's 158 KB of float64 gradients make several, streamed down one by one
MIXED_SCALE = 2.0**10  # fp16 loss x S must stay under fp16's 65,504 (lesson 6)
TOUR_ITEMS = 1 << 17  # the tour's tensor: 1 MiB of float64
BANDWIDTH = Bandwidth()  # PCIe 16 GB/s, NVMe read 3 GB/s, write 2 GB/s
NVME_WORKERS = 1  # I/O threads per rank (one keeps the order of reads easy to follow in the timeline)
OUT = Path("runs/07_offload")


part2 = load("07_offload", "infinity_chunks.py")  # ZeRO-Infinity and PatrickStar's chunks
part3 = load("07_offload", "sweep.py")  # step time vs device budget, per method
TITLES = {"infinity": "ZeRO-Infinity", "tour": "memory tiers (tour)"}
RUNS = {"zero2": "ZeRO-2, in device memory", "offload": "ZeRO-Offload", "mixed": "ZeRO-Offload, mixed precision",
        "dpu": "ZeRO-Offload + DPU"}


def model(precision: str = "fp64") -> GPT:
    return GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0,
               dtype=np.float16 if precision == "mixed" else np.float64)


def device_need(n: int, precision: str = "fp64") -> dict[str, int]:
    """``offload_device_need`` of the lesson's GPT on ``n`` ranks: the smallest budget that trains."""
    return offload_device_need(model(precision), n, CAP)


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    stream = datasets.token_stream(20_000, VOCAB, seed=0)
    return [datasets.lm_batch(stream, BATCH, SEQ, step=s) for s in range(steps)]


# ---- 1. the tiers alone ------------------------------------------------------------------------------
def tour(comm: Any, trace_path: str | os.PathLike[str] | None = None, out: Path = OUT) -> dict[str, Any]:
    """One tensor (``TOUR_ITEMS`` float64) on every rank: placed on the device, copied down to the CPU,
    written to this rank's NVMe directory, read back, copied up again; bit-exact at the end."""
    x = np.random.default_rng(comm.rank).standard_normal(TOUR_ITEMS)
    with mtrace.record(trace_path, comm, paradigm="memory tiers (tour)", time_unit="s",
                       config={"items": TOUR_ITEMS, "bandwidth": vars(BANDWIDTH)}), \
            Tiers(2 * x.nbytes, out / "nvme" / f"rank{comm.rank}", BANDWIDTH, NVME_WORKERS) as tiers:
        tiers.to_device("x", x)
        host = tiers.to_cpu("x")
        tiers.free("x")
        tiers.write_nvme("x", host).result()
        del host
        back = tiers.read_nvme("x").result()
        same = bool(np.array_equal(tiers.to_device("x", back), x))
        tiers.free("x")
        tiers.delete_nvme("x").result()
    return {"same": same, "trace": trace_path}


def tour_table(trace: mtrace.Trace) -> Table:
    table = Table(title=f"one tensor of {8 * TOUR_ITEMS:,} bytes through the tiers on rank 0 (times in ms)",
                  title_justify="left", caption="modelled: nbytes / bandwidth of the link crossed "
                  f"(PCIe {BANDWIDTH.pcie / 1e9:g} GB/s, NVMe read {BANDWIDTH.nvme_read / 1e9:g}, write "
                  f"{BANDWIDTH.nvme_write / 1e9:g}); measured: this machine's memcpy and file I/O (the page cache "
                  "absorbs small writes).", caption_justify="left")
    for col in ("move", "bytes", "measured", "modelled"):
        table.add_column(col, justify="right")
    for e in moves(trace, rank=0):
        table.add_row(f"{e.args['src']} -> {e.args['dst']}", f"{e.nbytes:,}", f"{e.duration * 1e3:.3f}",
                      f"{e.args['modelled_s'] * 1e3:.3f}")
    return table


# ---- 2.-5. training ------------------------------------------------------------------------------------
def train(comm: Any, run: str = "offload", steps: int = 4, trace_path: str | os.PathLike[str] | None = None,
          budget: int | None = None) -> dict[str, Any]:
    """Train the tiny GPT ``steps`` AdamW steps on ``comm`` as ``run`` (a key of ``RUNS``: ZeRO-2 with
    everything in memory, ZeRO-Offload in float64, in mixed precision, or with DPU) on a device of
    ``budget`` bytes (default: exactly ``offload_device_need``); the whole run, from building the
    wrapper, is traced into ``trace_path`` with a "step" mark at each step's start. Returns rank-local
    final parameters, the losses, the buckets' sizes and the peak."""
    precision = "mixed" if run == "mixed" else "fp64"
    net, n = model(precision), comm.size
    budget = device_need(n, precision)["total"] if budget is None else budget
    tiers = Tiers(budget, bandwidth=BANDWIDTH)
    meta = {"paradigm": RUNS[run], "time_unit": "s",
            "config": {"N": n, "precision": precision, "device budget": budget, "bucket cap": CAP,
                       "delayed update": run == "dpu", "vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL,
                       "layers": LAYERS, "batch": BATCH}}
    losses = []
    with mtrace.record(trace_path, comm, **meta):
        if run == "zero2":
            wrapper = ZeroDataParallel(net, comm, stage=2, lr=LR, bucket_cap_bytes=CAP, precision=precision)
        else:
            wrapper = ZeroOffload(net, comm, tiers, lr=LR, precision=precision, delayed_update=run == "dpu",
                                  bucket_cap_bytes=CAP, loss_scale=MIXED_SCALE)
        for step, (x, y) in enumerate(batches(steps)):
            mtrace.mark("step", step=step)
            xs, ys = local_batch(comm, x, y)
            if run == "zero2":
                with mtrace.span("F"):
                    loss = net.loss(xs, ys)
            else:
                loss = wrapper.loss(xs, ys)
            wrapper.backward(loss)
            wrapper.step()
            losses.append(float(comm.allreduce(np.array([loss.item()]))[0]) / n)
        mtrace.mark("flush")  # the last step ends here; with DPU its update goes up after this mark
        if run != "zero2":
            wrapper.flush()
    numels = [b.layout.numel for b in wrapper.buckets]
    params = net.state_dict()
    if run != "zero2":
        wrapper.close()
    tiers.close()
    return {"losses": losses, "params": params, "numels": numels,
            "peak": tiers.peak_device_bytes, "budget": budget, "trace": trace_path}


def too_small(comm: Any) -> str:
    """The message every rank gets for a device budget one byte below ``offload_device_need``."""
    tiers = Tiers(device_need(comm.size)["total"] - 1)
    try:
        ZeroOffload(model(), comm, tiers, lr=LR, bucket_cap_bytes=CAP)
    except DeviceOutOfMemory as exc:
        return f"{type(exc).__name__}: {exc}" + ("" if tiers.device_bytes == 0 else " (but bytes were placed!)")
    return "no error"


def run_all(comm: Any, steps: int, out: Path = OUT) -> dict[str, Any]:
    """The tour, the four training runs, ZeRO-Infinity and the chunks (traces under ``out``), and the
    too-small budget's message."""
    results: dict[str, Any] = {"tour": tour(comm, out / "tiers.json", out)}
    for run in RUNS:
        results[run] = train(comm, run, steps, out / f"{run}.json")
    results["oom"] = comm.allgather_object(too_small(comm))
    me = sys.modules[__name__]
    results["infinity"] = part2.train_infinity(me, comm, steps, out / "infinity.json", out)
    results["chunks"] = part2.train_chunks(me, comm, steps, out)
    results["sweep"] = part3.run_sweep(me, comm, out, results)
    return results


def bytes_table(results: dict[str, Any], n: int) -> Table:
    table = Table(title=f"bytes between device and CPU per step on each rank (N = {n}), measured from the trace",
                  title_justify="left",
                  caption="setup: the working parameters placed once when the wrapper is built. Formula: "
                          "zero_offload_bytes(bucket sizes, item, item, dp=N): each padded bucket's 1/N, "
                          "gradients down and parameters up. DPU: step i's update goes up during step i + 1 "
                          "(the last one at flush).", caption_justify="left")
    for col in ("run", "item", "setup up", "per step: down", "per step: up", "flush up", "formula down / up",
                "every rank"):
        table.add_column(col, justify="right")
    for run in ("offload", "mixed", "dpu"):
        res, item = results[run], 2 if run == "mixed" else 8
        trace = mtrace.load(res["trace"])
        want = zero_offload_bytes(res["numels"], item, item, dp=n)
        per_rank = [per_step_moves(trace, r) for r in range(n)]
        setup, steps, flush = per_rank[0][0], per_rank[0][1:-1], per_rank[0][-1]
        table.add_row(RUNS[run], str(item), f"{setup.get('cpu->device', 0):,}",
                      " ".join(f"{s.get('device->cpu', 0):,}" for s in steps),
                      " ".join(f"{s.get('cpu->device', 0):,}" for s in steps), f"{flush.get('cpu->device', 0):,}",
                      f"{want['device->cpu']:,} / {want['cpu->device']:,}",
                      "same" if all(p == per_rank[0] for p in per_rank) else "differ")
    return table


def device_summary(results: dict[str, Any], n: int) -> str:
    res = results["offload"]
    need = device_need(n)
    states = sum(zero_formulas.zero_state_bytes(res["numels"], 2, n).values())
    psi = model().num_parameters()
    return (f"device budget {res['budget']:,} bytes = offload_device_need: "
            + ", ".join(f"{k} {v:,}" for k, v in need.items() if k != "total")
            + f". Measured peak on rank 0: {res['peak']:,} bytes (<= budget: {res['peak'] <= res['budget']}).\n"
            f"ZeRO-2 would keep {states:,} bytes of model states on this device ({states / res['budget']:.2f}x the "
            f"budget); one process {32 * psi:,} ({32 * psi / res['budget']:.2f}x). The CPU holds the gradient, "
            "master and moment partitions instead.")


# ---- 5. step time with and without DPU ----------------------------------------------------------------
def step_parts(trace: mtrace.Trace, rank: int = 0) -> dict[str, float]:
    """Medians over the steps after the first, on the trace's clock: the step (from its "step" mark to the
    next, or to "flush"), its forward + backward spans, the CPU AdamW span."""
    marks = sorted(e.t0 for e in trace.select("mark", rank=rank) if e.name in ("step", "flush"))
    bounds = list(zip(marks[1:-1], marks[2:], strict=True))  # steps 1 .. S-1 (up to the flush mark)
    spans = trace.select("compute", rank=rank)
    adam = [e.duration for e in spans if e.name == "cpu adam"]  # none in ZeRO-2's run
    return {"step": statistics.median(b - a for a, b in bounds),
            "fb": statistics.median(sum(e.duration for e in spans if e.name in ("F", "B") and a <= e.t0 < b)
                                    for a, b in bounds),
            "adam": statistics.median(adam) if adam else 0.0}


def dpu_table(results: dict[str, Any], clock: Clock = REPLAY) -> Table:
    """Step time (rank 0, median after the first step) of every run on ``clock``, and the model from the
    run's own F+B and AdamW and the offload run's rest = its step - F+B - AdamW (collectives, copies
    between tiers, bookkeeping): no DPU F+B + AdamW + rest; DPU max(F+B, AdamW) + rest."""
    table = Table(title=f"step time in ms, {clock.label} (rank 0, median of steps 1..)", title_justify="left",
                  caption="modelled: the run's F+B and AdamW and the offload run's rest (its step less the two: "
                          "collectives, copies between tiers, bookkeeping); the CPU AdamW after forward and backward "
                          "(no DPU) or beside the next ones on a core of its own (DPU: max(F+B, AdamW)).",
                  caption_justify="left")
    for col in ("run", "F+B", "CPU AdamW", f"step {clock.short}", "step modelled"):
        table.add_column(col, justify="right")
    p0 = step_parts(clock.of(results["offload"]["trace"]))
    rest = max(0.0, p0["step"] - p0["fb"] - p0["adam"])
    table.add_row(RUNS["zero2"], "-", "-", f"{step_parts(clock.of(results['zero2']['trace']))['step'] * 1e3:.2f}", "-")
    for run in ("offload", "dpu"):
        p = p0 if run == "offload" else step_parts(clock.of(results[run]["trace"]))
        modelled = (max(p["fb"], p["adam"]) if run == "dpu" else p["fb"] + p["adam"]) + rest
        table.add_row(RUNS[run], *(f"{p[k] * 1e3:.2f}" for k in ("fb", "adam", "step")), f"{modelled * 1e3:.2f}")
    return table


def hidden_ms(trace: mtrace.Trace, rank: int = 0) -> dict[str, float]:
    """The delayed CPU AdamW on ``rank``, in ms: its total, the part inside F or B spans, how long the
    steps waited for it, and that wait by the formula: per job, max(0, AdamW - the rank's work from its
    post to its wait), the AdamW on a core of its own beside that work."""
    spans = trace.select("compute", rank=rank)
    fb = [(e.t0, e.t1) for e in spans if e.name in ("F", "B")]
    adam = [e for e in spans if e.name == "cpu adam" and e.args.get("delayed")]
    job = {(e.name, e.args["job"]): e.t0 for e in trace.select("mark", rank=rank) if e.args.get("cid") == "cpu adam"}
    ends = [(job[("async posted", k)], job[("async wait", k)], job[("async end", k)]) for _, k in
            sorted(key for key in job if key[0] == "async end")]
    return {"total": sum(e.duration for e in adam) * 1e3,
            "inside": sum(max(0.0, min(e.t1, b) - max(e.t0, a)) for e in adam for a, b in fb) * 1e3,
            "waited": sum(max(0.0, end - wait) for _, wait, end in ends) * 1e3,
            "formula": sum(max(0.0, e.duration - (wait - post)) for e, (post, wait, _) in
                           zip(sorted(adam, key=lambda e: e.t0), ends, strict=True)) * 1e3}


# ---- the lesson -------------------------------------------------------------------------------------
def check_ranks(p: int) -> str | None:
    if p not in (2, 4):
        return f"lesson 7 offloads ZeRO-2 partitions: run it on 2 ranks, or 4 (got {p})"
    return None


def run(comm: Any, steps: int, clock: Clock = REPLAY) -> None:
    console = make_console()
    n, lead = comm.size, comm.rank == 0
    if lead:
        OUT.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    results = run_all(comm, steps)
    if not lead:
        return
    console.rule("[bold]1. the tiers: one tensor device -> cpu -> nvme -> cpu -> device")
    console.print(tour_table(mtrace.load(results["tour"]["trace"])))
    console.print(f"back on the device bit-exact: {results['tour']['same']}", highlight=False)
    console.rule(f"[bold]2. ZeRO-Offload vs ZeRO-2 in memory: N = {n}, {steps} AdamW steps, float64")
    zero2, off = results["zero2"], results["offload"]
    diff = max(float(np.abs(off["params"][k] - zero2["params"][k]).max()) for k in zero2["params"])
    console.print("losses ZeRO-2   " + " ".join(f"{v:.12f}" for v in zero2["losses"]) + "\nlosses Offload  "
                  + " ".join(f"{v:.12f}" for v in off["losses"]), highlight=False)
    console.print(f"ZeRO-Offload trains to ZeRO-2's parameters: largest difference {diff:g} (every move is a copy; "
                  "the same reduce-scatter, the same AdamW, on the CPU).", highlight=False)
    console.rule("[bold]3. bytes between the tiers")
    console.print(bytes_table(results, n))
    console.rule("[bold]4. the device")
    console.print(device_summary(results, n), highlight=False)
    console.print(f"a budget one byte short, on every rank ({len(set(results['oom']))} distinct message):\n  "
                  + results["oom"][0], highlight=False)
    console.rule("[bold]5. the delayed parameter update (DPU)")
    if clock.caveat(2 * n):
        console.print(f"[yellow]note:[/yellow] with DPU each rank runs a second thread (the CPU AdamW): {2 * n} "
                      f"threads share {os.cpu_count()} cores (in-process ranks also share Python's GIL), so the "
                      "measured times include waiting for a core and the DPU step can be no faster, or slower; "
                      "the model gives the CPU step a core of its own.", highlight=False)
    console.print(dpu_table(results, clock))
    h = hidden_ms(clock.of(results["dpu"]["trace"]))
    console.print(f"DPU on rank 0 ({clock.short}): {h['total']:.2f} ms of CPU AdamW, {h['inside']:.2f} of it inside "
                  f"forward/backward spans; the steps waited {h['waited']:.2f} ms for it (formula, max(0, AdamW - "
                  f"the work from its post to its wait): {h['formula']:.2f}). Losses with DPU "
                  + " ".join(f"{v:.6f}" for v in results["dpu"]["losses"]) + " (from step 1 on, one update behind).",
                  highlight=False)
    beyond(console, results, n)
    console.rule("[bold]the ZeRO-Offload run's timeline")
    order = ("offload", "dpu", "mixed", "infinity", "zero2", "tour")  # the report draws the first one's tiers on top
    loops = [results["chunks"][("loop", p)]["trace"] for p in ("lru", "warmup")]
    finish([*(results[r]["trace"] for r in order), *loops], OUT / "report.html", console,
           timeline=results["dpu"]["trace"], titles=[*(RUNS.get(r, TITLES.get(r, r)) for r in order),
                                                     "chunks, reused layer, LRU", "chunks, reused layer, warm-up"],
           extra_figures=[("step time vs device budget, per method (wall clock)", part3.figure(results["sweep"]))],
           clock=clock)


def beyond(console: Any, results: dict[str, Any], n: int) -> None:
    """Sections 6 and 7: ZeRO-Infinity, PatrickStar's chunks, and the three methods' device budgets."""
    inf, zero2 = results["infinity"], results["zero2"]
    console.rule("[bold]6. ZeRO-Infinity: parameters and optimizer state on NVMe, one unit at a time on the device")
    diff = max(float(np.abs(inf["params"][k] - zero2["params"][k]).max()) for k in zero2["params"])
    console.print(f"losses {' '.join(f'{v:.12f}' for v in inf['losses'])}; parameters vs ZeRO-2: largest difference "
                  f"{diff:g}.", highlight=False)
    console.print(part2.infinity_table(inf, n))
    console.rule("[bold]7. PatrickStar chunks: evict by recency (LRU) or by the order recorded in warm-up")
    console.print(part2.chunks_table(results["chunks"]))
    gpt = results["chunks"][("GPT", "warmup")]
    console.print(f"device budget per rank: ZeRO-Offload {results['offload']['budget']:,} bytes (every parameter, a "
                  f"bucket of gradients, an upload), ZeRO-Infinity {inf['budget']:,} (the largest unit and its "
                  f"gradients: 2 max L), chunks {gpt['budget']:,} on one rank (the activations, {gpt['acts']:,}, "
                  f"plus {gpt['fit']} chunks); measured peaks {results['offload']['peak']:,}, {inf['peak']:,}, "
                  f"{gpt['peak']:,}. Not alike: only the chunk manager charges activations to the device "
                  "(PatrickStar's non-model data); ZeRO-Offload's and ZeRO-Infinity's budgets count model data "
                  "alone (activations, autograd's per-parameter gradients and the collectives' buffers live "
                  "beside them, uncharged).", highlight=False)
    console.print(part2.budget_table(sys.modules[__name__], results))
    console.rule("[bold]8. step time vs device budget: from each method's minimum to everything fits")
    if warn := time_sharing(n):
        console.print(f"[yellow]note:[/yellow] {warn}.", highlight=False)
    console.print(part3.sweep_table(results["sweep"], n))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    return parse_lesson_args(lesson_parser(__doc__, steps=4, ranks=2), argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_ranks(run, args.ranks, check_ranks, steps=args.steps, clock=Clock.of_args(args))


if __name__ == "__main__":
    main()
