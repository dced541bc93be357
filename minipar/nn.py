"""Modules: Linear, LayerNorm, Embedding, MLP, causal self-attention, a pre-norm block, a tiny GPT.

Initialisation contract (DESIGN.md): a parameter's values come from ``(seed, full name, full
shape)`` alone. A sharded parameter (tensor parallelism, ZeRO-3) records the full shape and the
slice it owns and takes that slice of the same full draw, so every parallel layout of a model
starts from exactly the numbers of the single-process model.

The full value is addressable: it is cut into tiles of at most ``TILE x TILE`` numbers (the last
two axes; one index per tile along any leading axis; runs of ``TILE**2`` for a vector) and tile
``k`` is drawn from its own generator, seeded with ``(seed, crc32(name), *k)``. A shard generates
only the tiles it overlaps, so building a sharded model never holds more than its shard plus one
tile. The values differ from one ``rng.normal(size=shape)`` draw, and that is the point: no rank
ever has to draw the whole to take its part.

A module's parameters are initialised once, when the outermost module constructor returns
(``Module.__init_subclass__`` wraps every constructor), with ``self.seed``: a ``Block`` built inside
a ``GPT`` is not initialised on its own first, and a module that wraps one built before keeps its
values (only parameters made during the constructor are initialised). A constructor therefore
declares parameters (shape, initialiser, shard) and never writes their values itself.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from minipar import fp8
from minipar import functional as F
from minipar.autograd import Tensor
from minipar.recompute import check_recompute, checkpoint

Init = tuple  # ("normal", std) | ("uniform", bound) | ("zeros",) | ("ones",)
_building = threading.local()  # module constructors running on this thread (threads-backend ranks)


class Parameter(Tensor):
    """A leaf tensor that a module trains. ``full_shape``/``shard`` describe its place in a sharded whole."""

    def __init__(self, shape: Sequence[int], init: Init = ("zeros",), dtype: Any = np.float64,
                 full_shape: Sequence[int] | None = None, shard: tuple[slice, ...] | None = None) -> None:
        shape = tuple(shape)
        if getattr(_building, "deferred", False):  # no storage: a placeholder of the right shape
            super().__init__(unallocated(shape, dtype), requires_grad=True)
        else:
            super().__init__(np.zeros(shape, dtype=dtype), requires_grad=True)
        self.init = init
        self.full_shape = tuple(full_shape) if full_shape is not None else shape
        self.shard = shard
        if getattr(_building, "depth", 0) and not getattr(_building, "deferred", False):
            _building.fresh.add(id(self))  # made by a module constructor: initialised when it returns


def unallocated(shape: Sequence[int], dtype: Any = np.float64) -> np.ndarray:
    """A read-only array of ``shape`` that holds no memory (every element is one shared zero): the
    data of a parameter whose values live elsewhere (a ZeRO-3 / FSDP shard)."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape))


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Build modules without storage (PyTorch's meta device): parameters get ``unallocated`` data
    and are not initialised. For ZeRO-3 / FSDP, which then give each rank only its shard's values
    (``init_values`` of the shard's positions), so no rank ever holds a whole model."""
    before = getattr(_building, "deferred", False)
    _building.deferred = True
    try:
        yield
    finally:
        _building.deferred = before


TILE = 64  # edge of an initialisation tile: at most TILE * TILE numbers (32 KiB in float64)


def _tile_edges(ndim: int) -> tuple[int, ...]:
    if ndim == 0:
        return ()
    if ndim == 1:
        return (TILE * TILE,)
    return (1,) * (ndim - 2) + (TILE, TILE)


def _draw_tile(seed: int, name: str, init: Init, tile: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), *tile])
    if init[0] == "normal":
        return rng.normal(0.0, init[1], size=shape)
    if init[0] == "uniform":
        return rng.uniform(-init[1], init[1], size=shape)
    raise ValueError(f"unknown initialiser {init!r}")


