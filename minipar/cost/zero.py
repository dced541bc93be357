"""ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") and FSDP (Zhao et al. 2023, "PyTorch FSDP"): bytes of model states per rank, bytes sent per
step, gathered units alive at once. Derivations in ``docs/formulas.md``, section 6.

Symbols (the paper's, Sec. 3.1 and 5): ``Psi`` parameters, ``N`` the data-parallel degree, ``K``
bytes of optimizer state per parameter. Mixed-precision Adam (Sec. 3.1) keeps fp16 parameters and
gradients (2 + 2 bytes) and an fp32 copy of the parameters, the momentum and the variance
(K = 4 + 4 + 4 = 12). Each stage partitions one more of the three over the N ranks (Sec. 5, Fig. 1):

    stage 0  plain data parallelism   (2 + 2 + K) Psi
    stage 1  P_os      (Sec. 5.1)     2 Psi + 2 Psi + K Psi / N
    stage 2  P_os+g    (Sec. 5.2)     2 Psi + (2 + K) Psi / N
    stage 3  P_os+g+p  (Sec. 5.3)     (2 + 2 + K) Psi / N

``zero_model_states`` is that table (``paper_table`` gives the paper's Table 1 from it, ``paper_gb``
rounds as the paper prints).
``zero_state_bytes`` is the same table for ``minipar.parallel.zero``'s exact layout: every bucket
(stages 1, 2) or unit (stage 3) of ``n`` elements is one flat buffer zero-padded to ``L``, the next
multiple of N, and rank r owns elements ``[r L/N, (r+1) L/N)``; a partitioned component costs the
padded shard ``sum L/N`` per rank, a replicated one the unpadded ``sum n``.

Traffic per rank per step (Sec. 7.2.1, ring collectives, exact because N divides every L), with
``(N-1)/N L`` elements per reduce-scatter or all-gather of one group (``zero_traffic_bytes``):

    stages 1, 2   reduce-scatter the gradients + all-gather the updated parameters
                  2 (N-1)/N sum L          (a DDP all-reduce of the padded buckets)
    stage 3       all-gather (forward) + all-gather (backward) + reduce-scatter the gradients
                  3 (N-1)/N sum L          (2 (N-1)/N for a unit kept gathered from its forward
                                            to its backward: the root unit, or every unit without
                                            ``reshard_after_forward``)

``zero_traffic_by_op`` splits it by collective (a trace's ``expected_bytes``).

FSDP's gathered units (Zhao et al. 2023, Sec. 3.3-3.4, ``fsdp_gathered_peak``): a unit is gathered
only while it computes, plus the next one's all-gather already under way with prefetching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import ROUND_HALF_UP, Decimal
from numbers import Integral

from minipar.checks import counts, number, whole, wholes
from minipar.cost.collectives import allreduce_bytes
from minipar.cost.data import ddp_bytes
from minipar.cost.sharding import shard_bounds

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}  # the paper's Table 1 columns
PARTITIONED_FROM = {"optimizer state": 1, "master parameters": 1, "gradients": 2, "parameters": 3}
BYTES_PER_ELEMENT = {  # bytes of each component per parameter
    "fp64": {"parameters": 8, "gradients": 8, "optimizer state": 16},  # AdamW updates the parameters: no copy
    "mixed": {"parameters": 2, "gradients": 2, "optimizer state": 8, "master parameters": 4},  # K = 8 + 4
    "bf16": {"parameters": 2, "gradients": 2, "optimizer state": 8, "master parameters": 4},  # K = 8 + 4
}
REDUCE_ITEMSIZE = {"bf16": 2, "fp32": 4, "fp16": 2}  # ``minipar.parallel.bf16``'s reduce dtypes


def precision_bytes(precision: str = "fp64", reduce_dtype: str | None = None) -> dict[str, int]:
    """Bytes per parameter of each model state, by ``precision`` ("fp64", "mixed": float16 with a
    loss scale, "bf16") and, for bf16, the dtype the gradients are reduced and kept in (``None``:
    bf16's own 2 bytes; "fp32": 4, Megatron's ``--accumulate-allreduce-grads-in-fp32``). K, the
    optimizer's bytes, is ``optimizer state`` + ``master parameters``: 12 in mixed and bf16."""
    if precision not in BYTES_PER_ELEMENT:
        raise ValueError(f"precision={precision!r}; choose one of {tuple(BYTES_PER_ELEMENT)}")
    if reduce_dtype is not None and (precision != "bf16" or reduce_dtype not in REDUCE_ITEMSIZE):
        raise ValueError(f"reduce_dtype={reduce_dtype!r} with precision={precision!r}: a reduce dtype is one of "
                         f"{tuple(REDUCE_ITEMSIZE)}, for precision='bf16' only")
    out = dict(BYTES_PER_ELEMENT[precision])
    if reduce_dtype is not None:
        out["gradients"] = REDUCE_ITEMSIZE[reduce_dtype]
    return out


