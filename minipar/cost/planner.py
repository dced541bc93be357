"""Choose a layout: enumerate every way to split a GPT over ``gpus`` GPUs, keep those that fit in
memory, rank them by predicted step time (``minipar.cost.perf.predict``), and say why each wins.

- ``plan``: every (dp, tp, pp, sp, chunks, schedule, micro-batch, ZeRO stage, recomputation,
  Megatron-SP) with ``dp tp pp sp = gpus`` that ``Layout.check`` accepts (so ``tp`` divides the
  heads), tensor parallelism kept inside a node (``tp <= gpus_per_node``: its all-reduces sit on
  the critical path, Narayanan et al. 2021 Sec. 3.3, Takeaway #1); fastest first. ZeRO-2 and
  ZeRO-3 only with ``pp = 1``: DeepSpeed's pipeline engine refuses them ("ZeRO-2 and ZeRO-3 are
  incompatible with pipeline parallelism", ``deepspeed/runtime/pipe/engine.py``: gradients
  accumulate over the micro-batches, which a sharded gradient would reduce-scatter every one of)
  and Megatron-LM's distributed optimizer shards only the optimizer state. A ``pp`` not dividing
  the layers is tried with ``v = 1`` and uneven stages (``perf.stage_blocks``, cut by
  ``stages.partition_layers``). Schedules: 1F1B (interleaved when ``v > 1``) and, with ``pp > 1``
  and ``v = 1``, the zero-bubble ZB-H1 (Qi et al. 2024; ``perf`` prices it by
  ``pipeline.bubble_fraction`` and ``peak_stash``: ``p`` micro-batches stashed on every stage).
  ZB-H2 only when asked (``schedules``): with F = I = W, as ``perf`` has them, its bubble equals
  ZB-H1's and it stashes ``2p - 1``, so it would only repeat ZB-H1's rows with more memory. The
  V-shaped ZB-V (Qi et al. 2024, Sec. 6) and DualPipeV (DeepSeek-V3's DualPipe folded in a V) with
  ``pp > 1`` and ``2p`` dividing the layers: two chunks per rank (``chunks = 2``), stages ``r`` and
  ``2p - 1 - r`` on rank ``r``, so rank 0 holds the embedding and the head; bubble ``(p-1)/(6m)`` of
  the busy time (``pipeline.bubble_fraction``), ``2p`` (ZB-V) and ``2p + 1`` (DualPipeV)
  chunk-micro-batches stashed. DualPipeV is priced as its order: the overlap of a pair's forward with
  another's backward hides expert-parallel all-to-alls, which this model has none of, so it ties ZB-V
  with one more chunk stashed and ranks after it. Every layout overlaps the data-parallel reduction
  with the backward (``overlap_grad_reduce``, Megatron-LM's ``--overlap-grad-reduce``: never slower,
  so not a choice to search). A model whose
  hidden size the heads do not divide is refused. A plan is a ranking of *predictions*: its first
  row is the model's opinion, as good as the terms of ``perf``.
- ``NoFit``: raised when no layout fits, naming what the least hungry layout lacks (bytes, GiB).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from minipar.checks import one_of, whole
from minipar.cost.cluster import Cluster
from minipar.cost.layout import UNEVEN, V_SHAPED, Layout, ModelSpec, check_specs
from minipar.cost.perf import GiB, Prediction, memory_bytes, predict, stage_blocks

MICRO_BATCHES = (1, 2, 4, 8, 16)  # 16: Table 1's small rows (Narayanan et al. 2021, run_table_1.sh)
ZERO_STAGES = (0, 1, 2, 3)  # 2 and 3 with pp = 1 only (module docstring)
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev")  # the zero-bubble ones with pp > 1 (module docstring)
TRIED = ("1f1b", "zb-h1", "zb-v", "dualpipev")  # zb-h2 prices as zb-h1 with more memory: never first


@dataclass
class Candidate:
    """One ranked layout: its prediction and the candidate ranked after it (``why`` compares them)."""

    layout: Layout
    prediction: Prediction
    runner_up: Candidate | None = field(default=None, repr=False)

    def label(self) -> str:
        lay = self.layout
        extra = (" SP" if lay.sequence_parallel else "") + (" uneven" if _uneven(self.prediction) else "")
        kind = f" {lay.kind}" if lay.pp > 1 else ""
        return (f"dp{lay.dp} tp{lay.tp} pp{lay.pp}{kind} sp{lay.sp} v{lay.chunks} b{lay.micro_batch} "
                f"zero{lay.zero} {lay.recompute}{extra}")

    def notes(self) -> str:
        """What the layout relies on that Megatron-LM's defaults do not give: uneven stages, ZeRO-2/3."""
        lay, out = self.layout, []
        if _uneven(self.prediction):
            model = self.prediction.model
            assert model is not None
            out.append(f"uneven stages (blocks per stage {_stages_text(stage_blocks(model, lay))})")
        if lay.zero >= 2:
            out.append(f"ZeRO-{lay.zero} with pp = 1 (DeepSpeed refuses ZeRO-2/3 with pipelining)")
        return "; ".join(out)

    def why(self) -> str:
        """What this layout wins on against the next one: bubble, communication per axis, memory."""
        me = self.prediction
        if self.runner_up is None:
            return f"last shown; {_dominant(me)}"
        other = self.runner_up.prediction
        gains = {"compute": other.compute_seconds - me.compute_seconds,
                 "bubble": other.bubble_seconds - me.bubble_seconds,
                 **{f"{k} comm": other.comm_seconds[k] - me.comm_seconds[k] for k in me.comm_seconds}}
        won = sorted(((v, k) for k, v in gains.items() if v > 1e-12 * other.step_seconds), reverse=True)
        lost = sorted(((-v, k) for k, v in gains.items() if v < -1e-12 * other.step_seconds), reverse=True)
        saved = other.step_seconds - me.step_seconds
        pace = "as fast as" if saved <= 1e-9 * me.step_seconds else f"{saved:.3g} s faster than"
        text = f"{pace} the next ({self.runner_up.label()})"
        if won:
            text += ": less " + ", ".join(f"{k} (-{v:.3g} s)" for v, k in won[:3])
        if lost:
            text += "; pays more " + ", ".join(f"{k} (+{v:.3g} s)" for v, k in lost[:2])
        dm = me.memory["total"] - other.memory["total"]
        text += f"; {abs(dm) / GiB:.1f} GiB {'more' if dm > 0 else 'less'} memory"
        return text + (f"; {self.notes()}" if self.notes() else "")


