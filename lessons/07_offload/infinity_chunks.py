"""Lesson 7, part two: ZeRO-Infinity and PatrickStar's chunks on the same tiny GPT (``lesson.py`` loads
this file; its constants come from there).

ZeRO-Infinity (Rajbhandari et al. 2021, Sec. 5-6; ``minipar/parallel/offload/infinity.py``): ZeRO
stage 3 with each rank's parameter shards and AdamW state in its own NVMe files; before a unit computes
(forward, and again for backward) this rank reads only its 1/N shard (bandwidth-centric), copies it up
and the all-gather assembles the unit on the device, ``prefetch_depth`` units ahead; the device holds
one unit and its gradient buffer, ``2 max L`` items (``zero_infinity_device_need``).

PatrickStar (Fang et al. 2021; ``minipar/parallel/offload/chunks.py``), one rank: parameters packed
into chunks that move whole between device and CPU as their tensors' states demand; the device budget
minus the activations measured in the warm-up iteration is what the chunks get; a chunk to evict is
chosen by recency (LRU) or by the order of uses recorded in warm-up (Belady's rule). On a model that
uses its layers in order both keep the most recent chunks and miss alike (``in_order_misses``); a model
that reuses its first layer at the end is where the recorded order wins.
"""

from __future__ import annotations

import os
import statistics
from functools import reduce
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from minipar import functional as F
from minipar import memory, nn
from minipar import trace as mtrace
from minipar.autograd import Tensor
from minipar.cost.offload import chunk_offload_bytes, in_order_misses, zero_infinity_bytes, zero_infinity_device_need
from minipar.parallel.ddp import local_batch
from minipar.parallel.offload import ChunkManager, ZeroInfinity
from minipar.tiers import Tiers
from viz.tiers import moves, per_step_moves
from viz.width import Table

CHUNK = 4096  # elements per chunk (32 KiB in float64): the largest tensor (a block's qkv, 3,072) fits
FIT = 3  # chunks that fit beside the activations at the start of backward
LOOP_D = 32  # the reused-layer model: three Linear(32, 32), one chunk each
MANIFEST = 48  # bytes ZeroInfinity's manifest (6 float64) writes per applied step, beyond zero_infinity_bytes


def unit_sizes(net: nn.GPT) -> list[int]:
    """Elements of each FSDP unit of ``nn.GPT``: embeddings, each block, the final norm, the head."""
    return [sum(p.size for p in m.parameters()) for m in (net.tok_emb, net.pos_emb, *net.blocks, net.ln_f, net.head)]


def train_infinity(lesson: ModuleType, comm: Any, steps: int, trace_path: str | os.PathLike[str] | None,
                   out: Path, depth: int = 1, budget: int | None = None) -> dict[str, Any]:
    """The lesson's GPT under ZeRO-Infinity on a device of ``budget`` bytes (default: exactly
    ``zero_infinity_device_need``), each rank's files under ``out/nvme_infinity/rank<r>``; traced whole
    with "step" marks."""
    units = unit_sizes(lesson.model())
    budget = zero_infinity_device_need(units, comm.size, 8)["total"] if budget is None else budget
    with nn.deferred():
        net = lesson.model()
    meta = {"paradigm": "ZeRO-Infinity", "time_unit": "s",
            "config": {"N": comm.size, "device budget": budget, "prefetch depth": depth, "units": units}}
    losses = []
    with Tiers(budget, out / "nvme_infinity" / f"rank{comm.rank}", lesson.BANDWIDTH, lesson.NVME_WORKERS) as tiers:
        with mtrace.record(trace_path, comm, **meta):
            inf = ZeroInfinity(net, comm, tiers, prefetch_depth=depth, lr=lesson.LR)
            for step, (x, y) in enumerate(lesson.batches(steps)):
                mtrace.mark("step", step=step)
                loss = inf.loss(*local_batch(comm, x, y))
                inf.backward(loss)
                inf.step()
                losses.append(float(comm.allreduce(np.array([loss.item()]))[0]) / comm.size)
            mtrace.mark("flush")
        params = inf.full_state_dict()
        inf.close()
    return {"losses": losses, "params": params, "units": units, "budget": budget, "peak": tiers.peak_device_bytes,
            "trace": trace_path}


