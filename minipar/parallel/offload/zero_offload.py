"""ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", Sec. 4
and 5): the parameters and forward/backward on the device, the gradients, the master parameters, the
Adam moments and the optimizer step on the CPU, on top of ZeRO stage 2 across ranks.

Where every byte lives (per rank, N ranks, Psi parameters; the paper's placement, Sec. 3-4)::

    device   working parameters, every bucket as one flat padded buffer (fp16 in "mixed",
             fp64 in "fp64"; the model's parameters are views of it)              sum L   items
             one bucket's gradient buffer, reused bucket after bucket              max L   items
             one updated partition on its way up (freed at once)                  max L/N items
    cpu      this rank's partition of the gradients (working precision), of the master
             parameters (fp32; fp64 in "fp64") and of AdamW's two moments (master precision)
                                                                                   4 sum L/N items

Per step: backward fills the gradient buffer bucket by bucket (as ``ZeroDataParallel`` stage 2, in
reverse order); as soon as a bucket's gradients are complete they are divided by N, reduce-scattered
(N = 1: kept whole) and this rank's partition is copied down to the CPU (``Tiers.to_cpu``, one
"transfer" event). The step runs AdamW on the CPU partitions (mixed: unscale into fp32, skip on an
overflow on any rank, dynamic loss scale, Micikevicius et al. 2018), casts each updated master
partition to the working precision, copies it up (``Tiers.to_device``) into the parameters' own
partition and all-gathers the parameters. Bytes moved between the tiers per step per rank: the
padded partitions once each way, ``sum L/N x itemsize`` down and the same up (mixed: 2 bytes each,
the paper's "2 Psi of fp16 gradients down, 2 Psi of fp16 parameters up", divided by N under ZeRO-2;
``minipar.cost.offload.zero_offload_bytes``).

One-step delayed parameter update (DPU, Sec. 5.2), the paper's rule in our words: the first N - 1
steps run without DPU (early in training the gradients change fast); at step N the gradients reach
the CPU but neither the CPU step nor the device's parameters are updated; at step N + 1 the CPU
computes the update from step N's gradients while the device runs forward and backward on the
parameters updated at step N - 1; from then on step i + 1 trains on the parameters updated with the
gradients of step i - 1. Here ``warmup_steps`` is the paper's N - 1 (the
paper's N is a hyperparameter, not the ranks). From step ``warmup_steps`` (counting from 0) on,
``step()`` first waits for the previous step's CPU update, copies it up and all-gathers it, then
starts this step's CPU update on a background thread and returns: the next forward/backward runs
beside it, on the parameters from before it. Every gradient is applied exactly once, in order; the last one is
still pending after the last ``step()`` until ``flush()``. Every collective (the reduce-scatters,
the overflow all-reduce, the all-gathers) stays on the calling thread: the background thread only
runs AdamW on CPU arrays.

The device is ``minipar.tiers.Tiers``: every array above is charged to its byte budget and every
copy between tiers is a recorded transfer. The budget is checked before anything is placed: below
``offload_device_need`` it raises ``DeviceOutOfMemory`` on every rank with the same message, before
any communication. Not charged (kept out of the model as in ``ZeroDataParallel``): autograd's own
gradient arrays and activations while backward runs, and the collectives' temporaries.

Trace: spans "F", "B", "opt" and "cpu adam" (the CPU AdamW, ``args.delayed`` with DPU: recorded by
the background thread, with CPU times, so it lies beside the next "F" and "B", between the marks
"async posted" / "start" / "end" / "wait" a non-blocking collective leaves, ``args.cid`` "cpu adam");
the tiers' "transfer" events and "device" memory samples; a "cpu" memory sample (``state_bytes``'
cpu entries) after every change of them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from minipar import residency, trace
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.comm.asyncwork import job_mark
from minipar.cost.offload import zero_offload_device_need
from minipar.nn import Module, Parameter
from minipar.optim import AdamW
from minipar.parallel.ddp import DEFAULT_BUCKET_CAP, bucket_assignment
from minipar.parallel.zero.flat import layout_of
from minipar.parallel.zero.stages import check_zero_config
from minipar.tiers import DeviceOutOfMemory, Tiers

ALGORITHM = "ring"  # hand-written collectives: every message is in the trace
MASTER = {"fp64": np.float64, "mixed": np.float32}


def _groups(module: Module, bucket_cap_bytes: int) -> list[list[tuple[str, Parameter]]]:
    """The buckets' (name, parameter) lists, as ``ZeroDataParallel`` groups them (reverse order)."""
    named = list(module.named_parameters())
    groups = bucket_assignment([p.data.nbytes for _, p in named], [p.data.dtype for _, p in named],
                               bucket_cap_bytes)
    return [[named[j] for j in g] for g in groups]


