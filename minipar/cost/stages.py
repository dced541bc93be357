"""Pipeline stages from per-layer costs: ``layer_costs`` (a GPT's training FLOPs per layer, the
embedding and the head as entries of their own) and ``partition_layers`` (the contiguous cut that
minimises the slowest stage, Alpa's inter-operator pass: Zheng et al. 2022, Sec. 5), with
``uneven_stage_blocks`` (blocks per stage when the stages cannot be equal). ``perf.stage_blocks``
and the planner both cut stages this way."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from minipar.checks import number, one_of, whole
from minipar.cost.layout import RECOMPUTE, ModelSpec, check_specs


def layer_costs(model: ModelSpec, batch: int = 1, recompute: str = "none") -> list[float]:
    """Training FLOPs (forward + backward, 3 forwards) of each layer for ``batch`` sequences:
    the embedding (no matmul: its gather and the backward's scatter-add, ``2 s h`` additions), the
    blocks (4 forwards with full recomputation; selective adds ``Q K^T`` and the attention over
    ``V`` again, ``4 s^2 h``), then the final layer norm with the head (``3 x 2 s h V``)."""
    check_specs("layer_costs", model=model)
    one_of("layer_costs", "recompute", recompute, RECOMPUTE)
    whole("layer_costs", "batch", batch)
    tokens = batch * model.seq
    block = {"none": 3 * model.layer_flops(tokens), "full": 4 * model.layer_flops(tokens),
             "selective": 3 * model.layer_flops(tokens) + 4.0 * tokens * model.seq * model.hidden}[recompute]
    return [2.0 * tokens * model.hidden] + [block] * model.layers + [3 * model.head_flops(tokens)]


@functools.lru_cache(maxsize=256)
def uneven_stage_blocks(model: ModelSpec, stages: int, recompute: str = "none") -> tuple[int, ...]:
    """Blocks on each of ``stages`` contiguous pipeline stages, cut by ``partition_layers`` over
    ``layer_costs`` (the embedding and the head are entries of their own, not blocks). Every entry's
    FLOPs scale with the batch, so the cut does not depend on it."""
    whole("uneven_stage_blocks", "stages", stages)
    counts = partition_layers(layer_costs(model, 1, recompute), stages)
    ends = [0] * (stages - 1) + [1]
    return tuple(c - (i == 0) - e for i, (c, e) in enumerate(zip(counts, ends)))


def partition_layers(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage (contiguous, every stage non-empty) minimising the costliest stage.

    ``best[k][i]``: the smallest possible maximum over ``k`` stages of the first ``i`` layers,
    ``best[k][i] = min_j max(best[k-1][j], sum(costs[j:i]))``; O(k n^2) (Zheng et al. 2022, Sec. 5).
    Ties go to the split with the last stages longest: under 1F1B the first stages hold the most
    micro-batches in flight, so they get the fewer layers."""
    for c in costs:
        number("partition_layers", "a layer's cost", c)
    n = len(costs)
    if not 1 <= whole("partition_layers", "stages", stages) <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]
