"""Modules: the GPT's full gradient by central differences, the initialisation contract, state dicts."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import numerical_grad

from minipar import nn
from minipar.nn import GPT, MLP, Parameter, init_values


def test_gpt_full_gradient_matches_central_differences():
    model = GPT(vocab_size=5, seq_len=4, d_model=4, n_heads=2, n_layers=2, seed=3)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 5, size=(2, 4))
    targets = rng.integers(0, 5, size=(2, 4))
    model.loss(idx, targets).backward()
    for name, p in model.named_parameters():
        expected = numerical_grad(lambda: model.loss(idx, targets).item(), p.data)
        np.testing.assert_allclose(p.grad, expected, atol=1e-7, rtol=1e-5, err_msg=name)


def test_mlp_gradient_matches_central_differences():
    model = MLP([3, 5, 2], seed=1)
    x = np.random.default_rng(1).normal(size=(4, 3))
    loss = lambda: (model(x) * model(x)).mean()  # noqa: E731
    loss().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, numerical_grad(lambda: loss().item(), p.data), atol=1e-7, err_msg=name)


def test_initialisation_depends_only_on_seed_name_and_full_shape():
    a = GPT(7, 4, 8, 2, 2, seed=5)
    b = GPT(7, 4, 8, 2, 2, seed=5)
    c = GPT(7, 4, 8, 2, 2, seed=6)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        np.testing.assert_array_equal(pa.data, pb.data)
        if pa.init[0] not in ("zeros", "ones"):
            assert not np.array_equal(pa.data, pc.data), name
    # different parameters of the same shape get different values
    assert not np.array_equal(a.blocks[0].attn.q.weight.data, a.blocks[0].attn.k.weight.data)
    # a block built alone and initialised with its full name prefix equals the model's block
    block = nn.Block(8, 2).init_parameters(5, prefix="blocks.1.")
    for (name, p), (_, q) in zip(block.named_parameters(), a.blocks[1].named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)


def test_sharded_parameter_takes_its_slice_of_the_full_draw():
    full = init_values(0, "layer.weight", (6, 8), ("normal", 0.02))
    for r in range(4):
        cols = slice(2 * r, 2 * r + 2)
        p = Parameter((6, 2), ("normal", 0.02), full_shape=(6, 8), shard=(slice(None), cols))
        holder = nn.Module()
        holder.weight = p
        holder.init_parameters(0, prefix="layer.")
        np.testing.assert_array_equal(p.data, full[:, cols])


def test_state_dict_round_trip_and_errors():
    a, b = MLP([3, 4, 2], seed=0), MLP([3, 4, 2], seed=1)
    b.load_state_dict(a.state_dict())
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    assert list(a.state_dict()) == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    with pytest.raises(KeyError, match="missing"):
        b.load_state_dict({"layers.0.weight": np.zeros((3, 4))})
    bad = a.state_dict()
    bad["layers.0.weight"] = np.zeros((4, 3))
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(bad)


def test_linear_layout_is_x_at_weight_plus_bias():
    lin = nn.Linear(3, 2)
    assert lin.weight.shape == (3, 2)
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(lin(x).data, x @ lin.weight.data + lin.bias.data)


def test_bad_configuration_messages():
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        GPT(5, 4, 6, 4, 1)
    with pytest.raises(ValueError, match="longer than seq_len"):
        GPT(5, 4, 4, 2, 1)(np.zeros((1, 5), dtype=np.int64))