def offload_device_need(module: Module, world: int, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP) -> dict[str, int]:
    """Device bytes ``ZeroOffload`` holds at its peak on every rank: the padded working parameters of
    every bucket, the largest bucket's gradient buffer, the largest updated partition on its way up,
    and their ``total`` (the smallest device budget that trains; ``cost.offload.zero_offload_device_need``)."""
    groups = [sum(p.data.size for _, p in g) for g in _groups(module, bucket_cap_bytes)]
    return zero_offload_device_need(groups, world, np.dtype(next(iter(module.parameters())).dtype).itemsize)


class OffloadBucket:
    """A group of parameters: one flat padded working buffer on the device (the parameters are views of
    it) and, on the CPU, this rank's partition of its master parameters and gradients."""

    def __init__(self, index: int, named: list[tuple[str, Parameter]], comm: Communicator, tiers: Tiers,
                 master_dtype: Any) -> None:
        self.index, self.names = index, [n for n, _ in named]
        self.params = [p for _, p in named]
        self.layout = layout_of(named, comm.size)
        host = self.layout.flatten([p.data for p in self.params], self.params[0].dtype)
        self.lo, self.hi = self.layout.shard_range(comm.rank)
        self.master = Tensor(host[self.lo:self.hi].astype(master_dtype))  # cpu, a copy
        self.flat = tiers.to_device(f"parameters/bucket{index}", host)
        for p, view in zip(self.params, self.layout.views(self.flat), strict=True):
            p.data = view
        self.cpu_grad: np.ndarray | None = None  # this rank's partition of the averaged gradients
        self.ready: set[int] = set()


