"""Every op's gradient against central differences, for hypothesis-drawn shapes (float64)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_gradients
from hypothesis import given
from hypothesis import strategies as st
from strategies import array, arrays, broadcastable_pair, matmul_shapes, shapes

import minipar.functional as F
from minipar import Function, Tensor, no_grad


@given(st.data(), broadcastable_pair(), st.sampled_from(["add", "sub", "mul", "div"]))
def test_broadcasting_arithmetic(data, pair, op):
    a = array(data.draw, pair[0])
    b = array(data.draw, pair[1], low=0.5, high=2.0)  # keep divisors away from 0
    fns = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y}
    check_gradients(fns[op], a, b)


@given(st.data(), matmul_shapes())
def test_batched_matmul(data, shapes_):
    check_gradients(lambda x, y: x @ y, array(data.draw, shapes_[0]), array(data.draw, shapes_[1]))


@given(st.data(), shapes(), st.booleans(), st.sampled_from(["sum", "mean", "max"]))
def test_reductions(data, shape, keepdims, op):
    x = array(data.draw, shape)
    axis = data.draw(st.sampled_from([None, *range(len(shape)), tuple(range(len(shape)))]))
    check_gradients(lambda t: getattr(t, op)(axis=axis, keepdims=keepdims), x)


@given(st.data(), shapes(min_dims=2, max_dims=4))
def test_reshape_transpose_permute(data, shape):
    x = array(data.draw, shape)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    check_gradients(lambda t: t.transpose(perm).reshape(-1, shape[0]), x)
    check_gradients(lambda t: t.T, x)


@given(st.data(), shapes(min_dims=2, max_dims=3, min_side=2))
def test_indexing_and_slicing(data, shape):
    x = array(data.draw, shape)
    idx = np.random.default_rng(0).integers(0, shape[0], size=5)  # repeats accumulate
    check_gradients(lambda t: t[1:, ..., ::-1], x)
    check_gradients(lambda t: t[idx], x)
    check_gradients(lambda t: t[:, 0], x)


@given(st.data(), shapes(min_dims=1, max_dims=3), st.integers(1, 4), st.booleans())
def test_linear(data, shape, out, bias):
    x, w = array(data.draw, shape), array(data.draw, (shape[-1], out))
    if bias:
        b = array(data.draw, (out,))
        check_gradients(lambda t, wt, bt: F.linear(t, wt, bt), x, w, b)
        expected = np.einsum("...i,io->...o", x, w) + b  # value, summed by hand over the last axis
        np.testing.assert_allclose(F.linear(Tensor(x), Tensor(w), Tensor(b)).data, expected, rtol=1e-12)
    else:
        check_gradients(lambda t, wt: F.linear(t, wt), x, w)
    # an input that needs no gradient (its GEMM is skipped): the weight still gets sum over rows of x
    wt = Tensor(w, requires_grad=True)
    F.linear(Tensor(x), wt).sum().backward()
    np.testing.assert_allclose(wt.grad, np.broadcast_to(x.reshape(-1, shape[-1]).sum(0)[:, None], w.shape),
                               rtol=1e-12, atol=1e-12)


@given(st.data(), shapes(min_dims=1, max_dims=3), st.sampled_from(["exp", "log", "tanh", "relu", "gelu", "pow"]))
def test_elementwise(data, shape, op):
    low = 0.2 if op in ("log", "pow") else -2.0
    x = array(data.draw, shape, low=low)
    if op == "relu":
        x = np.where(np.abs(x) < 1e-3, 0.5, x)  # not at the kink
    fns = {"exp": Tensor.exp, "log": Tensor.log, "tanh": Tensor.tanh, "relu": Tensor.relu, "gelu": F.gelu,
           "pow": lambda t: t**1.7}
    check_gradients(fns[op], x)


def test_gelu_over_several_blocks():
    """GELU runs in blocks of ``F._BLOCK`` numbers: values and slope at every position of an input
    spanning three blocks, against the tanh form and its derivative written out here."""
    x = np.random.default_rng(0).normal(scale=3.0, size=(2, F._BLOCK + 7))
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    xt = Tensor(x, requires_grad=True)
    y = F.gelu(xt)
    y.backward(np.ones_like(x))
    np.testing.assert_allclose(y.data, 0.5 * x * (1 + t), rtol=1e-12, atol=1e-15)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    np.testing.assert_allclose(xt.grad, slope, rtol=1e-10, atol=1e-14)


@given(st.data(), shapes(min_dims=1, max_dims=3, min_side=2), st.sampled_from(["softmax", "log_softmax"]))
def test_softmaxes(data, shape, op):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check_gradients(lambda t: getattr(F, op)(t, axis=axis), array(data.draw, shape))


@given(st.data(), shapes(min_dims=1, max_dims=3, min_side=2), st.booleans())
def test_layer_norm(data, shape, affine):
    x = array(data.draw, shape)
    if affine:
        w, b = array(data.draw, shape[-1:]), array(data.draw, shape[-1:])
        check_gradients(lambda t, wt, bt: F.layer_norm(t, wt, bt), x, w, b)
    else:
        check_gradients(lambda t: F.layer_norm(t), x)


@given(st.data(), st.integers(2, 6), st.integers(1, 4), shapes(min_dims=1, max_dims=2))
def test_embedding(data, vocab, dim, idx_shape):
    idx = np.random.default_rng(sum(idx_shape)).integers(0, vocab, size=idx_shape)
    check_gradients(lambda w: F.embedding(w, idx), array(data.draw, (vocab, dim)))


@given(st.data(), shapes(min_dims=1, max_dims=2), st.integers(2, 6))
def test_cross_entropy(data, lead, classes):
    logits = array(data.draw, (*lead, classes))
    targets = np.random.default_rng(classes).integers(0, classes, size=lead)
    check_gradients(lambda t: F.cross_entropy(t, targets), logits)
    # value: mean of -log softmax at the targets
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert F.cross_entropy(Tensor(logits), targets).item() == pytest.approx(expected, rel=1e-12)


@given(st.data(), st.integers(1, 3), st.integers(1, 4))
def test_concat_split_stack(data, n, side):
    parts = [array(data.draw, (side, 2)) for _ in range(n)]
    check_gradients(lambda *ts: F.concat(ts, axis=0) * 1.0, *parts)
    check_gradients(lambda *ts: F.stack(ts, axis=1), *parts)
    whole = array(data.draw, (2 * side, 3))
    check_gradients(lambda t: F.split(t, 2, axis=0)[1][:, 1:] * F.split(t, [1], axis=1)[1][:side], whole)


@given(st.data(), st.integers(1, 4), st.integers(1, 3))
def test_causal_attention(data, seq, heads):
    q, k, v = (array(data.draw, (2, seq, 2 * heads)) for _ in range(3))
    check_gradients(lambda a, b, c: F.attention(a, b, c, heads), q, k, v)
    # position i never attends to j > i: changing the last value row leaves earlier outputs unchanged
    v2 = v.copy()
    v2[:, -1] += 1.0
    out1 = F.attention(Tensor(q), Tensor(k), Tensor(v), heads).data
    out2 = F.attention(Tensor(q), Tensor(k), Tensor(v2), heads).data
    np.testing.assert_array_equal(out1[:, :-1], out2[:, :-1])


def test_reused_tensor_and_accumulation():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    y = x * x + x * 3.0  # x used three times
    y.sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 3.0)
    y = (x * 2.0).sum()
    y.backward()  # leaf gradients accumulate like PyTorch's
    np.testing.assert_allclose(x.grad, 2 * x.data + 5.0)


def test_no_grad_builds_no_graph():
    x = Tensor(np.ones(3), requires_grad=True)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf


class Probe(Function):
    """Identity that notes in ``ctx.log`` when backward passes through it."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.save_for_backward(log)
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.saved[0].append(("backward through h", None))
        return grad, None


