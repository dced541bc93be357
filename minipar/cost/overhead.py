"""What a training step costs a CPU beyond its FLOPs and bytes (``perf.predict`` adds it; every term
is 0 on the published GPU clusters, where kernels run on the device and these costs hide behind
them). Derivation in ``docs/formulas.md`` section 8, "Overheads on a CPU".

- **Per operation.** Each autograd op (a node of the graph: its forward, and its backward) costs
  ``Cluster.op_seconds`` whatever its size: Python, the autograd's bookkeeping, numpy's per-call
  cost. Tensor parallelism does not divide it: each rank runs every op of its layers on its shards.
  The counts are minipar's hybrid GPT's (``minipar.parallel.hybrid``, the program ``perf`` is held
  against in lesson 8 and the one ``minipar calibrate`` times), nodes per micro-batch:

  ========================  =====================================================================
  block, tensor-parallel    15: ln1; q, k, v as one column-parallel matmul; its split into 3 and
                            their 3 transposes; attention; the transpose back; proj (row-parallel,
                            adding the residual); ln2; fc; GeLU; proj
  block, sequence-parallel  16: ln1; q, k, v (each with its all-to-all); attention; the output's
                            all-to-all; proj and its bias; the residual; ln2; fc and bias; GeLU;
                            proj and bias; the residual
  embedding (first stage)   4 tensor-parallel (lookup, mask, ``g``, the positions added),
                            3 otherwise (two lookups, sum)
  head and loss (last)      4: ln_f, head, cross-entropy, the loss over the micro-batches
  ========================  =====================================================================

  Full recomputation runs every block's forward again (counted as half an op each, a forward being
  about half of an op's cost), selective recomputation the attention's.
- **Per message.** Every collective call and point-to-point transfer costs the rank
  ``Cluster.call_seconds`` of CPU and each of its message steps ``message_seconds``, beside the
  link's ``alpha``: entering the call beyond what it costs on one rank, resuming after its first
  wait, when whatever ran while the rank slept has refilled its caches, and per step posting,
  completing and recording a message (LogP's overhead ``o`` beside the latency, Culler et al.
  1993). Inside a stage's work, per micro-batch (``stage_collectives``): a block's collectives
  (``tensor.collectives_per_block``, forwards again under full recomputation; a ring all-reduce is
  ``2 (t-1)`` steps, an all-gather or reduce-scatter ``t-1``), Ulysses' 8 all-to-alls of ``u-1``
  steps (12 with full recomputation); the first stage adds the embedding's all-reduce, the last the
  head's and the vocabulary-parallel loss's 3. Being the stage's own CPU work, it is stretched by
  the bubble like the compute. The transfers between stages and the gradient sync, outside the
  stages' work, pay it beside ``alpha`` (``perf.comm_seconds``). Where ``alpha`` was fitted to
  wall-clock exchanges it already holds all this (``minipar calibrate`` writes 0); a replay charges
  this CPU as compute and ``alpha`` beside it.
- **Optimizer.** After the last backward each rank updates its parameter tensors: ``tensor_seconds``
  each (AdamW's dozen numpy calls) plus ``optimizer_gamma`` per byte of parameters, gradients and
  optimizer state it streams: ``(w + w + K)`` bytes per parameter of its shard (``K``: Adam's state,
  ``perf._optimizer_bytes``). With ZeRO the optimizer updates one flat shard (one tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

from minipar.checks import counts, number, one_of, whole
from minipar.cost.cluster import Cluster
from minipar.cost.layout import RECOMPUTE, Layout, check_specs
from minipar.cost.tensor import collectives_per_block

BLOCK_OPS = {"tensor": 15, "sequence": 16}  # autograd nodes of one block per micro-batch
EMBEDDING_OPS = {"tensor": 4, "sequence": 3}
HEAD_OPS = 4  # ln_f, head, cross-entropy, loss / m
BLOCK_TENSORS = 16  # parameter tensors of a block: 2 layer norms, q, k, v, proj, fc, proj (weight, bias each)
EMBEDDING_TENSORS, HEAD_TENSORS = 2, 3  # token and position tables; ln_f's weight and bias, the head
EMBEDDING_ALLREDUCES, HEAD_ALLREDUCES = 1, 4  # tensor-parallel: the embedding's g; the head's f and the loss's 3


def block_ops(sequence_parallel: bool, recompute: str = "none") -> float:
    """Ops one block runs per micro-batch (table in the module docstring), recomputed forwards
    included (full: the block's forward again, selective: the attention's, each counted half)."""
    one_of("block_ops", "sequence_parallel", sequence_parallel, (False, True))
    one_of("block_ops", "recompute", recompute, RECOMPUTE)
    path = "sequence" if sequence_parallel else "tensor"
    again = {"none": 0.0, "selective": 0.5, "full": 0.5 * BLOCK_OPS[path]}[recompute]
    return BLOCK_OPS[path] + again


def stage_ops(blocks: Sequence[int], sequence_parallel: bool, recompute: str = "none") -> list[float]:
    """Ops per micro-batch on each pipeline stage holding ``blocks[i]`` blocks: its blocks', the
    embedding's on the first stage, the head's and the loss's on the last (one stage: both)."""
    if not counts("stage_ops", "blocks", blocks):
        raise ValueError("stage_ops: blocks=[] must give the blocks of at least one stage")
    path = "sequence" if sequence_parallel else "tensor"
    out = [n * block_ops(sequence_parallel, recompute) for n in blocks]
    out[0] += EMBEDDING_OPS[path]
    out[-1] += HEAD_OPS
    return out


