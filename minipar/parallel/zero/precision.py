"""AdamW on this rank's shards, in float64 or in mixed precision as ZeRO trains (Rajbhandari et al.
2020, Sec. 3.1: "fp16 parameters and gradients ... an fp32 copy of the parameters, momentum and
variance", K = 12 bytes of optimizer state per parameter; Micikevicius et al. 2018, "Mixed
Precision Training", Sec. 3: the fp32 master copy and loss scaling).

``precision="fp64"``: the optimizer updates the working shard itself (no second copy).

``precision="mixed"``: the model computes in float16; the loss is multiplied by the loss scale S
before backward, so small gradients survive float16; the float16 gradient shards are reduce-scattered
as float16. Then, per step::

    g = fp32(grad shard) / S                         unscale into the fp32 master's precision
    overflow = any rank saw inf or nan in g          one all-reduce: every rank takes the same decision
    if overflow: skip the step, S /= 2                (dynamic loss scaling)
    else:        clip by the global norm (one all-reduce of the shards' squared norms)
                 AdamW on the fp32 master shard; working shard = fp16(master)
                 every ``growth_interval`` clean steps S *= 2

S starts at 2^12, not PyTorch's 2^16: here the loss itself is computed in float16 (there is no
autocast keeping it in float32), and loss x S must stay below float16's largest number, 65504.

``precision="bf16"`` (how large models are trained today; Kalamkar et al. 2019, "A Study of
BFLOAT16 for Deep Learning Training"): bfloat16 working parameters (two bytes, the copy that is
sent), activations rounded to bfloat16 (``minipar.autograd``: emulated, in float32 arrays), a float32
master copy and float32 AdamW moments (K = 12 as in mixed), and no loss scale: bfloat16 has
float32's exponent range, so the gradients neither overflow nor underflow where float32's would not.
The gradients are reduced in ``reduce_dtype``: "bf16" (two bytes a parameter on the wire, PyTorch
FSDP's ``MixedPrecision(reduce_dtype=torch.bfloat16)``) or "fp32" (four: the sums keep float32's
precision, Megatron's ``--accumulate-allreduce-grads-in-fp32``), or "fp16" when the sum fits
(``minipar.parallel.bf16.check_reduce_range``). Then, per step: ``g = fp32(grad shard)``, clip, AdamW on the fp32
master, working shard = bf16(master) (round to nearest even).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import BF16, Tensor
from minipar.comm import Communicator
from minipar.optim import AdamW
from minipar.parallel.bf16 import wire_dtype

PRECISIONS = ("fp64", "mixed")  # what the offload engines run too
ZERO_PRECISIONS = (*PRECISIONS, "bf16")
WORKING = {"fp64": np.float64, "mixed": np.float16, "bf16": BF16}


def reduce_dtype_of(precision: str, reduce_dtype: str | None) -> np.dtype:
    """The dtype a stage's gradients travel in (``minipar.parallel.bf16``)."""
    return wire_dtype(WORKING[precision], reduce_dtype)