def _uneven(p: Prediction | None) -> bool:
    return p is not None and p.model is not None and p.layout is not None and p.model.layers % p.layout.pp != 0


def _stages_text(blocks: list[int]) -> str:
    """``[2, 2, 1]`` as ``2,2,1``; long lists run-length coded: ``2 x32, 1 x32``."""
    if len(blocks) <= 8:
        return ",".join(map(str, blocks))
    runs = [(n, len(list(g))) for n, g in itertools.groupby(blocks)]
    return ", ".join(f"{n} x{k}" for n, k in runs)


def _dominant(p: Prediction) -> str:
    parts = {"compute": p.compute_seconds, "bubble": p.bubble_seconds,
             **{f"{k} comm": v for k, v in p.comm_seconds.items()}}
    top = max(parts, key=parts.get)
    return f"{top} is {parts[top] / p.step_seconds:.0%} of its step"


class NoFit(ValueError):
    """No layout fits; ``layout`` is the one needing the least memory, ``shortfall`` its missing bytes."""

    def __init__(self, message: str, layout: Layout | None, shortfall: float) -> None:
        super().__init__(message)
        self.layout, self.shortfall = layout, shortfall


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelSpec, gpus: int, cluster: Cluster, global_batch: int,
            micro_batches: Sequence[int] = MICRO_BATCHES, zero_stages: Sequence[int] = ZERO_STAGES,
            recompute: Sequence[str] = RECOMPUTE, schedules: Sequence[str] = TRIED) -> list[Layout]:
    """Every layout of ``gpus`` GPUs ``Layout.check`` accepts, with ``tp`` inside a node, ZeRO-2/3
    only without pipelining; a ``pp`` not dividing the layers with ``v = 1`` (uneven stages); the
    zero-bubble ``schedules`` with ``pp > 1`` (``v = 1``; ``v = 2`` for the V-shaped ones, ``2p`` dividing
    the layers). ``ValueError`` when the heads do not
    divide the hidden size."""
    check_specs("layouts", model=model, cluster=cluster)
    if model.hidden % model.heads:
        raise ValueError(f"hidden={model.hidden} is not divisible by heads={model.heads}: each head takes "
                         f"hidden/heads features; choose heads dividing {model.hidden}")
    whole("layouts", "gpus", gpus)
    whole("layouts", "global_batch", global_batch)
    for b in micro_batches:
        whole("layouts", "a micro-batch size in micro_batches", b)
    for z in zero_stages:
        one_of("layouts", "a ZeRO stage in zero_stages", z, ZERO_STAGES)
    for r in recompute:
        one_of("layouts", "a mode in recompute", r, RECOMPUTE)
    for k in schedules:
        one_of("layouts", "a schedule in schedules", k, SCHEDULES)
    out = []
    for tp in _divisors(gpus):
        if tp > cluster.gpus_per_node:
            continue
        for sp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * sp)):
                dp = gpus // (tp * sp * pp)
                chunks = [1] if pp == 1 or model.layers % pp else _divisors(model.layers // pp)
                runs = [(v, "1f1b") for v in chunks if "1f1b" in schedules]
                runs += [(1, k) for k in schedules if k in ("zb-h1", "zb-h2") and pp > 1]
                runs += [(2, k) for k in schedules if k in V_SHAPED and pp > 1 and model.layers % (2 * pp) == 0]
                stages = [z for z in zero_stages if pp == 1 or z < 2]
                for (v, k), b, z, r, seqp in itertools.product(runs, micro_batches, stages, recompute,
                                                               (False, True) if tp > 1 else (False,)):
                    lay = Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=z, micro_batch=b, global_batch=global_batch,
                                 chunks=v, recompute=r, sequence_parallel=seqp, schedule=k,
                                 overlap_grad_reduce=True)
                    if not [q for q in lay.check(model) if not (v == 1 and q.startswith(UNEVEN))]:
                        out.append(lay)
    return out


