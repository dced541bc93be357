"""Data parallelism with all-reduce: PyTorch's DistributedDataParallel (Li et al., VLDB 2020).

Every rank holds a full replica of the model and runs forward and backward on its shard of the
global batch; the gradients are then averaged over the ranks, so every replica takes the same
optimizer step -- the step one process would take on the whole global batch (the shards of all
ranks, in rank order, are exactly that batch). The paper's three ideas, as they appear here:

1. **Broadcast at wrap time** (sec. 3.2): rank ``broadcast_from``'s parameters are copied to every
   rank when the model is wrapped, so the replicas start equal even if their seeds differ.
2. **Gradient bucketing** (sec. 3.2.3, fig. 3): many small all-reduces cost many latencies
   (``alpha``); one all-reduce of everything cannot start before backward ends. The gradients are
   grouped into buckets of at most ``bucket_cap_bytes`` in REVERSE parameter order (the last
   layer's gradients are ready first) and each bucket is all-reduced as one flat array.
3. **Overlap with backward** (sec. 3.2.3, fig. 2(b)): a hook on every parameter fires when its
   gradient is complete; when the last gradient of a bucket arrives, that bucket's NON-BLOCKING
   all-reduce starts at once (on the communicator's worker thread), while backward goes on with
   earlier layers. Buckets start strictly in index order on every rank (the paper's rule: all ranks must launch the
   same all-reduces in the same order). When the last bucket has started, the hook waits for all of
   them and writes the averaged gradients back into ``p.grad``: when ``loss.backward()`` returns, the
   gradients are averaged, exactly as with PyTorch.

Gradient accumulation (sec. 3.2.4, ``no_sync``): inside ``with ddp.no_sync():`` hooks do nothing and
gradients just accumulate in ``p.grad``; the next backward outside the block all-reduces the sum.
To equal one process on the global batch of ``B`` samples with ``m`` micro-batches per rank, scale
each micro-batch loss by ``1/m``: each rank's accumulated gradient is then the gradient of the mean
loss over its ``B/p`` samples, and the all-reduce average over ``p`` ranks is the mean over ``B``.
(``train_step`` does this.)

Costs per step, ``n`` gradient bytes in ``k`` buckets on ``p`` ranks (ring): ``k`` all-reduces of
``2(p-1)`` messages each, ``2(p-1)/p * n`` bytes sent per rank (``minipar.cost.allreduce_bytes`` is exact,
chunk by chunk). Memory per rank: a full replica (ZeRO's baseline), ``n`` bytes of parameters,
``n`` of gradients and the optimizer state (SGD with momentum ``n``, Adam ``2n``), plus the flat
buffers of the buckets in flight (``n`` when the last bucket starts, 0 once written back: the
all-reduced buffers then are the gradients).

Buffers (PyTorch's ``gradient_as_bucket_view=True``): each bucket owns one flat buffer for the whole
run; the hook copies the gradients into it, the ring all-reduces it in place
(``asyncwork.iallreduce_in_place``; the other algorithms return a new array), and after backward
every ``p.grad`` is a view of it, valid until the next synchronised backward overwrites it (copy a
gradient to keep it). Fresh flat arrays
every step, allocated while backward's temporaries are alive, made glibc map new pages for them:
measured under mpiexec, 3,600 page faults (14 MB) per step with overlap against 1,200 without, about
12 ms of the compute thread's CPU per step on the 2-core machine: one of the two reasons overlap cost
time (the other: the worker thread's wake-ups preempting backward, see ``minipar.comm.asyncwork``).

Trace: compute spans "F", "B" (from the start of backward until the last gradient is ready), "opt";
a mark per bucket launch; every message of the bucket all-reduces (op "allreduce", algorithm as
chosen); memory samples "parameters", "gradients", "gradient buckets" (bytes in flight),
"optimizer state". ``ddp.trace_meta(steps)`` gives the meta (``expected_bytes`` by the formula).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import BF16, Tensor
from minipar.comm.asyncwork import iallreduce_in_place
from minipar.cost import ALLREDUCE_ALGORITHMS
from minipar.cost import data as cost
from minipar.datasets import shard
from minipar.nn import Module, Parameter
from minipar.optim import Optimizer
from minipar.parallel.bf16 import check_recipe, wire_dtype

DEFAULT_BUCKET_CAP = 25 * 2**20  # PyTorch's bucket_cap_mb=25; tiny models then fit in one bucket


def bucket_assignment(nbytes: Sequence[int], dtypes: Sequence[Any], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, walking the parameters in REVERSE order.

    Greedy: a parameter joins the open bucket if the bucket stays within ``cap_bytes`` and holds the
    same dtype; otherwise it opens a new bucket. A parameter larger than the cap gets a bucket of
    its own. So every bucket is within the cap or a single parameter, and the first parameter of
    each bucket would not have fitted into the previous one: the fewest buckets in this order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be > 0, got {cap_bytes}")
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        if buckets and size + nbytes[i] <= cap_bytes and dtypes[buckets[-1][0]] == dtypes[i]:
            buckets[-1].append(i)
            size += nbytes[i]
        else:
            buckets.append([i])
            size = nbytes[i]
    return buckets


class Bucket:
    """Parameters whose gradients travel together as one flat array."""

    def __init__(self, index: int, params: list[Parameter], names: list[str], reduce_dtype: str | None = None) -> None:
        self.index, self.params, self.names = index, params, names
        self.dtype = wire_dtype(params[0].data.dtype, reduce_dtype)  # what the gradients are all-reduced in
        self.sizes = [p.data.size for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int).tolist()
        self.numel = self.offsets[-1]
        self.nbytes = self.numel * self.dtype.itemsize
        self.ready: set[int] = set()
        self.request: Any = None
        self.buffer = np.empty(self.numel, self.dtype)  # the flat gradients, reused every step

    def flat_grads(self) -> np.ndarray:
        """The parameters' gradients copied into ``buffer`` (no new array: see the module docstring)."""
        for p, a, b in zip(self.params, self.offsets[:-1], self.offsets[1:]):
            self.buffer[a:b] = p.grad.reshape(-1)
        return self.buffer

    def unflatten(self, flat: np.ndarray, attr: str) -> None:
        """Write ``flat`` back as every parameter's ``grad`` (views of ``flat``) or ``data`` (copied)."""
        for p, a, b in zip(self.params, self.offsets[:-1], self.offsets[1:]):
            part = flat[a:b].reshape(p.data.shape)
            if attr == "grad":
                p.grad = part
            else:
                p.data[...] = part

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {len(self.params)} params, {self.nbytes} bytes)"