def test_hooks_fire_once_when_gradient_complete():
    w1 = Tensor(np.ones((2, 2)), requires_grad=True)
    w2 = Tensor(np.ones((2, 2)), requires_grad=True)
    x = Tensor(np.arange(4.0).reshape(2, 2))
    seen: list[tuple[str, np.ndarray]] = []
    w1.register_hook(lambda t: seen.append(("w1", t.grad.copy())))
    handle = w2.register_hook(lambda t: seen.append(("w2", t.grad.copy())))
    h = Probe.apply(x @ w1, seen)
    out = (h @ w2) + (h @ w2) * 2.0  # w2 used twice: hook only after both uses
    out.sum().backward()
    # the last layer finishes first, and its hook fires DURING backward, before backward reaches h
    assert [name for name, _ in seen] == ["w2", "backward through h", "w1"]
    del seen[1]
    np.testing.assert_allclose(seen[0][1], w2.grad)
    np.testing.assert_allclose(seen[1][1], w1.grad)
    handle.remove()
    seen.clear()
    out = (x @ w1 @ w2).sum()
    out.backward()
    assert [name for name, _ in seen] == ["w1"]


def test_retain_grad_keeps_a_non_leaf_gradient_and_hooks_are_for_leaves():
    x = Tensor(np.array([1.0, -2.0]), requires_grad=True)
    h = (x * 3.0).retain_grad()
    (h * h).sum().backward()
    np.testing.assert_allclose(h.grad, 2 * h.data)
    np.testing.assert_allclose(x.grad, 6 * h.data)
    with pytest.raises(ValueError, match="leaf"):
        h.register_hook(lambda t: None)


