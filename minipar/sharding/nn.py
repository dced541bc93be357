"""Ordinary layers on global tensors: the user declares where the weights live, the rest propagates.

The layers are ``minipar.nn``'s (same parameter names, same initial values from the same seed: a
rank draws only its piece, ``nn.init_values`` over the piece's index), written once with the ops
of ``minipar.sharding.ops`` and no communication of their own. A layer takes ``placements``: a dict
from parameter name (``"fc.weight"``) to one placement per mesh axis; parameters not named are
replicated. Composite functions (``layer_norm``, ``attention``, ``cross_entropy``) are made of the
propagated ops, so their backward is too.

Megatron-LM (Shoeybi et al. 2019, Sec. 3) as annotations, on a mesh axis ``tp`` (``MEGATRON``): the
first linear of the MLP and q, k, v split by columns (``Shard(1)``, their biases ``Shard(0)``), the
second linear and the attention's output projection split by rows (``Shard(0)``). Propagation then
finds Megatron's layout: the column split makes the hidden activation (and the heads) split with no
message, the row split makes the output a partial sum, which becomes whole where the next op needs
it (one all-reduce: Megatron's ``g``); in backward the replicated input's gradient comes out partial
and is all-reduced when it reaches the input (Megatron's ``f``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from minipar.mesh import DeviceMesh
from minipar.nn import Init, init_values
from minipar.sharding import ops
from minipar.sharding.autograd import whole_sums
from minipar.sharding.placement import Partial, Placement, Replicate, Shard
from minipar.sharding.tensor import GlobalTensor, check_layout, local_slices

Placements = dict[str, Sequence[Placement]]
MEGATRON: Placements = {  # column-parallel then row-parallel (Shoeybi et al. 2019, Fig. 3)
    "fc.weight": [Shard(1)], "fc.bias": [Shard(0)], "proj.weight": [Shard(0)],
    "q.weight": [Shard(1)], "q.bias": [Shard(0)], "k.weight": [Shard(1)], "k.bias": [Shard(0)],
    "v.weight": [Shard(1)], "v.bias": [Shard(0)]}


class Module:
    """A layer holding global-tensor parameters; ``placements`` names each parameter's layout."""

    def __init__(self, mesh: DeviceMesh, axes: Sequence[str], placements: Placements | None = None) -> None:
        self.mesh, self.axes, self.placements = mesh, tuple(axes), dict(placements or {})
        self.inits: dict[int, Init] = {}  # each parameter's initialiser, by the parameter's id

    def param(self, name: str, shape: Sequence[int], init: Init) -> GlobalTensor:
        """A parameter of the whole ``shape``, laid out as ``placements[name]`` (replicated if absent)."""
        where = tuple(self.placements.get(name, [Replicate()] * len(self.axes)))
        check_layout(shape, self.axes, where)
        t = GlobalTensor.zeros(shape, self.mesh, self.axes, where).requires_grad_()
        self.inits[id(t)] = init
        return t

    def sub(self, prefix: str) -> Placements:
        """The placements of a child named ``prefix`` (``"mlp."``), with the prefix removed."""
        return {k[len(prefix):]: v for k, v in self.placements.items() if k.startswith(prefix)}

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, GlobalTensor]]:
        for name, value in vars(self).items():
            if isinstance(value, GlobalTensor):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_parameters(f"{prefix}{name}.")

    def modules(self) -> Iterator[Module]:
        yield self
        for value in vars(self).values():
            if isinstance(value, Module):
                yield from value.modules()

    def parameters(self) -> list[GlobalTensor]:
        return [p for _, p in self.named_parameters()]

    def init_parameters(self, seed: int = 0, prefix: str = "") -> Module:
        """Each rank draws its piece of every parameter's single-process initial value (``minipar.nn``'s
        ``init_parameters(seed, prefix)``); along a ``Partial`` axis coordinate 0 holds it."""
        inits = {k: v for m in self.modules() for k, v in m.inits.items()}
        for name, p in self.named_parameters(prefix):
            index = local_slices(p.shape, p.degrees, p.coords, p.placements)
            init_values(seed, name, p.shape, inits[id(p)], index, out=p.local)
            if any(isinstance(q, Partial) and c for q, c in zip(p.placements, p.coords, strict=True)):
                p.local[...] = 0.0
        return self

    def __call__(self, *args: Any) -> GlobalTensor:
        return self.forward(*args)

    def forward(self, *args: Any) -> GlobalTensor:
        raise NotImplementedError


class Linear(Module):
    """``x @ weight + bias``, weight ``(in, out)``, PyTorch's uniform initialisation (``nn.Linear``)."""

    def __init__(self, fin: int, fout: int, mesh: DeviceMesh, axes: Sequence[str],
                 placements: Placements | None = None, bias: bool = True) -> None:
        super().__init__(mesh, axes, placements)
        bound = 1.0 / np.sqrt(fin)
        self.weight = self.param("weight", (fin, fout), ("uniform", bound))
        self.bias = self.param("bias", (fout,), ("uniform", bound)) if bias else None

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        y = ops.matmul(x, self.weight)
        return ops.add(y, self.bias) if self.bias is not None else y


class LayerNorm(Module):
    def __init__(self, dim: int, mesh: DeviceMesh, axes: Sequence[str], placements: Placements | None = None,
                 eps: float = 1e-5) -> None:
        super().__init__(mesh, axes, placements)
        self.weight, self.bias = self.param("weight", (dim,), ("ones",)), self.param("bias", (dim,), ("zeros",))
        self.eps = eps

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class FeedForward(Module):
    """``proj(gelu(fc(x)))`` (``nn.FeedForward``)."""

    def __init__(self, d_model: int, d_ff: int, mesh: DeviceMesh, axes: Sequence[str],
                 placements: Placements | None = None) -> None:
        super().__init__(mesh, axes, placements)
        self.fc = Linear(d_model, d_ff, mesh, axes, self.sub("fc."))
        self.proj = Linear(d_ff, d_model, mesh, axes, self.sub("proj."))

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return self.proj(ops.gelu(self.fc(x)))


