"""bfloat16 mixed precision, the recipe large models are trained with today (Kalamkar et al. 2019,
"A Study of BFLOAT16 for Deep Learning Training"; PyTorch FSDP's ``MixedPrecision(param_dtype,
reduce_dtype)``; Megatron-LM's ``--bf16 --accumulate-allreduce-grads-in-fp32``): what DDP, ZeRO and
FSDP share.

- Working parameters in bfloat16 (two bytes: what forward reads and an all-gather sends), activations
  rounded to bfloat16 by every op (``minipar.autograd``: emulated in float32 arrays, as numpy has no
  bfloat16 matmul), a float32 master copy and float32 AdamW moments (``MasterAdamW``, ZeRO's
  ``ShardedAdamW``): K = 12 bytes of optimizer state per parameter, as float16 mixed precision.
- No loss scale: bfloat16 keeps float32's 8 exponent bits (smallest normal 1.2e-38, largest 3.4e38),
  so a gradient that float32 represents does not underflow or overflow in bfloat16; it loses
  mantissa bits (8 against 24) instead. A loss scale with bf16 is refused.
- Gradients reduced in ``reduce_dtype``: "bf16" (2 bytes a parameter on the wire; each partial sum
  rounded to 8 bits) or "fp32" (4 bytes; the sum keeps float32's precision). "fp16" is accepted where
  the sum fits (``check_reduce_range``); FP8 formats are refused (largest 448 / 57344, 2-3 mantissa
  bits: no room for a sum).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from minipar.autograd import BF16, Tensor
from minipar.comm import Communicator
from minipar.optim import AdamW

REDUCE_DTYPES = {"bf16": BF16, "fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}
FP16_MAX = float(np.finfo(np.float16).max)  # 65504


def check_recipe(precision: str, reduce_dtype: str | None, loss_scale: float | None) -> list[str]:
    """What is wrong with this precision recipe (arguments only: the same on every rank)."""
    problems = []
    if precision == "bf16" and loss_scale is not None:
        problems.append(f"precision='bf16' takes no loss scale (loss_scale={loss_scale}): bfloat16 has float32's "
                        "exponent range, so nothing underflows that a scale would save; drop loss_scale")
    if reduce_dtype is not None and precision != "bf16":
        problems.append(f"reduce_dtype={reduce_dtype!r} is for precision='bf16'; precision={precision!r} reduces "
                        "in its working dtype: drop reduce_dtype")
    elif reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
        problems.append(f"reduce_dtype={reduce_dtype!r} cannot hold a gradient sum's range (the FP8 formats top "
                        f"out at 448 and 57344, with 2-3 mantissa bits); choose one of {tuple(REDUCE_DTYPES)}")
    return problems


def wire_dtype(working: np.dtype | type, reduce_dtype: str | None) -> np.dtype:
    """The dtype gradients travel in: ``working`` unless ``reduce_dtype`` names another."""
    return np.dtype(working if reduce_dtype is None else REDUCE_DTYPES[reduce_dtype])


def check_reduce_range(comm: Communicator, grads: np.ndarray, working: np.dtype) -> None:
    """Before a float16 reduce of bfloat16 gradients (``grads``, cast): the ranks' largest |gradient|
    times the number of ranks (the bound on an undivided sum, |sum| <= N max|g|) must stay within
    65504, or every rank raises the same line. One all-reduce (max) of one number; nothing to check
    for bf16 and fp32 (float32's range) nor for float16 mixed precision (its loss scaler skips the
    step when a gradient overflows)."""
    if grads.dtype != np.float16 or working != BF16:
        return
    amax = comm.allreduce(np.array([float(np.max(np.abs(grads), initial=0.0))]), op="max", algorithm="ring")[0]
    if not amax * comm.size <= FP16_MAX:
        raise ValueError(f"reduce_dtype='fp16' cannot hold this gradient sum: max |g| {amax:.4g} x {comm.size} "
                         f"ranks > {FP16_MAX:g} (float16's largest); reduce in 'bf16' or 'fp32'")


class MasterAdamW(AdamW):
    """AdamW on float32 master copies of bfloat16 ``params`` (every DDP replica runs it on its full
    model): ``step`` reads each parameter's gradient (bfloat16 or float32, as it was reduced), updates
    the master and writes bf16(master) back into the parameter (round to nearest even)."""

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self.working = list(params)
        wrong = sorted({str(p.dtype) for p in self.working if p.dtype != BF16})
        if wrong:
            raise ValueError(f"MasterAdamW keeps fp32 masters of bfloat16 parameters, got {wrong}; build the model "
                             "with dtype=ml_dtypes.bfloat16")
        super().__init__([Tensor(p.data.astype(np.float32)) for p in self.working], lr, betas, eps, weight_decay)

    def zero_grad(self) -> None:
        for p in self.working:
            p.grad = None

    def step(self) -> None:
        for p, m in zip(self.working, self.params, strict=True):
            m.grad = None if p.grad is None else p.grad.astype(np.float32)
        super().step()
        for p, m in zip(self.working, self.params, strict=True):
            p.data[...] = m.data
            m.grad = None

    def state_bytes(self) -> int:
        """The moments and the master copy: 12 bytes a parameter once stepped."""
        return super().state_bytes() + sum(m.data.nbytes for m in self.params)


def to_wire(t: Tensor, a: np.ndarray | None = None) -> np.ndarray:
    """What crosses a pipeline stage boundary for ``t``: its data (or ``a``, its gradient) as
    bfloat16 when ``t`` holds bf16-rounded values (two bytes an element, exactly: the values are
    bf16 already), else as it is."""
    a = t.data if a is None else a
    return a.astype(BF16) if t._bf16 else a


def from_wire(a: np.ndarray) -> Tensor:
    """A received activation as a leaf that needs a gradient: bfloat16 read back into float32 and
    marked bf16-rounded, so the ops after it and the gradient sent back round as one process's would."""
    if a.dtype != BF16:
        return Tensor(a, requires_grad=True)
    t = Tensor(a.astype(np.float32), requires_grad=True)
    t._bf16 = True
    return t
