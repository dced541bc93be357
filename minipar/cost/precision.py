"""Bytes per parameter of each way of training in reduced precision: the model states a rank keeps
(data parallelism, nothing partitioned; ZeRO divides them as ``zero.py`` says) and the bytes of the
gradient all-reduce. Derivations in ``docs/formulas.md``, section "Precision".

    recipe                 working   grads   master   m + v   FP8 copy   reduce (bytes / element)
    fp32                      4        4        -        8        -          4
    fp16 + loss scale         2        2        4        8        -          2   (ZeRO's K = 12)
    bf16                      2        2        4        8        -          2
    bf16, fp32 reduce         2        4        4        8        -          4   (Megatron's fp32 main grads)
    fp8 (+ bf16)              2        2        4        8        1          2

fp16 and bf16 cost the same bytes; bf16 has fp32's exponent range, so it needs no loss scale
(lesson 11 shows why). Reducing bf16 gradients in fp32 (PyTorch FSDP's ``MixedPrecision
(reduce_dtype=float32)``, Megatron's ``--accumulate-allreduce-grads-in-fp32``) keeps them in 4 bytes
and sends 4 bytes an element. FP8 training (Transformer Engine; ``minipar.fp8``) keeps the bf16
recipe's states and adds the e4m3 copy of every weight cast once per step (1 byte; Hopper also
keeps its transpose, one more byte, not counted): FP8 speeds up the GEMMs and shrinks the saved
activations (1 byte each instead of 2), not the per-parameter state, and the gradients are still
reduced in bf16. The all-reduce sends ``2 (N-1)/N`` elements per parameter on a ring
(``collectives.allreduce_bytes``).

FP8 under tensor parallelism with delayed scaling (``parallel/tensor/fp8.py``) all-reduces (op max)
the amax of every sharded tensor it casts, one float64 each: per Megatron block, q, k, v and the
MLP's first linear (column parallel) the weight's in forward and the output gradient's in backward,
the attention's and the MLP's output linears (row parallel) the input's and the weight's in forward:
``4 x 2 + 2 x 2 = 12`` (``fp8_amax_allreduces``). Block scaling needs none: a block lies in one shard.
"""

from __future__ import annotations

from minipar.cost.collectives import allreduce_bytes
from minipar.cost.zero import precision_bytes

RECIPES = ("fp32", "fp16 + loss scale", "bf16", "bf16, fp32 reduce", "fp8")


def _check(who: str, recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"{who}: recipe={recipe!r}; choose one of {RECIPES}")


def state_bytes(recipe: str) -> dict[str, int]:
    """Bytes per parameter of each model state under ``recipe`` (module docstring's table)."""
    _check("state_bytes", recipe)
    if recipe == "fp32":
        return {"parameters": 4, "gradients": 4, "optimizer state": 8}  # AdamW updates the parameters in place
    precision, reduce = {"fp16 + loss scale": ("mixed", None), "bf16": ("bf16", None),
                         "bf16, fp32 reduce": ("bf16", "fp32"), "fp8": ("bf16", None)}[recipe]
    out = precision_bytes(precision, reduce)  # one home: the ZeRO wrappers' own counts (cost.zero)
    if recipe == "fp8":
        out["fp8 weights"] = 1
    return out


def reduce_itemsize(recipe: str) -> int:
    """Bytes per element of the gradient all-reduce under ``recipe``."""
    _check("reduce_itemsize", recipe)
    return state_bytes(recipe)["gradients"]


def allreduce_bytes_per_step(recipe: str, params: int, dp: int, rank: int = 0) -> int:
    """Bytes ``rank`` sends in one ring all-reduce of ``params`` gradients over ``dp`` ranks."""
    return allreduce_bytes(params, reduce_itemsize(recipe), dp, rank, "ring")


AMAX_PER_BLOCK = 4 * 2 + 2 * 2  # column-parallel q, k, v, fc: w and dy; row-parallel proj, fc2: x and w


def fp8_amax_bytes(layers: int, tp: int, rank: int = 0) -> int:
    """Bytes ``rank`` sends per step for delayed scaling's amax all-reduces in ``layers`` Megatron
    blocks on ``tp`` ranks: ``AMAX_PER_BLOCK`` ring all-reduces of one float64 per block."""
    if layers < 0:
        raise ValueError(f"fp8_amax_bytes: layers={layers} must be >= 0")
    return layers * AMAX_PER_BLOCK * allreduce_bytes(1, 8, tp, rank, "ring")