class Double(Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(factor)
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        (factor,) = ctx.saved
        return grad * factor, None


@given(arrays((3, 2)))
def test_custom_function(x):
    check_gradients(lambda t: Double.apply(t, 2.5) * t, x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_kept(dtype):
    x = Tensor(np.ones((2, 3), dtype=dtype), requires_grad=True)
    w = Tensor(np.ones((3, 4), dtype=dtype), requires_grad=True)
    y = F.cross_entropy(F.gelu(F.layer_norm(x @ w * 0.5)) - 1.0, np.zeros(2, dtype=np.int64))
    assert y.dtype == dtype
    y.backward()
    assert x.grad.dtype == dtype and w.grad.dtype == dtype


def test_default_dtype_is_float64():
    assert Tensor([1, 2, 3]).dtype == np.float64


class SaveSquare(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x * x, x)  # a new array and the input's own (not counted again)
        return x + 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 * ctx.saved[1]


def test_held_buffers_counts_each_buffer_once_in_its_window():
    from minipar.memory import activation_bytes, held_buffers, seq_mark

    w = Tensor(np.ones((4, 6)), requires_grad=True)
    x = Tensor(np.ones((3, 4)))
    h = x @ w                                   # 3x6 new: 144 bytes
    v = h.reshape(6, 3).transpose()             # two views of h: free
    mark = seq_mark()
    y = SaveSquare.apply(v[0:2])                # a view of h (free); output and saved x*x: 2x6 each
    z = (y * 2.0).sum()                         # 2x6 product + scalar
    got = held_buffers(z)
    assert sorted(n for _, n in got.values()) == [8, 96, 96, 96, 144]
    assert activation_bytes(z) == 144 + 96 * 3 + 8
    late = held_buffers(z, since=mark)
    assert sorted(n for _, n in late.values()) == [8, 96, 96, 96]  # h belongs to the earlier window
    assert all(seq >= mark for seq, _ in late.values())
    assert held_buffers(w[1:]) == {}  # a view of a parameter is the parameter's memory


def test_leaf_gradients_never_share_memory():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    h = a * 2.0
    (h + b + h).sum().backward()  # b receives the upstream gradient object itself
    a.grad *= 10.0  # in-place changes of one gradient leave the others alone
    np.testing.assert_array_equal(b.grad, np.ones(3))
    np.testing.assert_array_equal(a.grad, np.full(3, 40.0))
    w = Tensor(np.ones((2, 2)), requires_grad=True)
    (Tensor(np.ones((3, 2))) @ w).sum().backward()
    assert w.grad.flags.owndata and w.grad.flags.writeable


def test_matmul_backward_reads_a_parameter_again() -> None:
    """Like a Function's saved parameter (autograd.Context.saved), matmul's backward reads a leaf's
    data when backward runs: FSDP and the offload tiers free a parameter's storage after forward and
    fetch it again, and backward must compute on what was fetched, never on the freed array."""
    x, w = Tensor(np.ones((1, 2)), requires_grad=True), Tensor(np.eye(2), requires_grad=True)
    y = (x @ w).sum()
    w.data = 2 * np.eye(2)  # the storage replaced between forward and backward
    y.backward()
    assert np.array_equal(x.grad, [[2.0, 2.0]]) and np.array_equal(w.grad, np.ones((2, 2)))