def plan(model: ModelSpec, gpus: int, cluster: Cluster, global_batch: int,
         micro_batches: Sequence[int] = MICRO_BATCHES, zero_stages: Sequence[int] = ZERO_STAGES,
         recompute: Sequence[str] = RECOMPUTE, top: int = 5, schedules: Sequence[str] = TRIED) -> list[Candidate]:
    """The ``top`` fastest layouts that fit, fastest first (ties: less memory first); ``NoFit``
    (a ``ValueError``) naming the shortfall when none fits, ``ValueError`` when none is valid."""
    whole("plan", "top", top)
    valid = layouts(model, gpus, cluster, global_batch, micro_batches, zero_stages, recompute, schedules)
    if not valid:
        raise ValueError(f"no layout of {gpus} GPUs can run {model.name or 'the model'} with global batch "
                         f"{global_batch}: check that the batch is divisible by dp x micro-batch for some dp "
                         f"dividing {gpus}, and the heads, layers and sequence by some tp, pp, sp")
    needs = [(memory_bytes(model, lay)["total"], i) for i, lay in enumerate(valid)]
    fitting = [valid[i] for need, i in needs if need <= cluster.memory_bytes]
    if not fitting:
        need, i = min(needs)
        short = need - cluster.memory_bytes
        untried = sorted({2, 3} - set(zero_stages))
        hint = f"; ZeRO {' and '.join(map(str, untried))} not tried (zero_stages, --zero)" if untried else ""
        raise NoFit(f"{model.name or 'the model'} fits in no layout of {gpus} GPUs: the least memory is "
                    f"{need / GiB:.1f} GiB per GPU ({Candidate(valid[i], None).label()}), {short / GiB:.1f} GiB "
                    f"({short:.4g} bytes) more than the {cluster.memory_bytes / GiB:.1f} GiB a GPU holds{hint}",
                    valid[i], short)
    ranked = sorted((predict(model, lay, cluster, uneven_stages=True) for lay in fitting),
                    key=lambda p: (p.step_seconds, p.memory["total"]))
    out = [Candidate(p.layout, p) for p in ranked[:top + 1]]
    for a, b in zip(out, out[1:]):
        a.runner_up = b
    return out[:top]


