"""Gradient checking by central differences."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minipar import Tensor


def numerical_grad(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f / d x by central differences, perturbing ``x`` in place."""
    g = np.zeros_like(x, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        hi = f()
        x[i] = old - eps
        lo = f()
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


def check_gradients(fn: Callable[..., Tensor], *inputs: np.ndarray, seed: int = 0, atol: float = 1e-6,
                    rtol: float = 1e-5) -> None:
    """Compare autograd gradients of ``sum(fn(*inputs) * R)`` (R random, fixed) with central differences."""
    tensors = [Tensor(x.astype(np.float64), requires_grad=True) for x in inputs]
    out = fn(*tensors)
    weights = np.random.default_rng(seed).normal(size=out.shape)
    (out * weights).sum().backward()

    def value() -> float:
        return float((fn(*[Tensor(t.data) for t in tensors]).data * weights).sum())

    for k, t in enumerate(tensors):
        expected = numerical_grad(value, t.data)
        assert t.grad is not None, f"input {k} got no gradient"
        np.testing.assert_allclose(t.grad, expected, atol=atol, rtol=rtol, err_msg=f"gradient of input {k}")