class ShardedAdamW:
    """AdamW over this rank's ``shards`` (working-precision tensors whose ``grad`` the stage sets)."""

    def __init__(self, shards: list[Tensor], comm: Communicator, precision: str = "fp64", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 max_grad_norm: float | None = None, loss_scale: float | None = None,
                 growth_interval: int = 2000) -> None:
        self.shards, self.comm, self.precision = shards, comm, precision
        self.max_grad_norm, self.growth_interval = max_grad_norm, growth_interval
        self.loss_scale = (2.0**12 if loss_scale is None else loss_scale) if precision == "mixed" else 1.0
        masters = precision in ("mixed", "bf16")
        self.master = [Tensor(s.data.astype(np.float32)) for s in shards] if masters else shards
        self.adam = AdamW(self.master, lr, betas, eps, weight_decay)
        self.clean_steps = 0
        self.skipped = 0

    def scale(self, loss: Tensor) -> Tensor:
        """What backward starts from: ``loss * S`` in mixed precision, ``loss`` otherwise."""
        return loss * self.loss_scale if self.precision == "mixed" else loss

    def step(self) -> bool:
        """One optimizer step on the shards' gradients (then cleared); False when skipped (overflow)."""
        grads = [s.grad if s.grad is not None else np.zeros_like(s.data) for s in self.shards]
        if self.precision == "mixed":
            grads = [g.astype(np.float32) / np.float32(self.loss_scale) for g in grads]
            bad = float(sum(int(not np.isfinite(g).all()) for g in grads))
            if self.comm.allreduce(np.array([bad]), op="sum", algorithm="ring")[0] > 0:
                self.loss_scale /= 2
                self.clean_steps = 0
                self.skipped += 1
                trace.mark("overflow: step skipped", loss_scale=self.loss_scale)
                self._clear()
                return False
        if self.precision == "bf16":
            grads = [g.astype(np.float32) for g in grads]  # a bf16 reduce's shards; fp32's unchanged
        if self.max_grad_norm is not None:
            local = sum(float(np.dot(g.ravel().astype(np.float64), g.ravel().astype(np.float64))) for g in grads)
            norm = math.sqrt(self.comm.allreduce(np.array([local]), op="sum", algorithm="ring")[0])
            if norm > self.max_grad_norm:  # torch.nn.utils.clip_grad_norm_'s rule
                grads = [g * (self.max_grad_norm / (norm + 1e-6)) for g in grads]
        for m, g in zip(self.master, grads, strict=True):
            m.grad = g
        self.adam.step()
        if self.master is not self.shards:
            for s, m in zip(self.shards, self.master, strict=True):
                s.data[...] = m.data  # fp16 / bf16 working copy of the fp32 master
        if self.precision == "mixed":
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.loss_scale *= 2
        self._clear()
        return True

    def _clear(self) -> None:
        for s in self.shards:
            s.grad = None
        for m in self.master:
            m.grad = None

    # ---- checkpoints: this rank's shards by name (``checkpoint.save`` / ``load``) -------------------
    def shards_to_save(self, names: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``{name/param, name/exp_avg, name/exp_avg_sq[, name/master]: shard}`` and the replicated
        scalars (AdamW's step, the loss scale), for groups named ``names`` in shard order."""
        arrays: dict[str, np.ndarray] = {}
        for i, name in enumerate(names):
            state = self.adam.state[i]
            zeros = np.zeros_like(self.master[i].data)
            param = self.shards[i].data  # bf16 saved as float32 (exact; .npy has no bfloat16), read back as bf16
            arrays[f"{name}/param"] = param.astype(np.float32) if param.dtype == BF16 else param
            arrays[f"{name}/exp_avg"] = state.get("exp_avg", zeros)
            arrays[f"{name}/exp_avg_sq"] = state.get("exp_avg_sq", zeros)
            if self.master is not self.shards:
                arrays[f"{name}/master"] = self.master[i].data
        step = self.adam.state[0].get("step", 0) if names else 0
        return arrays, {"step": step, "loss_scale": self.loss_scale, "clean_steps": self.clean_steps,
                        "skipped": self.skipped, "precision": self.precision}

    def load_shards(self, names: list[str], arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Put back what ``shards_to_save`` gave (re-cut for this world size by ``checkpoint.load``)."""
        if meta["precision"] != self.precision:
            raise ValueError(f"the checkpoint was saved in precision={meta['precision']!r}, this run uses "
                             f"{self.precision!r}")
        for i, name in enumerate(names):
            self.shards[i].data[...] = arrays[f"{name}/param"]
            if self.master is not self.shards:
                self.master[i].data[...] = arrays[f"{name}/master"]
            self.adam.state[i] = {} if not meta["step"] else {
                "step": meta["step"], "exp_avg": arrays[f"{name}/exp_avg"].copy(),
                "exp_avg_sq": arrays[f"{name}/exp_avg_sq"].copy()}
        self.loss_scale, self.clean_steps, self.skipped = meta["loss_scale"], meta["clean_steps"], meta["skipped"]

    def state_bytes(self) -> dict[str, int]:
        """Bytes on this rank: ``optimizer state`` (AdamW's moments) and, in mixed and bf16 precision,
        the fp32 ``master parameters`` (together the paper's K = 12 per parameter)."""
        out = {"optimizer state": self.adam.state_bytes()}
        if self.master is not self.shards:
            out["master parameters"] = sum(m.data.nbytes for m in self.master)
        return out
