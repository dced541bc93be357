"""ZeRO stage 3 as PyTorch's Fully Sharded Data Parallel (Zhao et al. 2023, "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", Sec. 3; Rajbhandari et al. 2020, Sec. 5.3).

A rank holds only its shard of every parameter, of its gradient and of AdamW's moments. A wrapping
policy cuts the model into **units** (one per transformer block, plus the embeddings, the final
layer norm and the head); each unit's parameters are one flat padded buffer (``flat.FlatLayout``)
cut into N shards. Around each unit (Zhao et al., Fig. 2 and Sec. 3.3)::

    forward    unshard (all-gather; the next unit's all-gather is already on its way: prefetch)
               compute
               reshard (``reshard_after_forward``: free the gathered parameters)
    backward   unshard again (prefetching the unit before it), compute the gradients,
               reduce-scatter them (this rank keeps the average of its shard), reshard

The autograd graph keeps each op's saved parameter as a reference to the parameter, not to its
array (``autograd.Context``), so freeing a unit's gathered buffer after forward really frees it and
backward reads the re-gathered values. Prefetching runs the all-gathers on the communicator's
background thread (``comm.iallgather``) while this thread computes: forward in registration order
(the next unit), backward in the reverse of the order the units ran forward.

Bytes per rank per step, padded parameter bytes Psi' (ring): all-gather forward (N-1)/N Psi',
again in backward (N-1)/N Psi', reduce-scatter (N-1)/N Psi': 3 (N-1)/N Psi' (Sec. 7.2.1 of the
ZeRO paper: "1.5x" data parallelism's 2 (N-1)/N). Without ``reshard_after_forward`` backward reuses
the forward's gather: 2 (N-1)/N Psi', the memory of every unit gathered at once. Memory per rank:
(8 + 8 + 16) Psi' / N in float64, plus the gathered units in flight: the current one and the
prefetched one (``minipar.cost.zero``).

The gradients' average over ranks is the gradient of the global batch, so every step equals one
process's AdamW step on the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import Tensor
from minipar.comm import Communicator, Request
from minipar.functional import on_backward
from minipar.nn import Block, Module, Parameter
from minipar.parallel.bf16 import check_recipe, check_reduce_range
from minipar.parallel.zero import checkpoint
from minipar.parallel.zero.flat import FlatLayout, init_shard, layout_of
from minipar.parallel.zero.precision import ShardedAdamW, reduce_dtype_of
from minipar.parallel.zero.stages import check_precision, tied_parameters

ALGORITHM = "ring"  # hand-written collectives: every message is in the trace
Policy = Callable[[str, Module], bool]


def transformer_units(name: str, module: Module) -> bool:
    """The default wrapping policy: a unit per transformer ``Block`` and per top-level module that
    holds parameters itself (``tok_emb``, ``pos_emb``, ``ln_f``, ``head`` of ``nn.GPT``; not a
    container such as ``blocks``, whose own forward never runs)."""
    owns = any(isinstance(v, Parameter) for v in vars(module).values())
    return isinstance(module, Block) or (name.count(".") == 0 and owns)


class Unit:
    """One FSDP unit: the flat shard of its parameters, gathered while it computes."""

    def __init__(self, index: int, name: str, named: list[tuple[str, Parameter]], comm: Communicator,
                 seed: int, replicas: Communicator | None = None, reduce_dtype: np.dtype | None = None) -> None:
        self.index, self.name, self.comm, self.replicas = index, name, comm, replicas
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.layout: FlatLayout = layout_of(named, comm.size)
        if all(_unallocated(p.data) for p in self.params):  # built under nn.deferred(): draw the shard
            values = init_shard(self.layout, self.params, comm.rank, seed, self.params[0].dtype)
        else:  # a model built whole: take this rank's part and let the rest go
            lo, hi = self.layout.shard_range(comm.rank)
            values = self.layout.flatten([p.data for p in self.params], self.params[0].dtype)[lo:hi].copy()
        self.shard = Tensor(values)  # the only copy of these parameters on this rank
        self.reduce_dtype = values.dtype if reduce_dtype is None else reduce_dtype  # gradients' wire dtype
        self.full: np.ndarray | None = None  # the gathered flat buffer while unsharded
        self.pending: Request | None = None  # a prefetch under way
        self.ready: set[int] = set()
        self.reduced = False
        self.reshard()

    @property
    def shards(self) -> list[Tensor]:
        """The tensors AdamW updates on this rank: the unit's one flat shard."""
        return [self.shard]

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered parameters beside the shard (none on one rank: the shard is the whole)."""
        full = self.full.nbytes if self.full is not None and self.full is not self.shard.data else 0
        return full + (self.layout.padded * self.shard.data.itemsize if self.pending is not None else 0)

    def prefetch(self) -> None:
        """Start the all-gather of this unit's parameters on the background thread."""
        if self.full is None and self.pending is None and self.comm.size > 1:
            self.pending = self.comm.iallgather(self.shard.data, algorithm=ALGORITHM)

    def unshard(self) -> None:
        """Every parameter's data a view of the gathered flat buffer (waiting for a prefetch). On
        one rank the shard is the whole unit: its views, no copy (PyTorch's FSDP falls back to
        NO_SHARD at world size 1)."""
        if self.full is not None:
            return
        if self.comm.size == 1:
            self.full = self.shard.data
        else:
            self.prefetch()
            self.full, self.pending = self.pending.wait(), None
        for p, view in zip(self.params, self.layout.views(self.full), strict=True):
            p.data = view

    def reshard(self) -> None:
        """Free the gathered buffer: the parameters hold no values until the next ``unshard`` (an
        empty array: a use outside the unit's forward or backward fails loudly, as in PyTorch)."""
        for p in self.params:
            p.data = np.empty(0, dtype=p.dtype)
        self.full = None

    def discard(self) -> None:
        """Forget any gathered or prefetched copy (the shard is about to change, or changed)."""
        if self.pending is not None:
            self.pending.wait()  # every rank started this all-gather: finish it, drop the result
            self.pending = None
        self.reshard()

    def reduce_scatter(self) -> None:
        """This rank's shard of the gradients averaged over the ranks (hybrid sharding: over its
        shard group, then all-reduced across the replicas); drop the full gradients."""
        grads = self.layout.flatten([p.grad for p in self.params], self.reduce_dtype)
        check_reduce_range(self.comm, grads, self.shard.dtype)
        grads /= self.comm.size * (self.replicas.size if self.replicas is not None else 1)  # before the sum:
        shard = self.comm.reduce_scatter(grads, op="sum", algorithm=ALGORITHM)  # float16 overflows as one process
        if self.replicas is not None and self.replicas.size > 1:
            shard = self.replicas.allreduce(shard, op="sum", algorithm=ALGORITHM)
        self.shard.grad = shard if self.shard.grad is None else self.shard.grad + shard
        for p in self.params:
            p.grad = None
        self.ready.clear()
        self.reduced = True


