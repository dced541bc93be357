"""What the cost model at scale (``perf``) and the planner take: a GPT (``ModelSpec``: its sizes,
parameters and FLOPs, Narayanan et al. 2021 Eq. 3) and a layout (``Layout``: degrees, ZeRO stage,
micro-batching, schedule, recomputation, and ``check``: every reason it cannot run the model, each
saying what to change). The formulas that use them are in ``perf.py``; their derivations in
``docs/formulas.md`` section 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minipar.checks import RECOMPUTE, one_of, whole
from minipar.cost.cluster import Cluster
from minipar.cost.pipeline import SCHEDULES

UNEVEN = "layers="  # how Layout.check's uneven-split message starts
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank in a V: rank r holds stages r and 2p - 1 - r


@dataclass(frozen=True)
class ModelSpec:
    """A GPT as minipar's ``nn.GPT`` builds it (learned positions, pre-norm blocks, untied head)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None
    bytes_per_number: int = 2
    name: str = ""

    def __post_init__(self) -> None:
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for key in ("layers", "hidden", "heads", "seq", "vocab", "ffn", "bytes_per_number"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"ModelSpec.{key} must be a positive int, got {getattr(self, key)!r}")

    @property
    def block_parameters(self) -> int:
        """One block: attention ``4h^2 + 4h``, MLP ``2 h f + f + h``, two layer norms ``4h``."""
        h, f = self.hidden, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    @property
    def parameters(self) -> int:
        """Token and position embeddings ``V h + s h``, the blocks, the final layer norm ``2h``, the
        untied head ``h V``."""
        h = self.hidden
        return self.vocab * h + self.seq * h + self.layers * self.block_parameters + 2 * h + h * self.vocab

    def layer_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block for ``tokens`` tokens (matmuls only, 2 per multiply-add)."""
        whole("ModelSpec.layer_flops", "tokens", tokens)
        h, f, s = self.hidden, self.ffn, self.seq
        return tokens * (8 * h * h + 4 * h * f + 4 * s * h)

    def head_flops(self, tokens: int) -> float:
        """Forward FLOPs of the logits."""
        whole("ModelSpec.head_flops", "tokens", tokens)
        return 2.0 * tokens * self.hidden * self.vocab

    def step_flops(self, batch: int, recompute: str = "none") -> float:
        """FLOPs of one training step of ``batch`` sequences (forward + backward = 3 forwards; full
        recomputation 4 forwards of the blocks; selective adds ``Q K^T`` and ``attention x V``)."""
        whole("ModelSpec.step_flops", "batch", batch)
        one_of("ModelSpec.step_flops", "recompute", recompute, RECOMPUTE)
        tokens = batch * self.seq
        layers = self.layers * self.layer_flops(tokens)
        extra = {"none": 0.0, "full": layers, "selective": self.layers * 4.0 * tokens * self.seq * self.hidden}
        return 3 * layers + 3 * self.head_flops(tokens) + extra[recompute]


@dataclass(frozen=True)
class Layout:
    """How a step is split: degrees, ZeRO stage, micro-batching, pipeline schedule, recomputation."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    zero: int = 0
    micro_batch: int = 1
    global_batch: int = 1
    chunks: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    overlap_grad_reduce: bool = False  # Megatron-LM's --overlap-grad-reduce: the dp reduction behind the backward

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def kind(self) -> str:
        """The schedule the bubble and stash formulas use (``interleaved`` whenever chunks > 1, but for
        the V-shaped ZB-V and DualPipeV, whose two chunks are the V's)."""
        return "interleaved" if self.chunks > 1 and self.schedule not in V_SHAPED else self.schedule

    def check(self, model: ModelSpec) -> list[str]:
        """Every reason this layout cannot run ``model``, each saying what to change."""
        out = []
        for key in ("dp", "tp", "pp", "sp", "micro_batch", "global_batch", "chunks"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                out.append(f"{key}={getattr(self, key)!r} must be a positive int")
        if out:
            return out
        t, u, p, v = self.tp, self.sp, self.pp, self.chunks
        for what, n in (("heads", model.heads), ("ffn", model.ffn), ("vocab", model.vocab)):
            if n % t:
                out.append(f"tp={t} does not divide {what}={n}: choose tp among the divisors of {what}")
        if model.seq % u:
            out.append(f"sp={u} does not divide seq={model.seq}: choose sp dividing the sequence length")
        if model.heads % (u * t):
            out.append(f"sp x tp={u * t} does not divide heads={model.heads} (Ulysses gives each rank whole "
                       f"heads): lower sp or tp")
        if p * v > model.layers:
            out.append(f"pp x chunks={p * v} exceeds layers={model.layers}: lower pp or chunks")
        elif model.layers % (p * v):
            out.append(f"{UNEVEN}{model.layers} is not divisible by pp x chunks={p * v} (Megatron splits the "
                       f"layers evenly): choose pp x chunks dividing {model.layers}")
        if self.global_batch % (self.dp * self.micro_batch):
            out.append(f"global_batch={self.global_batch} is not divisible by dp x micro_batch="
                       f"{self.dp * self.micro_batch}: change the batch, dp or micro_batch")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule={self.schedule!r}: choose one of {SCHEDULES} (simulate other schedules with "
                       "minipar.parallel.pipeline.simulate)")
        least = {"zb-h1": p, "zb-h2": p, "zb-v": 2 * p - 1, "dualpipev": 2 * p}.get(self.schedule, 0)
        if self.microbatches < least:
            out.append(f"{self.schedule}'s bubble formula needs microbatches >= {least}, got {self.microbatches}")
        if self.schedule in V_SHAPED and v != 2:
            out.append(f"{self.schedule} places two chunks per rank in a V: chunks must be 2, got {v}")
        if v > 1 and self.schedule not in ("1f1b", "interleaved", *V_SHAPED):
            out.append(f"chunks={v} needs the interleaved schedule, got {self.schedule!r}")
        if v > 1 and p == 1:
            out.append(f"chunks={v} interleaves pipeline stages: needs pp > 1 (or chunks=1)")
        if v > 1 and self.microbatches % p and self.schedule not in V_SHAPED:
            out.append(f"the interleaved schedule needs microbatches ({self.microbatches}) divisible by pp={p}: "
                       f"change the batch or micro_batch")
        if self.sequence_parallel and t == 1:
            out.append("sequence_parallel (Megatron-SP) needs tp > 1: set tp or turn it off")
        elif self.sequence_parallel and model.seq % t:
            out.append(f"sequence_parallel (Megatron-SP) splits the sequence over tp: tp={t} does not divide "
                       f"seq={model.seq}; choose tp dividing the sequence length or turn it off")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero={self.zero!r}: choose a ZeRO stage 0..3")
        if self.overlap_grad_reduce not in (False, True):
            out.append(f"overlap_grad_reduce={self.overlap_grad_reduce!r}: choose True or False")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute={self.recompute!r}: choose one of {RECOMPUTE}")
        return out


SPECS = {"model": ModelSpec, "layout": Layout, "cluster": Cluster}


def check_specs(who: str, **given: Any) -> None:
    """``ValueError`` unless each of ``model``, ``layout``, ``cluster`` given by keyword is a
    ``ModelSpec``, a ``Layout``, a ``Cluster`` (their sizes are checked where they are made:
    ``ModelSpec``, ``Layout.check``, ``Cluster.from_dict``)."""
    for name, value in given.items():
        if not isinstance(value, SPECS[name]):
            raise ValueError(f"{who}: {name}={value!r} must be a {SPECS[name].__name__}")