class CausalSelfAttention(Module):
    """``proj(attention(q(x), k(x), v(x)))`` on ``(batch, seq, d)`` (``nn.CausalSelfAttention``)."""

    def __init__(self, d_model: int, n_heads: int, mesh: DeviceMesh, axes: Sequence[str],
                 placements: Placements | None = None, causal: bool = True) -> None:
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pick a multiple")
        super().__init__(mesh, axes, placements)
        self.n_heads, self.causal = n_heads, causal
        for name in ("q", "k", "v", "proj"):
            setattr(self, name, Linear(d_model, d_model, mesh, axes, self.sub(name + ".")))

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return self.proj(attention(self.q(x), self.k(x), self.v(x), self.n_heads, self.causal))


class Block(Module):
    """Pre-norm block ``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` (``nn.Block``); placements named
    ``"attn.q.weight"``, ``"mlp.fc.weight"``, ..."""

    def __init__(self, d_model: int, n_heads: int, mesh: DeviceMesh, axes: Sequence[str],
                 placements: Placements | None = None, d_ff: int | None = None) -> None:
        super().__init__(mesh, axes, placements)
        self.ln1 = LayerNorm(d_model, mesh, axes, self.sub("ln1."))
        self.attn = CausalSelfAttention(d_model, n_heads, mesh, axes, self.sub("attn."))
        self.ln2 = LayerNorm(d_model, mesh, axes, self.sub("ln2."))
        self.mlp = FeedForward(d_model, d_ff or 4 * d_model, mesh, axes, self.sub("mlp."))

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        x = ops.add(x, self.attn(self.ln1(x)))
        return ops.add(x, self.mlp(self.ln2(x)))


def prefixed(prefix: str, placements: Placements) -> Placements:
    """``placements`` under a parent's name: ``prefixed("mlp.", MEGATRON)``."""
    return {prefix + k: v for k, v in placements.items()}


# ---- composite functions -------------------------------------------------------------------------------
def layer_norm(x: GlobalTensor, weight: GlobalTensor, bias: GlobalTensor, eps: float = 1e-5) -> GlobalTensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (``F.layer_norm``). The rows
    are made whole first (a partial sum reduced, a split feature axis gathered): op by op, the
    cheapest choice would carry a partial sum through the mean and pay for it, in pieces, at each
    nonlinear step."""
    x = ops.whole(x, -1)
    xc = ops.sub(x, ops.mean(x, -1, keepdims=True))
    var = ops.mean(ops.mul(xc, xc), -1, keepdims=True)
    return ops.add(ops.mul(ops.mul(xc, ops.unary("rsqrt", ops.add(var, eps))), weight), bias)


def attention(q: GlobalTensor, k: GlobalTensor, v: GlobalTensor, n_heads: int, causal: bool = True) -> GlobalTensor:
    """``softmax(q k^T / sqrt(d_head)) v`` per head on ``(batch, seq, heads * d_head)`` (``F.attention``)."""
    b, s, d = q.shape
    hd = d // n_heads

    def heads(t: GlobalTensor) -> GlobalTensor:
        return ops.transpose(ops.reshape(t, (b, s, n_heads, hd)), (0, 2, 1, 3))

    qh, kh, vh = heads(q), heads(k), heads(v)
    scores = ops.scale(ops.matmul(qh, ops.swap_last(kh)), 1.0 / float(np.sqrt(hd)))
    if causal:
        scores = ops.add(scores, ops.constant(np.triu(np.full((s, s), -np.inf), k=1), scores))
    y = ops.matmul(ops.softmax(scores, -1), vh)
    return ops.reshape(ops.transpose(y, (0, 2, 1, 3)), (b, s, d))


def cross_entropy(logits: GlobalTensor, targets: np.ndarray) -> GlobalTensor:
    """Mean over rows of ``logsumexp(logits) - logits[target]`` (``F.cross_entropy``); ``targets`` are
    the whole integer array on every rank. The target's logit is picked by a one-hot mask laid out
    like the logits (each rank builds its piece): with the vocabulary split, each rank picks from its
    own columns and the picks are a partial sum, as in Megatron's vocabulary-parallel loss; the
    ``logsumexp`` needs whole rows, so a split vocabulary is gathered for it (Megatron instead
    all-reduces the row maximum and sum: not a placement change, left out)."""
    targets = np.asarray(targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets of shape {targets.shape} for logits {logits.shape}")
    if not np.issubdtype(targets.dtype, np.integer) or (targets.size and (targets.min() < 0 or
                                                                          targets.max() >= logits.shape[-1])):
        raise ValueError(f"cross_entropy: targets must be integers in [0, {logits.shape[-1]}) (the classes)")
    where = whole_sums(logits.placements)
    sl = local_slices(logits.shape, logits.degrees, logits.coords, where)
    mask = targets[sl[:-1]][..., None] == np.arange(sl[-1].start, sl[-1].stop)
    onehot = GlobalTensor(mask.astype(logits.local.dtype), logits.shape, logits.mesh, logits.axes, where)
    pick = ops.sum(ops.mul(logits, onehot), -1)
    return ops.mean(ops.sub(ops.logsumexp(logits, -1), pick))
