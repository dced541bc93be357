"""The tensor-parallel transformer: parallel MLP, parallel attention, block and GPT (Megatron-LM,
Shoeybi et al. 2019, Sec. 3, Fig. 3; sequence parallelism: Korthikanti et al. 2022, Sec. 4.2.2).

Parameter names and full shapes are those of ``minipar.nn.GPT`` (``tok_emb.weight``,
``blocks.0.attn.q.weight``, ..., ``head.weight``), so ``init_parameters(seed)`` hands each rank its
slice of the single-process model and ``gather_state_dict`` gives that model back.

One block, t ranks::

    x --ln1--> f --[q k v: column parallel, heads h*t/H..]--attention--[proj: row parallel]--> g --+--> x
    x --ln2--> f --[fc: column parallel]--gelu--[proj: row parallel]--> g --+--> x

``f``/``g`` are all-reduces in backward/forward: 2 all-reduces forward and 2 backward per block.
With ``sequence_parallel=True`` the residual stream and layer norms hold a ``1/t`` sequence shard,
``f`` becomes an all-gather and ``g`` a reduce-scatter (same bytes), and the column-parallel
linears keep only the shard, all-gathering it again in backward (2 more all-gathers per block).
Layer-norm weights, the row-parallel biases and the position embedding then see only their shard's
gradient: ``sync_grads()`` all-reduces them (one all-reduce per step, as Megatron does).

The linears, layer norms, GELU and attention are single autograd ops that keep exactly the tensors
Korthikanti et al. 2022 (Sec. 4.1) count, so the graph of one block holds, measured, their
``sbh (34/t + 5as/(ht))`` minus the dropout terms (``minipar.cost.tensor``).

Measurement (the ``F``/``B`` spans per block, the activation meter's samples) happens only while
a trace records (``trace.current()``); otherwise a block is its math alone.

Layout: tokens arrive ``(batch, seq)``; inside, activations are ``[seq, batch, hidden]`` (Megatron's
layout) so the sequence is axis 0, the axis the comm layer gathers and scatters. The embedding
transposes once; attention transposes to ``(batch, seq, heads*d_head)`` for ``F.attention``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from minipar import functional as F
from minipar import trace
from minipar.autograd import Context, Function, Tensor
from minipar.memory import held_buffers, seq_mark
from minipar.nn import LayerNorm, Module, ModuleList, Parameter
from minipar.parallel.tensor.comm_ops import ActivationMeter, exit_region
from minipar.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tokens,
    column_parallel,
    vocab_parallel_cross_entropy,
)
from minipar.recompute import check_recompute, checkpoint

LN, TP, LOGITS = ActivationMeter.LABELS


def check_tp_config(comm: Any, vocab_size: int, d_model: int, n_heads: int, d_ff: int,
                 tp: int | None = None) -> None:
    """Raise ``ValueError`` (on every rank, before any message) naming what to change."""
    t = comm.size
    if tp is not None and tp != t:
        raise ValueError(f"tensor-parallel degree tp={tp} but the communicator has {t} ranks; "
                         f"launch {tp} ranks or pass tp={t}")
    problems = []
    if d_model % n_heads:
        problems.append(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    for name, n in (("n_heads", n_heads), ("d_model", d_model), ("d_ff", d_ff), ("vocab_size", vocab_size)):
        if n % t:
            problems.append(f"{name}={n} is not divisible by t={t}")
    if problems:
        raise ValueError("tensor parallelism: " + "; ".join(problems) +
                         ". Choose sizes that are multiples of t (or another t that divides them all).")


class _Held:
    """Activation bytes one part of the forward pass (a block, the embedding, the head, the loss)
    keeps, MEASURED from its autograd graph (``memory.held_buffers``) and released into the meter
    when backward has passed through it.

    Every buffer is attributed to the region whose code allocated it: tensors made inside a
    ``region(label)`` window go to ``label``, the rest of the part to ``measure``'s ``default``.
    """

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter, self.bytes = meter, dict.fromkeys(meter.LABELS, 0)
        self.start, self.windows = seq_mark(), []  # (lo, hi, label)

    @contextmanager
    def region(self, label: str) -> Iterator[None]:
        lo = seq_mark()
        yield
        self.windows.append((lo, seq_mark(), label))

    def measure(self, out: Tensor, default: str) -> None:
        """Hold the bytes the graph behind ``out`` keeps for the tensors made since this part began."""
        got = dict.fromkeys(self.bytes, 0)
        for seq, nbytes in held_buffers(out, self.start).values():
            got[next((lab for lo, hi, lab in self.windows if lo <= seq < hi), default)] += nbytes
        for label, n in got.items():
            if n:
                self.bytes[label] += n
                self.meter.hold(label, n)

    @staticmethod
    def window(held: _Held | None, label: str) -> Any:
        """``held.region(label)``, or nothing when no trace records (``held`` is None)."""
        return held.region(label) if held is not None else nullcontext()

    def release(self) -> None:
        for label, n in self.bytes.items():
            if n:
                self.meter.release(label, n)
        self.bytes = dict.fromkeys(self.meter.LABELS, 0)


class ParallelMLP(Module):
    """``proj(gelu(fc(x)))``: fc column-parallel (d -> d_ff/t), proj row-parallel (d_ff/t -> d)."""

    def __init__(self, d_model: int, d_ff: int, comm: Any, sequence_parallel: bool = False,
                 dtype: Any = np.float64) -> None:
        self.fc = ColumnParallelLinear(d_model, d_ff, comm, sequence_parallel=sequence_parallel, dtype=dtype)
        self.proj = RowParallelLinear(d_ff, d_model, comm, sequence_parallel=sequence_parallel, dtype=dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None, held: _Held | None = None) -> Tensor:
        """``residual + proj(gelu(fc(x)))``."""
        with _Held.window(held, TP):  # the tensor-parallel region
            h = F.gelu(self.fc(x))
        return self.proj(h, residual)


class ParallelAttention(Module):
    """Causal self-attention on this rank's ``n_heads/t`` heads: q, k, v column-parallel (columns of
    head h are ``[h d_head, (h+1) d_head)``, contiguous per rank) entered once, proj row-parallel."""

    def __init__(self, d_model: int, n_heads: int, comm: Any, sequence_parallel: bool = False,
                 dtype: Any = np.float64, keep_softmax: bool = True) -> None:
        self.local_heads, self.keep_softmax = n_heads // comm.size, keep_softmax
        kw = {"sequence_parallel": sequence_parallel, "dtype": dtype}
        self.q = ColumnParallelLinear(d_model, d_model, comm, **kw)
        self.k = ColumnParallelLinear(d_model, d_model, comm, **kw)
        self.v = ColumnParallelLinear(d_model, d_model, comm, **kw)
        self.proj = RowParallelLinear(d_model, d_model, comm, **kw)

    def forward(self, x: Tensor, residual: Tensor | None = None, held: _Held | None = None) -> Tensor:
        """``residual + proj(attention(q(x), k(x), v(x)))``."""
        with _Held.window(held, TP):  # the tensor-parallel region
            qkv = column_parallel(x, [self.q, self.k, self.v])  # one f (or all-gather) for q, k, v
            q, k, v = (part.transpose(1, 0, 2) for part in F.split(qkv, 3, axis=-1))
            y = F.attention(q, k, v, self.local_heads, keep_softmax=self.keep_softmax).transpose(1, 0, 2)
        return self.proj(y, residual)


class ParallelBlock(Module):
    """Pre-norm block ``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` on ``[seq(/t), batch, d]``.

    While a trace records, forward is one ``F`` span, backward one ``B`` span (args ``layer``), and
    the activations its graph keeps are measured into ``activations/tp`` (made inside the attention's
    and the MLP's tensor-parallel regions: q k v, softmax, attention output, fc output and GELU
    output) and ``activations/ln`` (the rest: layer-norm outputs and the two residual sums, on the
    sequence shard under sequence parallelism).

    ``recompute`` as ``nn.Block``'s. Under "full" the graph keeps the block's output only (measured
    into ``activations/ln``); backward runs the forward again (its collectives too: a span ``R``)
    and holds the recomputed layer's working set in the meter until the block's backward is done."""

    def __init__(self, d_model: int, n_heads: int, comm: Any, d_ff: int | None = None,
                 sequence_parallel: bool = False, layer: int = 0, dtype: Any = np.float64,
                 recompute: str = "none") -> None:
        self.recompute = check_recompute("ParallelBlock", recompute)
        self.layer, self.meter, self.sequence_parallel = layer, ActivationMeter(), sequence_parallel
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = ParallelAttention(d_model, n_heads, comm, sequence_parallel, dtype,
                                      keep_softmax=recompute != "selective")
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = ParallelMLP(d_model, d_ff or 4 * d_model, comm, sequence_parallel, dtype)

    def math(self, x: Tensor, held: _Held | None = None) -> Tensor:
        x = self.attn(self.ln1(x), x, held)
        return self.mlp(self.ln2(x), x, held)

    def body(self, x: Tensor) -> Tensor:
        """``math(x)``, through ``recompute.checkpoint`` under full recomputation."""
        return checkpoint(self.math, x, args={"layer": self.layer}) if self.recompute == "full" else self.math(x)

    def forward(self, x: Tensor) -> Tensor:
        if trace.current() is None:
            return self.body(x)
        held, started = _Held(self.meter), [0.0, 0.0]  # this forward's: released by its own backward
        work = [_Held(self.meter)]  # under full recomputation: the graph of the last run of math

        def again(x: Tensor) -> Tensor:
            work[0] = _Held(self.meter)
            return self.math(x, work[0])

        def recomputed(out: Tensor) -> None:
            work[0].measure(out, LN)  # one layer's working set, held until its backward is done
            started[:] = trace.now(), trace.cpu()  # B after the recomputation's R

        def backward_starts() -> None:
            started[:] = trace.now(), trace.cpu()

        def backward_done() -> None:
            rec = trace.current()
            if rec is not None:
                rec.add("compute", "B", started[0], trace.now(), c0=started[1], c1=trace.cpu(),
                        args={"layer": self.layer})
            held.release()
            work[0].release()

        with trace.span("F", args={"layer": self.layer}):
            x = F.on_backward.apply(x, backward_done)  # its backward runs after the whole block's
            y = (checkpoint(again, x, on_recompute=recomputed, args={"layer": self.layer})
                 if self.recompute == "full" else self.math(x, held))
            out = F.on_backward.apply(y, backward_starts)  # its backward runs first
            held.measure(out, LN)
            return out

    def grad_sync_params(self) -> list[Parameter]:
        """Replicated parameters used on a sequence shard: the layer norms and the proj biases."""
        if not self.sequence_parallel:
            return []
        return [*self.ln1.parameters(), *self.ln2.parameters(), *self.attn.proj.grad_sync_params(),
                *self.mlp.proj.grad_sync_params()]


class TensorParallelGPT(Module):
    """``minipar.nn.GPT`` split over the ``comm.size`` ranks of ``comm`` (tensor-parallel degree t).

    Every rank holds 1/t of the embedding table (vocabulary rows), of q/k/v/fc (columns), of
    proj (rows) and of the head (vocabulary columns); layer norms, proj biases and the position
    embedding are replicated. ``loss`` never forms the full logits. ``recompute``: every block's
    (``ParallelBlock``). Per training step::

        loss = model.loss(idx, targets); loss.backward(); model.sync_grads(); opt.step()
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int, comm: Any,
                 d_ff: int | None = None, sequence_parallel: bool = False, seed: int = 0,
                 dtype: Any = np.float64, tp: int | None = None, recompute: str = "none") -> None:
        d_ff = d_ff or 4 * d_model
        check_recompute("TensorParallelGPT", recompute)
        check_tp_config(comm, vocab_size, d_model, n_heads, d_ff, tp)
        self.comm, self.sequence_parallel, self.seed = comm, sequence_parallel, seed
        self.vocab_size, self.seq_len, self.d_model = vocab_size, seq_len, d_model
        self.meter = ActivationMeter()
        sp = sequence_parallel
        self.tok_emb = VocabParallelEmbedding(vocab_size, d_model, comm, sp, dtype)
        self.pos_emb = Table(seq_len, d_model, dtype)
        self.blocks = ModuleList([ParallelBlock(d_model, n_heads, comm, d_ff, sp, i, dtype, recompute)
                                  for i in range(n_layers)])
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.head = ColumnParallelLinear(d_model, vocab_size, comm, bias=False, sequence_parallel=sp,
                                         dtype=dtype)
        for block in self.blocks:
            block.meter = self.meter  # one meter for the whole model

    # ---- forward --------------------------------------------------------------------------------
    def _check(self, idx: np.ndarray) -> None:
        if idx.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {idx.shape}")
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than seq_len={self.seq_len}")
        if self.sequence_parallel and idx.shape[1] % self.comm.size:
            raise ValueError(f"sequence parallelism splits the {idx.shape[1]} positions over "
                             f"t={self.comm.size} ranks; use a sequence length that is a multiple of "
                             f"{self.comm.size}")
        check_tokens(idx, self.vocab_size, "token ids")

    def embed(self, idx: np.ndarray, held: _Held | None = None) -> Tensor:
        """Token + position embeddings as ``[seq, batch, d]`` (this rank's sequence shard under SP)."""
        idx = np.asarray(idx)
        self._check(idx)
        return embed_tokens(self.tok_emb, self.pos_emb.weight, idx, held)

    def local_logits(self, idx: np.ndarray) -> Tensor:
        """This rank's vocabulary slice of the logits, ``[seq, batch, V/t]`` (whole sequence)."""
        if trace.current() is None:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))
        self.meter.reset()
        with trace.span("F", args={"layer": "embed"}):
            emb = _Held(self.meter)
            x = F.on_backward.apply(self.embed(idx, emb), emb.release)  # released when backward reaches here
            emb.measure(x, LN)
        for block in self.blocks:
            x = block(x)
        with trace.span("F", args={"layer": "head"}):
            head = _Held(self.meter)
            x = F.on_backward.apply(x, head.release)  # released once backward has passed the head
            h = self.ln_f(x)
            with head.region(LOGITS):
                logits = self.head(h)
            head.measure(logits, LN)
            return logits

    def forward(self, idx: np.ndarray) -> Tensor:
        """Logits ``(batch, seq, V/t)``: this rank's vocabulary columns (``gather_logits`` for all)."""
        return self.local_logits(idx).transpose(1, 0, 2)

    def loss(self, idx: np.ndarray, targets: np.ndarray) -> Tensor:
        """Mean cross-entropy, the vocabulary-parallel way; equal on every rank."""
        targets = np.asarray(targets)
        if targets.shape != np.shape(idx):
            raise ValueError(f"targets {targets.shape} must have the tokens' shape {np.shape(idx)}")
        check_tokens(targets, self.vocab_size, "targets")
        logits = self.local_logits(idx)
        if trace.current() is None:
            return vocab_parallel_cross_entropy(logits, np.ascontiguousarray(targets.T), self.comm)
        with trace.span("F", args={"layer": "loss"}):
            held = _Held(self.meter)  # the softmax and target indices the loss saves, the loss itself
            logits = F.on_backward.apply(logits, held.release)
            loss = vocab_parallel_cross_entropy(logits, np.ascontiguousarray(targets.T), self.comm)
            held.measure(loss, LOGITS)
            return loss

    # ---- after backward ------------------------------------------------------------------------
    def grad_sync_params(self) -> list[Parameter]:
        """Replicated parameters used on a sequence shard (empty without sequence parallelism): every
        block's, the final layer norm's and the position embedding."""
        if not self.sequence_parallel:
            return []
        own = [*self.ln_f.parameters(), self.pos_emb.weight]
        return [p for block in self.blocks for p in block.grad_sync_params()] + own

    def sync_grads(self) -> None:
        """``sync_sequence_parallel_grads(self, comm)``: call after ``backward``, before the optimizer."""
        sync_sequence_parallel_grads(self, self.comm)


def sync_sequence_parallel_grads(module: Module, comm: Any) -> None:
    """All-reduce (one flat buffer, ring) the gradients of the ``grad_sync_params()`` of ``module`` or
    of its sub-modules: parameters
    replicated on every rank but used on a sequence shard (layer norms, row-parallel biases, the
    position embedding), so each rank holds only its shard's part. Megatron does the same after
    backward. Nothing is sent when there are none (no sequence parallelism)."""
    params = _grad_sync_params(module)
    if not params:
        return
    grads = [p.grad if p.grad is not None else np.zeros_like(p.data) for p in params]
    flat = comm.allreduce(np.concatenate([gr.reshape(-1) for gr in grads]), op="sum")
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.size].reshape(p.shape).copy()
        offset += p.size


def _grad_sync_params(module: Module) -> list[Parameter]:
    """``module.grad_sync_params()`` where the module names them, else its children's, in order."""
    if hasattr(module, "grad_sync_params"):
        return module.grad_sync_params()
    return [p for _, child in module.children() for p in _grad_sync_params(child)]


def embed_tokens(tok_emb: VocabParallelEmbedding, pos_emb: Parameter, idx: np.ndarray,
                 held: _Held | None = None) -> Tensor:
    """Token + position embeddings of ``idx`` (batch, seq) as ``[seq, batch, d]``: the
    vocabulary-parallel partial sums leave the region by ``g`` (or, under sequence parallelism, by
    the reduce-scatter, keeping this rank's sequence shard, whose positions are then added)."""
    comm, sp = tok_emb.comm, tok_emb.sequence_parallel
    seq, t, r = idx.shape[1], comm.size, comm.rank
    lo, hi = (r * seq // t, (r + 1) * seq // t) if sp else (0, seq)
    with _Held.window(held, TP):  # vocabulary-parallel partial sums
        partial = tok_emb.partial(np.ascontiguousarray(idx.T))
    x = exit_region(partial, comm, sp)
    return AddPositions.apply(x, pos_emb, lo, hi)


class AddPositions(Function):
    """``x + pos[lo:hi]`` broadcast over the batch axis, keeping nothing for backward (``dpos`` rows
    ``lo:hi`` = the gradient summed over the batch): a slice of the parameter would be a view that keeps
    its whole buffer alive in the graph, ZeRO-3's gathered stage included (``hybrid.zero_pp``)."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, pos: np.ndarray, lo: int, hi: int) -> np.ndarray:
        ctx.rows, ctx.shape = (lo, hi), pos.shape
        return x + pos[lo:hi][:, None, :]

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        lo, hi = ctx.rows
        dpos = np.zeros(ctx.shape, dtype=grad.dtype)
        dpos[lo:hi] = grad.sum(axis=1)
        return grad, dpos, None, None


class Table(Module):
    """A replicated embedding table used by slicing (the position embedding)."""

    def __init__(self, rows: int, dim: int, dtype: Any) -> None:
        self.weight = Parameter((rows, dim), ("normal", 1.0), dtype)


def gather_logits(logits: Tensor, comm: Any) -> np.ndarray:
    """All vocabulary columns of a (..., V/t) logits slice (an all-gather; tests and lessons only)."""
    whole = comm.allgather(np.ascontiguousarray(np.moveaxis(logits.data, -1, 0)))
    return np.moveaxis(whole, 0, -1)
