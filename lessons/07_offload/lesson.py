"""Lesson 7: memory tiers and ZeRO-Offload: a budgeted device, the CPU and NVMe, and every byte moved.

    mpiexec -n 2 python lessons/07_offload/lesson.py [--steps 4] [--verbose]
    python lessons/07_offload/lesson.py [--ranks 2]      # same, ranks as threads in one process

minipar has no accelerator, so the device is modelled strictly (``minipar.tiers``): a pool with a byte
budget; going past it raises ``DeviceOutOfMemory``; compute runs only on device-resident arrays. The
CPU is numpy memory, NVMe is real files (preallocated, page-aligned, O_DIRECT) read and written by a
thread pool. Every copy between tiers is a "transfer" trace event with its measured time and the
``Bandwidth`` model's (``minipar.cost.offload.transfer_seconds``: latency + bytes / bandwidth per
request), at this machine's rates measured when the lesson starts (``minipar.tiers.rates.measure``:
the disk's requests, the copies, the tier's own one-page moves), or those ``minipar calibrate -o
FILE`` wrote beside its cluster file (``FILE.tiers.json``) when the lesson runs with ``--cluster FILE``.

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
``DeviceOutOfMemory`` on every rank before anything is placed. Then how many of every move's measured
times (wall clock) are within 2x of the model (``--verbose``: by link and size). 4. Step time (one
step, the median of steps 1..) with and without DPU on both clocks, replayed (``--cluster``: each
span at its CPU time, each thread, the AdamW thread too, on a core of its own) and wall, modelled: the
CPU step after forward and backward, or beside the next ones, max(F+B, AdamW); the steps' wait for the
delayed AdamW against its formula; and which clock answers "does DPU pay off" (the replayed one: the
wall clock shares 2 cores among the ranks and their AdamW threads). Then the DPU run's timeline (the
whole run: setup, every step, the flush).
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
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from lessons import common
from lessons.common import console as make_console
from minipar import trace as mtrace
from minipar.calibrate import tiers_path
from minipar.cost import offload as formulas
from minipar.cost import zero as zero_formulas
from minipar.nn import GPT
from minipar.parallel.offload import compare, offload_device_need
from minipar.replay import PRESETS
from minipar.tiers import Bandwidth, Tiers
from minipar.tiers import rates as tier_rates
from viz import offload as views
from viz.tiers import budget_figure
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, LR = 32, 16, 32, 4, 2, 64, 8, 3e-3
CAP = 32 * 1024  # bytes per bucket: the GPT's 158 KB of float64 gradients make several, streamed down one by one
MIXED_SCALE = 2.0**10  # fp16 loss x S must stay under fp16's 65,504 (lesson 6)
TOUR_ITEMS = 1 << 17  # the tour's tensor: 1 MiB of float64
TYPICAL = Bandwidth()  # PCIe 4 and NVMe figures, not measured: the default of tour and train
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


def measured_bandwidth(comm: Any, out: Path = OUT, calibrated: str | None = None) -> Bandwidth:
    """The tier model of this machine: the rates ``minipar calibrate`` wrote to ``calibrated`` (a
    ``.tiers.json`` file) if it exists, else measured now under ``out`` by every rank at once, as the
    lesson's ranks share the disk and the cores (``minipar.tiers.rates.measure``, quick: the disk's
    requests and the copies, latency + bytes / bandwidth; ``rates.combine``: the ranks' median)."""
    if calibrated and os.path.exists(calibrated):
        return comm.allgather_object(Bandwidth.load(calibrated) if comm.rank == 0 else None)[0]
    comm.allgather_object(None)  # start together
    return tier_rates.combine(comm.allgather_object(tier_rates.measure(str(out), tier_rates.QUICK_SIZES, 3)))