def init_values(seed: int, name: str, full_shape: Sequence[int], init: Init,
                index: tuple[slice, ...] | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``full[index]`` of parameter ``name``'s initial value, generating only the tiles ``index``
    overlaps (module docstring); ``index=None`` gives the whole. Bit-identical to slicing the whole:
    a function of ``(seed, name, full_shape, init)`` and the position alone. Written into ``out``
    when given (no other array of that size is made), else into a new float64 array."""
    full_shape = tuple(full_shape)
    index = tuple(index) if index is not None else ()
    index += (slice(None),) * (len(full_shape) - len(index))
    spans = [range(*s.indices(n)) for s, n in zip(index, full_shape, strict=True)]
    if any(r.step != 1 for r in spans):
        raise ValueError(f"init_values: slices must have step 1, got {index}")
    out_shape = tuple(len(r) for r in spans)
    if out is None:
        out = np.empty(out_shape)
    elif out.shape != out_shape:
        raise ValueError(f"init_values: out has shape {out.shape}, the slice {index} of {full_shape} is {out_shape}")
    if init[0] in ("zeros", "ones"):
        out[...] = 1.0 if init[0] == "ones" else 0.0
        return out
    if init[0] not in ("normal", "uniform"):
        raise ValueError(f"unknown initialiser {init!r}")
    if not out.size:
        return out
    edges = _tile_edges(len(full_shape))
    tiles = [range(r.start // e, (r.stop - 1) // e + 1) for r, e in zip(spans, edges, strict=True)]
    for tile in itertools.product(*tiles):
        lo = [k * e for k, e in zip(tile, edges, strict=True)]
        hi = [min(a + e, n) for a, e, n in zip(lo, edges, full_shape, strict=True)]
        block = _draw_tile(seed, name, init, tile, tuple(b - a for a, b in zip(lo, hi, strict=True)))
        src = tuple(slice(max(r.start, a) - a, min(r.stop, b) - a) for r, a, b in zip(spans, lo, hi, strict=True))
        dst = tuple(slice(max(r.start, a) - r.start, min(r.stop, b) - r.start)
                    for r, a, b in zip(spans, lo, hi, strict=True))
        out[dst] = block[src]
    return out


def _init_when_built(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a module constructor: when the outermost one returns, initialise once every parameter
    made while it ran (not those of modules handed in from outside: a wrapper keeps their values)."""
    @functools.wraps(init)
    def wrapper(self: Module, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_building, "depth", 0)
        if depth == 0:
            _building.fresh = set()
        _building.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _building.depth = depth
        if depth == 0:
            fresh, _building.fresh = _building.fresh, set()
            self.init_parameters(self.seed, only=fresh)
    return wrapper


class Module:
    """Base class: parameters and sub-modules are found through attributes, in assignment order.

    ``seed``: what the parameters are initialised from when the outermost constructor returns (a
    model that takes a ``seed`` argument sets it first)."""

    seed = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            cls.__init__ = _init_when_built(vars(cls)["__init__"])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def children(self) -> Iterator[tuple[str, Module]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value.named_parameters(f"{prefix}{name}.")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def init_parameters(self, seed: int = 0, prefix: str = "", only: set[int] | None = None) -> Module:
        """(Re)initialise every parameter (or those whose ``id`` is in ``only``) from ``(seed, prefix +
        name, full shape)``: each generates only its own shard (``init_values``); returns self."""
        for name, p in self.named_parameters(prefix):
            if only is None or id(p) in only:
                init_values(seed, name, p.full_shape, p.init, p.shard, out=p.data)
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict[str, np.ndarray], strict: bool = True) -> None:
        params = dict(self.named_parameters())
        if strict:
            missing, extra = params.keys() - state.keys(), state.keys() - params.keys()
            if missing or extra:
                raise KeyError(f"state_dict mismatch: missing {sorted(missing)}, unexpected {sorted(extra)}")
        for name, value in state.items():
            if name not in params:
                continue
            if params[name].shape != np.shape(value):
                raise ValueError(f"{name}: shape {np.shape(value)} in state_dict, {params[name].shape} in model")
        for name, value in state.items():
            if name in params:
                params[name].data[...] = value


class ModuleList(Module):
    """An indexable list of modules; parameters are named ``0.weight``, ``1.weight``, ..."""

    def __init__(self, modules: Sequence[Module] = ()) -> None:
        self._modules = list(modules)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for i, m in enumerate(self._modules):
            yield from m.named_parameters(f"{prefix}{i}.")

    def children(self) -> Iterator[tuple[str, Module]]:
        for i, m in enumerate(self._modules):
            yield str(i), m

    def __getitem__(self, i: int) -> Module:
        return self._modules[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules)


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(in_features, out_features)``.

    Initialised like PyTorch's ``nn.Linear``: uniform in +-1/sqrt(in_features). ``fp8``: an
    ``fp8.Fp8Meta`` (set by ``fp8.enable``) runs the product with FP8 operands.
    """

    fp8: Any = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Any = np.float64) -> None:
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Parameter((in_features, out_features), ("uniform", bound), dtype)
        self.bias = Parameter((out_features,), ("uniform", bound), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None:
            return fp8.linear(x, self.weight, self.bias, self.fp8)
        return F.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype: Any = np.float64) -> None:
        self.weight = Parameter((dim,), ("ones",), dtype)
        self.bias = Parameter((dim,), ("zeros",), dtype)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(Module):
    """A lookup table of ``num_embeddings`` rows, initialised N(0, 1) like PyTorch's."""

    def __init__(self, num_embeddings: int, dim: int, dtype: Any = np.float64) -> None:
        self.weight = Parameter((num_embeddings, dim), ("normal", 1.0), dtype)

    def forward(self, idx: np.ndarray) -> Tensor:
        return F.embedding(self.weight, idx)


class MLP(Module):
    """Linear layers of the given widths with ReLU between them: ``MLP([4, 16, 16, 2])``."""

    def __init__(self, sizes: Sequence[int], seed: int = 0, dtype: Any = np.float64) -> None:
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output width, got {list(sizes)}")
        self.seed = seed
        self.layers = ModuleList([Linear(a, b, dtype=dtype) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = x.relu()
        return x


class FeedForward(Module):
    """The transformer's MLP: ``proj(gelu(fc(x)))``, d_model -> d_ff -> d_model."""

    def __init__(self, d_model: int, d_ff: int, dtype: Any = np.float64) -> None:
        self.fc = Linear(d_model, d_ff, dtype=dtype)
        self.proj = Linear(d_ff, d_model, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class CausalSelfAttention(Module):
    """Multi-head causal self-attention (Vaswani et al. 2017) with separate q, k, v projections;
    ``causal=False`` lets every position see the whole sequence (an encoder's attention)."""

    def __init__(self, d_model: int, n_heads: int, dtype: Any = np.float64, causal: bool = True,
                 keep_softmax: bool = True) -> None:
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pick a multiple")
        self.n_heads, self.causal, self.keep_softmax = n_heads, causal, keep_softmax
        self.q = Linear(d_model, d_model, dtype=dtype)
        self.k = Linear(d_model, d_model, dtype=dtype)
        self.v = Linear(d_model, d_model, dtype=dtype)
        self.proj = Linear(d_model, d_model, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.attention(self.q(x), self.k(x), self.v(x), self.n_heads, self.causal, self.keep_softmax))


class Block(Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` (GPT-2).

    ``recompute`` (``minipar.recompute``): "none" keeps every activation for backward, "selective"
    all but the attention's softmax, "full" only the block's input (its forward runs again in backward)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, dtype: Any = np.float64,
                 causal: bool = True, recompute: str = "none") -> None:
        self.recompute = check_recompute("Block", recompute)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, dtype=dtype, causal=causal,
                                        keep_softmax=recompute != "selective")
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = FeedForward(d_model, d_ff or 4 * d_model, dtype=dtype)

    def math(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.math, x) if self.recompute == "full" else self.math(x)


class GPT(Module):
    """A tiny GPT: token + position embeddings, ``n_layers`` blocks, final layer norm, vocabulary head;
    ``recompute`` is every block's (``Block``).

    ``forward(idx)`` maps integer tokens ``(batch, seq)`` to logits ``(batch, seq, vocab)``.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
                 d_ff: int | None = None, seed: int = 0, dtype: Any = np.float64, causal: bool = True,
                 recompute: str = "none") -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.tok_emb = Embedding(vocab_size, d_model, dtype=dtype)
        self.pos_emb = Embedding(seq_len, d_model, dtype=dtype)
        self.blocks = ModuleList([Block(d_model, n_heads, d_ff, dtype=dtype, causal=causal, recompute=recompute)
                                  for _ in range(n_layers)])
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.head = Linear(d_model, vocab_size, bias=False, dtype=dtype)

    def embed(self, idx: np.ndarray) -> Tensor:
        idx = np.asarray(idx)
        if idx.shape[-1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[-1]} tokens is longer than seq_len={self.seq_len}")
        return self.tok_emb(idx) + self.pos_emb(np.arange(idx.shape[-1]))

    def forward(self, idx: np.ndarray) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: np.ndarray, targets: np.ndarray) -> Tensor:
        return F.cross_entropy(self(idx), targets)
