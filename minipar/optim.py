"""Optimizers: SGD with momentum and AdamW, with PyTorch's update rules.

Both update ``p.data`` in place from ``p.grad`` and skip parameters without a gradient. Their state
(``state[i]`` for the i-th parameter) is plain numpy arrays, so ZeRO can shard it by parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from minipar.autograd import Tensor


class Optimizer:
    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.lr = lr
        self.state: list[dict[str, Any]] = [{} for _ in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.update(p.data, p.grad, self.state[i])

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        """Update one parameter array in place from its gradient (and its state)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        return sum(v.nbytes for s in self.state for v in s.values() if isinstance(v, np.ndarray))


class SGD(Optimizer):
    """``buf = momentum * buf + (g + wd * p)``; ``p -= lr * buf`` (PyTorch's SGD, dampening 0)."""

    def __init__(self, params: Iterable[Tensor], lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.momentum, self.weight_decay = momentum, weight_decay

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        g = grad + self.weight_decay * param if self.weight_decay else grad
        if self.momentum:
            buf = state.get("momentum")
            g = state["momentum"] = g.copy() if buf is None else self.momentum * buf + g
        param -= self.lr * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), PyTorch's ``AdamW`` rule::

        p -= lr * wd * p
        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        super().__init__(params, lr)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> None:
        b1, b2 = self.betas
        if not state:
            state.update(step=0, exp_avg=np.zeros_like(param), exp_avg_sq=np.zeros_like(param))
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # every pass in place, ``tmp`` the one scratch array (the update is memory-bound); python
        # floats as factors keep float32 arrays float32
        tmp = np.multiply(grad, 1.0 - b1, out=np.empty_like(param))
        m *= b1
        m += tmp
        np.multiply(grad, grad, out=tmp)
        tmp *= 1.0 - b2
        v *= b2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp *= 1.0 / math.sqrt(1.0 - b2**t)
        tmp += self.eps  # denominator
        np.divide(m, tmp, out=tmp)
        tmp *= self.lr / (1.0 - b1**t)
        param *= 1.0 - self.lr * self.weight_decay
        param -= tmp
