"""``minipar.cost.precision``: bytes per parameter of each precision recipe, against the papers'
counts written out by hand, the FP8 copy measured in an autograd graph, and the all-reduce's bytes
measured in a trace."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from minipar import fp8, trace
from minipar.autograd import Tensor
from minipar.cost import precision
from minipar.memory import held_buffers
from minipar.nn import Linear
from minipar.testing import run


def test_state_bytes_per_parameter_by_hand():
    # ZeRO Sec. 3.1: mixed-precision Adam keeps 2 + 2 + K bytes, K = 12 (fp32 master, momentum, variance)
    by_hand = {"fp32": 4 + 4 + 8, "fp16 + loss scale": 2 + 2 + 12, "bf16": 2 + 2 + 12,
               "bf16, fp32 reduce": 2 + 4 + 12, "fp8": 2 + 2 + 12 + 1}
    assert {r: sum(precision.state_bytes(r).values()) for r in precision.RECIPES} == by_hand
    assert [precision.reduce_itemsize(r) for r in precision.RECIPES] == [4, 2, 2, 4, 2]
    with pytest.raises(ValueError, match=r"^state_bytes: recipe='fp4'; choose one of"):
        precision.state_bytes("fp4")


def test_the_fp8_copy_of_a_weight_is_one_byte_an_element_measured():
    layer = fp8.enable(Linear(16, 8, dtype=np.float32), "delayed")
    x = Tensor(np.ones((4, 16), np.float32), requires_grad=True)
    held = held_buffers(layer(x))
    sizes = sorted(nbytes for _, nbytes in held.values())
    # the e4m3 input (4 x 16) and weight (16 x 8) kept for backward, one byte each, beside the output
    assert 16 * 8 * precision.state_bytes("fp8")["fp8 weights"] in sizes and 4 * 16 in sizes


def allreduce_sent(comm, dtype: str, n: int) -> int:
    grads = np.ones(n, dtype=np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else dtype)
    with trace.recording(comm.world_rank) as rec:
        comm.allreduce(grads, op="sum", algorithm="ring")
    return sum(e.nbytes for e in rec.events if e.kind == "comm" and e.name == "send")


@pytest.mark.parametrize(("recipe", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16"),
                                               ("bf16, fp32 reduce", "float32")])
def test_allreduce_bytes_per_step_equal_a_traced_ring(recipe: str, dtype: str):
    n, p = 1000, 4
    assert run(allreduce_sent, p, dtype=dtype, n=n) == [precision.allreduce_bytes_per_step(recipe, n, p, r)
                                                        for r in range(p)]


def fp8_step_sent(comm, recipe: str, sp: bool) -> int:
    """Bytes this rank sends in one FP8 training step of a 2-block tensor-parallel GPT."""
    from minipar.parallel.tensor import TensorParallelGPT

    model = fp8.enable(TensorParallelGPT(16, 8, 16, 4, 2, comm, sequence_parallel=sp, dtype=np.float32),
                       fp8.BlockScaling(4) if recipe == "block" else fp8.DelayedScaling())
    idx, targets = np.random.default_rng(0).integers(0, 16, (2, 2, 8))
    with trace.recording(comm.world_rank) as rec:
        model.loss(idx, targets).backward()
    return sum(e.nbytes for e in rec.events if e.kind == "comm" and e.name == "send")


@pytest.mark.parametrize(("t", "sp"), [(2, False), (2, True), (4, True)])
def test_delayed_scaling_sends_the_amax_all_reduces_block_scaling_does_not(t: int, sp: bool):
    """The same step under both recipes moves the same activations; delayed scaling adds 12 amax
    all-reduces of one float64 per block (``fp8_amax_bytes``): the difference of the traced bytes."""
    delayed, block = run(fp8_step_sent, t, recipe="delayed", sp=sp), run(fp8_step_sent, t, recipe="block", sp=sp)
    assert [d - b for d, b in zip(delayed, block, strict=True)] == [precision.fp8_amax_bytes(2, t, r) for r in range(t)]
    assert precision.fp8_amax_bytes(2, t) > 0
