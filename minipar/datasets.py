"""Small synthetic data sets made in code (no downloads), deterministic from a seed, and sharding.

- ``regression``: inputs and targets of a fixed random two-layer network plus noise.
- ``classification``: Gaussian blobs, one per class.
- ``token_stream``: a random sparse Markov chain over a vocabulary; each token has a few likely
  successors, so a language model can learn it (loss falls from log V towards the chain's entropy).
"""

from __future__ import annotations

import numpy as np


def regression(n: int, in_dim: int, out_dim: int, seed: int = 0, noise: float = 0.01,
               dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim))
    w1 = rng.normal(size=(in_dim, 2 * in_dim)) / np.sqrt(in_dim)
    w2 = rng.normal(size=(2 * in_dim, out_dim)) / np.sqrt(2 * in_dim)
    y = np.tanh(x @ w1) @ w2 + noise * rng.normal(size=(n, out_dim))
    return x.astype(dtype), y.astype(dtype)


def classification(n: int, in_dim: int, n_classes: int, seed: int = 0,
                   dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=2.0, size=(n_classes, in_dim))
    y = rng.integers(0, n_classes, size=n)
    x = centres[y] + rng.normal(size=(n, in_dim))
    return x.astype(dtype), y.astype(np.int64)


def markov_chain(vocab_size: int, seed: int = 0, branching: int = 3) -> np.ndarray:
    """Transition matrix: every token moves to one of ``branching`` random successors."""
    rng = np.random.default_rng(seed)
    probs = np.zeros((vocab_size, vocab_size))
    for tok in range(vocab_size):
        nxt = rng.choice(vocab_size, size=min(branching, vocab_size), replace=False)
        probs[tok, nxt] = rng.dirichlet(np.ones(len(nxt)))
    return probs


def token_stream(n_tokens: int, vocab_size: int, seed: int = 0, branching: int = 3) -> np.ndarray:
    """``n_tokens`` integer tokens drawn from ``markov_chain(vocab_size, seed, branching)``."""
    probs = markov_chain(vocab_size, seed, branching)
    cum = probs.cumsum(axis=1)
    rng = np.random.default_rng(seed + 1)
    u = rng.random(n_tokens)
    out = np.empty(n_tokens, dtype=np.int64)
    tok = int(rng.integers(vocab_size))
    for i in range(n_tokens):
        out[i] = tok
        tok = min(int(np.searchsorted(cum[tok], u[i], side="right")), vocab_size - 1)
    return out


def lm_batch(
    stream: np.ndarray, batch_size: int, seq_len: int, step: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``step`` of (inputs, next-token targets), each ``(batch_size, seq_len)``; deterministic."""
    if len(stream) <= seq_len + 1:
        raise ValueError(f"stream of {len(stream)} tokens is too short for seq_len={seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    x = np.stack([stream[s : s + seq_len] for s in starts])
    y = np.stack([stream[s + 1 : s + seq_len + 1] for s in starts])
    return x, y


def shard(array: np.ndarray, rank: int, size: int, axis: int = 0) -> np.ndarray:
    """Rank ``rank``'s contiguous block of ``array`` along ``axis``; the blocks of all ranks, in rank
    order, are exactly the whole array. The length must be divisible by ``size``."""
    n = array.shape[axis]
    if n % size:
        raise ValueError(f"cannot split {n} rows over {size} ranks evenly: make the batch a multiple of {size}")
    k = n // size
    return np.take(array, np.arange(rank * k, (rank + 1) * k), axis=axis)