def _unallocated(a: np.ndarray) -> bool:
    return a.size > 0 and not any(a.strides)


def check_fsdp_config(comm: Communicator, module: Module, policy: Policy, precision: str = "fp64",
                      shard_group: int | None = None, reduce_dtype: str | None = None,
                      loss_scale: float | None = None) -> list[tuple[str, Module]]:
    """The modules ``policy`` makes units of, outermost first, or ``ValueError`` (same on every
    rank, before any message): a policy that wraps nothing, parameters no unit owns, a precision
    the model's dtype does not match, a hybrid shard group that does not divide the ranks."""
    wrapped: list[tuple[str, Module]] = []

    def walk(prefix: str, m: Module) -> None:
        for name, child in m.children():
            full = prefix + name
            if policy(full, child):
                wrapped.append((full, child))
            else:
                walk(full + ".", child)

    walk("", module)
    owned = {id(p) for _, m in wrapped for p in m.parameters()}
    orphans = [n for n, p in module.named_parameters() if id(p) not in owned]
    problems = check_precision(module, precision) + check_recipe(precision, reduce_dtype, loss_scale)
    problems += tied_parameters(module)
    if shard_group is not None and (shard_group < 1 or comm.size % shard_group):
        divisors = [d for d in range(1, comm.size + 1) if comm.size % d == 0]
        problems.append(f"hybrid sharding needs shard groups of equal size: shard_group={shard_group} does not "
                        f"divide the {comm.size} ranks; pick one of {divisors}")
    if not wrapped or orphans:
        problems.append("the wrapping policy " + ("wraps no module" if not wrapped else f"leaves {orphans} in no "
                        "unit") + "; wrap the modules that hold them (e.g. policy=transformer_units)")
    if problems:
        raise ValueError("FSDP: " + "; ".join(problems))
    return wrapped


