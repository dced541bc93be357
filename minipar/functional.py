"""Differentiable functions of Tensors used by the models, each with its backward beside it.

Fused ops (softmax, log_softmax, layer_norm, gelu, cross_entropy) carry their analytic backward
rather than a chain of primitive nodes: fewer nodes, fewer temporaries, and the formulas a reader
finds in the papers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minipar.autograd import Tensor

_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))  # a python float keeps float32 arrays float32


def relu(x: Tensor) -> Tensor:
    return x.relu()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def exp(x: Tensor) -> Tensor:
    return x.exp()


def log(x: Tensor) -> Tensor:
    return x.log()


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh form (Hendrycks & Gimpel 2016): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    a = x.data
    t = np.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a**3))

    def backward(g: np.ndarray) -> tuple[np.ndarray]:
        dt = (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * a * a)
        return (g * (0.5 * (1.0 + t) + 0.5 * a * dt),)

    return Tensor._make(0.5 * a * (1.0 + t), (x,), backward)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    e = np.exp(x.data - x.data.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)
    return Tensor._make(y, (x,), lambda g: (y * (g - (g * y).sum(axis=axis, keepdims=True)),))


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    z = x.data - x.data.max(axis=axis, keepdims=True)
    y = z - np.log(np.exp(z).sum(axis=axis, keepdims=True))
    return Tensor._make(y, (x,), lambda g: (g - np.exp(y) * g.sum(axis=axis, keepdims=True),))


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer normalisation over the last axis (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight + bias."""
    mu = x.data.mean(axis=-1, keepdims=True)
    xc = x.data - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * rstd
    lead = tuple(range(x.ndim - 1))
    parents = tuple(p for p in (x, weight, bias) if p is not None)

    def backward(g: np.ndarray) -> list[np.ndarray]:
        gh = g * weight.data if weight is not None else g
        grads = [rstd * (gh - gh.mean(axis=-1, keepdims=True) - xhat * (gh * xhat).mean(axis=-1, keepdims=True))]
        if weight is not None:
            grads.append((g * xhat).sum(axis=lead))
        if bias is not None:
            grads.append(g.sum(axis=lead))
        return grads

    out = xhat * weight.data if weight is not None else xhat
    if bias is not None:
        out = out + bias.data
    return Tensor._make(out, parents, backward)


def embedding(weight: Tensor, idx: np.ndarray | Tensor) -> Tensor:
    """Rows of ``weight`` picked by integer ``idx``; gradients of repeated rows add up."""
    idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)

    def backward(g: np.ndarray) -> tuple[np.ndarray]:
        gw = np.zeros_like(weight.data)
        np.add.at(gw, idx, g)
        return (gw,)

    return Tensor._make(weight.data[idx], (weight,), backward)


def cross_entropy(logits: Tensor, targets: np.ndarray | Tensor) -> Tensor:
    """Mean over all positions of -log softmax(logits)[target]; targets are integer class ids."""
    t = np.asarray(targets.data if isinstance(targets, Tensor) else targets)
    if t.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {t.shape} do not match logits {logits.shape}: need {logits.shape[:-1]}")
    z = logits.data - logits.data.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
    n = t.size

    def backward(g: np.ndarray) -> tuple[np.ndarray]:
        d = np.exp(logp)
        np.put_along_axis(d, t[..., None], np.take_along_axis(d, t[..., None], axis=-1) - 1.0, axis=-1)
        return (d * (g / n),)

    return Tensor._make(np.asarray(-picked.mean(), dtype=logits.dtype), (logits,), backward)


def mse_loss(pred: Tensor, target: np.ndarray | Tensor) -> Tensor:
    diff = pred - target
    return (diff * diff).mean()


def masked_fill(x: Tensor, mask: np.ndarray, value: float) -> Tensor:
    """``value`` where ``mask`` is true (broadcast), ``x`` elsewhere; no gradient through the filled places."""
    keep = ~np.broadcast_to(mask, x.shape)
    return Tensor._make(np.where(keep, x.data, value).astype(x.dtype), (x,), lambda g: (g * keep,))


def causal_mask(scores: Tensor) -> Tensor:
    """Hide future positions: entry (i, j) of the last two axes becomes -inf where j > i."""
    t_q, t_k = scores.shape[-2:]
    future = np.triu(np.ones((t_q, t_k), dtype=bool), k=1 + t_k - t_q)
    return masked_fill(scores, future, -np.inf)


def attention(q: Tensor, k: Tensor, v: Tensor, n_heads: int, causal: bool = True) -> Tensor:
    """Scaled dot-product attention softmax(q k^T / sqrt(d_head)) v over ``n_heads`` heads.

    ``q, k, v`` are ``(batch, seq, n_heads * d_head)``; so is the result (heads concatenated).
    """
    b, t_q, width = q.shape
    t_k, hd = k.shape[1], width // n_heads

    def heads(x: Tensor, t: int) -> Tensor:
        return x.reshape(b, t, n_heads, hd).transpose(0, 2, 1, 3)

    scores = (heads(q, t_q) @ heads(k, t_k).transpose(0, 1, 3, 2)) * (1.0 / float(np.sqrt(hd)))
    if causal:
        scores = causal_mask(scores)
    y = softmax(scores) @ heads(v, t_k)
    return y.transpose(0, 2, 1, 3).reshape(b, t_q, width)


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    tensors = list(tensors)
    bounds = np.cumsum([t.shape[axis] for t in tensors])[:-1]
    return Tensor._make(np.concatenate([t.data for t in tensors], axis=axis), tuple(tensors),
                        lambda g: tuple(np.split(g, bounds, axis=axis)))


def stack(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    tensors = list(tensors)
    return Tensor._make(np.stack([t.data for t in tensors], axis=axis), tuple(tensors),
                        lambda g: tuple(np.moveaxis(g, axis, 0)))


def split(x: Tensor, sections: int | Sequence[int], axis: int = 0) -> list[Tensor]:
    """Split like ``np.split`` (equal parts or at indices); each part is a differentiable view."""
    n = x.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"axis {axis} of length {n} does not split into {sections} equal parts")
        edges = list(range(0, n + 1, n // sections))
    else:
        edges = [0, *sections, n]
    parts = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(lo, hi)
        parts.append(x[tuple(idx)])
    return parts
