"""Step time, throughput and memory of a GPT on a cluster under a hybrid layout (dp x tp x pp x sp,
ZeRO, recomputation, micro-batches): every term a formula from a paper, derivations in
``docs/formulas.md`` section 8.

Symbols: ``B`` global batch, ``b`` micro-batch, ``s`` sequence, ``l`` layers, ``h`` hidden, ``a``
heads, ``f`` MLP width, ``V`` vocabulary, ``w`` bytes per number; ``t, p, d, u`` the tensor-,
pipeline-, data- and sequence-parallel degrees (``u``: Ulysses), ``v`` model chunks per pipeline
rank, ``m = B / (d b)`` micro-batches per step.

- FLOPs per step (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", Sec. 5.1 and Appendix, Eq. 3): a layer's forward costs ``24 B s h^2
  + 4 B s^2 h`` (``8 B s h^2 + 4 B s h f + 4 B s^2 h`` in general), the logits ``2 B s h V``;
  backward twice the forward. Without recomputation ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``;
  full recomputation runs each layer's forward again, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``;
  selective recomputation (Korthikanti et al. 2022, Sec. 5 and Appendix) only ``Q K^T`` and the
  attention over ``V``: ``72 B s l h^2 (1 + 2s/(9h) + V/(12 l h))``. ``tflops_per_gpu`` divides the
  FLOPs executed (recomputation included: the paper's accounting, Eq. 3 with full recomputation,
  used for its Table 1) by the step time; ``model_tflops_per_gpu`` the FLOPs without recomputation.
- Compute: the slowest pipeline stage (its ``l/p`` layers, plus the logits on the last stage, on the
  first in a V; uneven stages cut by ``stage_blocks``) per micro-batch, each matmul's FLOPs over
  ``t u`` at the cluster's ``peak_flops x efficiency`` times its shape's share (``gemm``: tile and wave
  quantization, or a measured curve; a larger micro-batch fills more of the last wave), times ``m``;
  plus the memory-bound work
  outside the matmuls (softmax, masks, GeLU, layer norms: ``memory_traffic_bytes``, 4 moves of
  every byte Korthikanti et al. count, 5 with full recomputation), a byte moved costing
  ``gamma / 3`` (reducing a byte reads two and writes one). That term makes small-``h`` models
  slower per FLOP (the ``5 a s / h`` scores), as Narayanan et al.'s Table 1 shows. Bubble: the 1F1B-family
  bubble fraction ``phi = (p-1)/(v m + p - 1)`` (``pipeline.bubble_fraction``; ZB-H1 ``(p-1)/(3m)``,
  ZB-V and DualPipeV ``(p-1)/(6m)`` of the busy time) of the step is idle, so ``bubble = busy phi /
  (1 - phi) = busy (p-1)/(v m)``.
- Communication, exposed seconds per mesh axis (``collectives.collective_time``, ring algorithms):
  ``tp``: per layer and micro-batch ``tensor.collectives_per_block`` (2 all-reduces of ``s b h w``
  forward and 2 backward; with Megatron-SP 2 all-gathers and 2 reduce-scatters each way, the same
  volume: Korthikanti et al. 2022, Sec. 4.2.2; the 2 backward re-gathers of the column-parallel
  inputs ``collectives_per_block`` also lists are overlapped with the input-gradient GEMM in
  Megatron-LM, so off the critical path), the forward's again under full recomputation; on the
  critical path (Shoeybi et al. 2019, Sec. 3). ``sp``: Ulysses'
  4 all-to-alls of the ``(b, s/u, h/t)`` shard forward and 4 backward per layer (Jacobs et al. 2023,
  Sec. 3.2), on the critical path. ``pp``: one activation of ``s b h w / t`` per boundary (Narayanan
  et al. 2021, Sec. 4.1, scatter/gather), forward and gradient back: Megatron's blocking p2p puts
  one transfer each way on the critical path per slot of the schedule, ``2 (v m + p - 1)``
  transfers. ``dp``: the gradient all-reduce of this GPU's parameters after the pipeline flush,
  not overlapped (Narayanan et al. 2021, Sec. 3: the all-reduce runs at the end of the batch);
  ZeRO-2 reduce-scatters every micro-batch and ZeRO-3 also all-gathers the parameters twice per
  micro-batch (Rajbhandari et al. 2020, Sec. 7.2); the planner pairs them with ``pp = 1`` only.
  ``overlap_grad_reduce`` (Megatron-LM's ``--overlap-grad-reduce``, PyTorch DDP's buckets): the
  reduction runs behind the last micro-batch's backward on the slowest stage, exposed ``max(0,
  collective - backward)``; ZeRO-1's reduce-scatter so, its all-gather after; ZeRO-2 each
  micro-batch's reduce-scatter behind its backward; ZeRO-3 the forward's gather behind the forward.
- Memory per GPU: model states of the largest pipeline stage's parameters over ``t``, per ZeRO
  stage (Rajbhandari et al. 2020, Sec. 3.1 and 5: ``w + w + K`` bytes per parameter, K = 12 with
  mixed-precision Adam, ``2 w`` (Adam's m and v) otherwise); activations per layer by Korthikanti
  et al. 2022 (Sec. 4, Eq. 1-4, Sec. 5): ``s b h (34 + 5 a s / h)``, with ``t``: ``s b h (10 + 24/t
  + 5 a s/(h t))``, with ``t`` and SP: ``s b h (34/t + 5 a s / (h t))``; selective recomputation
  drops the ``5 a s / h`` term, full keeps ``2 s b h`` (``/t`` with SP) and one layer's whole working
  set while its backward runs; times the layers of the micro-batches the first stage holds
  (``pipeline.peak_stash``: ``p`` for 1F1B, ``l`` layers in all; interleaved ``1 + (p-1)/(p v)``
  times that, Sec. 4.2.3), over ``u`` (Ulysses splits the sequence). The terms are
  ``tensor.layer_terms(..., dropout=True)`` with ``w`` bytes a number and 1-byte masks.

- Overheads (``overhead.py``; 0 on the published GPU clusters): each autograd op of a stage costs
  ``op_seconds`` (tensor parallelism does not divide it), each of its collective calls
  ``call_seconds`` and each of their message steps ``message_seconds`` of CPU, all part of the
  stage's work (the bubble stretches them); the transfers between stages and the gradient sync pay
  ``call_seconds`` and ``message_seconds`` per step beside ``alpha``;
  after the flush and the sync the slowest rank's optimizer step costs its tensors'
  ``tensor_seconds`` and its bytes' ``optimizer_gamma``.

The mesh is ``(pp, dp, sp, tp)`` with tp innermost (``minipar.mesh``; Megatron-LM's order): a tp
group spans ``t`` consecutive ranks, sp ``t u``, dp ``t u d``; neighbouring pipeline stages sit
``t u d`` ranks apart, and as the stages move in lockstep the slowest boundary (across nodes once
the world spans several) sets the pace. ``group_link``: NVLink when the world fits in one node or
every such group does, the network otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipar.checks import one_of, whole
from minipar.cost import gemm
from minipar.cost.cluster import Cluster, Link
from minipar.cost.collectives import collective_time
from minipar.cost.layout import UNEVEN, V_SHAPED, Layout, ModelSpec, check_specs
from minipar.cost.overhead import optimizer_seconds, parameter_tensors, stage_collectives, stage_ops
from minipar.cost.pipeline import bubble_fraction, peak_stash
from minipar.cost.stages import uneven_stage_blocks
from minipar.cost.tensor import collectives_per_block, layer_terms, recompute_working_bytes
from minipar.cost.zero import zero_model_states

OVERLAPPED_REGATHERS = 2  # Megatron-SP's backward all-gathers hidden behind the input-gradient GEMM
GiB = 2**30


@dataclass
class Prediction:
    """What ``predict`` returns: seconds, throughput, bytes per GPU (``memory``), and ``explain()``."""

    step_seconds: float
    compute_seconds: float
    bubble_seconds: float
    comm_seconds: dict[str, float]
    tflops_per_gpu: float
    memory: dict[str, float]
    fits: bool
    model_tflops_per_gpu: float = 0.0
    memory_bound_seconds: float = 0.0  # the part of compute_seconds outside the matmuls
    overhead_seconds: float = 0.0  # the part of compute_seconds that is CPU overhead (per op, per message)
    optimizer_seconds: float = 0.0  # the slowest rank's optimizer step, after the gradient sync
    memory_limit: float = 0.0
    layout: Layout | None = field(default=None, repr=False)
    model: ModelSpec | None = field(default=None, repr=False)

    def explain(self) -> str:
        """One paragraph: where the step's time goes and what fills the memory."""
        parts = {"compute": self.compute_seconds, "bubble": self.bubble_seconds,
                 **{f"{k} communication": v for k, v in self.comm_seconds.items()},
                 "optimizer": self.optimizer_seconds}
        shown = ", ".join(f"{k} {v:.3g} s ({v / self.step_seconds:.0%})" for k, v in parts.items() if v > 0)
        if self.memory_bound_seconds > 0:
            shown += f"; of the compute, {self.memory_bound_seconds:.3g} s is memory-bound (softmax, masks, GeLU)"
        if self.overhead_seconds > 0:
            shown += f"; of the compute, {self.overhead_seconds:.3g} s is CPU overhead (per op, per message)"
        top = max(parts, key=parts.get)
        mem = {k: v for k, v in self.memory.items() if k != "total"}
        big = max(mem, key=mem.get)
        short = (self.memory["total"] - self.memory_limit) / GiB
        fit = "fits" if self.fits else f"does NOT fit (short by {short:.1f} GiB)"
        return (f"Step {self.step_seconds:.3g} s at {self.tflops_per_gpu:.0f} TFLOP/s per GPU: {shown}; {top} "
                f"dominates. Memory {self.memory['total'] / GiB:.1f} GiB per GPU of {self.memory_limit / GiB:.1f}, "
                f"{fit}; {big} is the largest part ({mem[big] / GiB:.1f} GiB, "
                + ", ".join(f"{k} {v / GiB:.1f}" for k, v in mem.items()) + " GiB).")