class DistributedDataParallel:
    """Wrap ``module`` for data parallelism over ``comm`` (every rank of ``comm`` calls this).

    ``bucket_cap_bytes``: the most gradient bytes per bucket (PyTorch's ``bucket_cap_mb``);
    ``algorithm``: the all-reduce ("ring" | "recursive_doubling" | "naive" | "native");
    ``broadcast_from``: the rank whose parameters every replica starts from;
    ``overlap``: False starts every bucket only after the last gradient is ready (to measure what
    overlap buys); ``reduce_dtype``: for a bfloat16 model, all-reduce the gradients in "bf16" (the
    default) or "fp32" (``minipar.parallel.bf16``; step with its ``MasterAdamW``).
    Use: ``loss = loss_fn(ddp.module, x_local, y_local); ddp.backward(loss)`` (or
    plain ``loss.backward()``), then ``optimizer.step()``; ``train_step`` does a whole step.
    """

    def __init__(self, module: Module, comm: Any, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP,
                 algorithm: str = "ring", broadcast_from: int = 0, overlap: bool = True,
                 reduce_dtype: str | None = None) -> None:
        dtypes = sorted({str(p.dtype) for p in module.parameters()})
        problems = check_recipe("bf16", reduce_dtype, None) if reduce_dtype is not None else []
        if reduce_dtype is not None and dtypes != [str(BF16)]:
            problems.append(f"reduce_dtype={reduce_dtype!r} is for a bfloat16 model, the parameters are {dtypes}: "
                            "drop reduce_dtype or build the model with dtype=ml_dtypes.bfloat16")
        if reduce_dtype == "fp16":
            problems.append("reduce_dtype='fp16' is not offered here (its range check would run inside backward's "
                            "hooks, beside buckets in flight): reduce in 'bf16' or 'fp32'")
        if problems:
            raise ValueError("DistributedDataParallel: " + "; ".join(problems))
        if algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"DistributedDataParallel: unknown algorithm {algorithm!r}; "
                             f"choose one of {ALLREDUCE_ALGORITHMS}")
        if not isinstance(broadcast_from, int) or not 0 <= broadcast_from < comm.size:
            raise ValueError(f"DistributedDataParallel: broadcast_from={broadcast_from!r} is not a rank "
                             f"of the communicator (size {comm.size}); pick 0..{comm.size - 1}")
        named, seen = [], set()
        for name, p in module.named_parameters():
            if id(p) not in seen:  # a tied parameter is reduced once
                seen.add(id(p))
                named.append((name, p))
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameters to synchronise")
        groups = bucket_assignment([p.data.nbytes for _, p in named], [p.data.dtype for _, p in named],
                                   bucket_cap_bytes)
        self.module, self.comm, self.algorithm, self.overlap = module, comm, algorithm, overlap
        self.bucket_cap_bytes = bucket_cap_bytes
        self.buckets = [Bucket(k, [named[i][1] for i in g], [named[i][0] for i in g], reduce_dtype)
                        for k, g in enumerate(groups)]
        self._where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        self._sync = True
        self._next = 0  # index of the next bucket to start
        self._inflight = 0  # bytes of the flat bucket buffers being all-reduced
        self._ready_at: tuple[float, float] | None = None  # (wall, CPU) time the last gradient was ready
        self._handles = [p.register_hook(self._on_grad_ready) for _, p in named]
        for b in self.buckets:  # sec. 3.2: every replica starts from broadcast_from's parameters
            mine = comm.rank == broadcast_from
            flat = np.concatenate([p.data.reshape(-1) for p in b.params]).astype(b.params[0].dtype) if mine else None
            b.unflatten(comm.broadcast(flat, root=broadcast_from), "data")
        self.param_bytes = sum(b.nbytes for b in self.buckets)
        trace.memory("parameters", self.param_bytes)

    # ---- forward and the PyTorch-like surface -------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self) -> list[Parameter]:
        return [p for b in self.buckets for p in b.params]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the module then trains locally again)."""
        for h in self._handles:
            h.remove()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, inside the block (PyTorch's ``no_sync``)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    # ---- backward: hooks start the buckets ---------------------------------------------------
    def _on_grad_ready(self, p: Tensor) -> None:
        if not self._sync:
            return
        bucket, j = self._where[id(p)]
        if j in bucket.ready:
            missing = [n for b in self.buckets for i, n in enumerate(b.names) if i not in b.ready]
            raise RuntimeError(
                f"DistributedDataParallel: {bucket.names[j]} got a second gradient before its bucket was "
                f"all-reduced: the previous backward left {missing} without a gradient. Every parameter "
                "must be used in every forward (or accumulate inside no_sync())")
        bucket.ready.add(j)
        if self.overlap or all(len(b.ready) == len(b.params) for b in self.buckets):
            self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        """Start buckets in index order while the next one is complete; after the last, finish."""
        ready_at = (trace.now(), trace.cpu()) if trace.current() is not None else None  # traced: B's end
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
                self.buckets[self._next].params):
            b = self.buckets[self._next]
            trace.mark("bucket", index=b.index, nbytes=b.nbytes, params=len(b.params))
            b.request = iallreduce_in_place(self.comm, b.flat_grads(), op="mean", algorithm=self.algorithm)
            self._next += 1
            self._inflight += b.nbytes
            trace.memory("gradient buckets", self._inflight)
        if self._next == len(self.buckets):  # every gradient is ready: wait, write back (like PyTorch)
            self._ready_at = ready_at
            for b in self.buckets:
                b.unflatten(b.request.wait(), "grad")
                b.request = None
                b.ready.clear()
            self._next, self._inflight = 0, 0
            trace.memory("gradient buckets", 0)
            trace.memory("gradients", sum(p.grad.nbytes for p in self.parameters()))

    def backward(self, loss: Tensor, **fields: Any) -> None:
        """``loss.backward()`` with a "B" span (``fields`` go on it) that ends when the last gradient
        is ready; then checks that every bucket was all-reduced (outside ``no_sync``)."""
        rec = trace.current()
        t0, c0 = (trace.now(), trace.cpu()) if rec is not None else (0.0, 0.0)
        self._ready_at = None
        loss.backward()
        if rec is not None:
            t1, c1 = self._ready_at if self._sync and self._ready_at is not None else (trace.now(), trace.cpu())
            rec.add("compute", "B", t0, t1, c0=c0, c1=c1, **fields)
        if self._sync and any(b.ready for b in self.buckets):
            missing = [n for b in self.buckets for i, n in enumerate(b.names) if i not in b.ready]
            raise RuntimeError(f"DistributedDataParallel: backward produced no gradient for {missing}; every "
                               "parameter must be used in every forward")

    # ---- costs and trace metadata ------------------------------------------------------------
    def bytes_per_step(self, rank: int | None = None) -> int:
        """Exact all-reduce bytes ``rank`` (default: this rank) sends per synchronised step."""
        r = self.comm.rank if rank is None else rank
        return cost.ddp_bytes([(b.numel, b.dtype.itemsize) for b in self.buckets], self.comm.size, r,
                              self.algorithm)

    def trace_meta(self, steps: int) -> dict[str, Any]:
        """Trace metadata: the config and ``expected_bytes`` (per rank, over ``steps`` synced steps;
        the rank average, which for the ring is exactly 2(p-1)/p n) and the exact
        ``expected_bytes_by_rank``."""
        p = self.comm.size
        by_rank = [steps * self.bytes_per_step(r) for r in range(p)]
        key = f"allreduce/{self.algorithm}"
        return {"paradigm": "data parallel (DDP)", "algorithm": self.algorithm, "buckets": len(self.buckets),
                "bucket_cap_bytes": self.bucket_cap_bytes, "grad_bytes": sum(b.nbytes for b in self.buckets),
                "overlap": self.overlap, "steps": steps,
                "expected_bytes": {} if self.algorithm == "native" else {key: sum(by_rank) / p},
                "expected_bytes_by_rank": {key: by_rank}}


def local_batch(comm: Any, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """This rank's contiguous shard of each global-batch array (rank order = batch order), checked
    on every rank before any communication: the batch must divide by ``comm.size``."""
    for a in arrays:
        if a.shape[0] % comm.size:
            raise ValueError(f"global batch of {a.shape[0]} samples does not divide over {comm.size} ranks; "
                             f"make it a multiple of {comm.size}")
    return tuple(shard(a, comm.rank, comm.size) for a in arrays)


def train_step(ddp: DistributedDataParallel, optimizer: Optimizer,
               loss_fn: Callable[[Module, np.ndarray, np.ndarray], Tensor],
               x: np.ndarray, y: np.ndarray, accumulation: int = 1) -> float:
    """One step on the GLOBAL batch ``(x, y)``: this rank takes its shard, runs ``accumulation``
    micro-batches (all but the last inside ``no_sync``, each loss scaled by ``1/accumulation``),
    and steps ``optimizer`` on the averaged gradients. Returns this rank's loss (mean over its shard;
    the mean over ranks is the global-batch loss). Spans "F" and "B" per micro-batch, "opt";
    memory samples of the parameters and the optimizer state."""
    p, m = ddp.comm.size, accumulation
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"accumulation must be an int >= 1, got {m!r}")
    if x.shape[0] % (p * m) or y.shape[0] != x.shape[0]:
        raise ValueError(f"global batch of {x.shape[0]} samples (targets {y.shape[0]}) does not split into "
                         f"{p} ranks x {m} micro-batches; make it a multiple of {p * m}")
    xs, ys = local_batch(ddp.comm, x, y)
    trace.memory("parameters", ddp.param_bytes)
    optimizer.zero_grad()
    total = 0.0
    for i in range(m):
        xm, ym = shard(xs, i, m), shard(ys, i, m)
        with trace.span("F", microbatch=i):
            loss = loss_fn(ddp.module, xm, ym) * (1.0 / m)
        total += float(loss.data)
        if i < m - 1:
            with ddp.no_sync():
                ddp.backward(loss, microbatch=i)
        else:
            ddp.backward(loss, microbatch=i)
    with trace.span("opt"):
        optimizer.step()
    trace.memory("optimizer state", optimizer.state_bytes())
    return total


def average_grads(params: Sequence[Parameter], comm: Any, dtype: Any = None) -> None:
    """Every gradient averaged over ``comm``: one ring all-reduce of them all, flat (a parameter
    without gradient contributes zeros), in ``dtype`` if given (a bf16 model's reduce dtype), and
    left in it; nothing is sent on one rank or for no parameters."""
    if comm.size == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else np.zeros_like(p.data) for p in params]
    flat = np.concatenate([g.reshape(-1) for g in grads])
    flat = comm.allreduce(flat if dtype is None else flat.astype(dtype), algorithm="ring")
    flat /= comm.size
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.size].reshape(p.shape)
        offset += p.size
