"""Partitioning: a model as a sequence of layers, cut into consecutive pipeline stages.

GPipe (Huang et al. 2018, section 2) writes a network as a sequence of L layers and cuts it into K
cells of consecutive layers, one per accelerator; Megatron-LM (Narayanan et al. 2021, section 2.2)
cuts the transformer's blocks evenly over the p pipeline ranks, and with the interleaved schedule
into p * v "model chunks", virtual stage s = chunk * p + rank. Here:

- ``LayeredModel`` describes a model as named layers plus a loss, *without* building them: each
  rank builds only the layers of its own stages (``build_stage``), so rank r holds ~1/p of the
  parameters, as on a real pipeline.
- ``mlp(sizes)``: layer i = ``Linear`` (+ ReLU except the last), parameters ``layers.{i}.weight``.
- ``gpt(...)``: ``[embed (tok_emb + pos_emb)] + blocks.0 .. blocks.{n-1} + [ln_f + head]``.
- ``split_layers(n_layers, n_stages, counts=None)``: the layer ranges of the stages; balanced by
  default (the first ``n_layers % n_stages`` stages get one extra layer) or given as layer counts;
  ``gpt_layer_counts`` balances the GPT's blocks with the embedding and head riding along.

Every parameter of a stage keeps its *full-model* name (``blocks.3.attn.q.weight``), so
``Stage.init_parameters(seed)`` gives exactly the values of ``nn.GPT(..., seed=seed)`` /
``nn.MLP(sizes, seed)`` (the initialisation contract of ``minipar.nn``), and a state dict of the
single-process model loads stage by stage. Building a stage costs O(its parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar import functional as F
from minipar.autograd import Tensor
from minipar.nn import Block, Embedding, LayerNorm, Linear, Module, Parameter
from minipar.recompute import check_recompute


class ReLULinear(Linear):
    """``relu(x @ weight + bias)`` (or without the ReLU): one layer of ``nn.MLP``."""

    def __init__(self, in_features: int, out_features: int, relu: bool, dtype: Any = np.float64) -> None:
        super().__init__(in_features, out_features, dtype=dtype)
        self.relu = relu

    def forward(self, x: Tensor | np.ndarray) -> Tensor:
        y = super().forward(x if isinstance(x, Tensor) else Tensor(x))
        return y.relu() if self.relu else y


class GPTEmbedding(Module):
    """The GPT's first layer: ``tok_emb(idx) + pos_emb(0..T-1)`` (parameters ``tok_emb.weight``,
    ``pos_emb.weight``, as in ``nn.GPT``)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dtype: Any = np.float64) -> None:
        self.seq_len = seq_len
        self.tok_emb = Embedding(vocab_size, d_model, dtype=dtype)
        self.pos_emb = Embedding(seq_len, d_model, dtype=dtype)

    def forward(self, idx: np.ndarray) -> Tensor:
        idx = np.asarray(idx)
        if idx.shape[-1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[-1]} tokens is longer than seq_len={self.seq_len}")
        return self.tok_emb(idx) + self.pos_emb(np.arange(idx.shape[-1]))


class GPTHead(Module):
    """The GPT's last layer: ``head(ln_f(x))`` -> logits (parameters ``ln_f.*``, ``head.weight``)."""

    def __init__(self, d_model: int, vocab_size: int, dtype: Any = np.float64) -> None:
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.head = Linear(d_model, vocab_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln_f(x))


@dataclass(frozen=True)
class LayeredModel:
    """A model written as consecutive layers, for cutting into stages.

    ``names[i]`` labels layer i (``"embed"``, ``"blocks.3"``, ``"layers.0"``); ``prefixes[i]`` is
    the prefix of its parameters' names in the single-process model; ``make(i)`` builds layer i (a
    ``Module`` whose ``forward`` maps the previous layer's output to its own); ``loss(output,
    targets)`` is the mean loss of a (micro-)batch; ``seed`` initialises the parameters."""

    kind: str
    names: tuple[str, ...]
    prefixes: tuple[str, ...]
    make: Callable[[int], Module]
    loss: Callable[[Tensor, np.ndarray], Tensor]
    seed: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.names)


def mlp(sizes: Sequence[int], seed: int = 0, dtype: Any = np.float64,
        loss: Callable[[Tensor, np.ndarray], Tensor] = F.mse_loss) -> LayeredModel:
    """``nn.MLP(sizes, seed)`` as ``len(sizes) - 1`` layers (mean-squared-error loss by default)."""
    sizes = [int(s) for s in sizes]
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least an input and an output width, got {sizes}")
    n = len(sizes) - 1
    return LayeredModel(
        "mlp", tuple(f"layers.{i}" for i in range(n)), tuple(f"layers.{i}." for i in range(n)),
        lambda i: ReLULinear(sizes[i], sizes[i + 1], relu=i < n - 1, dtype=dtype), loss, seed)