def tour(comm: Any, trace_path: str | os.PathLike[str] | None = None, out: Path = OUT,
         bandwidth: Bandwidth = TYPICAL) -> dict[str, Any]:
    """One tensor (``TOUR_ITEMS`` float64) on every rank: placed on the device, copied down to the CPU,
    written to this rank's NVMe directory, read back, copied up again; bit-exact at the end."""
    x = np.random.default_rng(comm.rank).standard_normal(TOUR_ITEMS)
    with mtrace.record(trace_path, comm, paradigm="memory tiers (tour)", time_unit="s",
                       config={"items": TOUR_ITEMS, "bandwidth": vars(bandwidth)}), \
            Tiers(2 * x.nbytes, out / "nvme" / f"rank{comm.rank}", bandwidth, NVME_WORKERS) as tiers:
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
          budget: int | None = None, bandwidth: Bandwidth = TYPICAL) -> dict[str, Any]:
    """The tiny GPT ``steps`` AdamW steps on ``comm`` as ``run`` (a key of ``RUNS``) on a device of
    ``budget`` bytes (default: exactly ``offload_device_need``), traced whole with a "step" mark per
    step (``compare.train_offload``)."""
    precision = "mixed" if run == "mixed" else "fp64"
    meta = {"paradigm": RUNS[run], "time_unit": "s", "steps": steps,  # the whole run: totals over its steps
            "config": {"N": comm.size, "precision": precision, "device budget": budget, "bucket cap": CAP,
                       "delayed update": run == "dpu", "vocab": VOCAB, "seq": SEQ,
                       "d_model": D_MODEL, "layers": LAYERS, "batch": BATCH}}
    batches = common.lm_batches(steps, VOCAB, BATCH, SEQ)
    return compare.train_offload(comm, lambda: model(precision), batches, trace_path, LR, bandwidth, CAP, budget,
                                 delayed=run == "dpu", in_memory=run == "zero2", loss_scale=MIXED_SCALE, meta=meta)


def run_all(comm: Any, steps: int, out: Path = OUT, calibrated: str | None = None) -> dict[str, Any]:
    """The tour, the four ZeRO runs, ZeRO-Infinity, the chunks (rank 0 alone) and the budget sweep
    (traces under ``out``), and the too-small budget's message; rank 0's results. ``calibrated``: the
    tier rates file of ``measured_bandwidth``."""
    bw = measured_bandwidth(comm, out, calibrated)
    results: dict[str, Any] = {"bandwidth": bw, "tour": tour(comm, out / "tiers.json", out, bw)}
    for run in RUNS:
        results[run] = train(comm, run, steps, out / f"{run}.json", bandwidth=bw)
    results["ranks"] = comm.size
    results["oom"] = comm.allgather_object(compare.short_budget_error(model, comm, CAP, LR))
    batches = common.lm_batches(steps, VOCAB, BATCH, SEQ)
    results["infinity"] = compare.train_infinity(comm, model, batches, out / "infinity.json", out / "nvme_infinity",
                                                 LR, bw, NVME_WORKERS)
    solo = comm.split(0 if comm.rank == 0 else 1)
    results["chunks"] = chunks(solo, steps, out, bw) if comm.rank == 0 else {}
    acts = results["chunks"][("GPT", "warmup")]["acts"] if comm.rank == 0 else 0
    sweep = compare.budget_sweep(comm, model, common.lm_batches(SWEEP_STEPS, VOCAB, BATCH, SEQ),
                                 half_batches(SWEEP_STEPS), out, LR, bw, CAP, results["offload"]["numels"],
                                 CHUNK, acts, NVME_WORKERS, MANIFEST)
    results["sweep"] = [views.sweep_row(mtrace.load(p), m, b, bw) | {"formula": f} | extra
                        for m, b, p, f, extra in sweep]
    return results