def stage_blocks(model: ModelSpec, layout: Layout) -> list[int]:
    """Blocks on each pipeline rank (all its chunks): ``l/p`` each when ``p`` divides ``l`` (or
    ``ceil(l/p)`` with interleaving, which ``Layout.check`` refuses anyway); otherwise (``v = 1``)
    the contiguous stages ``stages.partition_layers`` cuts from ``stages.layer_costs``, where the
    embedding and the head are entries of their own (the first and last stage's, not blocks)."""
    check_specs("stage_blocks", model=model, layout=layout)
    p, n = layout.pp, model.layers
    if n % p == 0 or layout.chunks > 1 or p > n:
        return [-(-n // p)] * p
    return list(uneven_stage_blocks(model, p, layout.recompute))


def _stage_parameters(model: ModelSpec, layout: Layout) -> list[int]:
    """Parameters of each pipeline stage: its blocks plus the embeddings (first stage) and the final
    layer norm with the head (last stage); everything when ``pp = 1``. Megatron's even split is
    counted as every stage holding ``l/p`` blocks and the larger of the two ends."""
    if layout.pp == 1:
        return [model.parameters]
    h, blocks = model.hidden, stage_blocks(model, layout)
    first, last = model.vocab * h + model.seq * h, 2 * h + h * model.vocab
    if model.layers % layout.pp == 0 or layout.chunks > 1:  # a V's rank 0 holds the first and last stages
        ends = first + last if layout.schedule in V_SHAPED else max(first, last)
        return [blocks[0] * model.block_parameters + ends]
    ends = [first] + [0] * (layout.pp - 2) + [last]
    return [n * model.block_parameters + e for n, e in zip(blocks, ends)]


def _head_rank(layout: Layout) -> int:
    """The pipeline rank holding the head: the last, or the first in a V (stage 2p - 1 on rank 0)."""
    return 0 if layout.schedule in V_SHAPED else layout.pp - 1


def _optimizer_bytes(w: int) -> int:
    """K: mixed-precision Adam's fp32 master, m and v (12) for 16-bit models; Adam's m and v in the
    model's precision otherwise (minipar's float64 AdamW: 16)."""
    return 12 if w == 2 else 2 * w


def _layer_terms(model: ModelSpec, layout: Layout, recompute: str) -> float:
    """``tensor.layer_terms`` of a Megatron GPT (dropout's masks included) for this layout, summed,
    over ``u`` (Ulysses splits the sequence, and the attention core by heads)."""
    terms = layer_terms(layout.tp, layout.micro_batch, model.seq, model.hidden, model.heads, model.ffn,
                        model.bytes_per_number, layout.sequence_parallel, recompute, dropout=True)
    return sum(terms.values()) / layout.sp


def activation_bytes_per_layer(model: ModelSpec, layout: Layout) -> float:
    """Bytes one layer keeps for one micro-batch: ``tensor.layer_terms`` with dropout (Korthikanti
    et al. 2022, Sec. 4.1-4.2, Sec. 5, generalised to MLP width ``f`` and ``w`` bytes per number;
    masks 1 byte): outside the tensor-parallel regions ``10 s b h`` for ``w = 2`` (two layer-norm
    inputs, the q k v and fc inputs, two dropout masks), inside ``8 s b h + 4 s b f + 5 a s^2 b``,
    the latter over ``t``; with SP all over ``t``; Ulysses over ``u``. Selective recomputation drops
    the ``5 a s^2 b``, full keeps the block's input (``recompute_working_bytes`` more, one layer at a
    time: ``memory_bytes``)."""
    check_specs("activation_bytes_per_layer", model=model, layout=layout)
    return _layer_terms(model, layout, layout.recompute)


def memory_traffic_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes one layer moves through GPU memory outside its matmuls for one micro-batch (softmax,
    masks, dropout, GeLU, layer norms, residual adds: memory-bound, Ivanov et al. 2021, "Data
    Movement Is All You Need"). Each byte Korthikanti et al. count (without recomputation) is a
    tensor written in the forward and read in the backward, and its gradient, as large, written
    and read in the backward: 4 moves; recomputation writes again what it recomputes (everything
    with full, the ``5 a s^2 b`` scores with selective): one more move of those."""
    check_specs("memory_traffic_bytes", model=model, layout=layout)
    kept = _layer_terms(model, layout, "none")
    again = {"none": 0.0, "selective": kept - _layer_terms(model, layout, "selective"), "full": kept}
    return 4 * kept + again[layout.recompute]


def _working_bytes(model: ModelSpec, layout: Layout) -> float:
    """What full recomputation holds on top of the kept inputs while one layer's backward runs: that
    layer's whole working set for one micro-batch (``tensor.recompute_working_bytes`` with dropout's
    masks, over ``u``); 0 for the other modes."""
    if layout.recompute != "full":
        return 0.0
    return recompute_working_bytes(layout.tp, layout.micro_batch, model.seq, model.hidden, model.heads, model.ffn,
                                   model.bytes_per_number, layout.sequence_parallel, dropout=True) / layout.sp


def memory_bytes(model: ModelSpec, layout: Layout) -> dict[str, float]:
    """Bytes per GPU on the heaviest stage: parameters, gradients, optimizer state (ZeRO stage),
    activations (the stage's in-flight micro-batches of its blocks: the first stage's under an even
    split; every stage's own under ``stage_blocks``' uneven one), total."""
    check_specs("memory_bytes", model=model, layout=layout)
    w, k, d, z = model.bytes_per_number, _optimizer_bytes(model.bytes_per_number), layout.dp * layout.sp, layout.zero
    p, v, m = layout.pp, layout.chunks, layout.microbatches
    per_layer = activation_bytes_per_layer(model, layout)
    working = _working_bytes(model, layout)
    stages = _stage_parameters(model, layout)
    blocks = stage_blocks(model, layout) if len(stages) == p else [-(-model.layers // p)]
    best: dict[str, float] = {}
    for rank, (params, n) in enumerate(zip(stages, blocks)):
        psi = params / layout.tp  # ZeRO shards over dp x sp
        states = {"parameters": w * psi / (d if z >= 3 else 1), "gradients": w * psi / (d if z >= 2 else 1),
                  "optimizer": k * psi / (d if z >= 1 else 1)}
        assert abs(sum(states.values()) - zero_model_states(psi, z, d, k, w, w)) <= 1e-6 * sum(states.values())
        out = {**states, "activations": peak_stash(layout.kind, p, m, rank, v) * n / v * per_layer + working}
        out["total"] = sum(out.values())
        if out["total"] > best.get("total", -1.0):
            best = out
    return best


def _all_to_all_time(nbytes: float, p: int, link: Link) -> float:
    """Pairwise all-to-all of an ``nbytes`` buffer on ``p`` ranks: ``p - 1`` steps, ``(p-1)/p n``
    bytes out (Thakur et al. 2005, Sec. 4)."""
    return 0.0 if p == 1 else (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta


def group_link(cluster: Cluster, span: int, world: int) -> Link:
    """The link of a group covering ``span`` consecutive ranks, groups tiling a world of ``world``
    ranks from rank 0: inside a node when the whole world fits in one, or when every such group
    does (``span`` divides ``gpus_per_node``); the network otherwise."""
    check_specs("group_link", cluster=cluster)
    whole("group_link", "span", span)
    whole("group_link", "world", world)
    g = cluster.gpus_per_node
    return cluster.intra if world <= g or (span <= g and g % span == 0) else cluster.inter


def comm_seconds(model: ModelSpec, layout: Layout, cluster: Cluster,
                 hidden: tuple[float, float] = (0.0, 0.0)) -> dict[str, float]:
    """Exposed communication seconds per step on each mesh axis (module docstring); each transfer
    between stages and each gradient-sync collective also costs ``call_seconds`` and each of their
    steps ``message_seconds`` of CPU (the stages' own collectives' is their work's:
    ``overhead.stage_collectives``). ``hidden``: the forward and backward seconds of one
    micro-batch on the slowest stage, behind which ``layout.overlap_grad_reduce`` runs the
    data-parallel collectives (``exposed = max(0, collective - compute)``)."""
    check_specs("comm_seconds", model=model, layout=layout, cluster=cluster)
    under_f, under_b = hidden if layout.overlap_grad_reduce else (0.0, 0.0)
    t, u, d, p, v, m = layout.tp, layout.sp, layout.dp, layout.pp, layout.chunks, layout.microbatches
    w, b, h, world = model.bytes_per_number, layout.micro_batch, model.hidden, layout.world
    layers_here = max(stage_blocks(model, layout))  # on the pipeline rank with the most blocks (all its chunks)
    act = model.seq // u * b * h * w  # one residual-stream activation on this rank's sequence shard
    o, call = cluster.message_seconds, cluster.call_seconds  # CPU of the transfers and the sync (overhead.py)
    out = {"tp": 0.0, "sp": 0.0, "pp": 0.0, "dp": 0.0}
    if t > 1:
        link, calls = group_link(cluster, t, world), collectives_per_block(layout.sequence_parallel)
        back = dict(calls["backward"])
        if layout.sequence_parallel:  # the 2 re-gathers overlap the input-gradient GEMM (Megatron-LM)
            back["allgather"] -= OVERLAPPED_REGATHERS
        forward = sum(n * collective_time(op, "ring", act, t, link.alpha, link.beta, cluster.gamma)
                      for op, n in calls["forward"].items())
        backward = sum(n * collective_time(op, "ring", act, t, link.alpha, link.beta, cluster.gamma)
                       for op, n in back.items())
        per_layer = forward * (2 if layout.recompute == "full" else 1) + backward
        out["tp"] = m * layers_here * per_layer
    if u > 1:
        shard = act / t  # q, k, v and the output on this rank's heads
        passes = 3 if layout.recompute == "full" else 2
        out["sp"] = m * layers_here * passes * 4 * _all_to_all_time(shard, u, group_link(cluster, t * u, world))
    if p > 1:
        link = group_link(cluster, world, world)  # stages move in lockstep: the slowest boundary sets the pace
        out["pp"] = 2 * (v * m + p - 1) * (link.alpha + call + o + act / t * link.beta)
    if d * u > 1:
        grads = w * max(_stage_parameters(model, layout)) / t
        n, link = d * u, group_link(cluster, t * u * d, world)
        ar, rs, ag = (collective_time(op, "ring", grads, n, link.alpha + o, link.beta, cluster.gamma) + call
                      for op in ("allreduce", "reduce_scatter", "allgather"))
        # overlapped (Megatron-LM's --overlap-grad-reduce, FSDP's prefetch): the all-reduce (ZeRO-1: its
        # reduce-scatter) behind the last micro-batch's backward; ZeRO-2 each micro-batch's reduce-scatter
        # behind its backward; ZeRO-3 the forward's gather behind the forward, the backward's and the
        # reduce-scatter behind the backward
        zero1 = _exposed(rs, under_b) + ag if layout.overlap_grad_reduce else ar
        out["dp"] = {0: _exposed(ar, under_b), 1: zero1, 2: m * _exposed(rs, under_b) + ag,
                     3: m * (_exposed(ag, under_f) + _exposed(ag + rs, under_b))}[layout.zero]
    return out


def _exposed(collective: float, compute: float) -> float:
    return max(0.0, collective - compute)


def optimizer_step_seconds(model: ModelSpec, layout: Layout, cluster: Cluster) -> float:
    """The slowest rank's optimizer step (``overhead.optimizer_seconds``): its stage's parameter tensors
    and ``w + w + K`` bytes per parameter of its shard (over ``t``, and ``d u`` with ZeRO, which
    updates one flat shard)."""
    check_specs("optimizer_step_seconds", model=model, layout=layout, cluster=cluster)
    blocks, h, w = stage_blocks(model, layout), model.hidden, model.bytes_per_number
    first, last = model.vocab * h + model.seq * h, 2 * h + h * model.vocab
    shard = layout.tp * (layout.dp * layout.sp if layout.zero else 1)
    slowest = 0.0
    for i, n in enumerate(blocks):
        params = n * model.block_parameters + (first if i == 0 else 0) + (last if i == _head_rank(layout) else 0)
        tensors = 1 if layout.zero else parameter_tensors(n, i == 0, i == _head_rank(layout))
        nbytes = (2 * w + _optimizer_bytes(w)) * params / shard
        slowest = max(slowest, optimizer_seconds(tensors, nbytes, cluster))
    return slowest


def predict(model: ModelSpec, layout: Layout, cluster: Cluster, uneven_stages: bool = False) -> Prediction:
    """Step time, TFLOP/s per GPU and memory per GPU of ``model`` under ``layout`` on ``cluster``
    (module docstring); ``ValueError`` listing every problem ``layout.check`` finds.

    ``uneven_stages=True`` (``chunks = 1`` only) accepts layers not divisible by ``pp`` (Megatron-LM
    of 2021 refuses them): ``stage_blocks`` cuts the stages (Alpa's DP over the FLOPs of the
    embedding, each block and the head) and the pipeline runs at the pace of the slowest; memory
    counts each stage's own blocks and in-flight micro-batches, tp and sp communication the stage
    with the most blocks."""
    check_specs("predict", model=model, layout=layout, cluster=cluster)
    one_of("predict", "uneven_stages", uneven_stages, (False, True))
    problems = layout.check(model)
    if uneven_stages and layout.chunks == 1:
        problems = [q for q in problems if not q.startswith(UNEVEN)]
    if problems:
        raise ValueError(f"predict: layout {layout} cannot run {model.name or 'the model'}: " + "; ".join(problems))
    u, p, v, m = layout.sp, layout.pp, layout.chunks, layout.microbatches
    tokens = layout.micro_batch * model.seq
    block = model.layer_flops(tokens) * (4 if layout.recompute == "full" else 3)
    if layout.recompute == "selective":
        block += 4.0 * tokens * model.seq * model.hidden
    # a byte moved costs gamma / 3: reducing a byte (gamma) reads two and writes one
    bound = memory_traffic_bytes(model, layout) * cluster.gamma / 3
    # each matmul at peak x efficiency x its shape's share (cost.gemm: tile and wave quantization)
    layer = gemm.block_seconds(model, layout, cluster) + bound
    head = sum(gemm.training_seconds(cluster, gemm.head_gemm(model, layout)))
    # Megatron's even split (or uneven_stages' cut), the logits on the last stage: the slowest stage
    # paces the pipeline; its autograd ops and message steps cost CPU on top (overhead.py)
    blocks = stage_blocks(model, layout)
    ops = stage_ops(blocks, u > 1, layout.recompute)
    cpu = [k * cluster.op_seconds + calls * cluster.call_seconds + steps * cluster.message_seconds
           for k, (calls, steps) in zip(ops, stage_collectives(blocks, layout))]
    times = [n * layer + c + (head if i == _head_rank(layout) else 0.0) for i, (n, c) in enumerate(zip(blocks, cpu))]
    slow = times.index(max(times))
    compute = m * times[slow]
    phi = bubble_fraction(layout.kind, p, m, v)
    bubble = compute * phi / (1 - phi)
    fwd = times[slow] * model.layer_flops(tokens) / block  # the first forward's share of a micro-batch's work
    comm = comm_seconds(model, layout, cluster, (fwd, times[slow] - fwd))
    optimizer = optimizer_step_seconds(model, layout, cluster)
    step = compute + bubble + sum(comm.values()) + optimizer
    world = layout.world
    executed = model.step_flops(layout.global_batch, layout.recompute)
    useful = model.step_flops(layout.global_batch, "none")
    memory = memory_bytes(model, layout)
    return Prediction(step_seconds=step, compute_seconds=compute, bubble_seconds=bubble, comm_seconds=comm,
                      tflops_per_gpu=executed / step / world / 1e12, memory=memory,
                      fits=memory["total"] <= cluster.memory_bytes,
                      model_tflops_per_gpu=useful / step / world / 1e12, memory_limit=cluster.memory_bytes,
                      memory_bound_seconds=m * blocks[slow] * bound,
                      overhead_seconds=m * cpu[slow], optimizer_seconds=optimizer,
                      layout=layout, model=model)
