"""The differentiable ops of ``minipar.autograd.Tensor``: arithmetic (broadcasting), matmul,
reductions, shape changes, indexing and elementwise functions, each backward written right next to
its forward (as micrograd does). ``TensorOps`` is the mixin ``Tensor`` inherits them from; every op
builds its node through ``Tensor._make``, the engine (graph, backward order, bf16 rounding) stays in
``minipar.autograd``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from minipar.autograd import Tensor

ArrayLike = Any


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``grad`` back to ``shape``, undoing numpy broadcasting."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad


class TensorOps:
    """Tensor's ops (module docstring); ``data``, ``shape``, ``ndim``, ``requires_grad`` and ``_make`` are
    ``Tensor``'s."""

    def _lift(self, other: ArrayLike) -> Tensor:
        if isinstance(other, TensorOps):
            return other
        return type(self)(np.asarray(other, dtype=self.data.dtype))

    # -- elementwise arithmetic (broadcasting) ---------------------------------------------
    def __add__(self, other: ArrayLike) -> Tensor:
        o = self._lift(other)
        return self._make(self.data + o.data, (self, o),
                            lambda g: (unbroadcast(g, self.shape), unbroadcast(g, o.shape)))

    def __mul__(self, other: ArrayLike) -> Tensor:
        o = self._lift(other)
        return self._make(self.data * o.data, (self, o),
                            lambda g: (unbroadcast(g * o.data, self.shape), unbroadcast(g * self.data, o.shape)))

    def __truediv__(self, other: ArrayLike) -> Tensor:
        o = self._lift(other)
        out = self.data / o.data
        return self._make(out, (self, o),
                            lambda g: (unbroadcast(g / o.data, self.shape),
                                       unbroadcast(-g * out / o.data, o.shape)))

    def __neg__(self) -> Tensor:
        return self._make(-self.data, (self,), lambda g: (-g,))

    def __pow__(self, k: float) -> Tensor:
        return self._make(self.data**k, (self,), lambda g: (g * k * self.data ** (k - 1),))

    def __sub__(self, other: ArrayLike) -> Tensor:
        return self + (-self._lift(other))

    def __radd__(self, other: ArrayLike) -> Tensor:
        return self + other

    def __rsub__(self, other: ArrayLike) -> Tensor:
        return self._lift(other) - self

    def __rmul__(self, other: ArrayLike) -> Tensor:
        return self * other

    def __rtruediv__(self, other: ArrayLike) -> Tensor:
        return self._lift(other) / self

    # -- matrix product (batched, broadcasting over leading dims) --------------------------
    def __matmul__(self, other: ArrayLike) -> Tensor:
        o = self._lift(other)
        a, b = self.data, o.data
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands of at least 2 dims, got {a.shape} @ {b.shape}")

        def backward(g: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
            # the operands read at backward, as a Function's saved parameter is (Context.saved): a
            # parameter whose storage was freed and fetched again (FSDP, offload) is read afresh
            a, b = self.data, o.data
            # the two products are the expensive part of a training step: skip the unneeded one
            ga = unbroadcast(g @ np.swapaxes(b, -1, -2), a.shape) if self.requires_grad else None
            gb = unbroadcast(np.swapaxes(a, -1, -2) @ g, b.shape) if o.requires_grad else None
            return ga, gb

        return self._make(a @ b, (self, o), backward)

    def __rmatmul__(self, other: ArrayLike) -> Tensor:
        return self._lift(other) @ self

    # -- reductions ---------------------------------------------------------------------------
    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        def backward(g: np.ndarray) -> tuple[np.ndarray]:
            if not keepdims and axis is not None:
                g = np.expand_dims(g, axis)
            return (np.broadcast_to(g, self.shape),)

        return self._make(np.sum(self.data, axis=axis, keepdims=keepdims), (self,), backward)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        axes = range(self.ndim) if axis is None else np.atleast_1d(axis)
        n = int(np.prod([self.shape[a] for a in axes]))
        return self.sum(axis, keepdims) * (1.0 / n)

    def max(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """Maximum; the gradient is shared equally among tied maxima."""
        m = np.max(self.data, axis=axis, keepdims=True)

        def backward(g: np.ndarray) -> tuple[np.ndarray]:
            if not keepdims and axis is not None:
                g = np.expand_dims(g, axis)
            mask = self.data == m
            return (mask * (g / mask.sum(axis=axis, keepdims=True)),)

        out = m if keepdims else np.max(self.data, axis=axis)
        return self._make(out, (self,), backward)

    # -- shape --------------------------------------------------------------------------------
    def reshape(self, *shape: int | tuple[int, ...]) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        return self._make(self.data.reshape(shape), (self,), lambda g: (g.reshape(self.shape),))

    def transpose(self, *axes: int) -> Tensor:
        """Permute axes (all of them, or swap the two given); no axes reverses them."""
        if len(axes) == 1 and isinstance(axes[0], tuple | list):
            axes = tuple(axes[0])
        if len(axes) == 2 and self.ndim != 2:
            perm = list(range(self.ndim))
            perm[axes[0]], perm[axes[1]] = perm[axes[1]], perm[axes[0]]
            axes = tuple(perm)
        perm = axes or tuple(reversed(range(self.ndim)))
        inv = np.argsort(perm)
        return self._make(np.transpose(self.data, perm), (self,), lambda g: (np.transpose(g, inv),))

    permute = transpose

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's name
        return self.transpose()

    def __getitem__(self, idx: Any) -> Tensor:
        if isinstance(idx, TensorOps):
            idx = idx.data

        parts = idx if isinstance(idx, tuple) else (idx,)
        fancy = any(isinstance(i, np.ndarray | list) for i in parts)

        def backward(g: np.ndarray) -> tuple[np.ndarray]:
            full = np.zeros_like(self.data)
            if fancy:
                np.add.at(full, idx, g)  # right even when indices repeat
            else:
                full[idx] = g
            return (full,)

        return self._make(self.data[idx], (self,), backward)

    # -- elementwise functions ----------------------------------------------------------------
    def exp(self) -> Tensor:
        out = np.exp(self.data)
        return self._make(out, (self,), lambda g: (g * out,))

    def log(self) -> Tensor:
        return self._make(np.log(self.data), (self,), lambda g: (g / self.data,))

    def tanh(self) -> Tensor:
        out = np.tanh(self.data)
        return self._make(out, (self,), lambda g: (g * (1.0 - out * out),))

    def relu(self) -> Tensor:
        mask = self.data > 0
        return self._make(self.data * mask, (self,), lambda g: (g * mask,))
