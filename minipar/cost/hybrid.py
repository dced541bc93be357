"""What one step of the tiny GPT on a ``pp x dp x sp x tp`` mesh should send on each axis, and what
each rank should hold: the per-paradigm formulas composed, rank by rank (``docs/formulas.md``,
section 8, "The tiny hybrid step, exactly"). Exact for minipar's ``HybridGPT`` (ring collectives,
float64); the large-scale model with the same terms is ``minipar.cost.perf``.

A rank at coordinates ``(pp_i, dp_i, sp_i, tp_i)`` owns the virtual stages ``s`` with
``s mod pp = pp_i`` (``pipeline.stage_owner``); ``b = B / (dp m)`` sequences per micro-batch, ``A =
S b d e`` one micro-batch's residual stream (``e = 8`` bytes). Per step it sends:

- ``tp`` (Shoeybi et al. 2019; Korthikanti et al. 2022), per micro-batch and stage: each block 2
  all-reduces of ``A`` forward and 2 backward, the embedding's ``g`` forward, the head input's ``f``
  backward, the loss's 3 all-reduces of ``S b`` numbers; with Megatron-SP each block 6 all-gathers
  and 4 reduce-scatters of ``A`` (``tensor.collectives_per_block``), the embedding a reduce-scatter
  and its backward all-gather, the head input an all-gather, its re-gather and its gradient's
  reduce-scatter; then once per step one all-reduce of the replicated parameters' gradients
  (``6 d`` per block, ``2 d`` for ln_f, ``S d`` for the position embedding).
- ``sp`` (Ulysses / Ring Attention / USP): ``sequence.attention_bytes`` forward and backward per
  block and micro-batch, on the ``(b, S/P, d)`` shard.
- ``pp``: ``pipeline.send_bytes`` with one micro-batch's stage output, ``A`` (``A/t`` under
  Megatron-SP, ``A/sp`` under sequence parallelism), then the loss broadcast from the last stage's
  rank: a binomial tree of ``1 + m`` numbers (``collectives.tree_broadcast_bytes``).
- the replicas (``dp x sp``): DDP's one ring all-reduce of the rank's gradients (``collectives.
  allreduce_bytes``), or ZeRO-1's (ZeRO-2's) reduce-scatter and all-gather of the padded buckets
  (``zero.zero_traffic_bytes``), or ZeRO-3's gathers (``zero3_gathers``) and one reduce-scatter per
  virtual stage. A ring sends to its successor only, so these bytes go on the axis
  in which the rank and its successor in the group differ (``dp``, ``sp`` or ``dp+sp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.checks import index, one_of, whole, wholes
from minipar.cost import sequence, zero
from minipar.cost.collectives import allreduce_bytes, ring_bytes, tree_broadcast_bytes
from minipar.cost.pipeline import SCHEDULES, peak_stash, send_bytes, stage_owner
from minipar.cost.tensor import collectives_per_block, layer_terms

V_SHAPED = ("zb-v", "dualpipev")  # schedules placing 2p stages in a V (pipeline.stage_owner)


@dataclass(frozen=True)
class TinyLayout:
    """A ``HybridGPT`` configuration: the model, the mesh degrees and the step's batch."""

    vocab: int
    seq: int
    d: int
    heads: int
    layers: int
    d_ff: int
    batch: int  # the global batch B
    pp: int = 1
    dp: int = 1
    sp: int = 1
    tp: int = 1
    microbatches: int = 1
    chunks: int = 1  # v: virtual stages per rank (interleaved; ZB-V: 2)
    schedule: str = "1f1b"  # the placement of virtual stages: ZB-V's V, else interleaved
    sequence_parallel: bool = False
    sp_method: str = "ulysses"
    ulysses: int | None = None
    zero_stage: int = 0
    reshard_after_forward: bool = True  # ZeRO-3's (``parallel.hybrid.zero_pp``)
    stage_layers: tuple[int, ...] | None = None  # layers (embed, blocks, head) per virtual stage
    itemsize: int = 8

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    @property
    def micro_batch(self) -> int:
        return self.batch // (self.dp * self.microbatches)

    def stage_counts(self) -> list[int]:
        """Layers per virtual stage: given, or the blocks spread evenly with the embedding on the first
        stage and the head on the last (``pipeline.partition.gpt_layer_counts``'s rule, restated)."""
        if self.stage_layers is not None:
            return list(self.stage_layers)
        n = self.pp * self.chunks
        base, extra = divmod(self.layers, n)
        return [base + (s < extra) + (s == 0) + (s == n - 1) for s in range(n)]

    def stages_of(self, pp_rank: int) -> list[tuple[bool, int, bool]]:
        """This pipeline rank's stages as (has the embedding, blocks, has the head)."""
        index("TinyLayout.stages_of", "pp_rank", pp_rank, self.pp, "pipeline ranks")
        counts, owner, out, start = self.stage_counts(), self.owner(), [], 0
        last = self.layers + 1
        for s, c in enumerate(counts):
            layers = range(start, start + c)
            start += c
            if owner[s] == pp_rank:
                embed, head = 0 in layers, last in layers
                out.append((embed, c - embed - head, head))
        return out

    def owner(self) -> list[int]:
        """The pipeline rank of each virtual stage (``pipeline.stage_owner``)."""
        return stage_owner(self.pp, self.chunks, self.schedule if self.schedule in V_SHAPED else "interleaved")

    def coords(self, rank: int) -> dict[str, int]:
        """The (pp, dp, sp, tp) coordinates of ``rank`` on the mesh (pp outermost, tp innermost)."""
        index("TinyLayout.coords", "rank", rank, self.world, "ranks of the mesh")
        pp_i, rest = divmod(rank, self.dp * self.sp * self.tp)
        dp_i, rest = divmod(rest, self.sp * self.tp)
        sp_i, tp_i = divmod(rest, self.tp)
        return {"pp": pp_i, "dp": dp_i, "sp": sp_i, "tp": tp_i}


