"""ZeRO-Infinity (Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme
Scale Deep Learning", Sec. 5-6): ZeRO stage 3 with every rank's parameter shards and optimizer state
on NVMe, brought up unit by unit only while the unit computes.

The model is cut into FSDP units (``minipar.parallel.zero.fsdp``'s wrapping policy, one flat padded
buffer per unit, ``minipar.parallel.zero.flat``). Where every byte lives (per rank, N ranks, unit u
of L_u padded elements, s_u = L_u / N)::

    nvme     this rank's shard of every unit's parameters (working precision), of AdamW's two
             moments and, in "mixed", of the fp32 master (files ``unit<i>/param|exp_avg|exp_avg_sq|master.<slot>``,
             two slots and a manifest: see below)
    cpu      this rank's gradient partitions until the step; the shards being read or written
    device   one unit at a time: its shard (s_u) while the all-gather assembles the unit (L_u),
             then in backward the unit (L_u) and its flat gradient buffer (L_u): 2 max L_u items

Per unit, before its forward and again before its backward (Sec. 6.1, bandwidth-centric
partitioning): this rank reads ONLY its own 1/N shard from its own files (NVMe -> CPU), copies it
to the device (CPU -> device) and the all-gather assembles the unit on the device (N = 1: the copy
is the unit). The gathered unit is released as soon as the unit has computed. The reads of the
next ``prefetch_depth`` units of the schedule (forward order, then backward: the reverse) are
submitted ahead to the NVMe thread pool, so the disk works while this thread computes (Sec. 6.2,
overlap-centric design). When a unit's gradients are complete they are flattened into a device
buffer, divided by N and reduce-scattered; this rank's partition goes device -> CPU. The step
streams the units: read shard (fp64) or master (mixed) and moments NVMe -> CPU (``prefetch_depth``
units ahead), AdamW on the CPU (``minipar.optim.AdamW``'s rule, with ``FullyShardedDataParallel``'s
mixed-precision rules: unscale, skip on an overflow on any rank, dynamic loss scale), write back.

Bytes per rank per step (``minipar.cost.offload.zero_infinity_bytes``; docs/formulas.md, section 7),
with p the working item (8 fp64, 2 mixed) and s = sum s_u: NVMe -> CPU ``2 p s`` (forward and
backward) plus the step's reads (fp64: param 8 + moments 16; mixed: master 4 + moments 8), CPU ->
NVMe the step's writes (fp64: 24; mixed: param 2 + master 4 + moments 8), CPU -> device ``2 p s``,
device -> CPU ``p s``. A step skipped on an overflow reads and writes no state.

The device budget is checked before anything is placed or written: below ``2 p max L_u`` bytes it raises
``DeviceOutOfMemory`` on every rank (same message, nothing sent, no file written). Not charged, as in
``ZeroOffload``: autograd's activations and per-parameter gradients (before they are flattened), the
collectives' temporaries. Outside their unit's forward and backward the parameters are empty arrays, and
every op checks that those it reads are on the device (``minipar.residency``; else "on the nvme").

A step is atomic across files and ranks (``minipar.parallel.offload.commit``): every state file in two slots,
``unit<i>/<kind>.0`` and ``.1``, the step writes the other slot (in place into its preallocated files after
the first time, ``Tiers.write_nvme(in_place=True)``, flushed by ``sync_nvme``) and one atomic write of a
manifest (48 bytes) commits it, once every rank's writes succeeded. A failed write (a full disk: with the
files preallocated, only the manifest's new file can find none; a vanished directory) makes ``step`` raise
the tiers' error, naming the file and the bytes, on every rank (the others: "... failed on another rank");
the object then still reads the previous step (counters unchanged; the step's gradients are gone). ``resume=True``
opens the state left in ``tiers`` (same model, same N; a killed process's: ``Tiers(..., reopen=True)``). Cost:
the files take twice the model states on disk, and each applied step writes the manifest's 48 bytes (cpu ->
nvme, beyond ``zero_infinity_bytes``); the current slot is kept in memory, so reads do not reread the manifest.
A skipped step (fp16 overflow) writes nothing: its halved loss scale is not on disk until the next applied step.

Trace: spans "F" (per unit), "B", "opt"; the tiers' "transfer" events, "device" and "nvme" memory
samples, and a "cpu" sample (the gradient partitions) after each change of them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from minipar import residency, trace
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.cost.offload import zero_infinity_device_need
from minipar.functional import on_backward
from minipar.nn import Module, Parameter
from minipar.optim import AdamW
from minipar.parallel.offload.commit import agree, manifest, resume_point
from minipar.parallel.zero.flat import init_shard, layout_of
from minipar.parallel.zero.fsdp import Policy, check_fsdp_config, transformer_units
from minipar.tiers import DeviceOutOfMemory, Tiers

ALGORITHM = "ring"  # hand-written collectives: every message is in the trace
WORKING = {"fp64": np.float64, "mixed": np.float16}
MASTER = {"fp64": np.float64, "mixed": np.float32}


class InfinityUnit:
    """One unit: its layout, and on this rank its gradient partition (cpu) and, while it computes,
    the gathered parameters (device). Its shards themselves live in files."""

    def __init__(self, index: int, name: str, named: list[tuple[str, Parameter]], world: int) -> None:
        self.index, self.name = index, name
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.layout = layout_of(named, world)
        self.full: np.ndarray | None = None  # device, while unsharded
        self.grad: np.ndarray | None = None  # cpu, this rank's averaged gradient partition
        self.ready: set[int] = set()
        self.reduced = False

    def key(self, kind: str) -> str:
        return f"unit{self.index}/{kind}"

    def initial_shard(self, rank: int, seed: int, dtype: Any) -> np.ndarray:
        """This rank's initial shard: drawn alone under ``nn.deferred()``, else cut from the whole."""
        if all(p.data.size > 0 and not any(p.data.strides) for p in self.params):
            return init_shard(self.layout, self.params, rank, seed, dtype)
        lo, hi = self.layout.shard_range(rank)
        return self.layout.flatten([p.data for p in self.params], dtype)[lo:hi].copy()

    def empty_params(self) -> None:
        for p in self.params:
            p.data = np.empty(0, dtype=p.dtype)


