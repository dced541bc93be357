"""Training the tiny GPT lowers the loss by a stated margin, deterministically; data are deterministic."""

from __future__ import annotations

import numpy as np

from minipar import datasets
from minipar.nn import GPT
from minipar.optim import AdamW


def train(steps: int) -> list[float]:
    stream = datasets.token_stream(4000, vocab_size=12, seed=0)
    model = GPT(vocab_size=12, seq_len=8, d_model=16, n_heads=2, n_layers=1, seed=0)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x, y = datasets.lm_batch(stream, batch_size=8, seq_len=8, step=step)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_gpt_learns_the_markov_chain():
    losses = train(120)
    assert losses == train(120)  # bit-for-bit deterministic
    start, end = np.mean(losses[:5]), np.mean(losses[-10:])
    assert start > np.log(12) - 0.5  # starts near uniform guessing
    assert end < start - 1.0, (start, end)


def test_data_sets_are_deterministic_and_shaped():
    x1, y1 = datasets.regression(10, 3, 2, seed=4)
    x2, y2 = datasets.regression(10, 3, 2, seed=4)
    np.testing.assert_array_equal(x1, x2)
    assert x1.shape == (10, 3) and y1.shape == (10, 2)
    xc, yc = datasets.classification(50, 2, 3, seed=1)
    assert set(np.unique(yc)) <= {0, 1, 2} and xc.shape == (50, 2)
    stream = datasets.token_stream(500, 10, seed=2)
    np.testing.assert_array_equal(stream, datasets.token_stream(500, 10, seed=2))
    x, y = datasets.lm_batch(stream, 4, 6, step=3)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_shards_cover_the_batch_exactly():
    batch = np.arange(24).reshape(12, 2)
    parts = [datasets.shard(batch, r, 4) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), batch)
    try:
        datasets.shard(batch, 0, 5)
    except ValueError as exc:
        assert "multiple of 5" in str(exc)
    else:
        raise AssertionError("uneven shard accepted")
