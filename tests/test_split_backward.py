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
    # held until W, by hand: the output's gradient (4 x 5) and the saved x (4 x 3); not w, not the output
    assert later.nbytes() == (20 + 12) * 8
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


def test_between_b_and_w_only_what_w_needs_stays_alive() -> None:
    import gc
    import weakref

    w1, w2 = nn.Parameter((3, 4), ("normal", 1.0)), nn.Parameter((4, 2), ("normal", 1.0))
    w1.data[...], w2.data[...] = np.full((3, 4), 0.5), np.full((4, 2), -0.25)
    x = Tensor(np.ones((5, 3)), requires_grad=True)
    h = F.linear(x, w1)
    y = F.gelu(h)  # GELU keeps h for its backward: needed by B, not by W
    z = F.linear(y, w2)
    gone = [weakref.ref(t) for t in (h, y, z)]
    later = WeightGradients([w1, w2])
    z.backward(np.ones((5, 2)), weights=later)
    del h, y, z
    gc.collect()
    assert [r() for r in gone] == [None, None, None]  # the graph's nodes are freed after B
    # what stays, by hand: per linear its output's gradient and its saved input: (5x2 + 5x4) + (5x4 + 5x3)
    assert later.nbytes() == (10 + 20 + 20 + 15) * 8
    later.run()
    assert w1.grad.shape == (3, 4) and w2.grad.shape == (4, 2)


def zb_pipeline(comm, widths: list[int], mb: int, path: str) -> None:
    from minipar import trace
    from minipar.optim import SGD
    from minipar.parallel.pipeline import Pipeline, mlp

    pipe = Pipeline(comm, mlp(widths, seed=1), "zb-h1", microbatches=2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2 * mb, widths[0])), rng.normal(size=(2 * mb, widths[-1]))
    with trace.record(path, comm=comm):
        pipe.step(x, y, SGD(pipe.parameters(), lr=0.1))


def test_pipeline_holds_what_w_needs_between_i_and_w(tmp_path) -> None:
    """A 2-stage MLP pipeline under ZB-H1: right after ``0I1`` (rank 0's last I; ``0W0`` ran), rank
    0 holds only what ``0W1`` needs: per linear layer its saved input and its output's gradient."""
    from minipar import trace
    from minipar.testing import run

    widths, mb = [3, 5, 4, 2, 6], 2  # stage 0: layers 0, 1 (3 -> 5 -> 4); stage 1: layers 2, 3
    path = str(tmp_path / "zb.json")
    run(zb_pipeline, 2, "threads", widths=widths, mb=mb, path=path)
    events = trace.load(path).events
    i1 = next(e for e in events if e.rank == 0 and e.kind == "compute" and e.name == "I" and e.microbatch == 1)
    after = [e for e in events if e.rank == 0 and e.kind == "memory" and e.name == "activations" and e.t0 >= i1.t1]
    # layer 0: its input, a view of the whole batch (np.split), which keeps the 4 x 3 batch, and its
    # output's gradient 2 x 5; layer 1: its input 2 x 5 (the ReLU's output) and its output's gradient 2 x 4
    assert after[0].nbytes == 8 * (2 * mb * 3) + 8 * mb * (5 + 5 + 4) and after[0].args["stashed"] == 1


def test_frozen_primitive_and_silent_weights_behave_as_in_one_backward() -> None:
    """A frozen parameter gets no gradient; a weight used by a primitive op (``h * w``, ``.sum()``) and
    by a Function sums in the same order as one backward; a Function that returns None for a weight
    leaves it a zero gradient with its hook fired once, as one backward does."""

    class Silent(Function):  # x @ w whose backward never gives w a gradient
        @staticmethod
        def forward(ctx: Context, x: np.ndarray, w: np.ndarray) -> np.ndarray:
            ctx.save_for_backward(w)
            return x @ w

        @staticmethod
        def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
            (w,) = ctx.saved
            return g @ w.T, None

    def build() -> tuple[list[nn.Parameter], Tensor, dict[int, int]]:
        rng = np.random.default_rng(7)
        ws = [nn.Parameter(s, ("normal", 1.0)) for s in ((3, 4), (4,), (4, 4), (4, 2))]
        for w in ws:
            w.data[...] = rng.normal(size=w.shape)
        ws[1].requires_grad = False  # frozen
        fired: dict[int, int] = {}
        for k, w in enumerate(ws):
            w.register_hook(lambda t, k=k: fired.__setitem__(k, fired.get(k, 0) + 1))
        x = Tensor(rng.normal(size=(5, 3)), requires_grad=True)
        h = F.linear(x, ws[0]) * ws[0].sum() + ws[1]   # ws[0] in a Function and two primitive ops
        out = Silent.apply(F.gelu(h @ ws[2]), ws[3])   # ws[2] in a primitive matmul; ws[3] gets None
        return ws, out, fired, x

    ws, out, fired, x = build()
    out.backward(np.ones((5, 2)))
    want = [None if w.grad is None else w.grad.copy() for w in ws]
    want_fired, want_x = dict(fired), x.grad.copy()
    ws, out, fired, x = build()
    later = WeightGradients(ws)
    out.backward(np.ones((5, 2)), weights=later)
    np.testing.assert_array_equal(x.grad, want_x)
    later.run()
    assert want[1] is None and ws[1].grad is None  # frozen: no gradient either way
    for k in (0, 2, 3):
        np.testing.assert_array_equal(ws[k].grad, want[k], err_msg=str(k))
    np.testing.assert_array_equal(ws[3].grad, np.zeros((4, 2)))
    assert fired == want_fired == {0: 1, 2: 1, 3: 1}
    with pytest.raises(ValueError, match="leaf tensors"):
        WeightGradients([x * 2.0])


def test_a_primitive_op_of_a_weight_does_not_keep_the_graph() -> None:
    import gc
    import weakref

    w1, w2 = nn.Parameter((3, 4), ("normal", 1.0)), nn.Parameter((4,), ("normal", 1.0))
    x = Tensor(np.ones((5, 3)), requires_grad=True)
    h = F.gelu(F.linear(x, w1))
    z = h * w2  # a primitive op: its closure holds h, whose graph reaches back to x
    gone = weakref.ref(h)
    later = WeightGradients([w1, w2])
    z.backward(np.ones((5, 4)), weights=later)
    del h, z
    gc.collect()
    assert gone() is None and w2.grad is None
    # kept by hand: w2's gradient (4), linear's output gradient (5x4) and saved input x (5x3)
    assert later.nbytes() == (4 + 20 + 15) * 8
    later.run()
    assert w2.grad.shape == (4,) and w1.grad.shape == (3, 4)