def half_batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The chunks' batches on one rank: half the global batch."""
    return [(x[:BATCH // 2], y[:BATCH // 2]) for x, y in common.lm_batches(steps, VOCAB, BATCH, SEQ)]


def chunks(solo: Any, steps: int, out: Path, bandwidth: Bandwidth) -> dict[tuple[str, str], dict[str, Any]]:
    """The GPT and the reused-layer model under both policies on one rank, each on a device of its
    activations + ``FIT`` (GPT) or 2 (loop) chunks."""
    loop = [(np.random.default_rng(i).normal(size=(2, LOOP_D)), np.random.default_rng(10 + i).normal(size=(2, LOOP_D)))
            for i in range(steps)]
    models = {"GPT": (model, CHUNK, FIT, half_batches(steps)),
              "loop": (lambda: compare.Reuse(LOOP_D), LOOP_D * LOOP_D + LOOP_D, 2, loop)}
    return compare.train_chunk_policies(solo, models, out, LR, bandwidth)


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


def dpu_table(results: dict[str, Any], clock: common.Clock) -> tuple[Table, str]:
    """One step's time (rank 0, median of steps 1..) of ZeRO-2, ZeRO-Offload and DPU on both clocks,
    with the model (``viz.offload.dpu_table``'s: the replayed parts; no DPU F+B + AdamW + rest, DPU
    max(F+B, AdamW) + rest), and the sentence saying which clock answers "does DPU pay off"."""
    replayed, wall = common.Clock("replay", clock.cluster_spec), common.Clock("wall")
    runs = ("zero2", "offload", "dpu")
    parts = {c.short: {r: views.step_parts(c.of(results[r]["trace"])) for r in runs} for c in (replayed, wall)}
    rp, wp = parts["replayed"], parts["wall clock"]
    rest = max(0.0, rp["offload"]["step"] - rp["offload"]["fb"] - rp["offload"]["adam"])
    table = Table(title=f"one step in ms (rank 0, median of steps 1..; replayed on {replayed.cluster.name}; wall: "
                        "the wall clock)",
                  title_justify="left")
    for col in ("run", "F+B", "AdamW", "step replayed", "model", "wall"):
        table.add_column(col, justify="right")
    for r in runs:
        p = rp[r]
        model = "-" if r == "zero2" else f"{((max if r == 'dpu' else sum)((p['fb'], p['adam'])) + rest) * 1e3:.2f}"
        cells = ("-", "-") if r == "zero2" else (f"{p['fb'] * 1e3:.2f}", f"{p['adam'] * 1e3:.2f}")
        table.add_row(RUNS[r], *cells, f"{p['step'] * 1e3:.2f}", model, f"{wp[r]['step'] * 1e3:.2f}")
    gain = {k: v["offload"]["step"] - v["dpu"]["step"] for k, v in parts.items()}
    answer = (f"Does DPU pay off? Ask the replayed clock (a core for each rank and each AdamW thread, as a GPU and "
              f"its host have): it can hide at most the AdamW, {rp['dpu']['adam'] * 1e3:.2f} ms of "
              f"{rp['dpu']['fb'] * 1e3:.2f} ms F+B; the steps differ by {-gain['replayed'] * 1e3:+.2f} ms (the rest: "
              f"noise). The wall clock ({-gain['wall clock'] * 1e3:+.2f} ms) cannot: {2 * results['ranks']} threads "
              f"share {os.cpu_count()} cores.")
    return table, answer


LINKS = ("cpu->device", "device->cpu", "cpu->nvme", "nvme->cpu")


def move_ratios(results: dict[str, Any]) -> dict[str, list[tuple[int, float, float]]]:
    """Every move of the lesson's runs (every rank; wall clock, as recorded), by link ("cpu->nvme (synced)"
    for an atomic write): (bytes, measured s, modelled s)."""
    paths = [results[r]["trace"] for r in ("tour", *RUNS, "infinity")]
    paths += [r["trace"] for r in results["chunks"].values()]
    out: dict[str, list[tuple[int, float, float]]] = {}
    for path in paths:
        for e in mtrace.load(path).events:
            if e.kind == "transfer" and e.nbytes:
                link = f"{e.args['src']}->{e.args['dst']}" + (" (synced)" if e.args.get("synced") else "")
                out.setdefault(link, []).append((e.nbytes, e.duration, e.args["modelled_s"]))
    return out


def moves_summary(results: dict[str, Any], verbose: bool) -> str:
    """How many of the lesson's moves took within 2x of the model (``verbose``: the median ratio per link)."""
    bw, ratios = results["bandwidth"], move_ratios(results)
    every = [m / t for v in ratios.values() for _, m, t in v]
    within = sum(0.5 <= r <= 2 for r in every)
    per_link = ", ".join(f"{k} {statistics.median(m / t for _, m, t in v):.2f}" for k, v in sorted(ratios.items()))
    return (f"Moves between tiers (wall clock) vs the model at rates measured just now by every rank at once "
            f"(disk write / read "
            f"{bw.nvme_write / 1e9:.2f} / {bw.nvme_read / 1e9:.2f} GB/s + {bw.nvme_write_latency * 1e6:.0f} / "
            f"{bw.nvme_read_latency * 1e6:.0f} us, synced + {bw.nvme_sync * 1e3:.1f} ms, IQR "
            f"{bw.nvme_sync_spread * 1e3:.1f}; copy {bw.pcie / 1e9:.0f} GB/s "
            f"+ {bw.pcie_latency * 1e6:.1f} us): {within:,} of {len(every):,} within 2x"
            + (f"; measured / modelled, median: {per_link}." if verbose else "."))


def moves_table(results: dict[str, Any]) -> Table:
    """``--verbose``: per link and size, the moves' median measured and modelled time (wall clock)."""
    table = Table(title="moves between tiers by link and size, every run and rank: median ms (wall clock)",
                  title_justify="left",
                  caption="modelled at rates the ranks measured together (sharing the disk and the cores as "
                          "here); a move's destination is mapped before it (no page faults in it). Misses: the "
                          "spread of a loaded machine (preemption, the GIL between a rank's compute and its I/O "
                          "thread; fdatasync's IQR above).", caption_justify="left")
    for col in ("link", "bytes", "moves", "measured", "modelled", "within 2x"):
        table.add_column(col, justify="right")
    for link, moves in sorted(move_ratios(results).items()):
        for lo, hi in ((1, 1 << 12), ((1 << 12) + 1, 1 << 16), ((1 << 16) + 1, 1 << 40)):
            mine = [(m, t) for n, m, t in moves if lo <= n <= hi]
            if mine:
                table.add_row(link, f"{lo:,}-{hi:,}" if hi < 1 << 40 else f"> {lo - 1:,}", f"{len(mine):,}",
                              f"{statistics.median(m for m, _ in mine) * 1e3:.3f}",
                              f"{statistics.median(t for _, t in mine) * 1e3:.3f}",
                              f"{sum(0.5 <= m / t <= 2 for m, t in mine)}")
    return table


def check_ranks(p: int) -> str | None:
    if p not in (2, 4):
        return f"lesson 7 offloads ZeRO-2 partitions: run it on 2 ranks, or 4 (got {p})"
    return None


def run(comm: Any, steps: int, clock: common.Clock = common.REPLAY, verbose: bool = False) -> None:
    console = make_console()
    n, lead = comm.size, comm.rank == 0
    common.shared_folder(comm, OUT)
    calibrated = None if clock.cluster_spec in PRESETS else tiers_path(clock.cluster_spec)  # minipar calibrate's
    results = run_all(comm, steps, calibrated=calibrated)
    if not lead:
        return
    section = common.sections(console)
    if verbose:
        section("the tiers: one tensor device -> cpu -> nvme -> cpu -> device")
        console.print(views.moves_table(mtrace.load(results["tour"]["trace"]), results["bandwidth"]))
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
    console.print(moves_summary(results, verbose), highlight=False)
    if verbose:
        console.print(moves_table(results))
    section("the delayed parameter update (DPU)")
    table, answer = dpu_table(results, clock)
    console.print(table)
    h = views.hidden_ms(clock.of(results["dpu"]["trace"]))
    console.print(f"DPU on rank 0, {steps} steps ({clock.short}): {h['total']:.2f} ms of AdamW, {h['inside']:.2f} "
                  f"inside F/B spans; the steps waited {h['waited']:.2f} ms for it (formula, max(0, AdamW - the work "
                  f"from its post to its wait): {h['formula']:.2f}). {answer}",
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