class FullyShardedDataParallel:
    """ZeRO-3 / FSDP of ``module`` over ``comm`` with AdamW (every rank calls this).

    ``shard_group``: hybrid sharding (PyTorch's HYBRID_SHARD, ZeRO++'s hpZ): parameters are sharded
    inside groups of that many consecutive ranks and replicated across the groups; gradients are
    reduce-scattered in the group, then all-reduced across the replicas (a 2-D grid of
    sub-communicators from ``comm.split``).

    ``precision``: "fp64", "mixed" (float16 with a loss scale) or "bf16" (bfloat16 parameters, which
    the all-gathers send, fp32 master) with ``reduce_dtype`` "bf16" (default) or "fp32" for the
    gradients' reduce-scatter (PyTorch FSDP's ``MixedPrecision(param_dtype, reduce_dtype)``).

    Build the model under ``nn.deferred()`` so that no rank ever holds it whole (each rank then
    draws only its shards' initial values); a model built whole is cut and its full arrays freed.
    Per step: ``loss = fsdp(x, y)`` or ``module.loss(...)`` on this rank's part of the batch,
    ``fsdp.backward(loss)``, ``fsdp.step()``.
    """

    def __init__(self, module: Module, comm: Communicator, policy: Policy = transformer_units,
                 reshard_after_forward: bool = True, prefetch: bool = True, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 precision: str = "fp64", max_grad_norm: float | None = None, loss_scale: float | None = None,
                 growth_interval: int = 2000, shard_group: int | None = None, reduce_dtype: str | None = None) -> None:
        wrapped = check_fsdp_config(comm, module, policy, precision, shard_group, reduce_dtype, loss_scale)
        self.module, self.comm = module, comm
        if shard_group is None or shard_group == comm.size:  # fully sharded
            self.shards, self.replicas = comm, None
        else:  # hybrid (HSDP, ZeRO++'s hpZ): shard inside consecutive groups, replicate across them
            self.shards = comm.split(comm.rank // shard_group)
            self.replicas = comm.split(comm.rank % shard_group)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        wire = reduce_dtype_of(precision, reduce_dtype)
        self.units = self._make_units(wrapped, module.seed, wire)
        for unit, (_, m) in zip(self.units, wrapped, strict=True):
            m.forward = self._wrap(unit, m.forward)  # an instance attribute: the class's forward stays
            for j, p in enumerate(unit.params):
                p.register_hook(lambda _p, u=unit, j=j: self._on_grad_ready(u, j))
        self.optimizer = ShardedAdamW([s for u in self.units for s in u.shards], self.shards, precision, lr, betas, eps,
                                      weight_decay, max_grad_norm, loss_scale, growth_interval)
        self.order: list[Unit] = []  # the units in the order this forward runs them
        self.last_order: list[Unit] = []  # ... and the last forward ran them (forward prefetch)
        self._sample()

    def _make_units(self, wrapped: list[tuple[str, Module]], seed: int, wire: np.dtype) -> list[Any]:
        """One flat ``Unit`` per wrapped module (FSDP2, ``fsdp2.py``, makes per-parameter ones)."""
        return [Unit(i, name, list(m.named_parameters(name + ".")), self.shards, seed, self.replicas, wire)
                for i, (name, m) in enumerate(wrapped)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ---- around each unit ---------------------------------------------------------------------
    def _wrap(self, unit: Unit, forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> Tensor:
            self.order.append(unit)
            with trace.span("F", args={"unit": unit.name}):
                unit.unshard()
                nxt = self._next_in_forward(unit)
                if self.prefetch and nxt is not None:
                    nxt.prefetch()
                self._sample()
                out = forward(*args, **kwargs)
                if self.reshard_after_forward:
                    unit.reshard()
                    self._sample()
            return on_backward.apply(out, lambda: self._pre_backward(unit))  # before the unit's backward
        return wrapped

    def _next_in_forward(self, unit: Unit) -> Unit | None:
        """The unit that ran after ``unit`` in the last forward (PyTorch FSDP's recorded execution
        order); before any forward finished, the next one registered."""
        at = len(self.order) - 1  # ``unit`` is this forward's latest
        if len(self.last_order) > at + 1 and self.last_order[at] is unit:
            return self.last_order[at + 1]
        return self.units[unit.index + 1] if not self.last_order and unit.index + 1 < len(self.units) else None

    def _pre_backward(self, unit: Unit) -> None:
        unit.reduced = False
        unit.unshard()
        at = len(self.order) - 1 - self.order[::-1].index(unit)  # its latest run: backward comes newest first
        if self.prefetch and at > 0 and self.order[at - 1] is not unit:
            self.order[at - 1].prefetch()
        self._sample()

    def _on_grad_ready(self, unit: Unit, j: int) -> None:
        unit.ready.add(j)
        if len(unit.ready) == len(unit.params):
            self._sample()  # the unit's full gradients, at their peak
            unit.reduce_scatter()
            unit.reshard()
            self._sample()

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` in a "B" span; each unit reduce-scatters its gradients as soon as they
        are complete. A unit some parameter of which got no gradient is reduced at the end."""
        with trace.span("B"):
            self.optimizer.scale(loss).backward()
            for unit in reversed(self.order):
                if not unit.reduced:
                    unit.reduce_scatter()
            for unit in self.units:  # a prefetch for a backward that never came
                unit.discard()
        self.last_order, self.order = self.order, []
        self._sample()

    def step(self) -> bool:
        """AdamW on this rank's shards (the parameters stay sharded until the next forward); False
        when mixed precision skipped the step (an overflow on some rank)."""
        with trace.span("opt"):
            for unit in self.units:  # gathered copies would be stale after the step
                unit.discard()
            applied = self.optimizer.step()
        self._sample()
        return applied

    # ---- whole values, for tests and checkpoints ---------------------------------------------
    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter, whole (all-gathers every unit: for tests and single-process use)."""
        out = {}
        for unit in self.units:
            flat = self.shards.allgather(unit.shard.data, algorithm=ALGORITHM)
            out.update(zip(unit.names, (v.copy() for v in unit.layout.views(flat)), strict=True))
        return out

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its shards (parameters, AdamW's moments, the fp32 master) into
        ``directory``, atomically (``checkpoint.save``)."""
        arrays, meta = self.optimizer.shards_to_save([u.name for u in self.units])
        meta["params"] = {u.name: u.layout.described() for u in self.units}
        if self.replicas is None:
            checkpoint.save(directory, self.shards, arrays, self._numels(arrays), meta)
            return
        error = None
        if self.replicas.rank == 0:  # hybrid: one replica group writes, then tells every rank
            try:
                checkpoint.save(directory, self.shards, arrays, self._numels(arrays), meta)
            except ValueError as exc:
                error = str(exc)
        error = self.comm.broadcast_object(error, root=0)
        if error is not None:
            raise ValueError(error)

    def load_checkpoint(self, directory: str) -> None:
        """Resume from ``directory``, saved at this or another world size (the shards are re-cut)."""
        names = [u.name for u in self.units]
        arrays, meta = checkpoint.load(directory, self.shards, self._numels(self.optimizer.shards_to_save(names)[0]))
        for unit in self.units:
            unit.discard()
        self.optimizer.load_shards(names, arrays, meta)

    def _numels(self, arrays: dict[str, np.ndarray]) -> dict[str, int]:
        by_unit = {u.name: u.layout.numel for u in self.units}
        return {key: by_unit[key.rsplit("/", 1)[0]] for key in arrays}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: parameter, gradient and optimizer-state shards (with the fp32
        master in mixed precision), the full gradients of the unit in backward until they are
        reduce-scattered, and the gathered units (unsharded or on their way)."""
        shards = [s for u in self.units for s in u.shards]
        return {"parameters": sum(s.data.nbytes for s in shards),
                "gradients": sum(p.grad.nbytes for p in self.module.parameters() if p.grad is not None)
                + sum(s.grad.nbytes for s in shards if s.grad is not None),
                **self.optimizer.state_bytes(),
                "gathered units": sum(u.gathered_bytes for u in self.units)}

    def _sample(self) -> None:
        if trace.current() is not None:
            for label, nbytes in self.state_bytes().items():
                trace.memory(label, nbytes)
