"""The offload methods side by side on one model (lesson 7): ZeRO-Infinity and PatrickStar's chunks
trained on a budgeted device, each whole run traced with a "step" mark at every step's start and a
"flush" mark after the last, so the bytes and times of every step can be read back from the trace
(``viz.tiers.per_step_moves``, ``viz.offload``).

- ``marked_steps(wrapper, comm, batches)``: the training loop of every method here: per step a
  mark, ``wrapper.loss``, ``backward``, ``step``; the global batch's losses.
- ``train_offload(...)``: ZeRO-Offload (Ren et al. 2021; with ``delayed``, its delayed parameter
  update) on a device of exactly ``offload_device_need`` (or ``budget``), or ZeRO-2 with everything
  in device memory (``in_memory``), the baseline it must equal; ``short_budget_error(...)`` what it
  raises on a device one byte too small.
- ``train_infinity(...)``: ZeRO-Infinity (Rajbhandari et al. 2021, Sec. 5-6) on a device of exactly
  ``zero_infinity_device_need`` (or ``budget``), each rank's NVMe files under ``nvme/rank<r>``.
- ``train_chunks(...)``: PatrickStar (Fang et al. 2021) on one rank, a device of the activations
  measured on the first batch plus ``fit`` chunks, evicting by recency (LRU) or by the warm-up's order;
  ``train_chunk_policies(...)`` each of a few models under both.
- ``Reuse``: ``Linear`` layers applied in an order that comes back to the first: where the recorded
  order of uses beats recency (on a model that uses its layers in order both miss alike).
- ``budget_sweep(...)``: ZeRO-Offload and ZeRO-Infinity at a few device budgets from their minimum
  to ZeRO-2's model states, the chunks from one chunk beside the activations to every chunk: each
  run's trace, with the bytes per step the formulas give.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np

from minipar import functional as F
from minipar import memory, nn
from minipar import trace as mtrace
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.cost.offload import (
    chunk_offload_bytes,
    in_order_misses,
    zero_infinity_bytes,
    zero_infinity_device_need,
    zero_offload_bytes,
)
from minipar.cost.zero import zero_state_bytes
from minipar.parallel.ddp import local_batch
from minipar.parallel.offload.chunks import ChunkManager
from minipar.parallel.offload.infinity import ZeroInfinity
from minipar.parallel.offload.zero_offload import ZeroOffload, offload_device_need
from minipar.parallel.zero import ZeroDataParallel
from minipar.tiers import Bandwidth, DeviceOutOfMemory, Tiers

Batches = Sequence[tuple[np.ndarray, np.ndarray]]


def marked_steps(wrapper: Any, comm: Communicator, batches: Batches, local: bool = True) -> list[float]:
    """Train ``wrapper`` (its ``loss``, ``backward``, ``step``) on ``batches``, each rank on its part of
    the global batch (``local``; else the whole batch), a "step" mark at each step's start and a
    "flush" mark after the last; the global batch's loss per step (the mean over ranks)."""
    losses = []
    for step, (x, y) in enumerate(batches):
        mtrace.mark("step", step=step)
        loss = wrapper.loss(*(local_batch(comm, x, y) if local else (x, y)))
        wrapper.backward(loss)
        wrapper.step()
        losses.append(float(comm.allreduce(np.array([loss.item()]))[0]) / comm.size)
    mtrace.mark("flush")
    return losses


