"""Differentiable functions of Tensors used by the models, each with its backward beside it.

Fused ops (linear, softmax, log_softmax, layer_norm, gelu, attention, cross_entropy) carry their
analytic backward rather than a chain of primitive nodes: fewer nodes, fewer temporaries, and the
formulas a reader finds in the papers. Their numpy passes work in place where the array is their
own: at a small transformer's sizes every fresh temporary and every extra pass shows in the step.
``layer_norm``, ``gelu`` and ``attention`` are ``Function``s that keep for backward exactly what
Korthikanti et al. 2022 (Sec. 4.1) count for a transformer layer: the layer norm's input, GELU's
input, attention's q, k, v and softmax; everything else they need is recomputed in backward, and
``memory.held_buffers`` sees all they keep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from minipar import residency
from minipar.autograd import Context, Function, Tensor

_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))  # a python float keeps float32 arrays float32


def relu(x: Tensor) -> Tensor:
    return x.relu()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def exp(x: Tensor) -> Tensor:
    return x.exp()


def log(x: Tensor) -> Tensor:
    return x.log()


class _Linear(Function):
    """``x @ weight`` over the last axis of ``x``: the rows of every leading axis form one GEMM, so
    the weight's gradient is one GEMM too. Keeps ``x`` (a view of it) and the weight, alive anyway."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        rows = x.reshape(-1, x.shape[-1])  # (n, in)
        ctx.save_for_backward(rows, weight)
        ctx.shape = x.shape
        return (rows @ weight).reshape(*x.shape[:-1], weight.shape[1])

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        rows, weight = ctx.saved
        need_x, need_w = ctx.needs_input_grad
        g = g.reshape(-1, weight.shape[1])  # (n, out)
        dx = (g @ weight.T).reshape(ctx.shape) if need_x else None
        dw = rows.T @ g if need_w else None
        return dx, dw


