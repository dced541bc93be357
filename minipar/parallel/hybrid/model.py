"""The tiny GPT trained under any combination of pipeline, tensor, sequence and data parallelism on
one ``DeviceMesh`` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Sec. 3: PTD-P; ZeRO across data-parallel ranks, Rajbhandari et al.
2020, as Megatron-LM's distributed optimizer and DeepSpeed's pipeline engine do).

Each axis of the mesh carries one kind of traffic, and each gradient is reduced on the axis that
replicated it, once::

    pp   the pipeline runtime on mesh["pp"]: activations and their gradients, any schedule
    tp   inside every layer: Megatron's f / g (or Megatron-SP's all-gather / reduce-scatter); after
         backward, Megatron-SP's replicated parameters (layer norms, row-parallel biases, the
         position embedding) all-reduced over tp
    sp   inside attention: Ulysses' all-to-alls or Ring Attention's K/V hand-off
    dp   (with sp) every gradient averaged over the dp x sp ranks that hold the same parameter
         slice: one ring all-reduce of the flat gradients (DDP), or ZeRO stage 1's reduce-scatter
         before the step and all-gather after it (Megatron-LM's distributed optimizer)

Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, DualPipeV: backwards split into I and W,
``split_backward``) run with tp and sp > 1 too: each parallel op's collective runs once, in I with
the input's gradient (``f``'s all-reduce, the reduce-scatters, ``g-bar``'s and Ulysses' gradient
exchanges, Ring Attention's hand-offs), and W is local but for Megatron-SP's re-gather of the
column-parallel inputs, which runs inside W where the schedule places it (``tensor.layers``;
``cost.hybrid.w_regather_bytes``).

Gradients are reduced after the last micro-batch's backward, as Megatron-LM does under pipelining
(DDP's per-bucket overlap would fire once per micro-batch). ZeRO stages 2 and 3 (FSDP, with
``reshard_after_forward``) reduce-scatter there too, once per step (``zero_pp.py``). ``nn.GPT`` has no
tied weights, so no gradient crosses ``pp``. A step equals one process's step on the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np

from minipar import nn, trace
from minipar.autograd import BF16
from minipar.mesh import DeviceMesh
from minipar.nn import Module, Parameter
from minipar.optim import AdamW
from minipar.parallel.bf16 import MasterAdamW, check_recipe, wire_dtype
from minipar.parallel.ddp import average_grads
from minipar.parallel.pipeline import Pipeline, make_schedule
from minipar.parallel.pipeline.partition import gpt_layer_counts, split_layers
from minipar.parallel.sequence.layout import check_sequence_config
from minipar.parallel.sequence.model import SequenceGroup
from minipar.parallel.tensor.layers import check_tokens
from minipar.parallel.tensor.model import check_tp_config, sync_sequence_parallel_grads
from minipar.parallel.zero import ZeroDataParallel
from minipar.recompute import check_recompute

from .stages import sequence_parallel_layers, tensor_parallel_layers
from .zero_pp import PIPELINE_ZERO_STAGES, GatheringPipeline, PipelineZero

SP_METHODS = ("ulysses", "ring", "hybrid")


def check_hybrid_config(mesh: DeviceMesh, vocab_size: int, seq_len: int, d_model: int, n_heads: int,
                        n_layers: int, d_ff: int, schedule: str, microbatches: int, chunks: int,
                        sequence_parallel: bool, sp_method: str, ulysses: int | None, zero_stage: int,
                        layers: Sequence[int] | None, dtype: Any = np.float64, recompute: str = "none",
                        reshard_after_forward: bool = True, reduce_dtype: str | None = None) -> None:
    """``ValueError`` listing every problem (the same on every rank, before any message)."""
    check_recompute("hybrid", recompute)
    tp, sp, pp = (mesh.degree(a) for a in ("tp", "sp", "pp"))
    problems = []
    if recompute == "selective" and sp > 1:
        problems.append("recompute='selective' drops minipar's attention softmax; the sequence-parallel attentions "
                        "keep their own: use 'full' or sp = 1")

    def collect(check: Any, *args: Any, **kwargs: Any) -> None:
        try:
            check(*args, **kwargs)
        except ValueError as exc:
            problems.append(str(exc))

    if tp > 1 and sp > 1:
        problems.append(f"tp={tp} and sp={sp}: a stage is either tensor-parallel (add "
                        "sequence_parallel=True for Megatron-SP) or sequence-parallel (Ulysses / ring), not both")
    collect(check_tp_config, mesh["tp"], vocab_size, d_model, n_heads, d_ff)
    if sequence_parallel and tp == 1:
        problems.append("sequence_parallel=True is Megatron-SP, which splits tensor-parallel regions: it needs tp > 1")
    if sequence_parallel and seq_len % tp:
        problems.append(f"Megatron-SP splits the sequence of {seq_len} over tp={tp}: use a multiple of {tp}")
    if sp > 1:
        collect(check_sequence_config, mesh["sp"], seq_len, n_heads, d_model, sp_method, ulysses)
    if sp_method not in SP_METHODS:
        problems.append(f"sp_method={sp_method!r}; choose one of {SP_METHODS}")
    try:
        sched = make_schedule(schedule, pp, microbatches, chunks)
        stages = sched.virtual_stages
        if recompute == "full" and any(a.op == "W" for acts in sched.values() for a in acts):
            problems.append(f"recompute='full' runs a block's whole backward, weight gradients included, inside "
                            f"its recomputation: schedule={schedule!r} would have no W left to place; use another "
                            "schedule")
    except ValueError as exc:
        problems.append(str(exc))
        stages = pp
    if layers is None:
        collect(gpt_layer_counts, n_layers, stages)
    else:
        try:
            split_layers(n_layers + 2, stages, layers)
        except ValueError as exc:
            problems.append(f"layers={list(layers)} (per virtual stage, counting the embedding and the head as "
                            f"layers: {n_layers} blocks + 2): {exc}")
    if zero_stage in (1, 2, 3) and np.dtype(dtype) != np.float64:
        problems.append(f"zero_stage={zero_stage} trains in float64 here (ZeroDataParallel's precision='fp64'); "
                        f"got dtype {np.dtype(dtype)}: use float64 or zero_stage=0")
    bf16 = np.dtype(dtype) == BF16
    problems += check_recipe("bf16" if bf16 else str(np.dtype(dtype)), reduce_dtype, None)
    if bf16 and reduce_dtype == "fp16":
        problems.append("reduce_dtype='fp16': the hybrid model reduces a bf16 model's gradients in 'bf16' or 'fp32'")
    if zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage={zero_stage}: the data-parallel axis runs DDP (0) or ZeRO stage 1, 2 or 3")
    if not reshard_after_forward and zero_stage != 3:
        problems.append(f"reshard_after_forward=False keeps ZeRO-3's gathered parameters; zero_stage={zero_stage} "
                        "gathers none: drop it or use zero_stage=3")
    if problems:
        raise ValueError(f"hybrid ({mesh.shape}): " + "; ".join(problems))


class _Stages(Module):
    """This rank's pipeline stages as one module (full parameter names), for ZeRO's buckets."""

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe

    def children(self) -> Any:
        for s in sorted(self._pipe.stages):
            yield f"stage{s}", self._pipe.stages[s]

    def named_parameters(self, prefix: str = "") -> Any:
        yield from self._pipe.named_parameters()


class HybridGPT:
    """``minipar.nn.GPT`` on ``mesh``: pipeline over ``pp`` (``schedule``, ``microbatches``, ``chunks``,
    ``layers`` per virtual stage), each stage tensor-parallel over ``tp`` (``sequence_parallel``:
    Megatron-SP) or sequence-parallel over ``sp`` (``sp_method``, ``ulysses`` = P_u for "hybrid",
    ``zigzag``), replicated by DDP (``zero_stage=0``) or ZeRO stage 1, 2 or 3 over ``dp`` x ``sp``
    (``reshard_after_forward``: ZeRO-3's, ``zero_pp.py``); AdamW. ``dtype=ml_dtypes.bfloat16`` with
    ``zero_stage=0``: bf16 mixed precision (``minipar.parallel.bf16``: fp32 masters and moments, bf16 on
    the pp and tp wires), the dp average in ``reduce_dtype`` ("bf16", the default, or "fp32").
    Every rank calls it with the same arguments, then ``loss = model.step(idx, targets)`` with the
    same global batch ``(B, S)`` of token ids everywhere. ``recompute``: every block's ("none",
    "selective" with sp = 1, "full" with a schedule that is not zero-bubble; ``minipar.recompute``)."""

    def __init__(self, mesh: DeviceMesh, vocab_size: int, seq_len: int, d_model: int, n_heads: int,
                 n_layers: int, d_ff: int | None = None, *, schedule: str = "1f1b", microbatches: int = 1,
                 chunks: int = 1, layers: Sequence[int] | None = None, sequence_parallel: bool = False,
                 sp_method: str = "ulysses", ulysses: int | None = None, zigzag: bool = False,
                 zero_stage: int = 0, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, seed: int = 0, dtype: Any = np.float64,
                 recompute: str = "none", reshard_after_forward: bool = True,
                 reduce_dtype: str | None = None) -> None:
        d_ff = d_ff or 4 * d_model
        check_hybrid_config(mesh, vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, schedule, microbatches,
                            chunks, sequence_parallel, sp_method, ulysses, zero_stage, layers, dtype, recompute,
                            reshard_after_forward, reduce_dtype)
        bf16 = np.dtype(dtype) == BF16  # the data-parallel reduce in reduce_dtype (bf16 unless 'fp32')
        self.reduce_dtype = wire_dtype(BF16, reduce_dtype) if bf16 else None
        self.mesh, self.seq_len, self.vocab_size, self.head_dim = mesh, seq_len, vocab_size, d_model // n_heads
        self.sequence_parallel, self.zero_stage, self.microbatches = sequence_parallel, zero_stage, microbatches
        self.replicas = mesh.group("dp", "sp")  # ranks holding the same parameter slices
        self.group: SequenceGroup | None = None
        if mesh.degree("sp") > 1:
            layout = check_sequence_config(mesh["sp"], seq_len, n_heads, d_model, sp_method, ulysses, None, zigzag)
            self.group = SequenceGroup(mesh["sp"], layout, sp_method)
            layered = sequence_parallel_layers(vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, self.group,
                                               seed, dtype, recompute)
        else:
            layered = tensor_parallel_layers(vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, mesh["tp"],
                                             sequence_parallel, seed, dtype, recompute)
        stages = make_schedule(schedule, mesh.degree("pp"), microbatches, chunks).virtual_stages
        counts = list(layers) if layers is not None else gpt_layer_counts(n_layers, stages)
        if zero_stage == 3:  # no storage until each stage's FSDP unit draws this rank's shard alone
            with nn.deferred():
                self.pipe: Pipeline = GatheringPipeline(mesh["pp"], layered, schedule, microbatches, chunks, counts)
        else:
            self.pipe = Pipeline(mesh["pp"], layered, schedule, microbatches, chunks, counts)
        self.module = _Stages(self.pipe)
        self.zero: ZeroDataParallel | None = None
        self.sharded: PipelineZero | None = None
        self.optimizer: AdamW | None = None
        if zero_stage in PIPELINE_ZERO_STAGES:
            self.sharded = PipelineZero(self.pipe, self.module, self.replicas, zero_stage, reshard_after_forward, lr,
                                        betas, eps, weight_decay)
        elif zero_stage == 1:
            self.zero = ZeroDataParallel(self.module, self.replicas, stage=1, lr=lr, betas=betas, eps=eps,
                                         weight_decay=weight_decay)
        else:
            adamw = MasterAdamW if bf16 else AdamW  # bf16: fp32 masters and moments
            self.optimizer = adamw(self.module.parameters(), lr, betas, eps, weight_decay)

    # ---- one step ---------------------------------------------------------------------------------
    def local_batch(self, idx: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This replica's rows of the global batch (``dp``) and this rank's positions (``sp``)."""
        idx, targets = np.asarray(idx), np.asarray(targets)
        dp, m = self.mesh.degree("dp"), self.microbatches
        problems = []
        if idx.ndim != 2 or targets.shape != idx.shape:
            problems.append(f"tokens and targets must both be (batch, seq), got {idx.shape} and {targets.shape}")
        elif idx.shape[0] % (dp * m):
            problems.append(f"a global batch of {idx.shape[0]} is not divisible by dp x m = {dp} x {m}; use a "
                            f"multiple of {dp * m}")
        elif idx.shape[1] > self.seq_len or (self.group is not None and idx.shape[1] != self.seq_len):
            problems.append(f"sequences of {idx.shape[1]} tokens; the model takes seq_len={self.seq_len}")
        elif self.sequence_parallel and idx.shape[1] % self.mesh.degree("tp"):
            problems.append(f"Megatron-SP splits the {idx.shape[1]} positions over tp={self.mesh.degree('tp')}")
        for what, a in (("token ids", idx), ("targets", targets)):  # each stage checks only what it reads
            try:
                check_tokens(a, self.vocab_size, what)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("hybrid: " + "; ".join(problems))
        rows = np.split(np.arange(idx.shape[0]), dp)[self.mesh.coords["dp"]]
        idx, targets = idx[rows], targets[rows]
        if self.group is not None:
            idx, targets = (self.group.layout.shard(a, self.group.comm.rank) for a in (idx, targets))
        return idx, targets

    def forward_backward(self, idx: np.ndarray, targets: np.ndarray) -> float:
        """Forward and backward of the global batch; gradients reduced as the module docstring says
        (ZeRO stage 1 reduce-scatters in ``optimizer_step``). Returns the global-batch mean loss."""
        x, y = self.local_batch(idx, targets)
        loss = self.pipe.step(x, y)
        with trace.span("sync", args={"iteration": self.pipe.iteration - 1}):
            if self.sequence_parallel:
                with self.sharded.shapes_only() if self.sharded is not None else nullcontext():
                    sync_sequence_parallel_grads(self.module, self.mesh["tp"])
            if self.sharded is not None:
                self.sharded.reduce()
            elif self.zero is None:
                average_grads(self.module.parameters(), self.replicas, self.reduce_dtype)
        self._sample()  # when the optimizer step begins
        return float(np.mean(self.replicas.allgather_object(loss)))  # control plane: not traffic

    def optimizer_step(self) -> None:
        if self.zero is not None or self.sharded is not None:
            (self.zero or self.sharded).step()
        else:
            with trace.span("opt", args={"iteration": self.pipe.iteration - 1}):
                self.optimizer.step()
            self._sample()  # ZeRO samples its own

    def _sample(self) -> None:
        if trace.current() is not None:
            for label, nbytes in self.state_bytes().items():
                trace.memory(label, nbytes)

    def step(self, idx: np.ndarray, targets: np.ndarray) -> float:
        loss = self.forward_backward(idx, targets)
        self.optimizer_step()
        return loss

    # ---- the whole model back, for tests and lessons (control plane, not traced) -------------------
    def full_state_dict(self) -> dict[str, np.ndarray]:
        """``nn.GPT``'s state dict assembled from every rank's slices, on every rank."""
        with self.sharded.whole() if self.sharded is not None else nullcontext():
            return self._assemble({n: p.data for n, p in self.pipe.named_parameters()})

    def full_grads(self) -> dict[str, np.ndarray]:
        """The last ``forward_backward``'s gradients, reduced (DDP only: ZeRO-1 reduces in its step)."""
        if self.zero_stage:
            raise ValueError(f"hybrid: with zero_stage={self.zero_stage} the gradients are reduce-scattered; "
                             "read them with zero_stage=0")
        return self._assemble({n: p.grad if p.grad is not None else np.zeros_like(p.data)
                               for n, p in self.pipe.named_parameters()})

    def _assemble(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        params = dict(self.pipe.named_parameters())
        first_replica = self.mesh.coords["dp"] == 0 and self.mesh.coords["sp"] == 0
        mine = [(n, np.array(a), params[n].full_shape, params[n].shard) for n, a in arrays.items()] \
            if first_replica else []
        out: dict[str, np.ndarray] = {}
        for part in self.mesh.comm.allgather_object(mine):
            for name, array, full_shape, shard in part:
                whole = out.setdefault(name, np.zeros(full_shape, dtype=array.dtype))
                whole[shard if shard is not None else ...] = array
        return out

    def holdings(self, batch: int) -> dict[str, Any]:
        """What this rank holds, in words: ``layers`` (its stages' layers), ``slices`` (its tensor slice,
        read from the parameters' declared ``shard``: heads, MLP columns, vocabulary rows or head
        columns), ``data`` (its replica's rows of a global ``batch`` and, under sequence parallelism,
        its contiguous positions) and ``params`` (numbers of parameters held)."""
        params = dict(self.pipe.named_parameters())
        layers = [n for s in sorted(self.pipe.stages) for n in self.pipe.stages[s].layer_names]

        def shard(suffix: str, axis: int) -> slice | None:
            name = next((n for n in params if n.endswith(suffix)), None)
            return None if name is None or params[name].shard is None else params[name].shard[axis]

        slices = []
        q, fc = shard("attn.q.weight", 1), shard("mlp.fc.weight", 1)
        if q is not None:
            slices.append(f"heads {q.start // self.head_dim}-{q.stop // self.head_dim - 1}")
        if fc is not None:
            slices.append(f"fc {fc.start}:{fc.stop}")
        for sl in (shard("tok_emb.weight", 0), shard("head.weight", 1)):
            if sl is not None:
                slices.append(f"vocab {sl.start}:{sl.stop}")
        coords, degree = self.mesh.coords, self.mesh.degree
        rows, positions = batch // degree("dp"), self.seq_len // degree("sp")
        data = f"rows {coords['dp'] * rows}:{(coords['dp'] + 1) * rows}"
        if degree("sp") > 1:
            data += f", positions {coords['sp'] * positions}:{(coords['sp'] + 1) * positions}"
        return {"layers": _layer_span(layers), "slices": ", ".join(slices) or "whole weights", "data": data,
                "params": sum(u.layout.numel for u in self.sharded.units.values()) if self.zero_stage == 3
                else sum(p.data.size for p in params.values())}  # ZeRO-3: its stages' parameters, of which it holds 1/N

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now: parameters, gradients, optimizer state
        (``minipar.cost.hybrid.model_state_bytes`` predicts them)."""
        if self.zero is not None or self.sharded is not None:
            return (self.zero or self.sharded).state_bytes()
        params = self.parameters()
        return {"parameters": sum(p.data.nbytes for p in params),
                "gradients": sum(p.grad.nbytes for p in params if p.grad is not None),
                "optimizer state": self.optimizer.state_bytes()}

    def parameters(self) -> list[Parameter]:
        return self.module.parameters()

    def trace_meta(self) -> dict[str, Any]:
        """Metadata for ``trace.record``: the mesh (axes and shape, for the viewer's per-axis traffic)
        and the pipeline's (schedule, actions, stage layers)."""
        return {**self.pipe.trace_meta(), "paradigm": "hybrid", "mesh": self.mesh.meta(),
                "sequence_parallel": self.sequence_parallel, "zero_stage": self.zero_stage,
                "reshard_after_forward": self.sharded.reshard_after_forward if self.sharded is not None else None,
                "sp_method": self.group.method if self.group is not None else None}


def _layer_span(names: list[str]) -> str:
    """``["embed", "blocks.0", "blocks.1"]`` -> ``"embed, blocks 0-1"``."""
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    parts = [n for n in names if not n.startswith("blocks.")]
    if blocks:
        parts.insert(1 if names[0] == "embed" else 0,
                     f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
    return ", ".join(parts)