def train_offload(comm: Communicator, make_model: Callable[[], nn.GPT], batches: Batches,
                  trace_path: str | os.PathLike[str] | None, lr: float, bandwidth: Bandwidth, cap: int,
                  budget: int | None = None, delayed: bool = False, in_memory: bool = False,
                  loss_scale: float = 2.0**16, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``make_model()``'s GPT (its dtype: float64, or float16 for mixed precision) under ZeRO-Offload with
    buckets of ``cap`` bytes on a device of ``budget`` bytes (default: exactly ``offload_device_need``),
    ``delayed``: with the delayed parameter update; or ZeRO-2 in device memory (``in_memory``). The
    whole run, from building the wrapper, is traced into ``trace_path`` with ``meta`` (give it
    ``"steps"``: the trace's totals are over every step). Returns the
    losses, this rank's final parameters, the buckets' sizes, the budget and the device's peak."""
    net = make_model()
    precision = "mixed" if net.parameters()[0].data.dtype == np.float16 else "fp64"
    budget = offload_device_need(net, comm.size, cap)["total"] if budget is None else budget
    tiers = Tiers(budget, bandwidth=bandwidth)
    with mtrace.record(trace_path, comm, **(meta or {})):
        if in_memory:
            wrapper = ZeroDataParallel(net, comm, stage=2, lr=lr, bucket_cap_bytes=cap, precision=precision)
            wrapper.loss = lambda x, y: _forward(net, x, y)
        else:
            wrapper = ZeroOffload(net, comm, tiers, lr=lr, precision=precision, delayed_update=delayed,
                                  bucket_cap_bytes=cap, loss_scale=loss_scale)
        losses = marked_steps(wrapper, comm, batches)
        if not in_memory:
            wrapper.flush()  # with the delayed update the last one goes up after the "flush" mark
    numels, params = [b.layout.numel for b in wrapper.buckets], net.state_dict()
    if not in_memory:
        wrapper.close()
    tiers.close()
    return {"losses": losses, "params": params, "numels": numels, "peak": tiers.peak_device_bytes,
            "budget": budget, "trace": trace_path}


def short_budget_error(make_model: Callable[[], nn.GPT], comm: Communicator, cap: int, lr: float) -> str:
    """What ``ZeroOffload`` raises on this rank of ``comm`` given a device one byte below
    ``offload_device_need``: ``<type>: <message>`` (marked if it had placed bytes first), or "no error"."""
    tiers = Tiers(offload_device_need(make_model(), comm.size, cap)["total"] - 1)
    try:
        ZeroOffload(make_model(), comm, tiers, lr=lr, bucket_cap_bytes=cap)
    except DeviceOutOfMemory as exc:
        return f"{type(exc).__name__}: {exc}" + ("" if tiers.device_bytes == 0 else " (but bytes were placed!)")
    return "no error"


def _forward(net: nn.GPT, x: np.ndarray, y: np.ndarray) -> Tensor:
    with mtrace.span("F"):
        return net.loss(x, y)


def unit_sizes(net: nn.GPT) -> list[int]:
    """Elements of each FSDP unit of ``nn.GPT``: embeddings, each block, the final norm, the head."""
    return [sum(p.size for p in m.parameters()) for m in (net.tok_emb, net.pos_emb, *net.blocks, net.ln_f, net.head)]


def train_infinity(comm: Communicator, make_model: Callable[[], nn.GPT], batches: Batches,
                   trace_path: str | os.PathLike[str] | None, nvme: Path, lr: float, bandwidth: Bandwidth,
                   workers: int = 1, depth: int = 1, budget: int | None = None) -> dict[str, Any]:
    """``make_model()``'s GPT under ZeRO-Infinity with ``depth`` units prefetched, on a device of
    ``budget`` bytes (default: exactly ``zero_infinity_device_need``) and ``workers`` NVMe threads per
    rank; the whole run traced into ``trace_path``. Returns the losses, the whole model's parameters,
    the units' sizes, the budget and the device's peak."""
    units = unit_sizes(make_model())
    budget = zero_infinity_device_need(units, comm.size, 8)["total"] if budget is None else budget
    with nn.deferred():
        net = make_model()
    meta = {"paradigm": "ZeRO-Infinity", "time_unit": "s", "steps": len(batches),
            "config": {"N": comm.size, "device budget": budget, "prefetch depth": depth, "units": units}}
    with Tiers(budget, nvme / f"rank{comm.rank}", bandwidth, workers) as tiers:
        with mtrace.record(trace_path, comm, **meta):
            inf = ZeroInfinity(net, comm, tiers, prefetch_depth=depth, lr=lr)
            losses = marked_steps(inf, comm, batches)
        params = inf.full_state_dict()
        inf.close()
    return {"losses": losses, "params": params, "units": units, "budget": budget, "peak": tiers.peak_device_bytes,
            "trace": trace_path}


class Reuse(nn.Module):
    """``Linear(d, d)`` layers applied in ``order`` (a layer may come back), each followed by tanh; an
    MSE loss. ``order=(0, 1, 2, 0)``: the first layer's chunk is needed at both ends of forward, where
    the order of uses beats recency."""

    def __init__(self, d: int, order: tuple[int, ...] = (0, 1, 2, 0)) -> None:
        self.order = order
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(max(order) + 1)])

    def forward(self, x: Tensor) -> Tensor:
        return reduce(lambda h, i: self.layers[i](h).tanh(), self.order, x)

    def loss(self, x: np.ndarray, y: np.ndarray) -> Tensor:
        return F.mse_loss(self(Tensor(x)), y)


def activations(make_model: Callable[[], nn.Module], batch: tuple[np.ndarray, np.ndarray]) -> int:
    """Bytes of one step's autograd graph (what the chunks' warm-up measures at the start of backward)."""
    since = memory.seq_mark()
    return memory.activation_bytes(make_model().loss(*batch), since)


