"""The tiny GPT as pipeline layers whose insides are tensor- or sequence-parallel.

``minipar.parallel.pipeline`` cuts a ``LayeredModel`` into stages and builds only its own; here the
layers it builds are the parallel ones, so one pipeline stage is itself split over the ranks of
its ``tp`` (or ``sp``) group. Every layer keeps ``nn.GPT``'s parameter names and full shapes, so
each rank starts from its slice of the single-process model (Megatron-LM's PTD-P composition,
Narayanan et al. 2021, Sec. 3):

- ``tensor_parallel_layers``: embed = ``VocabParallelEmbedding`` + positions (``g`` or, with
  Megatron-SP, the reduce-scatter), blocks = ``ParallelBlock`` (Shoeybi et al. 2019, Fig. 3;
  Korthikanti et al. 2022, Sec. 4.2.2), head = layer norm + column-parallel vocabulary, loss =
  vocabulary-parallel cross-entropy. Activations are ``[seq(/t), batch, d]``; with t = 1 every
  collective is a no-op on one rank and this is the plain GPT.
- ``sequence_parallel_layers``: every rank holds all weights and ``S/P`` positions; attention is
  Ulysses, Ring Attention or their hybrid over the ``sp`` group (Jacobs et al. 2023; Liu et al.
  2023; Fang & Zhao 2024). Activations are ``(batch, S/P, d)``; the loss is the mean over this
  rank's tokens.

``grad_sync_params`` names the parameters a layer replicates over ``tp`` but uses on a sequence
shard only (Megatron-SP's layer norms, row-parallel biases, position embedding): their gradients
are all-reduced over ``tp``, once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minipar import functional as F
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.nn import Block, Embedding, LayerNorm, Module, Parameter
from minipar.parallel.pipeline.partition import GPTHead, LayeredModel
from minipar.parallel.sequence.model import SequenceGroup, SequenceParallelAttention
from minipar.parallel.tensor.layers import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from minipar.parallel.tensor.model import ParallelBlock, Table, embed_tokens


class TensorParallelEmbedding(Module):
    """Layer 0 under tensor parallelism: ``tok_emb`` (vocabulary rows split) + ``pos_emb``."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, comm: Communicator,
                 sequence_parallel: bool, dtype: Any) -> None:
        self.tok_emb = VocabParallelEmbedding(vocab_size, d_model, comm, sequence_parallel, dtype)
        self.pos_emb = Table(seq_len, d_model, dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, idx: np.ndarray) -> Tensor:
        return embed_tokens(self.tok_emb, self.pos_emb.weight, np.asarray(idx))

    def grad_sync_params(self) -> list[Parameter]:
        return [self.pos_emb.weight] if self.sequence_parallel else []


class TensorParallelBlock(ParallelBlock):
    """``ParallelBlock``'s math alone: the pipeline's F/B spans time the stage it belongs to."""

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class TensorParallelHead(Module):
    """The last layer under tensor parallelism: ``head(ln_f(x))``, this rank's vocabulary columns of
    the logits, ``[seq, batch, V/t]`` (Megatron-SP all-gathers the sequence first)."""

    def __init__(self, d_model: int, vocab_size: int, comm: Communicator, sequence_parallel: bool,
                 dtype: Any) -> None:
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.head = ColumnParallelLinear(d_model, vocab_size, comm, bias=False,
                                         sequence_parallel=sequence_parallel, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln_f(x))

    def grad_sync_params(self) -> list[Parameter]:
        return list(self.ln_f.parameters()) if self.sequence_parallel else []


def _gpt_names(n_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    names = ("embed", *(f"blocks.{i}" for i in range(n_layers)), "head")
    prefixes = ("", *(f"blocks.{i}." for i in range(n_layers)), "")
    return names, prefixes


def tensor_parallel_layers(vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
                           d_ff: int, tp: Communicator, sequence_parallel: bool, seed: int,
                           dtype: Any, recompute: str = "none") -> LayeredModel:
    """``nn.GPT`` as ``n_layers + 2`` tensor-parallel layers over ``tp`` (module docstring);
    ``recompute``: the blocks' (``ParallelBlock``)."""

    def make(i: int) -> Module:
        if i == 0:
            return TensorParallelEmbedding(vocab_size, seq_len, d_model, tp, sequence_parallel, dtype)
        if i == n_layers + 1:
            return TensorParallelHead(d_model, vocab_size, tp, sequence_parallel, dtype)
        return TensorParallelBlock(d_model, n_heads, tp, d_ff, sequence_parallel, i - 1, dtype, recompute)

    def loss(logits: Tensor, targets: np.ndarray) -> Tensor:  # logits [seq, batch, V/t]
        return vocab_parallel_cross_entropy(logits, np.ascontiguousarray(np.asarray(targets).T), tp)

    names, prefixes = _gpt_names(n_layers)
    return LayeredModel("gpt", names, prefixes, make, loss, seed)


class SequenceShardEmbedding(Module):
    """Layer 0 under sequence parallelism: this rank's positions' token and position embeddings."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, positions: np.ndarray, dtype: Any) -> None:
        self.tok_emb = Embedding(vocab_size, d_model, dtype=dtype)
        self.pos_emb = Embedding(seq_len, d_model, dtype=dtype)
        self.positions = positions

    def forward(self, idx: np.ndarray) -> Tensor:
        return self.tok_emb(np.asarray(idx)) + self.pos_emb(self.positions)


def sequence_parallel_layers(vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
                             d_ff: int, group: SequenceGroup, seed: int, dtype: Any,
                             recompute: str = "none") -> LayeredModel:
    """``nn.GPT`` as ``n_layers + 2`` layers on this rank's ``S/P`` positions; attention over
    ``group`` (module docstring). The loss is the mean over this rank's tokens. ``recompute``:
    the blocks' ("full" recomputes them; "selective" needs minipar's attention, which these replace)."""

    def make(i: int) -> Module:
        if i == 0:
            return SequenceShardEmbedding(vocab_size, seq_len, d_model, group.positions, dtype)
        if i == n_layers + 1:
            return GPTHead(d_model, vocab_size, dtype)
        block = Block(d_model, n_heads, d_ff, dtype=dtype, recompute=recompute)
        block.attn = SequenceParallelAttention(block.attn, group)
        return block

    loss: Callable[[Tensor, np.ndarray], Tensor] = F.cross_entropy
    names, prefixes = _gpt_names(n_layers)
    return LayeredModel("gpt", names, prefixes, make, loss, seed)
