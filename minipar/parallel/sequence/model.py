"""The sequence-parallel GPT: ``minipar.nn.GPT`` with every block's attention split along the
sequence by Ulysses, Ring Attention or both (``method = "ulysses" | "ring" | "hybrid"``).

Every rank holds all the weights and S/P positions of every activation (``layout.positions``: a
contiguous slice, or two zigzag chunks). Embeddings, layer norms, MLPs and the head work on those
positions alone; the token and position embeddings look up this rank's own positions, so position
ids stay right under the zigzag split. Only attention needs the other positions. The loss is the
mean over this rank's tokens; every rank holds the same number, so the mean over ranks is the
single-process loss, and ``sync_grads`` averages the gradients (one all-reduce of every gradient,
flat, as DDP and Megatron's context parallelism do)::

    model = SequenceParallelGPT(..., comm=comm, method="ring", zigzag=True)
    loss = model.loss(model.shard(idx), model.shard(targets)); loss.backward(); model.sync_grads(); opt.step()
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar.autograd import Tensor
from minipar.checks import one_of
from minipar.comm import Communicator
from minipar.nn import GPT, CausalSelfAttention, Linear, Module
from minipar.parallel.ddp import average_grads
from minipar.parallel.sequence.comm_ops import linear_seq_to_heads
from minipar.parallel.sequence.hybrid import hybrid_attention, hybrid_attention_on_heads
from minipar.parallel.sequence.layout import METHODS, SequenceLayout, check_sequence_config
from minipar.parallel.sequence.ring import ring_attention
from minipar.parallel.sequence.ulysses import ulysses_attention, ulysses_attention_on_heads
from minipar.parallel.tensor.comm_ops import is_bf16


class SequenceGroup:
    """The P ranks of ``comm`` as a P_u x P_r grid (``layout``), with the Ulysses sub-communicator
    (P_u consecutive ranks) and the ring sub-communicator (every P_u-th rank), and the attention of
    ``method`` over them. Build it after ``check_sequence_config``: ``split`` communicates."""

    def __init__(self, comm: Communicator, layout: SequenceLayout, method: str) -> None:
        one_of("SequenceGroup", "method", method, METHODS)
        if not isinstance(layout, SequenceLayout) or layout.degree != comm.size or (method != "hybrid" and (
                layout.ulysses, layout.ring) != ((comm.size, 1) if method == "ulysses" else (1, comm.size))):
            raise ValueError(f"SequenceGroup: layout={layout!r} is not a {method} layout of the communicator's "
                             f"{comm.size} ranks; make it with check_sequence_config")
        self.comm, self.layout, self.method = comm, layout, method
        ring_index, ulysses_index = layout.coords(comm.rank)
        self.ulysses = comm.split(ring_index) if method == "hybrid" else comm
        self.ring = comm.split(ulysses_index) if method == "hybrid" else comm
        self.blocks = [layout.ring_pieces(i) for i in range(layout.ring)]
        self.positions = layout.positions(comm.rank)

    def __str__(self) -> str:
        i, u = self.layout.coords(self.comm.rank)
        return (f"SP({self.method}: Ulysses {self.layout.ulysses} x Ring {self.layout.ring}, "
                f"{'zigzag' if self.layout.zigzag else 'contiguous'})-Rank({self.comm.rank}: ring {i}, ulysses {u})")

    def attention(self, q: Tensor, k: Tensor, v: Tensor, n_heads: int, causal: bool) -> Tensor:
        """Attention of this rank's (b, S/P, H d) q, k, v shards; returns its (b, S/P, H d) output."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, n_heads, self.ulysses, causal)
        if self.method == "ring":
            return ring_attention(q, k, v, n_heads, self.ring, self.blocks, causal)
        return hybrid_attention(q, k, v, n_heads, self.ulysses, self.ring, self.blocks, causal)

    def attention_of(self, x: Tensor, q: Linear, k: Linear, v: Linear, n_heads: int, causal: bool) -> Tensor:
        """Attention of this rank's (b, S/P, h) input ``x`` with the projections ``q``, ``k``, ``v``.
        Ulysses and the hybrid project and all-to-all in one op (``linear_seq_to_heads``), so the
        graph keeps q, k, v once, after the all-to-all, as DeepSpeed does."""
        if self.method == "ring":
            return ring_attention(q(x), k(x), v(x), n_heads, self.ring, self.blocks, causal)
        qh, kh, vh = (linear_seq_to_heads.apply(x, lin.weight, lin.bias, self.ulysses, projects_bf16(x, lin))
                      for lin in (q, k, v))
        if self.method == "ulysses":
            return ulysses_attention_on_heads(qh, kh, vh, n_heads, self.ulysses, causal)
        return hybrid_attention_on_heads(qh, kh, vh, n_heads, self.ulysses, self.ring, self.blocks, causal)


def projects_bf16(x: Tensor, lin: Linear) -> bool:
    """Whether ``lin(x)`` is a bfloat16 model's value (rounded to bf16 by the op)."""
    return is_bf16(x) or is_bf16(lin.weight) or (lin.bias is not None and is_bf16(lin.bias))


class SequenceParallelAttention(Module):
    """``nn.CausalSelfAttention``'s projections (same parameters, same names) around the sequence
    group's attention: q, k, v and proj are the linears of this rank's positions (under Ulysses,
    q, k, v fused with the all-to-all)."""

    def __init__(self, attn: CausalSelfAttention, group: SequenceGroup) -> None:
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.n_heads, self.causal, self.group = attn.n_heads, attn.causal, group

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.group.attention_of(x, self.q, self.k, self.v, self.n_heads, self.causal))


class SequenceParallelGPT(GPT):
    """``minipar.nn.GPT`` over the ``comm.size`` ranks of ``comm``, split along the sequence.

    ``method``: ``"ulysses"`` (P_u = P), ``"ring"`` (P_r = P) or ``"hybrid"`` (give ``ulysses`` = P_u
    or ``ring`` = P_r). ``zigzag``: the load-balanced split for causal Ring Attention. Bad
    configurations raise ``ValueError`` on every rank before any message."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
                 comm: Communicator, method: str = "ring", zigzag: bool = False, ulysses: int | None = None,
                 ring: int | None = None, d_ff: int | None = None, seed: int = 0, dtype: Any = np.float64,
                 causal: bool = True) -> None:
        layout = check_sequence_config(comm, seq_len, n_heads, d_model, method, ulysses, ring, zigzag)
        super().__init__(vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, seed, dtype, causal)
        self.group = SequenceGroup(comm, layout, method)
        for block in self.blocks:
            block.attn = SequenceParallelAttention(block.attn, self.group)

    def shard(self, tokens: np.ndarray) -> np.ndarray:
        """This rank's positions of ``tokens`` (batch, S): (batch, S/P)."""
        return self.group.layout.shard(tokens, self.group.comm.rank)

    def embed(self, idx: np.ndarray) -> Tensor:
        idx = np.asarray(idx)
        if idx.shape[-1] != len(self.group.positions):
            raise ValueError(f"this rank holds {len(self.group.positions)} positions of the sequence, got "
                             f"{idx.shape[-1]} tokens; pass model.shard(tokens)")
        return self.tok_emb(idx) + self.pos_emb(self.group.positions)

    def sync_grads(self) -> None:
        """Average every parameter's gradient over the sequence group: one ring all-reduce of the
        gradients packed into one buffer, 2 (P-1)/P x (parameter bytes) sent per rank."""
        average_grads([p for p in self.parameters() if p.grad is not None], self.group.comm)