def infinity_table(res: dict[str, Any], n: int) -> Table:
    table = Table(title=f"ZeRO-Infinity: bytes between tiers per step on rank 0 (N = {n}, float64), measured vs "
                        "zero_infinity_bytes", title_justify="left",
                  caption="nvme->cpu: this rank's shard before each unit's forward and backward (2 x 8 s) and the "
                          "step's reads of shard and moments (24 s); cpu->nvme: the step's writes (24 s) and the "
                          f"manifest that commits them ({MANIFEST} bytes); cpu->device: the shard up twice (16 s); "
                          "device->cpu: the gradient partition (8 s); s = Psi / N.",
                  caption_justify="left")
    want = zero_infinity_bytes(res["units"], n)
    want["cpu->nvme"] += MANIFEST
    steps = per_step_moves(mtrace.load(res["trace"]), 0)[1:-1]
    for col in ("move", *(f"step {i}" for i in range(len(steps))), "formula"):
        table.add_column(col, justify="right")
    for key in want:
        table.add_row(key, *(f"{s.get(key, 0):,}" for s in steps), f"{want[key]:,}")
    return table


class Reuse(nn.Module):
    """``Linear(d, d)`` layers applied in ``order`` (a layer may come back), each followed by tanh; an
    MSE loss. ``order=(0, 1, 2, 0)``: the first layer's chunk is needed at both ends of forward, where
    the order of uses beats recency."""

    def __init__(self, d: int, order: tuple[int, ...] = (0, 1, 2, 0), seed: int = 3) -> None:
        self.seed, self.order = seed, order
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(max(order) + 1)])

    def forward(self, x: Tensor) -> Tensor:
        return reduce(lambda h, i: self.layers[i](h).tanh(), self.order, x)

    def loss(self, x: np.ndarray, y: np.ndarray) -> Tensor:
        return F.mse_loss(self(Tensor(x)), y)


def loop_batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.random.default_rng(i).normal(size=(2, LOOP_D)), np.random.default_rng(10 + i).normal(size=(2, LOOP_D)))
            for i in range(steps)]


def activations(make: Any, batch: tuple[np.ndarray, np.ndarray]) -> int:
    """Bytes of one step's autograd graph (what the warm-up measures at the start of backward)."""
    since = memory.seq_mark()
    return memory.activation_bytes(make().loss(*batch), since)


