"""Backward split in two (zero-bubble's B and W): B computes every gradient but the weights', W the
weights', and B then W equals one ordinary backward bit for bit.

Property: for drawn tiny GPTs, MLPs and batches, the input's gradient after B and every parameter's
gradient after W equal those of ``loss.backward()`` exactly; after B alone no weight has a gradient;
the weight-using ops are asked for their input gradient in B and for their weight gradient in W only;
the memory held between B and W is what the kept ops saved plus the kept gradients (by hand below).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar import functional as F
from minipar import nn
from minipar.autograd import Context, Function, Tensor
from minipar.parallel.pipeline.partition import Stage, gpt
from minipar.split_backward import WeightGradients


def stage_of(c: dict) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """The last pipeline stage of a tiny GPT (its blocks and head; input: an activation), an input
    and targets."""
    model = gpt(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], seed=c["seed"])
    stage = Stage(1, model, range(1, c["layers"] + 2))
    rng = np.random.default_rng(c["seed"])
    x = rng.normal(size=(c["batch"], c["seq"], c["d"]))
    targets = rng.integers(0, c["vocab"], (c["batch"], c["seq"]))
    return stage, x, targets


@st.composite
def configs(draw: st.DrawFn) -> dict:
    heads = draw(st.integers(1, 3))
    return {"vocab": draw(st.integers(3, 9)), "seq": draw(st.integers(1, 5)), "d": heads * draw(st.integers(1, 3)),
            "heads": heads, "layers": draw(st.integers(1, 2)), "batch": draw(st.integers(1, 3)),
            "seed": draw(st.integers(0, 1000))}


@budget(20)
@given(configs())
def test_b_then_w_equals_backward_exactly(c: dict) -> None:
    stage, x, targets = stage_of(c)
    inp = Tensor(x, requires_grad=True)
    F.cross_entropy(stage(inp), targets).backward()
    want = {n: p.grad.copy() for n, p in stage.named_parameters()}
    want_x = inp.grad.copy()
    stage.zero_grad()
    inp = Tensor(x, requires_grad=True)
    later = WeightGradients(stage.parameters())
    F.cross_entropy(stage(inp), targets).backward(weights=later)
    np.testing.assert_array_equal(inp.grad, want_x)  # B: the gradient the previous stage waits for
    assert all(p.grad is None for p in stage.parameters())  # ... and no weight's
    assert later.nbytes() > 0
    later.run()
    for name, p in stage.named_parameters():
        np.testing.assert_array_equal(p.grad, want[name], err_msg=name)
    assert later.nbytes() == 0
    with pytest.raises(RuntimeError, match="already called"):
        later.run()


class Spy(Function):
    """``x @ w``, recording which gradients each backward call was asked for."""

    calls: list[tuple[bool, ...]] = []

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        x, w = ctx.saved
        Spy.calls.append(ctx.needs_input_grad)
        need_x, need_w = ctx.needs_input_grad
        return (g @ w.T if need_x else None), (x.T @ g if need_w else None)


def test_weight_ops_asked_for_one_side_each_time() -> None:
    Spy.calls = []
    w = nn.Parameter((3, 5), ("normal", 1.0))
    w.data[...] = np.arange(15.0).reshape(3, 5)
    x = Tensor(np.ones((4, 3)), requires_grad=True)
    later = WeightGradients([w])
    out = Spy.apply(x, w)
    out.backward(np.ones((4, 5)), weights=later)
    assert Spy.calls == [(True, False)] and w.grad is None
    np.testing.assert_array_equal(x.grad, np.tile(np.arange(15.0).reshape(3, 5).sum(axis=1), (4, 1)))
    # held until W, by hand: the output's gradient (4 x 5), the output (4 x 5), the saved x (4 x 3); not w
    assert later.nbytes() == (20 + 20 + 12) * 8
    later.run()
    assert Spy.calls == [(True, False), (False, True)]
    np.testing.assert_array_equal(w.grad, np.full((3, 5), 4.0))


def test_an_op_of_weights_alone_waits_for_w() -> None:
    table = nn.Parameter((6, 2), ("normal", 1.0))
    table.data[...] = np.arange(12.0).reshape(6, 2)
    later = WeightGradients([table])
    F.embedding(table, np.array([1, 1, 4])).sum().backward(weights=later)
    assert table.grad is None
    later.run()
    np.testing.assert_array_equal(table.grad, [[0, 0], [2, 2], [0, 0], [0, 0], [1, 1], [0, 0]])
