"""Helpers for tests/test_zero.py: hand-picked configurations in ``strategies.zero_configs``' shape, the
model, batches and optimizer both sides use, a rank's rows of the global batch, and the sizes ZeRO and
FSDP work with, written out by hand from the GPT's definition (``minipar.nn``), not read from a layout."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from sp_helpers import Watched

from minipar import nn, trace

LR, WEIGHT_DECAY = 1e-2, 0.1
SMALL_CAP, LARGE_CAP = 200, 1 << 20
# Gradients: each rank sums its rows, the ring adds N partial sums in another order than one process,
# then / N: a few ulps of the largest term (seen: 2e-16 absolute on entries <= O(1)). test_zero asserts
# it of ZeRO's and FSDP's gradients; the parameter checks after AdamW steps (``tolerances``) rely on it.
GRAD_TOL = {"rtol": 1e-10, "atol": 1e-12}
# Parameters after AdamW steps: the update's own rounding (a few ulps of the parameter and of lr per
# step), plus the drift AdamW makes of gradients GRAD_TOL apart (``tolerances.assert_close_after_adamw``):
# ~ lr GRAD_TOL / |g| where |g| >> eps, up to 2 lr GRAD_TOL / eps per step where the exact gradient is
# zero (the key bias; q and k with a one-token sequence; what feeds a 2-wide model's layer norms).
PARAM_TOL = {"rtol": 1e-10, "atol": 1e-11}


def config(mode: str, world: int, cap: int = SMALL_CAP, reshard: bool = True, prefetch: bool = True,
           deferred: bool = True, d: int = 4, heads: int = 2, layers: int = 2, steps: int = 3, seed: int = 7) -> dict:
    """A hand-picked configuration (for ``@example``); vocabulary 5 and d = 4 make most groups need
    padding at N = 3 (``test_zero.BY_HAND``), d = 3 at N = 2 and 4."""
    return {"mode": mode, "world": world, "cap": cap, "reshard": reshard, "prefetch": prefetch, "deferred": deferred,
            "vocab": 5, "seq": 3, "d": d, "heads": heads, "layers": layers, "batch": 2 * world, "steps": steps,
            "seed": seed}


def build(c: dict) -> nn.GPT:
    return nn.GPT(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], seed=c["seed"])


def batch(c: dict, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and targets ``(batch, seq)`` of the global batch at ``step``."""
    x, y = np.random.default_rng([c["seed"], step]).integers(0, c["vocab"], (2, c["batch"], c["seq"]))
    return x, y


def rows(c: dict, rank: int) -> slice:
    """Rank ``rank``'s contiguous 1/N of the batch rows."""
    k = c["batch"] // c["world"]
    return slice(rank * k, (rank + 1) * k)


def train_steps(comm, c: dict, model: nn.GPT, par) -> tuple[list[float], trace.Recorder]:
    """``c["steps"]`` steps of ``par`` (ZeRO or FSDP) on this rank's rows of each batch, recorded: the
    losses and the recorder."""
    losses = []
    with trace.recording(comm.rank) as rec:
        for i in range(c["steps"]):
            x, y = batch(c, i)
            loss = model.loss(x[rows(c, comm.rank)], y[rows(c, comm.rank)])
            par.backward(loss)
            par.step()
            losses.append(loss.item())
    return losses, rec


def param_sizes(c: dict) -> dict[str, int]:
    """Every parameter's number of elements, by name, from the definitions in ``minipar.nn``: embeddings
    V x d and S x d; per block two layer norms (weight, bias: d each), q, k, v, proj (d x d + d), the
    feed-forward d -> 4d -> d; the final layer norm; the head d x V without bias."""
    d, f, v = c["d"], 4 * c["d"], c["vocab"]
    out = {"tok_emb.weight": v * d, "pos_emb.weight": c["seq"] * d}
    for i in range(c["layers"]):
        block = {"ln1.weight": d, "ln1.bias": d, **{f"attn.{w}.{kind}": d * d if kind == "weight" else d
                                                     for w in "qkv" for kind in ("weight", "bias")},
                 "attn.proj.weight": d * d, "attn.proj.bias": d, "ln2.weight": d, "ln2.bias": d,
                 "mlp.fc.weight": d * f, "mlp.fc.bias": f, "mlp.proj.weight": f * d, "mlp.proj.bias": d}
        out.update({f"blocks.{i}.{k}": n for k, n in block.items()})
    out.update({"ln_f.weight": d, "ln_f.bias": d, "head.weight": d * v})
    return out


def unit_sizes(c: dict) -> list[int]:
    """Elements of each FSDP unit of ``transformer_units``, in order: tok_emb, pos_emb, the blocks,
    ln_f, head."""
    sizes = param_sizes(c)
    prefixes = ["tok_emb.", "pos_emb.", *(f"blocks.{i}." for i in range(c["layers"])), "ln_f.", "head."]
    return [sum(n for k, n in sizes.items() if k.startswith(p)) for p in prefixes]


def padded(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``world``: L of a flat group."""
    return -(-numel // world) * world


def ring_bytes(numel: int, world: int) -> int:
    """Bytes a rank sends in one ring reduce-scatter, or one ring all-gather, of a padded float64
    buffer of ``numel`` elements: N - 1 blocks of ``padded / N`` elements."""
    return (world - 1) * padded(numel, world) // world * 8


def first_gradients(optimizer) -> list[list[np.ndarray]]:
    """Make ``optimizer.step`` (a ``ShardedAdamW``) copy its shards' gradients the first time it runs
    (they are cleared after): the list it fills, empty until then."""
    seen, step = [], optimizer.step

    def spy() -> bool:
        if not seen:
            seen.append([s.grad.copy() for s in optimizer.shards])
        return step()

    optimizer.step = spy
    return seen


def attempt(comm, make: Callable) -> tuple[str, int, list[str]]:
    """``make(comm)`` on a watched communicator: the ``ValueError``'s message ("accepted" when none),
    the comm events recorded meanwhile, and the communicator's attributes used besides rank and size
    (a check that touched none sent nothing, not even on the untraced control plane)."""
    watched = Watched(comm)
    with trace.recording(comm.rank) as rec:
        try:
            make(watched)
            msg = "accepted"
        except ValueError as exc:
            msg = str(exc)
    return msg, sum(e.kind == "comm" for e in rec.events), watched.used