def train_chunks(solo: Communicator, make_model: Callable[[], nn.Module], batches: Batches,
                 trace_path: str | os.PathLike[str] | None, chunk: int, fit: int, policy: str, lr: float,
                 bandwidth: Bandwidth, acts: int | None = None) -> dict[str, Any]:
    """``make_model()`` under PatrickStar's chunks of ``chunk`` elements on the one rank of ``solo``,
    evicting by ``policy`` ("lru" or "warmup"), on a device of the activations (``acts``, default
    measured on the first batch) plus ``fit`` chunks; traced whole. Returns the chunk count and bytes,
    the budget, the device's peak and the parameters."""
    acts = activations(make_model, batches[0]) if acts is None else acts
    tiers = Tiers(acts + fit * 8 * chunk, bandwidth=bandwidth)
    with mtrace.record(trace_path, solo, paradigm=f"PatrickStar chunks ({policy}, {fit} fit)", time_unit="s",
                       steps=len(batches), config={"chunk elements": chunk, "device budget": tiers.device_budget}):
        cm = ChunkManager(make_model(), tiers, chunk, policy=policy, lr=lr)
        marked_steps(cm, solo, batches, local=False)
    out = {"chunks": len(cm.chunks), "chunk_bytes": cm.chunk_bytes, "fit": fit, "acts": acts,
           "budget": tiers.device_budget, "peak": tiers.peak_device_bytes, "params": cm.state_dict(),
           "trace": trace_path}
    cm.close()
    tiers.close()
    return out


def train_chunk_policies(solo: Communicator, models: dict[str, tuple[Callable[[], nn.Module], int, int, Batches]],
                         out: str | os.PathLike[str], lr: float, bandwidth: Bandwidth) -> dict[tuple[str, str], Any]:
    """``train_chunks`` of each of ``models`` (name: (make_model, chunk elements, chunks that fit beside
    the activations, batches)) evicting by recency ("lru"), then by the warm-up's order ("warmup"), both
    on one budget (the activations measured once, on the first batch), traced into
    ``out/chunks_<name>_<policy>.json``; each (name, policy)'s result."""
    results = {}
    for name, (make, size, fit, batches) in models.items():
        acts = activations(make, batches[0])
        for policy in ("lru", "warmup"):
            results[(name, policy)] = train_chunks(solo, make, batches, Path(out) / f"chunks_{name}_{policy}.json",
                                                   size, fit, policy, lr, bandwidth, acts)
    return results


def spread(low: int, high: int, points: int = 3) -> list[int]:
    """``points`` budgets from ``low`` to ``high`` (both included), evenly spaced, rounded to bytes."""
    return sorted({round(low + (high - low) * i / (points - 1)) for i in range(points)})


def budget_sweep(comm: Communicator, make_model: Callable[[], nn.GPT], batches: Batches, chunk_batches: Batches,
                 out: Path, lr: float, bandwidth: Bandwidth, cap: int, numels: list[int], chunk: int, acts: int,
                 workers: int = 1, manifest: int = 0) -> list[tuple[str, int, Path, int, dict[str, int]]]:
    """Step time against the device budget, per method: ZeRO-Offload and ZeRO-Infinity at 3 budgets
    from their minimum to the model states ZeRO-2 keeps per rank (both move the same bytes at every
    budget: their schedules ignore spare memory), the chunks on rank 0 alone (``chunk_batches``) from
    one chunk beside the ``acts`` bytes of activations to every chunk (fewer misses as more fit).
    ``numels``: the ZeRO buckets' sizes (``train_offload``'s) of ``cap`` bytes, for the formulas.
    Collective; rank 0 gets ``(method, budget, trace, formula bytes per step, extra)`` per run (extra:
    the chunks' ``fit`` and ``chunks``), the others []. Traces under ``out/sweep``."""
    sweep, n, rows = out / "sweep", comm.size, []
    if comm.rank == 0:
        sweep.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    units, need = unit_sizes(make_model()), offload_device_need(make_model(), n, cap)["total"]
    full = sum(zero_state_bytes(numels, 2, n).values())
    formula = sum(zero_offload_bytes(numels, 8, 8, dp=n).values())
    for budget in spread(need, full):
        path = sweep / f"offload_{budget}.json"
        train_offload(comm, make_model, batches, path, lr, bandwidth, cap, budget=budget)
        rows.append(("ZeRO-Offload", budget, path, formula, {}))
    need = zero_infinity_device_need(units, n, 8)["total"]
    formula = sum(zero_infinity_bytes(units, n).values()) + manifest
    for budget in spread(need, max(full, need)):
        path = sweep / f"infinity_{budget}.json"
        train_infinity(comm, make_model, batches, path, out / "nvme_infinity", lr, bandwidth, workers, budget=budget)
        rows.append(("ZeRO-Infinity", budget, path, formula, {}))
    solo = comm.split(0 if comm.rank == 0 else 1)
    if comm.rank != 0:
        return []
    k, count = 1, None
    while count is None or k <= count:
        path = sweep / f"chunks_{k}.json"
        run = train_chunks(solo, make_model, chunk_batches, path, chunk, k, "warmup", lr, bandwidth, acts)
        count = run["chunks"]
        formula = sum(chunk_offload_bytes(8 * chunk, in_order_misses(count, k)).values())
        rows.append(("chunks (1 rank)", run["budget"], path, formula, {"fit": k, "chunks": count}))
        k += 1
    return rows
