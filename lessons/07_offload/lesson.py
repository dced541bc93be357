"""Lesson 7: memory tiers and ZeRO-Offload: a budgeted device, the CPU and NVMe, and every byte moved.

    mpiexec -n 2 python lessons/07_offload/lesson.py [--steps 4] [--verbose]
    python lessons/07_offload/lesson.py [--ranks 2]      # same, ranks as threads in one process

minipar has no accelerator, so the device is modelled strictly (``minipar.tiers``): a pool with a byte
budget; going past it raises ``DeviceOutOfMemory``; compute runs only on device-resident arrays. The
CPU is numpy memory, NVMe is real files written by a thread pool. Every copy between tiers is a
"transfer" trace event with its measured time and the ``Bandwidth`` model's (PCIe 16 GB/s, NVMe
3 GB/s read, 2 GB/s write; ``minipar.cost.offload.transfer_seconds``).

ZeRO-Offload (Ren et al. 2021, Sec. 3-5; ``minipar/parallel/offload/zero_offload.py``) keeps the
parameters and forward/backward on the device and moves the rest to the CPU: the gradients stream
down as backward produces them (reduce-scattered first: ZeRO-2, each of the N ranks offloads its
1/N), the CPU holds the master parameters and Adam's moments and runs AdamW, and the updated
parameters go back up: per step and rank P items of gradients down and P of parameters up, P = Psi /
N (padded per bucket), the fewest possible (Sec. 3). With the delayed parameter update (DPU, Sec.
5.2) the CPU's AdamW of step i runs beside the device's forward and backward of step i + 1.

Printed: 1. ZeRO-Offload trains to exactly ZeRO-2's parameters (float64, bit for bit). 2. Bytes
between device and CPU per step and rank, measured from the trace, vs ``zero_offload_bytes``. 3. The
device: budget = ``offload_device_need``, the measured peak, and a budget one byte short raising
``DeviceOutOfMemory`` on every rank before anything is placed. 4. Step time (one step, the median of
steps 1..) with and without DPU, replayed (``--clock``, ``--cluster``: each span at its CPU time, each
thread, the AdamW thread too, on a core of its own) and modelled: the CPU step after forward and
backward, or beside the next ones, max(F+B, AdamW); the steps' wait for the delayed AdamW against
its formula. Then the DPU run's timeline (the whole run: setup, every step, the flush).
``--verbose`` adds: one tensor through device -> cpu -> nvme -> cpu -> device, each move measured and
modelled; the losses; the bytes per step of every step and in mixed precision; ZeRO-Infinity
(parameters and optimizer state on NVMe, one unit at a time on the device: the same parameters,
bytes per step by tier vs ``zero_infinity_bytes``); PatrickStar's chunks on one rank, evicting by
recency (LRU) or by the warm-up's order, on the GPT and on a model that reuses its first layer (where
the order wins), and each method's device budget; step time vs device budget per method, from its
minimum to everything fits, on the wall clock (the NVMe files' and copies' own time, which a replay
does not model). Library: ``minipar.parallel.offload.compare`` (ZeRO-Infinity, chunks), ``viz.offload``
(the tables), ``viz.tiers`` (the report's figures). Writes runs/07_offload/*.json, sweep/*.json and
report.html.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from lessons import common
from lessons.common import console as make_console
from minipar import trace as mtrace
from minipar.cost import offload as formulas
from minipar.cost import zero as zero_formulas
from minipar.nn import GPT
from minipar.parallel.offload import compare, offload_device_need
from minipar.tiers import Bandwidth, Tiers
from viz import offload as views
from viz.tiers import budget_figure
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, LR = 32, 16, 32, 4, 2, 64, 8, 3e-3
CAP = 32 * 1024  # bytes per bucket: the GPT's 158 KB of float64 gradients make several, streamed down one by one
MIXED_SCALE = 2.0**10  # fp16 loss x S must stay under fp16's 65,504 (lesson 6)
TOUR_ITEMS = 1 << 17  # the tour's tensor: 1 MiB of float64
BANDWIDTH = Bandwidth()  # PCIe 16 GB/s, NVMe read 3 GB/s, write 2 GB/s
NVME_WORKERS = 1  # I/O threads per rank (one keeps the order of reads easy to follow in the timeline)
CHUNK, FIT, LOOP_D = 4096, 3, 32  # chunk elements (a block's qkv, 3,072, fits); chunks beside the activations
MANIFEST = 48  # bytes ZeroInfinity's manifest (6 float64) writes per applied step, beyond zero_infinity_bytes
SWEEP_STEPS = 4  # per budget of the sweep: medians over steps 1..3 (step 0 places, warms up)
OUT = Path("runs/07_offload")
RUNS = {"zero2": "ZeRO-2, in device memory", "offload": "ZeRO-Offload", "mixed": "ZeRO-Offload, mixed precision",
        "dpu": "ZeRO-Offload + DPU"}
TITLES = {**RUNS, "infinity": "ZeRO-Infinity", "tour": "memory tiers (tour)"}


def model(precision: str = "fp64") -> GPT:
    dtype = np.float16 if precision == "mixed" else np.float64
    return GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0, dtype=dtype)


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


def train(comm: Any, run: str = "offload", steps: int = 4, trace_path: str | os.PathLike[str] | None = None,
          budget: int | None = None) -> dict[str, Any]:
    """The tiny GPT ``steps`` AdamW steps on ``comm`` as ``run`` (a key of ``RUNS``) on a device of
    ``budget`` bytes (default: exactly ``offload_device_need``), traced whole with a "step" mark per
    step (``compare.train_offload``)."""
    precision = "mixed" if run == "mixed" else "fp64"
    meta = {"paradigm": RUNS[run], "time_unit": "s", "steps": steps,  # the whole run: totals over its steps
            "config": {"N": comm.size, "precision": precision, "device budget": budget, "bucket cap": CAP,
                       "delayed update": run == "dpu", "vocab": VOCAB, "seq": SEQ,
                       "d_model": D_MODEL, "layers": LAYERS, "batch": BATCH}}
    batches = common.lm_batches(steps, VOCAB, BATCH, SEQ)
    return compare.train_offload(comm, lambda: model(precision), batches, trace_path, LR, BANDWIDTH, CAP, budget,
                                 delayed=run == "dpu", in_memory=run == "zero2", loss_scale=MIXED_SCALE, meta=meta)


def run_all(comm: Any, steps: int, out: Path = OUT) -> dict[str, Any]:
    """The tour, the four ZeRO runs, ZeRO-Infinity, the chunks (rank 0 alone) and the budget sweep
    (traces under ``out``), and the too-small budget's message; rank 0's results."""
    results: dict[str, Any] = {"tour": tour(comm, out / "tiers.json", out)}
    for run in RUNS:
        results[run] = train(comm, run, steps, out / f"{run}.json")
    results["oom"] = comm.allgather_object(compare.short_budget_error(model, comm, CAP, LR))
    batches = common.lm_batches(steps, VOCAB, BATCH, SEQ)
    results["infinity"] = compare.train_infinity(comm, model, batches, out / "infinity.json", out / "nvme_infinity",
                                                 LR, BANDWIDTH, NVME_WORKERS)
    solo = comm.split(0 if comm.rank == 0 else 1)
    results["chunks"] = chunks(solo, steps, out) if comm.rank == 0 else {}
    acts = results["chunks"][("GPT", "warmup")]["acts"] if comm.rank == 0 else 0
    sweep = compare.budget_sweep(comm, model, common.lm_batches(SWEEP_STEPS, VOCAB, BATCH, SEQ),
                                 half_batches(SWEEP_STEPS), out, LR, BANDWIDTH, CAP, results["offload"]["numels"],
                                 CHUNK, acts, NVME_WORKERS, MANIFEST)
    results["sweep"] = [views.sweep_row(mtrace.load(p), m, b, BANDWIDTH) | {"formula": f} | extra
                        for m, b, p, f, extra in sweep]
    return results


def half_batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The chunks' batches on one rank: half the global batch."""
    return [(x[:BATCH // 2], y[:BATCH // 2]) for x, y in common.lm_batches(steps, VOCAB, BATCH, SEQ)]


def chunks(solo: Any, steps: int, out: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The GPT and the reused-layer model under both policies on one rank, each on a device of its
    activations + ``FIT`` (GPT) or 2 (loop) chunks."""
    loop = [(np.random.default_rng(i).normal(size=(2, LOOP_D)), np.random.default_rng(10 + i).normal(size=(2, LOOP_D)))
            for i in range(steps)]
    models = {"GPT": (model, CHUNK, FIT, half_batches(steps)),
              "loop": (lambda: compare.Reuse(LOOP_D), LOOP_D * LOOP_D + LOOP_D, 2, loop)}
    return compare.train_chunk_policies(solo, models, out, LR, BANDWIDTH)


def bytes_table(results: dict[str, Any], n: int, verbose: bool) -> Table:
    """Bytes between device and CPU per step of each ZeRO-Offload run vs ``zero_offload_bytes``."""
    runs = ("offload", "mixed", "dpu") if verbose else ("offload", "dpu")
    items = {run: 2 if run == "mixed" else 8 for run in runs}
    want = {RUNS[r]: formulas.zero_offload_bytes(results[r]["numels"], items[r], items[r], dp=n) for r in runs}
    traces = {RUNS[r]: mtrace.load(results[r]["trace"]) for r in runs}
    return views.offload_bytes_table(traces, {RUNS[r]: items[r] for r in runs}, want, n, verbose)


def device_summary(results: dict[str, Any], n: int) -> str:
    res, need = results["offload"], offload_device_need(model(), n, CAP)
    states = sum(zero_formulas.zero_state_bytes(res["numels"], 2, n).values())
    return (f"device budget {res['budget']:,} bytes = offload_device_need ("
            + ", ".join(f"{k} {v:,}" for k, v in need.items() if k != "total")
            + f"); measured peak on rank 0 {res['peak']:,} bytes (<= budget: {res['peak'] <= res['budget']}). "
            f"ZeRO-2 would keep {states:,} bytes of model states on this device ({states / res['budget']:.2f}x "
            f"the budget). A budget one byte short raises on every rank ({len(set(results['oom']))} distinct "
            f"message), before anything is placed: {results['oom'][0].split(':')[0]}. ZeRO-Offload's reach (all "
            f"model states over this need) is {formulas.zero_offload_reach(res['numels'], n, 8, 32):.2f}x here, "
            "below 8x in mixed precision whatever the model: the device keeps every working parameter, a bucket "
            "and an upload (cost.offload.zero_offload_reach; 7.40x at the bound tests/test_offload_bound.py "
            "measures); ZeRO-Infinity and the chunks pass 8x: their parameters leave the device too.")


def dpu_table(results: dict[str, Any], clock: common.Clock, verbose: bool) -> Table:
    """One step's time (rank 0, median of steps 1..) of ZeRO-2, ZeRO-Offload and DPU on ``clock``, modelled."""
    traces = {RUNS[r]: clock.of(results[r]["trace"]) for r in ("zero2", "offload", "dpu")}
    return views.dpu_table(traces, clock.label, clock.short, verbose)


def check_ranks(p: int) -> str | None:
    if p not in (2, 4):
        return f"lesson 7 offloads ZeRO-2 partitions: run it on 2 ranks, or 4 (got {p})"
    return None


def run(comm: Any, steps: int, clock: common.Clock = common.REPLAY, verbose: bool = False) -> None:
    console = make_console()
    n, lead = comm.size, comm.rank == 0
    common.shared_folder(comm, OUT)
    results = run_all(comm, steps)
    if not lead:
        return
    section = common.sections(console)
    if verbose:
        section("the tiers: one tensor device -> cpu -> nvme -> cpu -> device")
        console.print(views.moves_table(mtrace.load(results["tour"]["trace"]), BANDWIDTH))
        console.print(f"back on the device bit-exact: {results['tour']['same']}", highlight=False)
    section(f"ZeRO-Offload vs ZeRO-2 in memory: N = {n}, {steps} AdamW steps, float64")
    zero2, off = results["zero2"], results["offload"]
    if verbose:
        for run in ("zero2", "offload", "dpu"):
            console.print(f"losses {RUNS[run]}: " + " ".join(f"{v:.12f}" for v in results[run]["losses"]),
                          highlight=False)
    diff = common.max_difference(off["params"], zero2["params"])
    console.print(f"ZeRO-Offload trains to ZeRO-2's parameters: largest difference {diff:g} (every move is a copy; "
                  "the same reduce-scatter, the same AdamW, on the CPU).", highlight=False)
    section("bytes between the tiers, per step")
    console.print(bytes_table(results, n, verbose))
    section("the device")
    console.print(device_summary(results, n), highlight=False)
    if verbose:
        console.print(results["oom"][0], highlight=False)
    section("the delayed parameter update (DPU)")
    common.print_note(console, clock.caveat(2 * n) and f"with DPU each rank runs a second thread (the CPU AdamW): "
                      f"{2 * n} threads share {os.cpu_count()} cores (in-process ranks also share Python's GIL), so "
                      "the measured times include waiting for a core and the DPU step can be no faster, or slower; "
                      "the model gives the CPU step a core of its own")
    console.print(dpu_table(results, clock, verbose))
    h = views.hidden_ms(clock.of(results["dpu"]["trace"]))
    console.print(f"DPU on rank 0 over the {steps} steps ({clock.short}): {h['total']:.2f} ms of CPU AdamW, "
                  f"{h['inside']:.2f} of it inside forward/backward spans; the steps waited {h['waited']:.2f} ms for "
                  f"it (formula, max(0, AdamW - the work from its post to its wait): {h['formula']:.2f}).",
                  highlight=False)
    if verbose:
        beyond(console, section, results, n)
    console.rule(f"[bold]the ZeRO-Offload + DPU run, {clock.short}: setup, {steps} steps and the flush")
    order = ("offload", "dpu", "mixed", "infinity", "zero2", "tour")  # the report draws the first one's tiers on top
    loops = [results["chunks"][("loop", p)]["trace"] for p in ("lru", "warmup")]
    common.finish([*(results[r]["trace"] for r in order), *loops], OUT / "report.html", console,
                  timeline=results["dpu"]["trace"],
                  titles=[*(f"{TITLES[r]}, {steps} steps" for r in order[:-1]), TITLES["tour"],
                          "chunks, reused layer, LRU", "chunks, reused layer, warm-up"],
                  extra_figures=[("step time vs device budget, per method (wall clock)",
                                  budget_figure(results["sweep"], "time of one step vs device budget (rank 0, "
                                                "median of steps 1..; wall clock; bytes)"))],
                  clock=clock, brief=not verbose)
    console.print("ZeRO-Offload moves the fewest bytes possible (P down, P up per step and rank) and leaves the "
                  "device only the parameters and a bucket; DPU hides the CPU's AdamW behind the next step.",
                  highlight=False)
    console.print(common.reading_path("07_offload"), highlight=False)


def infinity_table(results: dict[str, Any], n: int) -> Table:
    """ZeRO-Infinity's bytes per step on rank 0 vs ``zero_infinity_bytes`` plus the manifest."""
    inf = results["infinity"]
    want = formulas.zero_infinity_bytes(inf["units"], n)
    want["cpu->nvme"] += MANIFEST
    return views.infinity_table(mtrace.load(inf["trace"]), want, n, MANIFEST)


def chunks_table(results: dict[str, Any]) -> Table:
    """The chunks' bytes up per step vs chunk bytes x misses (the GPT: ``in_order_misses``)."""
    runs, loop = results["chunks"], {"lru": 5, "warmup": 4}  # the loop (layers 0 1 2 0) by hand: test_chunks.py
    misses = {key: formulas.in_order_misses(r["chunks"], r["fit"]) if key[0] == "GPT" else loop[key[1]]
              for key, r in runs.items()}
    want = {key: next(iter(formulas.chunk_offload_bytes(r["chunk_bytes"], misses[key]).values()))
            for key, r in runs.items()}
    return views.chunks_table(runs, {k: mtrace.load(r["trace"]) for k, r in runs.items()}, want)


def beyond(console: Any, section: Any, results: dict[str, Any], n: int) -> None:
    """ZeRO-Infinity, PatrickStar's chunks, each method's budget and the budget sweep (``--verbose``)."""
    inf, zero2 = results["infinity"], results["zero2"]
    section("ZeRO-Infinity: parameters and optimizer state on NVMe")
    diff = common.max_difference(inf["params"], zero2["params"])
    console.print(f"losses {' '.join(f'{v:.12f}' for v in inf['losses'])}; parameters vs ZeRO-2: largest difference "
                  f"{diff:g}.", highlight=False)
    console.print(infinity_table(results, n))
    section("PatrickStar chunks: evict by recency (LRU) or by the warm-up's order")
    console.print(chunks_table(results))
    gpt, off = results["chunks"][("GPT", "warmup")], results["offload"]
    console.print(f"device budget per rank: ZeRO-Offload {off['budget']:,} bytes (every parameter, a bucket of "
                  f"gradients, an upload), ZeRO-Infinity {inf['budget']:,} (the largest unit and its gradients: "
                  f"2 max L), chunks {gpt['budget']:,} on one rank (the activations, {gpt['acts']:,}, plus "
                  f"{gpt['fit']} chunks); measured peaks {off['peak']:,}, {inf['peak']:,}, {gpt['peak']:,}. Only the "
                  "chunk manager charges activations to the device (PatrickStar's non-model data); ZeRO-Offload's "
                  "and ZeRO-Infinity's budgets count model data alone.", highlight=False)
    section("step time vs device budget, from each method's minimum up")
    common.print_note(console, common.time_sharing(n))
    console.print(views.sweep_table(results["sweep"], n))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=4, ranks=2)
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    common.run_lesson(run, parse_args(argv), check_ranks)


if __name__ == "__main__":
    main()