def _check_stage(who: str, stage: int) -> None:
    if stage not in STAGES:
        names = ", ".join(f"{s} ({STAGE_NAMES[s]})" for s in STAGES)
        raise ValueError(f"{who}: unknown ZeRO stage {stage!r}; choose one of {names}")


def _check_dp(who: str, dp: int) -> None:
    if not isinstance(dp, Integral) or dp < 1:
        raise ValueError(f"{who}: the data-parallel degree N must be a positive int, got dp={dp!r}")


def _check_groups(who: str, numels: Sequence[int], dp: int, rank: int = 0, root: int | None = None) -> None:
    _check_dp(who, dp)
    if any(not isinstance(n, Integral) or n < 0 for n in numels):
        raise ValueError(f"{who}: numels must be element counts (non-negative ints), one per bucket or unit; got "
                         f"{numels!r}")
    if not 0 <= rank < dp:
        raise ValueError(f"{who}: rank={rank} is not one of the N={dp} ranks")
    if root is not None and not 0 <= root < len(numels):
        raise ValueError(f"{who}: root={root} is not the index of a unit in numels (0..{len(numels) - 1})")


def padded(numel: int, dp: int) -> int:
    """``L``: ``numel`` rounded up to a multiple of ``dp`` (at most ``dp - 1`` elements of padding)."""
    whole("padded", "numel", numel, least=0)
    _check_dp("padded", dp)
    return -(-numel // dp) * dp


def zero_model_states(params: int, stage: int, dp: int, optimizer_bytes: int = 12, param_bytes: int = 2,
                      grad_bytes: int = 2) -> float:
    """Bytes of model states per rank at ZeRO ``stage`` (Rajbhandari et al. 2020, Sec. 5, Fig. 1).

    Psi = ``params``, N = ``dp``, K = ``optimizer_bytes``. Plain data parallelism (stage 0) replicates
    all three: ``(2 + 2 + K) Psi``. Stage 1 partitions the optimizer states, each rank updating only
    its ``1/N`` (Sec. 5.1): ``K Psi / N``. Stage 2 also keeps only the gradients of that ``1/N``
    (Sec. 5.2): ``2 Psi / N``. Stage 3 also stores only that ``1/N`` of the parameters and gathers
    the rest when needed (Sec. 5.3): ``2 Psi / N``.
    """
    _check_stage("zero_model_states", stage)
    _check_dp("zero_model_states", dp)
    number("zero_model_states", "params", params)
    wholes("zero_model_states", optimizer_bytes=optimizer_bytes, param_bytes=param_bytes, grad_bytes=grad_bytes)
    own = {"parameters": param_bytes, "gradients": grad_bytes, "optimizer state": optimizer_bytes}
    return sum(b * params / (dp if stage >= PARTITIONED_FROM[c] else 1) for c, b in own.items())


def zero_state_bytes(numels: list[int], stage: int, dp: int, rank: int = 0, precision: str = "fp64",
                     reduce_dtype: str | None = None) -> dict[str, int]:
    """Exact bytes of model states on ``rank`` for buckets (stages 1, 2) or units (stage 3) of
    ``numels`` elements (unpadded) on N = ``dp`` ranks, by component.

    A component is partitioned from the stage that partitions it (``PARTITIONED_FROM``: the
    optimizer state and fp32 master parameters from stage 1, the gradients from 2, the parameters
    from 3) and then costs this rank's padded shard, ``sum L/N`` elements, the same on every rank;
    before that it is replicated and costs ``sum n`` elements, except the parameters of stages 1
    and 2, which live in the padded flat buckets the all-gathers write into: ``sum L``. Bytes per element
    (``BYTES_PER_ELEMENT``): ``"fp64"`` parameters 8, gradients 8, AdamW's m and v 16 (the optimizer
    updates the parameters in place: no master copy); ``"mixed"`` fp16 parameters 2, fp16 gradients
    2, fp32 m and v 8, fp32 master parameters 4 (the paper's K = 12 is the last two); ``"bf16"``
    as mixed with bfloat16 for float16, and with ``reduce_dtype="fp32"`` the gradient shards of
    stages 2 and 3 in 4 bytes (``precision_bytes``; stage 1's full gradients stay bf16 until the step
    reduces them).
    """
    _check_stage("zero_state_bytes", stage)
    _check_groups("zero_state_bytes", numels, dp, rank)
    try:
        per = precision_bytes(precision, reduce_dtype)
    except ValueError as exc:
        raise ValueError(f"zero_state_bytes: {exc}") from None
    if stage < PARTITIONED_FROM["gradients"]:  # full gradients: each parameter's own, in its working dtype
        per["gradients"] = BYTES_PER_ELEMENT[precision]["gradients"]
    full, shard = sum(numels), sum(padded(n, dp) // dp for n in numels)
    out = {c: b * (shard if stage >= PARTITIONED_FROM[c] else full) for c, b in per.items()}
    if stage in (1, 2):  # the full parameters are views of the padded flat buckets
        out["parameters"] = per["parameters"] * shard * dp
    return out


def zero_traffic_bytes(numels: list[int], stage: int, dp: int, itemsize: int = 8, rank: int = 0,
                       reshard_after_forward: bool = True, root: int | None = None,
                       grad_itemsize: int | None = None) -> int:
    """Exact bytes ``rank`` sends in one step (ring collectives) for buckets or units of ``numels``
    elements (unpadded) of ``itemsize`` bytes, on N = ``dp`` ranks (Sec. 7.2.1). The gradients'
    collectives (all-reduce, reduce-scatter) move ``grad_itemsize`` bytes an element (default
    ``itemsize``; bf16 parameters reduced in fp32: 2 and 4).

    Each group is padded to ``L`` (a multiple of N), so every ring reduce-scatter or all-gather of it
    sends N - 1 of its N equal chunks: ``(N-1) L/N`` elements, on every rank.

    - stage 0: DDP, one all-reduce per unpadded bucket (``data.ddp_bytes``; rank-dependent when N
      does not divide a bucket);
    - stages 1, 2: per bucket a reduce-scatter of the gradients and an all-gather of the updated
      parameters, 2 collectives: the all-reduce's volume on the padded buckets;
    - stage 3: per unit two all-gathers (before its forward and again before its backward) and one
      reduce-scatter, 3 collectives; 2 for a unit kept gathered from forward to backward (the
      ``root`` unit, an index into ``numels``, or every unit when ``reshard_after_forward`` is off).

    ``reshard_after_forward`` and ``root`` describe stage 3 only. Not counted: the scalar all-reduces
    a step may add (mixed precision's overflow flag, the global gradient norm for clipping), each
    ``collectives.allreduce_bytes(1, 8, N, rank, "ring")``. A step mixed precision skips (overflow)
    sends no all-gather in stages 1 and 2: half their bytes.
    """
    _check_stage("zero_traffic_bytes", stage)
    _check_groups("zero_traffic_bytes", numels, dp, rank, root)
    whole("zero_traffic_bytes", "itemsize", itemsize)
    grad = whole("zero_traffic_bytes", "grad_itemsize", itemsize if grad_itemsize is None else grad_itemsize)
    if stage == 0:
        return ddp_bytes([(n, grad) for n in numels], dp, rank, "ring")
    total = 0
    for i, n in enumerate(numels):
        gathers = 1 if stage < 3 else 2 if reshard_after_forward and i != root else 1  # + one reduce-scatter
        total += (dp - 1) * (padded(n, dp) // dp) * (gathers * itemsize + grad)
    return total


def fsdp2_traffic_bytes(units: Sequence[Sequence[Sequence[int]]], dp: int, itemsize: int = 8, rank: int = 0,
                        reshard_after_forward: bool = True) -> int:
    """Exact bytes ``rank`` sends in one step of FSDP2 (``parallel.zero.fsdp2``): ``units`` lists each
    unit's parameter shapes, each parameter placed ``Shard(0)`` over N = ``dp`` ranks, cut as DTensor
    cuts (``cost.sharding.shard_bounds``: rank m holds ``s_m`` of its ``n`` elements, no padding). Per
    parameter, the all-gather (twice with ``reshard_after_forward``: before forward and before
    backward) sends every piece but the successor's, ``n - s_{rank+1}``, and the gradient's
    reduce-scatter every part but its own, ``n - s_rank``. Equal to ``zero_traffic_bytes(..., stage=3)``
    when N divides every first dimension and every unit (no padding on either side)."""
    _check_dp("fsdp2_traffic_bytes", dp)
    whole("fsdp2_traffic_bytes", "itemsize", itemsize)
    if not 0 <= rank < dp:
        raise ValueError(f"fsdp2_traffic_bytes: rank={rank} is not one of the N={dp} ranks")
    gathers, total = 2 if reshard_after_forward else 1, 0
    for shape in (tuple(s) for unit in units for s in unit):
        if not shape or counts("fsdp2_traffic_bytes", "a parameter's shape", shape)[0] == 0:
            raise ValueError(f"fsdp2_traffic_bytes: shape {shape} has no first dimension to shard; give each "
                             "parameter's shape, e.g. (5, 4)")
        n = math.prod(shape)
        piece = [n // shape[0] * (b - a) for a, b in (shard_bounds(shape[0], dp, m) for m in range(dp))]
        total += gathers * (n - piece[(rank + 1) % dp]) + (n - piece[rank])
    return total * itemsize if dp > 1 else 0


def zero_traffic_by_op(numels: list[int], stage: int, dp: int, itemsize: int = 8,
                       grad_itemsize: int | None = None) -> dict[str, float]:
    """``zero_traffic_bytes`` of rank 0 by collective: stage 0 all of it in ``allreduce``; a ring
    reduce-scatter and a ring all-gather of one group send the same elements, so stages 1 and 2 send
    one group's worth, ``(N-1)/N sum L`` elements, to each and stage 3 (two all-gathers and one
    reduce-scatter per unit) two to ``allgather`` and one to ``reduce_scatter``, the gradients'
    elements of ``grad_itemsize`` bytes (default ``itemsize``)."""
    grad = itemsize if grad_itemsize is None else grad_itemsize
    if stage == 0:
        return {"allreduce": float(zero_traffic_bytes(numels, stage, dp, itemsize, grad_itemsize=grad))}
    _check_groups("zero_traffic_by_op", numels, dp)
    one = float(sum((dp - 1) * (padded(n, dp) // dp) for n in numels))  # (N-1)/N sum L elements
    return {"allgather": one * itemsize * (2 if stage == 3 else 1), "reduce_scatter": one * grad}


def fsdp_gathered_peak(numels: list[int], dp: int, itemsize: int = 8, prefetch: bool = True, *,
                       reshard_after_forward: bool = True, root: int | None = None) -> int:
    """The most bytes of gathered (unsharded) FSDP units alive at once on a rank, for units of
    ``numels`` elements (unpadded) listed in the order they run (Zhao et al. 2023, Sec. 3.3-3.4).

    A gathered unit is its whole padded flat buffer, ``L`` elements. With ``reshard_after_forward``
    a unit is gathered only while it computes, forward or backward; with ``prefetch`` the all-gather
    of its neighbour (forward: the next unit; backward: the one before) is already under way, so the
    peak is the largest pair of neighbours, ``max (L_i + L_{i+1})``; without, the largest unit,
    ``max L_i``. The ``root`` unit (an index into ``numels``; PyTorch's outermost unit, whose forward
    encloses every other unit's) is gathered when forward starts and freed when backward ends, so
    it adds ``L_root`` to every step's units (once). Without ``reshard_after_forward`` every unit is
    still gathered when forward ends: ``sum L``. On one rank nothing is gathered (the shard is the
    whole unit, PyTorch's NO_SHARD fallback): 0.
    """
    _check_groups("fsdp_gathered_peak", numels, dp, root=root)
    whole("fsdp_gathered_peak", "itemsize", itemsize)
    if dp == 1:
        return 0
    sizes = [padded(n, dp) for n in numels]
    if not reshard_after_forward:
        return sum(sizes) * itemsize
    kept = set() if root is None else {root}
    steps = [{i, i + 1} if prefetch and i + 1 < len(sizes) else {i} for i in range(len(sizes))]
    return max((sum(sizes[j] for j in step | kept) for step in steps), default=0) * itemsize


def paper_table(params: int, dp_sizes: list[int], k: int = 12) -> list[dict]:
    """Rajbhandari et al. 2020's Table 1 for ``params`` parameters: one row per N in ``dp_sizes``,
    ``{"dp": N, "baseline": GB, "P_os": GB, "P_os+g": GB, "P_os+g+p": GB}`` in GB = 1e9 bytes,
    unrounded (the paper prints about three significant figures, at most two decimals, rounding
    half up: 41.25 is printed 41.3). E.g. 7.5e9 parameters on N = 64: 120, 31.4, 16.6, 1.88."""
    counts("paper_table", "dp_sizes", dp_sizes)
    whole("paper_table", "k", k)
    return [{"dp": n, **{STAGE_NAMES[s]: zero_model_states(params, s, n, k) / 1e9 for s in STAGES}}
            for n in dp_sizes]


def paper_gb(value: float) -> str:
    """GB as the paper's Table 1 prints them: 3 significant figures, at most 2 decimals, rounding half
    up (41.25 -> "41.3", 1.875 -> "1.88", 120.0 -> "120")."""
    if number("paper_gb", "value", value) == 0:
        raise ValueError("paper_gb: value=0 must be a positive number of GB")
    decimals = min(2, max(0, 2 - math.floor(math.log10(value))))
    rounded = Decimal(repr(value)).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP)
    return f"{rounded:f}".rstrip("0").rstrip(".") if decimals else f"{rounded:f}"


def hsdp_traffic_bytes(numels: list[int], shard_group: int, dp: int, itemsize: int = 8, rank: int = 0) -> int:
    """Bytes ``rank`` sends per step under hybrid sharding (FSDP ``shard_group=G`` of ``dp`` ranks):
    stage 3 inside its group of G (``3 (G-1)/G`` of each unit padded to a multiple of G) plus the
    all-reduce of its gradient shard across the ``dp / G`` replicas (ring, exact per rank)."""
    _check_dp("hsdp_traffic_bytes", dp)
    if whole("hsdp_traffic_bytes", "shard_group", shard_group) > dp or dp % shard_group:
        raise ValueError(f"hsdp_traffic_bytes: shard_group={shard_group} does not divide dp={dp}")
    replicas = dp // shard_group
    inside = zero_traffic_bytes(numels, 3, shard_group, itemsize, rank % shard_group)
    across = sum(allreduce_bytes(padded(n, shard_group) // shard_group, itemsize, replicas, rank // shard_group,
                                 "ring") for n in numels)
    return inside + across