class ZeroInfinity:
    """ZeRO-Infinity of ``module`` over ``comm`` with ``tiers`` (a device budget and an NVMe
    directory, one per rank). Every rank calls this. Per step: ``loss = inf.loss(x, y)`` (or
    ``inf(x)``), ``inf.backward(loss)``, ``inf.step()``; ``close()`` removes this object's files."""

    def __init__(self, module: Module, comm: Communicator, tiers: Tiers, prefetch_depth: int = 1,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, precision: str = "fp64", policy: Policy = transformer_units,
                 loss_scale: float = 2.0**12, growth_interval: int = 2000, resume: bool = False) -> None:
        wrapped = check_fsdp_config(comm, module, policy, precision)
        if prefetch_depth < 0:
            raise ValueError(f"ZeroInfinity: prefetch_depth={prefetch_depth} must be >= 0")
        if tiers.nvme_dir is None:
            raise ValueError("ZeroInfinity keeps the model states on NVMe: give the Tiers an nvme_dir")
        self.module, self.comm, self.tiers, self.precision = module, comm, tiers, precision
        self.depth, self.growth_interval = prefetch_depth, growth_interval
        self.loss_scale = loss_scale if precision == "mixed" else 1.0
        self.clean_steps = self.skipped = self.steps_applied = 0
        self.units = [InfinityUnit(i, name, list(m.named_parameters(name + ".")), comm.size)
                      for i, (name, m) in enumerate(wrapped)]
        self.dtype = np.dtype(WORKING[precision])
        self._check_budget()
        self._adam = AdamW([Tensor(np.zeros(1))], lr, betas, eps, weight_decay)  # its rule, per shard
        self.kinds = ["param", "exp_avg", "exp_avg_sq"] + (["master"] if precision == "mixed" else [])
        self.slot = 0  # the slot of the files that hold the current state (the manifest's, once committed)
        if resume:
            self._open()
        else:
            self._write_initial_states(module.seed)
        self._unguard = residency.guard(self, tiers, module.named_parameters(), "nvme")  # checked at every op
        for unit, (_, m) in zip(self.units, wrapped, strict=True):
            m.forward = self._wrap(unit, m.forward)
            for j, p in enumerate(unit.params):
                p.register_hook(lambda _p, u=unit, j=j: self._on_grad_ready(u, j))
        self.order: list[InfinityUnit] = []
        self.last_order: list[InfinityUnit] = []
        self._plan: list[tuple[str, int]] = []  # this pass's predicted uses: ("F" | "B", unit index)
        self._cursor = 0
        self._reads: dict[int, Future[np.ndarray]] = {}  # plan position -> NVMe read under way
        self._stale: list[Future[Any]] = []
        self.log: list[tuple[str, str, int]] = []  # this pass's ("read" | "use", phase, unit index), in order

    # ---- set-up ---------------------------------------------------------------------------------
    def device_need(self) -> dict[str, int]:
        """Device bytes at the peak: the largest gathered unit and its gradient buffer."""
        return zero_infinity_device_need([u.layout.numel for u in self.units], self.comm.size, self.dtype.itemsize)

    def _check_budget(self) -> None:
        """``DeviceOutOfMemory`` (same on every rank) before anything is placed, written or sent."""
        need = self.device_need()
        if self.tiers.device_bytes + need["total"] > self.tiers.device_budget:
            parts = ", ".join(f"{k} {v}" for k, v in need.items() if k != "total")
            raise DeviceOutOfMemory(self.tiers.device_budget, self.tiers.resident("device"),
                                    f"ZeroInfinity ({parts})", need["total"])

    def key(self, unit: InfinityUnit, kind: str, slot: int | None = None) -> str:
        """The NVMe name of ``unit``'s ``kind`` in ``slot`` (default: the current one)."""
        return unit.key(f"{kind}.{self.slot if slot is None else slot}")

    def _write_initial_states(self, seed: int) -> None:
        """Each unit's shard (and zero moments, the fp32 master) to this rank's files in slot 0, then
        the manifest; wait for them so that a full disk or a vanished directory fails here."""
        writes = []
        for u in self.units:
            shard = u.initial_shard(self.comm.rank, seed, self.dtype)
            master = shard.astype(MASTER[self.precision])
            writes.append(self.tiers.write_nvme(self.key(u, "param"), shard, copy=False))
            if self.precision == "mixed":
                writes.append(self.tiers.write_nvme(self.key(u, "master"), master, copy=False))
            for kind in ("exp_avg", "exp_avg_sq"):
                writes.append(self.tiers.write_nvme(self.key(u, kind), np.zeros_like(master), copy=False))
            u.empty_params()
        for w in writes:
            w.result()
        self._commit(self.slot, self.steps_applied, self.loss_scale, self.clean_steps)

    def _commit(self, slot: int, steps: int, loss_scale: float, clean_steps: int) -> None:
        """The one atomic write that makes ``slot`` current (raises if it failed: nothing changed)."""
        saved = manifest(slot, steps, loss_scale, clean_steps, self.loss_scale, self.clean_steps)
        self.tiers.write_nvme("manifest", saved, copy=False).result()

    def _open(self) -> None:
        """``resume``: the slot and counters of the last step committed on every rank."""
        self.slot, self.steps_applied, self.loss_scale, self.clean_steps = \
            resume_point(self.comm, self.tiers.read_nvme("manifest").result())
        for u in self.units:
            u.empty_params()

    # ---- forward and backward, unit by unit -----------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def loss(self, *args: Any) -> Tensor:
        return self.module.loss(*args)

    def scale(self, loss: Tensor) -> Tensor:
        """What backward starts from: ``loss * S`` in mixed precision, ``loss`` otherwise."""
        return loss * self.loss_scale if self.precision == "mixed" else loss

    def _wrap(self, unit: InfinityUnit, forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> Tensor:
            if not self.order:
                self._begin_pass()
            self.order.append(unit)
            unit.reduced = False
            with trace.span("F", args={"unit": unit.name}):
                self._unshard(unit, "F")
                out = forward(*args, **kwargs)
                self._release(unit)
            return on_backward.apply(out, lambda: self._unshard(unit, "B"))
        return wrapped

    def _begin_pass(self) -> None:
        """The schedule of this forward and backward: the last forward's order (before any, the
        registration order), then its reverse."""
        self._discard_reads()
        fwd = [u.index for u in (self.last_order or self.units)]
        self._plan = [("F", i) for i in fwd] + [("B", i) for i in reversed(fwd)]
        self._cursor, self.log = 0, []

    def _fetch(self, unit: InfinityUnit, phase: str) -> np.ndarray:
        """This rank's shard of ``unit`` on the CPU: the read started ahead, else one now; first the
        reads of the next ``prefetch_depth`` uses of the schedule are started."""
        at = next((j for j in range(self._cursor, len(self._plan)) if self._plan[j] == (phase, unit.index)), None)
        fut = None
        if at is not None:
            for j in range(self._cursor, at):  # predicted uses that did not come
                if j in self._reads:
                    self._stale.append(self._reads.pop(j))
            fut = self._reads.pop(at, None)
            self._cursor = at + 1
        if fut is None:
            fut = self._read(phase, unit.index)
        for j in range(self._cursor, min(self._cursor + self.depth, len(self._plan))):
            if j not in self._reads:
                self._reads[j] = self._read(*self._plan[j])
        self.log.append(("use", phase, unit.index))
        return fut.result()

    def _read(self, phase: str, index: int) -> Future[np.ndarray]:
        self.log.append(("read", phase, index))
        return self.tiers.read_nvme(self.key(self.units[index], "param"))

    def _unshard(self, unit: InfinityUnit, phase: str) -> None:
        """NVMe -> CPU (this rank's shard only) -> device, all-gathered there; the parameters views of it
        (nothing to do if the unit is still gathered: a unit run twice, backward reaching it again)."""
        if unit.full is not None:
            return
        host = self._fetch(unit, phase)
        if self.comm.size == 1:
            unit.full = self.tiers.to_device(unit.key("gathered"), host)
        else:
            shard = self.tiers.to_device(unit.key("shard"), host)
            unit.full = self.tiers.adopt(unit.key("gathered"), self.comm.allgather(shard, algorithm=ALGORITHM))
            self.tiers.free(unit.key("shard"))
        for p, view in zip(unit.params, unit.layout.views(unit.full), strict=True):
            p.data = view

    def _release(self, unit: InfinityUnit) -> None:
        unit.empty_params()
        if unit.full is not None:
            self.tiers.free(unit.key("gathered"))
            unit.full = None

    def _on_grad_ready(self, unit: InfinityUnit, j: int) -> None:
        unit.ready.add(j)
        if len(unit.ready) == len(unit.params):
            self._reduce(unit)
            self._release(unit)

    def _reduce(self, unit: InfinityUnit) -> None:
        """The unit's gradients flattened into a device buffer, / N, reduce-scattered; this rank's
        partition down to the CPU (summed there over backwards until the step)."""
        lay = unit.layout
        buf = self.tiers.empty(unit.key("gradients"), lay.padded, self.dtype)
        buf[lay.numel:] = 0
        for view, p in zip(lay.views(buf), unit.params, strict=True):
            view[...] = 0 if p.grad is None else p.grad
            p.grad = None
        buf /= self.comm.size  # before the sum: float16 overflows as one process would
        lo, hi = lay.shard_range(self.comm.rank)
        buf[lo:hi] = self.comm.reduce_scatter(buf, op="sum", algorithm=ALGORITHM)
        down = self.tiers.to_cpu(unit.key("gradients"), buf[lo:hi])
        self.tiers.free(unit.key("gradients"))
        unit.grad = down if unit.grad is None else unit.grad + down
        unit.ready.clear()
        unit.reduced = True
        self._sample()

    def backward(self, loss: Tensor) -> None:
        """Backward from ``scale(loss)``; each unit is reduced as soon as its gradients are complete,
        a unit some parameter of which got none at the end."""
        with trace.span("B"):
            self.scale(loss).backward()
            for unit in reversed(self.order):
                if not unit.reduced:
                    self._reduce(unit)
                    self._release(unit)
            self._discard_reads()
        self.last_order, self.order = self.order, []

    def _discard_reads(self) -> None:
        """Wait for reads started for uses that did not come, and drop them."""
        for f in [*self._reads.values(), *self._stale]:
            f.result()
        self._reads, self._stale = {}, []

    # ---- the step, streamed through the CPU -----------------------------------------------------
    def step(self) -> bool:
        """AdamW on every unit's shard, read from and written back to NVMe unit by unit; False when
        mixed precision skipped the step (an overflow on some rank)."""
        with trace.span("opt"):
            self._discard_reads()
            if self._overflow():
                return False
            clean, scale = self.clean_steps, self.loss_scale
            if self.precision == "mixed":
                clean += 1
                scale *= 2 if clean % self.growth_interval == 0 else 1
            try:
                agree(self.comm, lambda: self._update(1 - self.slot), "a write")  # every rank commits, or none
                agree(self.comm, lambda: self._commit(1 - self.slot, self.steps_applied + 1, scale, clean),
                      "the commit", undo=lambda: self._commit(self.slot, self.steps_applied, self.loss_scale,
                                                              self.clean_steps))
            finally:
                self._sample()
            self.slot, self.steps_applied, self.clean_steps, self.loss_scale = \
                1 - self.slot, self.steps_applied + 1, clean, scale
        return True

    def _update(self, new: int) -> None:
        """AdamW unit by unit: the state read from the current slot, written to slot ``new``; raises
        the first failed write once every write has finished (the manifest is not written then)."""
        kinds = ["master" if self.precision == "mixed" else "param", "exp_avg", "exp_avg_sq"]
        reads: dict[int, list[Future[np.ndarray]]] = {}
        writes: list[Future[None]] = []
        try:
            for i, u in enumerate(self.units):
                for j in range(i, min(i + 1 + self.depth, len(self.units))):
                    if j not in reads:
                        reads[j] = [self.tiers.read_nvme(self.key(self.units[j], k)) for k in kinds]
                master, m, v = (f.result() for f in reads.pop(i))
                grad = u.grad if u.grad is not None else np.zeros(u.layout.shard_size, self.dtype)
                if self.precision == "mixed":  # unscaled into the master's precision, one unit at a time
                    grad = grad.astype(np.float32) / np.float32(self.loss_scale)
                u.grad = None
                self._adam.update(master, grad, {"step": self.steps_applied, "exp_avg": m, "exp_avg_sq": v})
                if self.precision == "mixed":
                    writes.append(self.tiers.write_nvme(self.key(u, "param", new), master.astype(self.dtype),
                                                        copy=False, in_place=True))
                writes += [self.tiers.write_nvme(self.key(u, k, new), a, copy=False, in_place=True)
                           for k, a in zip(kinds, (master, m, v), strict=True)]
        finally:
            for u in self.units:
                u.grad = None
            for f in [f for fs in reads.values() for f in fs]:
                f.exception()
            errors = [e for e in (w.exception() for w in writes) if e is not None]  # waits for every write
        if errors:  # the other slot keeps the previous step (this one's files may be torn: never read)
            raise errors[0]
        self.tiers.sync_nvme()  # this slot on the disk before the manifest names it

    def _overflow(self) -> bool:
        """Mixed precision: does any rank's float16 gradient partition hold an inf or a nan (one
        all-reduce, so every rank decides alike)? Then the gradients are dropped, nothing is read
        or written, and the loss scale halves. (Checked on the float16 partitions as they are:
        dividing a finite one by the scale, a power of two, stays finite in float32.)"""
        if self.precision != "mixed":
            return False
        local = [u.grad for u in self.units if u.grad is not None]
        flags = np.array([float(sum(not np.isfinite(g).all() for g in local))])
        if self.comm.allreduce(flags, op="sum", algorithm=ALGORITHM)[0] == 0:
            return False
        for u in self.units:
            u.grad = None
        self._sample()
        self.loss_scale, self.clean_steps, self.skipped = self.loss_scale / 2, 0, self.skipped + 1
        trace.mark("overflow: step skipped", loss_scale=self.loss_scale)
        return True

    def cpu_bytes(self) -> int:
        """Host bytes this object holds between uses: the gradient partitions waiting for the step
        (the shards and states passing through are not counted: each lives from its read to its
        use or write, at most ``prefetch_depth + 1`` units of them)."""
        return sum(u.grad.nbytes for u in self.units if u.grad is not None)

    def _sample(self) -> None:
        """A "cpu" memory sample (the device and NVMe tiers sample themselves)."""
        if trace.current() is not None:
            trace.memory("cpu", self.cpu_bytes())

    # ---- whole values and cleanup -------------------------------------------------------------
    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter, whole: each unit's shard read from this rank's file and all-gathered
        (for tests; its reads are recorded like any other)."""
        out = {}
        for u in self.units:
            shard = self.tiers.read_nvme(self.key(u, "param")).result()
            flat = shard if self.comm.size == 1 else self.comm.allgather(shard, algorithm=ALGORITHM)
            out.update(zip(u.names, (v.copy() for v in u.layout.views(flat)), strict=True))
        return out

    def close(self) -> None:
        """Wait for pending reads, remove this object's files (``Tiers.close``: the rest), unguard."""
        self._discard_reads()
        for u in self.units:
            self._release(u)
        names = [self.key(u, k, slot) for u in self.units for k in self.kinds for slot in (0, 1)]
        for f in [self.tiers.delete_nvme(name) for name in [*names, "manifest"]]:
            f.result()
        self._unguard()