def block_collectives(layout: Layout) -> tuple[float, float]:
    """``(calls, message steps)`` of one block's tensor- or sequence-parallel collectives per
    micro-batch (module docstring)."""
    check_specs("block_collectives", layout=layout)
    t, u, again = layout.tp, layout.sp, 2 if layout.recompute == "full" else 1
    calls = steps = 0.0
    if t > 1:
        per_call = {"allreduce": 2 * (t - 1), "allgather": t - 1, "reduce_scatter": t - 1}
        block = collectives_per_block(layout.sequence_parallel)
        for phase, times in (("forward", again), ("backward", 1)):
            calls += times * sum(block[phase].values())
            steps += times * sum(n * per_call[op] for op, n in block[phase].items())
    if u > 1:
        calls += (again + 1) * 4
        steps += (again + 1) * 4 * (u - 1)
    return calls, steps


def stage_collectives(blocks: Sequence[int], layout: Layout) -> list[tuple[float, float]]:
    """``(calls, message steps)`` per micro-batch inside each pipeline stage's work: its blocks', the
    embedding's all-reduce on the first stage, the head's and the loss's on the last (tensor
    parallelism)."""
    if not counts("stage_collectives", "blocks", blocks):
        raise ValueError("stage_collectives: blocks=[] must give the blocks of at least one stage")
    calls, steps = block_collectives(layout)
    out = [[n * calls, n * steps] for n in blocks]
    if layout.tp > 1:
        for i, k in ((0, EMBEDDING_ALLREDUCES), (-1, HEAD_ALLREDUCES)):
            out[i][0] += k
            out[i][1] += k * 2 * (layout.tp - 1)
    return [(c, s) for c, s in out]


def parameter_tensors(blocks: int, first: bool, last: bool) -> int:
    """Parameter tensors of a stage with ``blocks`` blocks (the embeddings' on the first stage, ln_f's
    and the head's on the last); a tensor-parallel rank holds a slice of each, as many tensors."""
    whole("parameter_tensors", "blocks", blocks, least=0)
    return blocks * BLOCK_TENSORS + (EMBEDDING_TENSORS if first else 0) + (HEAD_TENSORS if last else 0)


def optimizer_seconds(tensors: int, nbytes: float, cluster: Cluster) -> float:
    """One optimizer step over ``tensors`` parameter tensors streaming ``nbytes`` bytes (module
    docstring): ``tensors x tensor_seconds + nbytes x optimizer_gamma``."""
    whole("optimizer_seconds", "tensors", tensors, least=0)
    number("optimizer_seconds", "nbytes", nbytes)
    check_specs("optimizer_seconds", cluster=cluster)
    return tensors * cluster.tensor_seconds + nbytes * cluster.optimizer_gamma