def train_chunks(lesson: ModuleType, comm: Any, steps: int, out: Path) -> dict[str, Any]:
    """On rank 0 alone (a communicator of one: ``comm.split``): the GPT and the reused-layer model under
    both policies, each on a device of its activations + ``FIT`` (GPT) or 2 (loop) chunks; per step the
    bytes each way. Returns rank 0's results (other ranks: {})."""
    solo = comm.split(0 if comm.rank == 0 else 1)
    if comm.rank != 0:
        return {}
    gpt_batches = [(x[:lesson.BATCH // 2], y[:lesson.BATCH // 2]) for x, y in lesson.batches(steps)]
    models = {"GPT": (lesson.model, CHUNK, FIT, gpt_batches),
              "loop": (lambda: Reuse(LOOP_D), LOOP_D * LOOP_D + LOOP_D, 2, loop_batches(steps))}
    results: dict[str, Any] = {}
    for name, (make, size, fit, batches) in models.items():
        acts = activations(make, batches[0])
        for policy in ("lru", "warmup"):
            path = out / f"chunks_{name}_{policy}.json"
            tiers = Tiers(acts + fit * 8 * size, bandwidth=lesson.BANDWIDTH)
            net = make()
            with mtrace.record(path, solo, paradigm=f"PatrickStar chunks ({name}, {policy})", time_unit="s",
                               config={"chunk elements": size, "device budget": tiers.device_budget}):
                cm = ChunkManager(net, tiers, size, policy=policy, lr=lesson.LR)
                for step, (x, y) in enumerate(batches):
                    mtrace.mark("step", step=step)
                    cm.backward(cm.loss(x, y))
                    cm.step()
                mtrace.mark("flush")
            results[(name, policy)] = {"chunks": len(cm.chunks), "chunk_bytes": cm.chunk_bytes, "fit": fit,
                                       "acts": acts, "budget": tiers.device_budget, "peak": tiers.peak_device_bytes,
                                       "params": cm.state_dict(), "trace": path}
            cm.close()
            tiers.close()
    return results


def chunks_table(results: dict[tuple[str, str], dict[str, Any]]) -> Table:
    table = Table(title="PatrickStar chunks on one rank: bytes up (cpu -> device) per step, LRU vs the warm-up's "
                        "order", title_justify="left",
                  caption="step 0 is the warm-up (both policies evict by recency while it records the order). "
                          "formula: chunk bytes x misses; GPT: in_order_misses(C, k) = C + (C - k); the loop "
                          "(layers 0 1 2 0) by hand: LRU 5, warm-up order 4 (tests/test_chunks.py).",
                  caption_justify="left")
    for col in ("model", "policy", "chunks C", "fit k", "budget (acts + k chunks)", "peak", "up per step",
                "formula"):
        table.add_column(col, justify="right")
    for (name, policy), r in results.items():
        steps = per_step_moves(mtrace.load(r["trace"]), 0)[1:-1]
        misses = in_order_misses(r["chunks"], r["fit"]) if name == "GPT" else {"lru": 5, "warmup": 4}[policy]
        want = chunk_offload_bytes(r["chunk_bytes"], misses)
        table.add_row(name, policy, str(r["chunks"]), str(r["fit"]),
                      f"{r['acts']:,} + {r['fit']} x {r['chunk_bytes']:,}",
                      f"{r['peak']:,}", " ".join(f"{s.get('cpu->device', 0):,}" for s in steps),
                      f"{next(iter(want.values())):,}")
    return table


def step_time(trace: mtrace.Trace, rank: int = 0) -> dict[str, float]:
    """Medians over steps 1.. (between consecutive "step" / "flush" marks on ``rank``): the step's wall
    time and its moves' measured and modelled seconds."""
    marks = sorted(e.t0 for e in trace.select("mark", rank=rank) if e.name in ("step", "flush"))
    windows = list(zip(marks[1:-1], marks[2:], strict=True))
    mine = moves(trace, rank)

    def median(value: Any) -> float:
        return statistics.median(sum(value(e) for e in mine if a <= e.t0 < b) for a, b in windows)

    return {"step": statistics.median(b - a for a, b in windows), "measured": median(lambda e: e.duration),
            "modelled": median(lambda e: e.args["modelled_s"])}


def budget_table(lesson: ModuleType, results: dict[str, Any]) -> Table:
    """Each method's device budget beside its step time on rank 0, and the time of its moves per step."""
    table = Table(title="device budget vs step time on rank 0 (ms; medians of steps 1..; wall clock)",
                  title_justify="left",
                  caption="moves modelled: the Bandwidth model (PCIe 16 GB/s, NVMe 3 GB/s read, 2 GB/s write); "
                          "measured: memory copies and fsync'ed files on this machine (NVMe's many small fsync'ed "
                          "files cost far more than the model's bandwidth says). ZeRO-2's row: the model states it "
                          "keeps on the device, its need. Chunks: one rank, half the global batch.",
                  caption_justify="left")
    for col in ("method", "device budget", "step", "moves measured", "moves modelled"):
        table.add_column(col, justify="right")
    zero2 = sum(lesson.zero_formulas.zero_state_bytes(results["zero2"]["numels"], 2, len(results["oom"])).values())
    rows = [("ZeRO-2, in device memory", zero2, results["zero2"]), ("ZeRO-Offload", None, results["offload"]),
            ("ZeRO-Offload + DPU", None, results["dpu"]), ("ZeRO-Infinity", None, results["infinity"]),
            ("chunks (GPT, warm-up order)", None, results["chunks"][("GPT", "warmup")])]
    for name, budget, res in rows:
        t = step_time(mtrace.load(res["trace"]))
        table.add_row(name, f"{budget if budget is not None else res['budget']:,}", f"{t['step'] * 1e3:.2f}",
                      f"{t['measured'] * 1e3:.3f}", f"{t['modelled'] * 1e3:.3f}")
    return table