def _rank(who: str, c: TinyLayout, name: str, rank: int, size: int, of: str) -> int:
    """``c`` is a ``TinyLayout`` and ``rank`` one of its ``size`` ranks (``of``: which)."""
    if not isinstance(c, TinyLayout):
        raise ValueError(f"{who}: c={c!r} must be a TinyLayout")
    return index(who, name, rank, size, of)


def stage_parameters(c: TinyLayout, pp_rank: int) -> list[int]:
    """Numbers of parameters of each virtual stage pipeline rank ``pp_rank`` runs, in stage order: its
    layers, the tensor-parallel ones split by ``t`` (``nn.GPT``'s shapes)."""
    _rank("stage_parameters", c, "pp_rank", pp_rank, getattr(c, "pp", 0), "pipeline ranks")
    t, d, f, v, s = c.tp, c.d, c.d_ff, c.vocab, c.seq
    block = 2 * d + 3 * (d * d // t + d // t) + (d // t) * d + d + 2 * d + d * f // t + f // t + (f // t) * d + d
    return [embed * (v // t * d + s * d) + blocks * block + head * (2 * d + d * v // t)
            for embed, blocks, head in c.stages_of(pp_rank)]


def parameters_per_rank(c: TinyLayout, pp_rank: int) -> int:
    """Numbers of parameters a rank of pipeline rank ``pp_rank`` holds (``stage_parameters``' sum)."""
    _rank("parameters_per_rank", c, "pp_rank", pp_rank, getattr(c, "pp", 0), "pipeline ranks")
    return sum(stage_parameters(c, pp_rank))


def _tp_bytes(c: TinyLayout, rank: int) -> int:
    t, tp_i = c.tp, c.coords(rank)["tp"]
    if t == 1:
        return 0
    b, e = c.micro_batch, c.itemsize
    a_numel = c.seq * b * c.d
    a = a_numel * e

    def allreduce(numel: int) -> int:
        return allreduce_bytes(numel, e, t, tp_i, "ring")

    total, replicated = 0, 0
    for embed, blocks, head in c.stages_of(c.coords(rank)["pp"]):
        per_mb = 0
        if c.sequence_parallel:
            calls = collectives_per_block(True)
            gathers = blocks * (calls["forward"]["allgather"] + calls["backward"]["allgather"]) + embed + 2 * head
            scatters = blocks * (calls["forward"]["reduce_scatter"] + calls["backward"]["reduce_scatter"]) \
                + embed + head
            per_mb += round((gathers + scatters) * ring_bytes("allgather", a, t))
            replicated += blocks * 6 * c.d + head * 2 * c.d + embed * c.seq * c.d
        else:
            per_mb += (4 * blocks + embed + head) * allreduce(a_numel)
        per_mb += head * 3 * allreduce(c.seq * b)  # the vocabulary-parallel loss: max, sum, target logit
        total += c.microbatches * per_mb
    return total + (allreduce(replicated) if replicated else 0)


def _sp_bytes(c: TinyLayout, rank: int) -> int:
    if c.sp == 1:
        return 0
    blocks = sum(n for _, n, _ in c.stages_of(c.coords(rank)["pp"]))
    b = c.micro_batch
    per_block = sum(sequence.attention_bytes(c.sp_method, b, c.seq, c.d, c.sp, c.ulysses, c.itemsize, backward,
                                             n_heads=c.heads) for backward in (False, True))
    return c.microbatches * blocks * per_block


def _pp_bytes(c: TinyLayout, rank: int) -> int:
    if c.pp == 1:
        return 0
    pp_i = c.coords(rank)["pp"]
    shard = c.tp if c.sequence_parallel else c.sp
    boundary = c.seq // shard * c.micro_batch * c.d * c.itemsize
    p2p = send_bytes(c.owner(), c.microbatches, boundary)[pp_i]
    root = c.owner()[-1]
    return p2p + tree_broadcast_bytes((1 + c.microbatches) * c.itemsize, c.pp, pp_i, root)


def _replica_bytes(c: TinyLayout, rank: int) -> tuple[str, int]:
    """(axis, bytes) of the gradient reduction over the ``dp x sp`` replicas."""
    n = c.dp * c.sp
    if n == 1:
        return "", 0
    co = c.coords(rank)
    me = co["dp"] * c.sp + co["sp"]  # this rank's index in its replica group
    nxt = (me + 1) % n
    axis = "+".join(a for a, (x, y) in (("dp", (co["dp"], nxt // c.sp)), ("sp", (co["sp"], nxt % c.sp))) if x != y)
    numel = parameters_per_rank(c, co["pp"])
    if c.zero_stage == 0:
        return axis, allreduce_bytes(numel, c.itemsize, n, me, "ring")
    if c.zero_stage < 3:
        return axis, zero.zero_traffic_bytes([numel], c.zero_stage, n, c.itemsize, me)  # one bucket: tiny models
    gathers = zero3_gathers(c, co["pp"])
    return axis, sum((n - 1) * (zero.padded(numel, n) // n) * c.itemsize * (g + 1)  # + the reduce-scatter
                     for numel, g in zip(stage_parameters(c, co["pp"]), gathers, strict=True))


def zero3_gathers(c: TinyLayout, pp_rank: int) -> list[int]:
    """All-gathers of each of ``pp_rank``'s virtual stages in one step under ZeRO-3 (``zero_pp.py``):
    with ``reshard_after_forward`` one per compute action, m forwards + m backwards (B or I) + the W's of
    its split backwards (``split_backwards``); without, 1 (kept gathered until the reduce-scatter)."""
    owner = c.owner()
    stages = [s for s in range(len(owner)) if owner[s] == pp_rank]
    if not c.reshard_after_forward:
        return [1] * len(stages)
    return [2 * c.microbatches + split_backwards(c.schedule, c.pp, c.microbatches, s) for s in stages]


def gathered_peak_bytes(c: TinyLayout, rank: int) -> int:
    """The most bytes of ZeRO-3 parameters gathered at once on ``rank`` beside its shards: one stage's
    padded flat buffer ``L_s e`` at a time with ``reshard_after_forward`` (each action gathers its own
    stage and frees it), the largest; without, all of the rank's stages, ``sum L_s e``
    (``zero.fsdp_gathered_peak`` without prefetch); 0 below stage 3 or on one replica."""
    _rank("gathered_peak_bytes", c, "rank", rank, getattr(c, "world", 0), "ranks of the mesh")
    if c.zero_stage != 3:
        return 0
    return zero.fsdp_gathered_peak(stage_parameters(c, c.coords(rank)["pp"]), c.dp * c.sp, c.itemsize,
                                   prefetch=False, reshard_after_forward=c.reshard_after_forward)


def split_backwards(kind: str, p: int, m: int, stage: int) -> int:
    """Micro-batches whose backward on virtual ``stage`` is split into I and W in one step: all ``m``
    under ZB-H1, ZB-H2 and ZB-V; under DualPipeV (``pipeline.dualpipe``'s steps 3, 6 and 7), on rank r
    with a = r going down and b = 2p - 1 - r coming back, the p - 1 - r I's of its warm-up (b) and of its
    cool-down (a), plus the split ones among its r + 1 full-or-split pairs: ``ceil((r + 1) / 2)`` of
    stage a's and, when r is even, one fewer of b's; none under the other schedules."""
    one_of("split_backwards", "kind", kind, SCHEDULES)
    wholes("split_backwards", p=p, m=m)
    if kind in V_SHAPED:
        index("split_backwards", "stage", stage, 2 * p, "virtual stages of the V")
    else:
        whole("split_backwards", "stage", stage, least=0)
    if kind in ("zb-h1", "zb-h2", "zb-v"):
        return m
    if kind != "dualpipev":
        return 0
    r = stage if stage < p else 2 * p - 1 - stage
    return p - 1 - r + (r + 2) // 2 - (stage >= p and r % 2 == 0)


def w_regather_bytes(c: TinyLayout, rank: int) -> int:
    """Bytes ``rank`` sends inside its W actions in one step: under Megatron-SP, the re-gathers of the
    column-parallel inputs (q k v's and fc's per block, the head's), which a split backward runs in W
    (``tensor.layers``). Each is a ring all-gather of the sequence shard, ``(t-1)`` shards of ``S/t b d
    e`` bytes, once per split backward of the stage (``split_backwards``); every other W is local, so 0
    without Megatron-SP. These bytes are part of ``traffic_by_axis``'s ``tp`` (moved from B to W)."""
    _rank("w_regather_bytes", c, "rank", rank, getattr(c, "world", 0), "ranks of the mesh")
    if not (c.sequence_parallel and c.tp > 1):
        return 0
    pp_i, owner, total = c.coords(rank)["pp"], c.owner(), 0
    stages = [s for s in range(len(owner)) if owner[s] == pp_i]
    for s, (_, blocks, head) in zip(stages, c.stages_of(pp_i), strict=True):
        total += split_backwards(c.schedule, c.pp, c.microbatches, s) * (2 * blocks + head)
    return total * (c.tp - 1) * (c.seq // c.tp) * c.micro_batch * c.d * c.itemsize


def traffic_by_axis(c: TinyLayout, rank: int) -> dict[str, int]:
    """Bytes ``rank`` sends in one step, by the mesh axes its messages cross (module docstring)."""
    _rank("traffic_by_axis", c, "rank", rank, getattr(c, "world", 0), "ranks of the mesh")
    out = {"tp": _tp_bytes(c, rank), "sp": _sp_bytes(c, rank), "pp": _pp_bytes(c, rank)}
    axis, nbytes = _replica_bytes(c, rank)
    if nbytes:
        out[axis] = out.get(axis, 0) + nbytes
    return {a: v for a, v in out.items() if v}


def model_state_bytes(c: TinyLayout, rank: int) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state a rank holds after a step: DDP keeps all
    three for its parameters (``e + e + 2e`` bytes each: AdamW's two moments in the parameters'
    type); ZeRO-1 (float64) shards the optimizer state over the ``dp x sp`` replicas, ZeRO-2 the
    gradients too (``zero.zero_state_bytes``, one bucket), ZeRO-3 also the parameters, a unit per
    virtual stage (``stage_parameters``; gathered ones apart: ``gathered_peak_bytes``)."""
    _rank("model_state_bytes", c, "rank", rank, getattr(c, "world", 0), "ranks of the mesh")
    numel, e = parameters_per_rank(c, c.coords(rank)["pp"]), c.itemsize
    if c.zero_stage == 0:
        return {"parameters": e * numel, "gradients": e * numel, "optimizer state": 2 * e * numel}
    co = c.coords(rank)
    numels = stage_parameters(c, co["pp"]) if c.zero_stage == 3 else [numel]
    return zero.zero_state_bytes(numels, c.zero_stage, c.dp * c.sp, co["dp"] * c.sp + co["sp"])


def activation_peak_bytes(c: TinyLayout, rank: int, schedule: str = "1f1b") -> int:
    """The most activation bytes ``rank`` keeps at once: ``pipeline.peak_stash`` micro-batches of its
    stage, each keeping (``tensor.layer_terms`` and the terms around the blocks, Korthikanti et al.
    2022 Sec. 4.1 without dropout; ``S_ = A/t`` under Megatron-SP, else ``A``):

    - per block ``sum(layer_terms)``; a stage after the first also keeps its received input, ``S_``;
    - the embedding: its vocabulary-parallel rows and their masked copy, ``2A``, its reduced output
      and the position sum, ``2 S_``;
    - the head: ln_f's output ``S_``, the logits and the loss's saved softmax ``2 S b V e / t``, the
      targets' int64 indices and mask ``9 S b``, the loss and the pipeline's ``loss / m``, ``2e``.

    Tensor-parallel stages, one stage per rank (``chunks == 1``); sequence-parallel blocks are
    ``sequence.activation_terms``, measured in ``tests/test_sequence_parallel.py``."""
    _rank("activation_peak_bytes", c, "rank", rank, getattr(c, "world", 0), "ranks of the mesh")
    if c.sp > 1 or c.chunks > 1 or schedule.startswith("zb"):
        raise ValueError("activation_peak_bytes models tensor-parallel stages, one per rank (sp = 1, chunks = 1), "
                         "whose backward is not split (between a split backward's I and W the kept bytes are the "
                         "weight ops' inputs and output gradients: split_backward.WeightGradients.nbytes)")
    t, b, e = c.tp, c.micro_batch, c.itemsize
    a = c.seq * b * c.d * e
    s_ = a // t if c.sequence_parallel else a
    pp_i = c.coords(rank)["pp"]
    ((embed, blocks, head),) = c.stages_of(pp_i)
    block = sum(layer_terms(t, b, c.seq, c.d, c.heads, c.d_ff, e, c.sequence_parallel).values())
    per_mb = blocks * block + (s_ if not embed else 2 * a + 2 * s_)
    per_mb += head * (s_ + 2 * c.seq * b * (c.vocab // t) * e + 9 * c.seq * b + 2 * e)
    return peak_stash(schedule, c.pp, c.microbatches, pp_i) * per_mb
