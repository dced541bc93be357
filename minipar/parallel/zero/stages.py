"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", Sec. 5.1-5.2, Fig. 1).

Data parallelism with the optimizer state (stage 1, P_os) and also the gradients (stage 2,
P_os+g) partitioned over the N ranks. Every rank keeps the full parameters and runs forward and
backward on its part of the batch. The parameters are grouped into buckets (as DDP does, in
reverse order: the last layer's gradients are ready first), each stored as one flat padded buffer
(``flat.FlatLayout``) that the parameters are views of; rank r owns slice r of every bucket::

    backward        full gradients                                      (stage 1)
                    bucket by bucket, as soon as its last gradient is ready, reduce-scatter it
                    and drop the full gradients: a rank keeps only its shard (stage 2)
    step            reduce-scatter every bucket's gradients             (stage 1)
                    AdamW on this rank's shard of parameters, with its shard of the moments
                    all-gather the updated shards into every rank's parameters

"the reduce-scatter followed by the all-gather has the same communication volume as the
all-reduce" (Sec. 7.2.1): 2 (N-1)/N of the padded parameter bytes per rank per step, DDP's.
Memory per rank (float64, Psi parameters, AdamW's 2 Psi of moments, 8 B each): stage 1 8 Psi
parameters + 8 Psi gradients + 16 Psi / N optimizer state; stage 2 8 Psi + 8 Psi / N + 16 Psi / N
(``minipar.cost.zero``). The gradients' average over ranks is the gradient of the global batch,
as with DDP, so every step equals one process's step on the global batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.nn import Module, Parameter
from minipar.parallel.bf16 import check_recipe, check_reduce_range
from minipar.parallel.ddp import DEFAULT_BUCKET_CAP, bucket_assignment
from minipar.parallel.zero import checkpoint
from minipar.parallel.zero.flat import FlatLayout, layout_of
from minipar.parallel.zero.precision import (
    WORKING,
    ZERO_PRECISIONS,
    ShardedAdamW,
    reduce_dtype_of,
)

ALGORITHM = "ring"  # hand-written collectives: every message is in the trace
STAGES = (1, 2)


class ZeroBucket:
    """A group of parameters stored as one flat padded buffer; this rank's shard of its parameters
    (a view), of its gradients and, in the optimizer, of AdamW's moments."""

    def __init__(self, index: int, named: list[tuple[str, Parameter]], comm: Communicator,
                 reduce_dtype: np.dtype | None = None) -> None:
        self.index, self.names = index, [n for n, _ in named]
        self.params = [p for _, p in named]
        self.layout: FlatLayout = layout_of(named, comm.size)
        self.flat = self.layout.flatten([p.data for p in self.params], self.params[0].dtype)
        for p, view in zip(self.params, self.layout.views(self.flat), strict=True):
            p.data = view  # all-gathers write straight into the parameters
        lo, hi = self.layout.shard_range(comm.rank)
        self.shard = Tensor(self.flat[lo:hi])  # what AdamW updates (a view: the parameters change)
        self.reduce_dtype = self.flat.dtype if reduce_dtype is None else reduce_dtype  # gradients' wire dtype
        self.ready: set[int] = set()

    def reduce_scatter(self, comm: Communicator) -> None:
        """This rank's shard of the gradients averaged over the ranks; drop the full gradients."""
        grads = self.layout.flatten([p.grad for p in self.params], self.reduce_dtype)
        check_reduce_range(comm, grads, self.flat.dtype)
        grads /= comm.size  # before the sum: float16 overflows where one process would
        shard = comm.reduce_scatter(grads, op="sum", algorithm=ALGORITHM)
        self.shard.grad = shard if self.shard.grad is None else self.shard.grad + shard
        for p in self.params:
            p.grad = None
        self.ready.clear()

    def all_gather(self, comm: Communicator) -> None:
        self.flat[...] = comm.allgather(self.shard.data, algorithm=ALGORITHM)


def check_precision(module: Module, precision: str) -> list[str]:
    """What is wrong with training ``module`` in ``precision`` (shared by every stage)."""
    if precision not in ZERO_PRECISIONS:
        return [f"precision={precision!r}; choose one of {ZERO_PRECISIONS}"]
    want = np.dtype(WORKING[precision])
    wrong = sorted({str(p.dtype) for p in module.parameters() if p.dtype != want})
    name = "ml_dtypes.bfloat16" if precision == "bf16" else f"np.{want}"
    return [f"precision={precision!r} computes in {want} but the model's parameters are {wrong}; build it "
            f"with dtype={name}"] if wrong else []


def tied_parameters(module: Module) -> list[str]:
    """A parameter reachable under two names (tied weights) would sit in a flat buffer twice."""
    first: dict[int, str] = {}
    tied = [f"{name} is {first[id(p)]}" for name, p in module.named_parameters()
            if first.setdefault(id(p), name) != name]
    return [f"tied parameters ({', '.join(tied)}) are not supported: give each its own Parameter"] if tied else []


def check_zero_config(comm: Communicator, module: Module, stage: int, bucket_cap_bytes: int,
                      precision: str, reduce_dtype: str | None = None, loss_scale: float | None = None) -> None:
    """Raise ``ValueError`` (same on every rank, before any message) naming what to change."""
    problems = check_precision(module, precision) + check_recipe(precision, reduce_dtype, loss_scale)
    problems += tied_parameters(module)
    empty = [n for n, p in module.named_parameters() if p.data.size and not any(p.data.strides)]
    if empty:
        problems.append(f"{empty[:3]}{'...' if len(empty) > 3 else ''} hold no values (a model built under "
                        "nn.deferred()): stages 1 and 2 keep full parameters; build the model normally, or use "
                        "FullyShardedDataParallel")
    if stage not in STAGES:
        problems.append(f"stage={stage!r} is not a ZeRO stage this class runs; use 1 (optimizer state) or 2 "
                        "(+ gradients), or FullyShardedDataParallel for stage 3 (+ parameters)")
    if bucket_cap_bytes <= 0:
        problems.append(f"bucket_cap_bytes={bucket_cap_bytes} must be > 0")
    if problems:
        raise ValueError("ZeRO: " + "; ".join(problems))


class ZeroDataParallel:
    """ZeRO stage 1 or 2 of ``module`` over ``comm`` with AdamW (every rank calls this).

    Per step: ``loss = zero(x, y)`` (or ``module.loss`` on this rank's part of the batch),
    ``zero.backward(loss)``, ``zero.step()``. ``precision``: "fp64", "mixed" (float16 with a loss
    scale) or "bf16" with ``reduce_dtype`` "bf16" (the default) or "fp32" (``precision.py``).
    """

    def __init__(self, module: Module, comm: Communicator, stage: int = 2, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP, precision: str = "fp64",
                 max_grad_norm: float | None = None, loss_scale: float | None = None, growth_interval: int = 2000,
                 reduce_dtype: str | None = None) -> None:
        check_zero_config(comm, module, stage, bucket_cap_bytes, precision, reduce_dtype, loss_scale)
        self.module, self.comm, self.stage = module, comm, stage
        named = list(module.named_parameters())
        groups = bucket_assignment([p.data.nbytes for _, p in named], [p.data.dtype for _, p in named],
                                   bucket_cap_bytes)
        wire = reduce_dtype_of(precision, reduce_dtype)
        self.buckets = [ZeroBucket(i, [named[j] for j in g], comm, wire) for i, g in enumerate(groups)]
        self.optimizer = ShardedAdamW([b.shard for b in self.buckets], comm, precision, lr, betas, eps, weight_decay,
                                      max_grad_norm, loss_scale, growth_interval)
        self._where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        self._next = 0
        if stage == 2:
            for p in module.parameters():
                p.register_hook(self._on_grad_ready)
        self._sample()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with trace.span("F"):
            return self.module(*args, **kwargs)

    def _on_grad_ready(self, p: Tensor) -> None:
        """Stage 2: note ``p``'s gradient; reduce-scatter the buckets, in index order, that are complete."""
        bucket, j = self._where[id(p)]
        bucket.ready.add(j)
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
                self.buckets[self._next].params):
            self.buckets[self._next].reduce_scatter(self.comm)
            self._next += 1
            self._sample()

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` in a "B" span; stage 2 reduce-scatters the buckets as they fill (a
        bucket left incomplete, a parameter without gradient, is reduced at the end)."""
        with trace.span("B"):
            self.optimizer.scale(loss).backward()
            if self.stage == 2:
                for b in self.buckets[self._next:]:
                    b.reduce_scatter(self.comm)
                self._next = 0
        self._sample()

    def step(self) -> bool:
        """Stage 1 reduce-scatters every bucket; AdamW on this rank's shards; all-gather them.
        False when mixed precision skipped the step (an overflow on some rank)."""
        with trace.span("opt"):
            if self.stage == 1:
                for b in self.buckets:
                    b.reduce_scatter(self.comm)
            applied = self.optimizer.step()
            if applied:
                for b in self.buckets:
                    b.all_gather(self.comm)
        self._sample()
        return applied

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its shards (parameters, AdamW's moments, the fp32 master) into
        ``directory``, atomically (``checkpoint.save``)."""
        arrays, meta = self.optimizer.shards_to_save(self._names())
        meta["params"] = {f"bucket{b.index}": b.layout.described() for b in self.buckets}
        checkpoint.save(directory, self.comm, arrays, self._numels(arrays), meta)

    def load_checkpoint(self, directory: str) -> None:
        """Resume from ``directory``, saved at this or another world size (the shards are re-cut),
        then all-gather the parameters."""
        names = self._names()
        arrays, meta = checkpoint.load(directory, self.comm, self._numels(self.optimizer.shards_to_save(names)[0]))
        self.optimizer.load_shards(names, arrays, meta)
        for b in self.buckets:
            b.all_gather(self.comm)

    def _names(self) -> list[str]:
        return [f"bucket{b.index}" for b in self.buckets]

    def _numels(self, arrays: dict[str, np.ndarray]) -> dict[str, int]:
        by_bucket = {f"bucket{b.index}": b.layout.numel for b in self.buckets}
        return {key: by_bucket[key.rsplit("/", 1)[0]] for key in arrays}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters (the padded flat buckets), gradients (full ones
        alive plus the shards), optimizer state (the moments of its shards) and, in mixed precision,
        the fp32 master parameters."""
        full = sum(p.grad.nbytes for p in self.module.parameters() if p.grad is not None)
        shards = sum(b.shard.grad.nbytes for b in self.buckets if b.shard.grad is not None)
        return {"parameters": sum(b.flat.nbytes for b in self.buckets), "gradients": full + shards,
                **self.optimizer.state_bytes()}

    def _sample(self) -> None:
        if trace.current() is not None:
            for label, nbytes in self.state_bytes().items():
                trace.memory(label, nbytes)