class ZeroOffload:
    """ZeRO-Offload of ``module`` over ``comm``, the device being ``tiers`` (every rank calls this).

    Per step: ``loss = offload.loss(x, y)`` (or ``offload(x)``, or ``module.loss`` directly: every op
    checks that the parameters it reads are device-resident, ``minipar.residency``),
    ``offload.backward(loss)``, ``offload.step()``; ``flush()`` after the last step with ``delayed_update``
    applies the pending update; ``close()`` ends the background thread and frees the device arrays.
    """

    def __init__(self, module: Module, comm: Communicator, tiers: Tiers, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 precision: str = "fp64", delayed_update: bool = False, warmup_steps: int = 0,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP, loss_scale: float = 2.0**12,
                 growth_interval: int = 2000) -> None:
        check_zero_config(comm, module, 2, bucket_cap_bytes, precision)
        if warmup_steps < 0:
            raise ValueError(f"ZeroOffload: warmup_steps={warmup_steps} must be >= 0")
        self._check_budget(module, comm, tiers, bucket_cap_bytes)
        self.module, self.comm, self.tiers, self.precision = module, comm, tiers, precision
        self.delayed_update, self.warmup_steps, self.growth_interval = delayed_update, warmup_steps, growth_interval
        self.loss_scale = loss_scale if precision == "mixed" else 1.0
        self.clean_steps = self.skipped = self.steps = 0
        self.buckets = [OffloadBucket(i, g, comm, tiers, MASTER[precision])
                        for i, g in enumerate(_groups(module, bucket_cap_bytes))]
        dtype = self.buckets[0].flat.dtype
        self.grad_buffer = tiers.empty("gradient bucket", max(b.layout.padded for b in self.buckets), dtype)
        self.adam = AdamW([b.master for b in self.buckets], lr, betas, eps, weight_decay)
        self._where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        self._next = 0
        for p in module.parameters():
            p.register_hook(self._on_grad_ready)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-adam") if delayed_update else None
        self._pending: tuple[Future, trace.Recorder | None, dict[str, Any]] | None = None  # DPU's job
        self._unguard = residency.guard(self, tiers, module.named_parameters(), "cpu")
        self._sample()

    @staticmethod
    def _check_budget(module: Module, comm: Communicator, tiers: Tiers, bucket_cap_bytes: int) -> None:
        """Raise ``DeviceOutOfMemory`` (same message on every rank, nothing placed, nothing sent)."""
        need = offload_device_need(module, comm.size, bucket_cap_bytes)
        if tiers.device_bytes + need["total"] > tiers.device_budget:
            parts = ", ".join(f"{k} {v}" for k, v in need.items() if k != "total")
            raise DeviceOutOfMemory(tiers.device_budget, tiers.resident("device"), f"ZeroOffload ({parts})",
                                    need["total"])

    # ---- device work (every op checks its parameters are on the device: minipar.residency) ------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with trace.span("F"):
            return self.module(*args, **kwargs)

    def loss(self, *args: Any) -> Tensor:
        """``module.loss(*args)`` on the device-resident parameters."""
        with trace.span("F"):
            return self.module.loss(*args)

    def scale(self, loss: Tensor) -> Tensor:
        """What backward starts from: ``loss * S`` in mixed precision, ``loss`` otherwise."""
        return loss * self.loss_scale if self.precision == "mixed" else loss

    def _on_grad_ready(self, p: Tensor) -> None:
        bucket, j = self._where[id(p)]
        bucket.ready.add(j)
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
                self.buckets[self._next].params):
            self._offload(self.buckets[self._next])
            self._next += 1
            self._sample()

    def _offload(self, b: OffloadBucket) -> None:
        """The bucket's gradients into the device buffer, / N, reduce-scattered; this rank's partition
        copied down to the CPU (accumulated there over backwards until the step)."""
        buf = self.grad_buffer[:b.layout.padded]
        buf[b.layout.numel:] = 0
        for view, p in zip(b.layout.views(buf), b.params, strict=True):
            view[...] = 0 if p.grad is None else p.grad
            p.grad = None
        buf /= self.comm.size  # before the sum: float16 overflows where one process would
        part = buf[b.lo:b.hi]
        part[...] = self.comm.reduce_scatter(buf, op="sum", algorithm=ALGORITHM)
        down = self.tiers.to_cpu(f"gradients/bucket{b.index}", part)
        b.cpu_grad = down if b.cpu_grad is None else b.cpu_grad + down
        b.ready.clear()

    def backward(self, loss: Tensor) -> None:
        """Backward from ``scale(loss)``; buckets offloaded as they fill, the incomplete ones at the end."""
        with trace.span("B"):
            self.scale(loss).backward()
            for b in self.buckets[self._next:]:
                self._offload(b)
            self._next = 0
        self._sample()

    # ---- the CPU step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """AdamW on the CPU partitions and the updated parameters up (delayed by one step with
        ``delayed_update`` after ``warmup_steps``). False when mixed precision skipped this step's
        gradients (an overflow on some rank)."""
        with trace.span("opt"):
            grads = self._cpu_grads()
            if self._pool is None or self.steps < self.warmup_steps:
                if grads is not None:
                    self._update(grads)
                    self._upload()
            else:
                self._finish_pending()
                if grads is not None:
                    rec, job = trace.current(), {"cid": "cpu adam", "job": self.steps}
                    job_mark(rec, "async posted", job)
                    self._pending = (self._pool.submit(self._update, grads, rec, job), rec, job)
            self.steps += 1
        self._sample()
        return grads is not None

    def _cpu_grads(self) -> list[np.ndarray] | None:
        """The partitions' gradients as AdamW takes them (mixed: fp32, unscaled); None on an overflow
        on any rank (one all-reduce: every rank decides alike; then S / 2)."""
        grads = [b.cpu_grad if b.cpu_grad is not None else np.zeros(b.hi - b.lo, b.flat.dtype) for b in self.buckets]
        for b in self.buckets:
            b.cpu_grad = None
        if self.precision != "mixed":
            return grads
        grads = [g.astype(np.float32) / np.float32(self.loss_scale) for g in grads]
        bad = float(sum(int(not np.isfinite(g).all()) for g in grads))
        if self.comm.allreduce(np.array([bad]), op="sum", algorithm=ALGORITHM)[0] > 0:
            self.loss_scale /= 2
            self.clean_steps = 0
            self.skipped += 1
            trace.mark("overflow: step skipped", loss_scale=self.loss_scale)
            return None
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.loss_scale *= 2
        return grads

    def _update(self, grads: list[np.ndarray], rec: trace.Recorder | None = None,
                job: dict[str, Any] | None = None) -> None:
        """AdamW on the CPU master partitions, a "cpu adam" span on the thread that runs it. With DPU
        (``job``) that is the background thread, recording into the rank's ``rec`` between the job's
        "async start" and "async end" marks (``asyncwork.job_mark``), as a non-blocking collective's
        worker does: a replay starts it where it was posted and runs it beside the next forward."""
        if job is None:
            self._adam(grads, delayed=False)
            return
        with trace.bound(rec):
            job_mark(rec, "async start", job)
            self._adam(grads, delayed=True)
            job_mark(rec, "async end", job)

    def _adam(self, grads: list[np.ndarray], delayed: bool) -> None:
        with trace.span("cpu adam", args={"delayed": delayed}):
            for b, g in zip(self.buckets, grads, strict=True):
                b.master.grad = g
            self.adam.step()
            for b in self.buckets:
                b.master.grad = None

    def _upload(self) -> None:
        """Each updated master partition cast to the working precision on the CPU, copied up into the
        parameters' own partition, then the parameters all-gathered."""
        for b in self.buckets:
            name = f"update/bucket{b.index}"
            b.flat[b.lo:b.hi] = self.tiers.to_device(name, b.master.data.astype(b.flat.dtype))
            self.tiers.free(name)
            b.flat[...] = self.comm.allgather(b.flat[b.lo:b.hi], algorithm=ALGORITHM)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            pending, rec, job = self._pending
            job_mark(rec, "async wait", job)
            pending.result()
            self._pending = None
            self._upload()

    def flush(self) -> None:
        """Wait for the pending delayed update and copy it up (every gradient so far then applied)."""
        with trace.span("opt"):
            self._finish_pending()
        self._sample()

    def close(self) -> None:
        """Finish the pending update, stop the background thread, free this wrapper's device arrays."""
        self.flush()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for name in [f"parameters/bucket{b.index}" for b in self.buckets] + ["gradient bucket"]:
            self.tiers.free(name)
        self._unguard()

    def _sample(self) -> None:
        """A "cpu" memory sample: this rank's bytes in host memory now (the device samples itself)."""
        if trace.current() is not None:
            trace.memory("cpu", sum(v for k, v in self.state_bytes().items() if k.startswith("cpu")))

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by tier and kind. AdamW's two moments exist from the first update
        on; while a delayed update runs (which may be creating them) they are not read but counted as
        that update leaves them, two arrays of the master's shape and dtype."""
        master = sum(b.master.data.nbytes for b in self.buckets)
        return {"device parameters": sum(b.flat.nbytes for b in self.buckets),
                "device gradient bucket": self.grad_buffer.nbytes,
                "cpu gradients": sum(b.cpu_grad.nbytes for b in self.buckets if b.cpu_grad is not None),
                "cpu master parameters": master,
                "cpu optimizer state": self.adam.state_bytes() if self._pending is None else 2 * master}