def gpt(vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int, d_ff: int | None = None,
        seed: int = 0, dtype: Any = np.float64, recompute: str = "none") -> LayeredModel:
    """``nn.GPT(...)`` as ``n_layers + 2`` layers: embed, the blocks, ln_f + head; cross-entropy loss.
    ``recompute``: the blocks' (``nn.Block``; "full" recomputes each block in its stage's backward)."""
    check_recompute("gpt", recompute)
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pick a multiple")

    def make(i: int) -> Module:
        if i == 0:
            return GPTEmbedding(vocab_size, seq_len, d_model, dtype)
        if i == n_layers + 1:
            return GPTHead(d_model, vocab_size, dtype)
        return Block(d_model, n_heads, d_ff, dtype=dtype, recompute=recompute)

    names = ("embed", *(f"blocks.{i}" for i in range(n_layers)), "head")
    prefixes = ("", *(f"blocks.{i}." for i in range(n_layers)), "")
    return LayeredModel("gpt", names, prefixes, make, F.cross_entropy, seed)


def split_layers(n_layers: int, n_stages: int, counts: Sequence[int] | None = None) -> list[range]:
    """The layer indices of each stage: consecutive, covering ``0..n_layers-1`` exactly once.

    Balanced by default (stage sizes differ by at most one, larger stages first), or ``counts[s]``
    layers for stage s. Raises ``ValueError`` saying what to change (before any communication)."""
    if n_stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {n_stages}")
    if counts is None:
        if n_stages > n_layers:
            raise ValueError(f"cannot cut {n_layers} layers into {n_stages} stages: every stage needs at "
                             f"least one layer; use at most {n_layers} stages (ranks x chunks) "
                             "or a deeper model")
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (s < extra) for s in range(n_stages)]
    counts = [int(c) for c in counts]
    if len(counts) != n_stages:
        raise ValueError(f"got {len(counts)} layer counts for {n_stages} stages (ranks x chunks); "
                         f"give one count per stage")
    if any(c < 1 for c in counts) or sum(counts) != n_layers:
        raise ValueError(f"layer counts {counts} must be >= 1 each and sum to the model's {n_layers} layers")
    bounds = np.cumsum([0, *counts])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def gpt_layer_counts(n_blocks: int, n_stages: int) -> list[int]:
    """Layer counts for ``gpt(...)`` (``n_blocks + 2`` layers): the blocks spread evenly over the
    stages, the light embedding riding with the first stage's blocks and ln_f + head with the last's
    (as Megatron-LM places them), so no stage is left holding only the embedding."""
    if n_blocks < n_stages:
        raise ValueError(f"{n_blocks} blocks cannot give each of {n_stages} stages a block; "
                         "use more blocks or fewer stages (ranks x chunks)")
    base, extra = divmod(n_blocks, n_stages)
    return [base + (s < extra) + (s == 0) + (s == n_stages - 1) for s in range(n_stages)]


class Stage(Module):
    """One pipeline stage: consecutive layers of a ``LayeredModel`` applied in order.

    ``named_parameters`` gives full-model names, so ``init_parameters(seed)`` and
    ``load_state_dict`` (non-strict, with the full model's dict) work as on the whole model."""

    def __init__(self, index: int, model: LayeredModel, layers: range) -> None:
        self.index, self.seed = index, model.seed
        self.layer_range = layers
        self.layer_names = [model.names[i] for i in layers]
        self._layers = [(model.prefixes[i], model.make(i)) for i in layers]

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for pre, layer in self._layers:
            yield from layer.named_parameters(prefix + pre)

    def children(self) -> Iterator[tuple[str, Module]]:
        for name, (_, layer) in zip(self.layer_names, self._layers, strict=True):
            yield name, layer

    def forward(self, x: Any) -> Tensor:
        for _, layer in self._layers:
            x = layer(x)
        return x

    def __repr__(self) -> str:
        return f"Stage({self.index}: {', '.join(self.layer_names)})"


def build_stage(model: LayeredModel, stage: int, n_stages: int, counts: Sequence[int] | None = None) -> Stage:
    """Stage ``stage`` of ``n_stages`` of ``model`` (layers from ``split_layers``), initialised."""
    return Stage(stage, model, split_layers(model.n_layers, n_stages, counts)[stage])