class _AddBias(Function):
    """``y + bias`` written into ``y``'s own array: only for the fresh product ``linear`` makes, which
    nothing else holds (no second output-sized array, no extra pass)."""

    @staticmethod
    def forward(ctx: Context, y: np.ndarray, bias: np.ndarray) -> np.ndarray:
        y += bias
        return y

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return g, g.reshape(-1, g.shape[-1]).sum(axis=0)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight + bias`` with ``weight`` of shape ``(in, out)`` (``nn.Linear``'s layout).

    The bias is added by its own node: its gradient is ready before the layer's two GEMMs run, so
    data parallelism can send a bucket that holds it that much earlier (``parallel/ddp.py``)."""
    y = _Linear.apply(x, weight)
    return _AddBias.apply(y, bias) if bias is not None else y


def _exp_minus_2u(a: np.ndarray) -> np.ndarray:
    """exp(-2u) with u = sqrt(2/pi) (a + 0.044715 a^3), in one fresh array (a^3 as a * a * a: ``a**3``
    is ~30x slower). It overflows to inf for very negative a, where GELU is -0 and its slope 0."""
    e = np.multiply(a, a, out=np.empty_like(a))  # an array even for a 0-d input, so out= works
    e *= -2 * 0.044715 * _SQRT_2_OVER_PI
    e -= 2 * _SQRT_2_OVER_PI
    e *= a
    with np.errstate(over="ignore"):
        return np.exp(e, out=e)


def _gelu(a: np.ndarray) -> np.ndarray:
    y = _exp_minus_2u(a)
    y += 1.0
    return np.divide(a, y, out=y)  # a s(2u)


def _gelu_backward(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    s = _exp_minus_2u(a)
    s += 1.0
    np.reciprocal(s, out=s)  # s(2u)
    d = np.multiply(a, a, out=np.empty_like(a))
    d *= 3 * 0.044715 * 2 * _SQRT_2_OVER_PI
    d += 2 * _SQRT_2_OVER_PI  # 2 du/da
    d *= a
    d *= s
    d *= 1.0 - s
    d += s  # d gelu / da = s + a s (1 - s) 2 du/da
    d *= g
    return d


_BLOCK = 1 << 17  # numbers per block of _in_blocks (512 KiB in float32)


def _in_blocks(fn: Callable[..., np.ndarray], *arrays: np.ndarray) -> np.ndarray:
    """``fn(*arrays)`` for an elementwise ``fn`` of same-shaped arrays, computed block by block over
    their flattened numbers: the dozen passes of a chain like GELU's then mostly hit cache instead of
    streaming the whole arrays from memory each time."""
    if arrays[0].size <= _BLOCK:
        return fn(*arrays)
    flat = [a.reshape(-1) for a in arrays]
    out = np.empty_like(flat[0])
    for i in range(0, out.size, _BLOCK):
        out[i:i + _BLOCK] = fn(*(f[i:i + _BLOCK] for f in flat))
    return out.reshape(arrays[0].shape)


class _Gelu(Function):
    """GELU, tanh form (Hendrycks & Gimpel 2016), computed as a sigmoid: 0.5 (1 + tanh u) = s(2u) =
    1 / (1 + exp(-2u)), one exp instead of a slower tanh. Keeps its input and recomputes s in
    backward. Both directions are chains of in-place passes, run in cache-sized blocks."""

    @staticmethod
    def forward(ctx: Context, a: np.ndarray) -> np.ndarray:
        ctx.save_for_backward(a)
        return _in_blocks(_gelu, a)

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> np.ndarray:
        (a,) = ctx.saved
        return _in_blocks(_gelu_backward, a, g)


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh form (Hendrycks & Gimpel 2016): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return _Gelu.apply(x)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    e = np.exp(x.data - x.data.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)
    return Tensor._make(y, (x,), lambda g: (y * (g - (g * y).sum(axis=axis, keepdims=True)),))


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    z = x.data - x.data.max(axis=axis, keepdims=True)
    y = z - np.log(np.exp(z).sum(axis=axis, keepdims=True))
    return Tensor._make(y, (x,), lambda g: (g - np.exp(y) * g.sum(axis=axis, keepdims=True),))


# Row reductions over the last axis through einsum: on rows of tens to hundreds of numbers numpy's
# ``.sum(axis=-1)`` is 3-5x slower, and ``_rowdot`` makes no product array.
def _rowsum(a: np.ndarray) -> np.ndarray:
    """sum(a) over the last axis, kept as an axis of length 1."""
    return np.einsum("...i->...", a)[..., None]


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum(a * b) over the last axis, kept as an axis of length 1."""
    return np.einsum("...i,...i->...", a, b)[..., None]


def _normalise(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[-1]
    xc = x - _rowsum(x) / n
    rstd = 1.0 / np.sqrt(_rowdot(xc, xc) / n + eps)
    xc *= rstd
    return xc, rstd


class _LayerNorm(Function):
    """Keeps its input (and the weight, a parameter): the mean and 1/std (two numbers per row, which
    Megatron's fused kernel also keeps) are recomputed in backward, so the activation kept is exactly
    the input."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None,
                eps: float) -> np.ndarray:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.eps = bias is not None, eps
        out, _ = _normalise(x, eps)
        if weight is not None:
            out *= weight
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        x, weight = ctx.saved
        n = x.shape[-1]
        xhat, rstd = _normalise(x, ctx.eps)
        rows_g, rows_xhat = g.reshape(-1, n), xhat.reshape(-1, n)
        dw = np.einsum("ri,ri->i", rows_g, rows_xhat) if weight is not None else None  # sum of g xhat
        db = rows_g.sum(axis=0) if ctx.has_bias else None
        # dx = rstd (gh - mean(gh) - xhat mean(gh xhat)) with gh = g weight, built in place in gh
        gh = g * weight if weight is not None else g.copy()
        xhat *= _rowdot(gh, xhat) / n
        gh -= _rowsum(gh) / n
        gh -= xhat
        gh *= rstd
        return gh, dw, db, None


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer normalisation over the last axis (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight + bias."""
    return _LayerNorm.apply(x, weight, bias, eps)


def embedding(weight: Tensor, idx: np.ndarray | Tensor) -> Tensor:
    """Rows of ``weight`` picked by integer ``idx``; gradients of repeated rows add up."""
    idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
    if residency.guards is not None:  # an offload wrapper lives: its parameters on the device
        residency.check((weight,))

    def backward(g: np.ndarray) -> tuple[np.ndarray]:
        gw = np.zeros_like(weight.data)
        n = gw.shape[-1]
        # add.at on flat positions (row * n + column) takes numpy's fast 1-D path; rows repeat, so not +=
        np.add.at(gw.reshape(-1), (idx.reshape(-1, 1) * n + np.arange(n)).reshape(-1), g.reshape(-1))
        return (gw,)

    return Tensor._make(weight.data[idx], (weight,), backward)


def cross_entropy(logits: Tensor, targets: np.ndarray | Tensor) -> Tensor:
    """Mean over all positions of -log softmax(logits)[target]; targets are integer class ids."""
    t = np.asarray(targets.data if isinstance(targets, Tensor) else targets)
    if t.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {t.shape} do not match logits {logits.shape}: need {logits.shape[:-1]}")
    z = logits.data - logits.data.max(axis=-1, keepdims=True)
    picked = np.take_along_axis(z, t[..., None], axis=-1)  # z at the targets
    e = np.exp(z, out=z)  # exp(z - max), in place: z is no longer needed
    total = _rowsum(e)
    n = t.size

    def backward(g: np.ndarray) -> tuple[np.ndarray]:
        d = e / total  # softmax
        np.put_along_axis(d, t[..., None], np.take_along_axis(d, t[..., None], axis=-1) - 1.0, axis=-1)
        d *= g / n
        return (d,)

    loss = (np.log(total) - picked).mean()  # -log softmax at the targets = log(total) - z
    return Tensor._make(np.asarray(loss, dtype=logits.dtype), (logits,), backward)


def mse_loss(pred: Tensor, target: np.ndarray | Tensor) -> Tensor:
    diff = pred - target
    return (diff * diff).mean()


class _Attention(Function):
    """softmax(q k^T / sqrt(d_head)) v per head; keeps q, k, v and the softmax (Korthikanti et al.
    2022, Sec. 4.1, without dropout), or only q, k, v (selective recomputation); recomputes the
    head layouts in backward."""

    @staticmethod
    def heads(x: np.ndarray, n_heads: int) -> np.ndarray:
        """(b, t, h d_head) -> (b, h, t, d_head): a view when ``x`` is contiguous."""
        b, t, width = x.shape
        return x.reshape(b, t, n_heads, width // n_heads).transpose(0, 2, 1, 3)

    @staticmethod
    def matmul_merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a @ b`` per head (b, h, t, d_head), written straight into a (b, t, h d_head) array
        through its ``heads`` view: merging the heads back costs no copy."""
        n, h, t, d_head = *a.shape[:-1], b.shape[-1]
        out = np.empty((n, t, h * d_head), dtype=np.result_type(a, b))
        np.matmul(a, b, out=_Attention.heads(out, h))
        return out

    @staticmethod
    def softmax(q: np.ndarray, k: np.ndarray, n_heads: int, scale: float, causal: bool) -> np.ndarray:
        """softmax(q k^T scale) per head, (b, h, t_q, t_k), in one fresh array."""
        t_q, t_k = q.shape[1], k.shape[1]
        p = _Attention.heads(q, n_heads) @ _Attention.heads(k, n_heads).transpose(0, 1, 3, 2)
        p *= scale
        if causal:
            p += np.triu(np.full((t_q, t_k), -np.inf, dtype=p.dtype), k=1 + t_k - t_q)  # -inf above the diagonal
        p -= p.max(axis=-1, keepdims=True)
        np.exp(p, out=p)
        p /= _rowsum(p)
        return p

    @staticmethod
    def forward(ctx: Context, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int,
                causal: bool, keep_softmax: bool) -> np.ndarray:
        scale = 1.0 / float(np.sqrt(q.shape[-1] // n_heads))
        p = _Attention.softmax(q, k, n_heads, scale, causal)
        ctx.save_for_backward(q, k, v, p if keep_softmax else None)
        ctx.n_heads, ctx.scale, ctx.causal = n_heads, scale, causal
        return _Attention.matmul_merged(p, _Attention.heads(v, n_heads))

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        q, k, v, p = ctx.saved
        n = ctx.n_heads
        if p is None:  # selective recomputation: the same numbers again, from the kept q and k
            from minipar import trace  # here: "import minipar" loads the engine alone (tests/test_layering.py)

            with trace.span("R", args={"op": "attention"}):
                p = _Attention.softmax(q, k, n, ctx.scale, ctx.causal)
        qh, kh, vh, gh = (_Attention.heads(x, n) for x in (q, k, v, g))
        dv = _Attention.matmul_merged(p.transpose(0, 1, 3, 2), gh)
        dp = gh @ vh.transpose(0, 1, 3, 2)
        dp -= _rowdot(dp, p)  # softmax backward, in place: ds = p (dp - sum(dp p))
        dp *= p
        dp *= ctx.scale
        dq = _Attention.matmul_merged(dp, kh)
        dk = _Attention.matmul_merged(dp.transpose(0, 1, 3, 2), qh)
        return dq, dk, dv, None, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, n_heads: int, causal: bool = True,
              keep_softmax: bool = True) -> Tensor:
    """Scaled dot-product attention softmax(q k^T / sqrt(d_head)) v over ``n_heads`` heads.

    ``q, k, v`` are ``(batch, seq, n_heads * d_head)``; so is the result (heads concatenated).
    ``keep_softmax=False``: selective recomputation (Korthikanti et al. 2022 Sec. 5), the softmax
    (``a s^2 b`` numbers) is not kept but computed again in backward (a span ``R`` in the trace).
    """
    if q.shape[-1] % n_heads:
        raise ValueError(f"attention: width {q.shape[-1]} is not divisible by n_heads={n_heads}")
    return _Attention.apply(q, k, v, n_heads, causal, keep_softmax)


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


class on_backward(Function):
    """Identity both ways; calls ``callback()`` when the gradient passes: a hook at a point of the
    graph (tensor parallelism times a layer's backward and releases its activations in the memory
    samples; FSDP, ZeRO-Infinity and the chunk manager fetch a unit's parameters before its backward)."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, callback: Callable[[], None]) -> np.ndarray:
        ctx.callback = callback
        return x

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        ctx.callback()
        return grad, None
