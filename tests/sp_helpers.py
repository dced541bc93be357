"""Helpers for tests/test_sequence_parallel.py: hand-picked configurations in ``strategies.sp_configs``'
shape, the degrees a configuration hands the constructor, drawn q/k/v arrays, the training loop
both models run, the online softmax folded block by block, and the numpy references (softmax,
log-sum-exp, per-token cross-entropy) written out by hand."""

from __future__ import annotations

import numpy as np
from strategies import sp_grid
from tp_helpers import batch

from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.sequence import OnlineSoftmax, SequenceParallelGPT

# Attention alone: a handful of float64 sums of O(1) terms per output, in another order than the
# single-process softmax (block by block, rescaled): differences are a few ulps, ~1e-15.
ATTN_TOL = {"rtol": 1e-12, "atol": 1e-12}
LR = 1e-2  # the GPT's AdamW (``train``)


def config(method: str, p: int, seq: int, zigzag: bool = False, causal: bool = True, pu: int | None = None,
           heads: int | None = None, layers: int = 2, seed: int = 5) -> dict:
    """A hand-picked configuration (for ``@example``); ``pu`` is the hybrid grid's Ulysses degree."""
    pu, pr = sp_grid(method, p, pu or 1)
    heads = heads or 2 * pu
    return {"p": p, "method": method, "pu": pu, "pr": pr, "given": "both", "zigzag": zigzag, "causal": causal,
            "seq": seq, "heads": heads, "d": 2 * heads, "ff": None, "vocab": 7, "batch": 2, "layers": layers,
            "seed": seed}


def degrees(c: dict) -> dict:
    """The ``ulysses`` / ``ring`` keywords ``c`` hands the constructor (only "hybrid" takes them)."""
    if c["method"] != "hybrid":
        return {"ulysses": None, "ring": None}
    return {"ulysses": c["pu"] if c["given"] != "ring" else None, "ring": c["pr"] if c["given"] != "ulysses" else None}


def qkv_grad(c: dict) -> list[np.ndarray]:
    """q, k, v and the output's gradient, (batch, S, H d) each, over the whole sequence."""
    rng = np.random.default_rng(c["seed"])
    return [rng.normal(size=(c["batch"], c["seq"], c["d"])) for _ in range(4)]


def train(model: GPT, c: dict, steps: int = 2) -> dict:
    """``steps`` AdamW steps on configuration ``c``'s batches: parameters before, each step's gradients
    (``grads``: name -> one array per step), losses, parameters after. A ``SequenceParallelGPT`` gets its
    own positions and syncs its gradients; ``nn.GPT`` gets the whole sequence, and its logits are kept
    (the per-token losses)."""
    sequence_parallel = isinstance(model, SequenceParallelGPT)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out: dict = {"init": model.state_dict(), "losses": [], "logits": [],
                 "grads": {n: [] for n, _ in model.named_parameters()}}
    for step in range(steps):
        x, y = batch(c, step)
        if sequence_parallel:
            x, y = model.shard(x), model.shard(y)
        else:
            out["logits"].append(model(x).data)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        if sequence_parallel:
            model.sync_grads()
        for n, p in model.named_parameters():
            out["grads"][n].append(p.grad.copy())
        opt.step()
        out["losses"].append(loss.item())
    out["final"] = model.state_dict()
    return out


def log_sum_exp(s: np.ndarray) -> np.ndarray:
    """log sum_j e^(s_j) over the last axis, shifted by the row max; -inf for a row of -inf."""
    m = s.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (shift + np.log(np.exp(s - shift).sum(axis=-1, keepdims=True)))[..., 0]


def softmax(s: np.ndarray) -> np.ndarray:
    """Row softmax, every exponent <= 0."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def fold(s: np.ndarray, v: np.ndarray, widths: list[int], order: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Fold the key blocks (``widths`` columns each) of scores ``s`` (b, H, n, k) and values ``v``
    (b, H, k, d) in ``order``, with numpy raising on any overflow or invalid operation."""
    edges = np.cumsum([0, *widths])
    b, h, n, _ = s.shape
    soft = OnlineSoftmax(b, h, n, v.shape[-1], s.dtype)
    out = np.empty((b, h, n, v.shape[-1]))
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # e^(very negative) may underflow to 0
        for j in order:
            cols = slice(edges[j], edges[j + 1])
            soft.update(slice(0, n), s[..., cols].copy(), v[:, :, cols])
        lse = soft.result(out)
    return out, lse


def softmax_reference(s: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """softmax(s) v and log-sum-exp over the whole row at once; 0 and -inf for a row of -inf."""
    seen = np.isfinite(s).any(axis=-1)
    with np.errstate(invalid="ignore"):
        out = softmax(s) @ v
    out[~seen] = 0.0
    return out, log_sum_exp(s)


def token_losses(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Cross-entropy of every token: log-sum-exp of its logits minus its target's logit."""
    return log_sum_exp(logits) - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


class Watched:
    """A communicator that notes every attribute used besides ``rank``, ``size`` and ``world_rank``:
    a check that touched nothing else sent nothing, not even on the untraced control plane
    (``split`` gathers its table there)."""

    QUIET = ("rank", "size", "world_rank")

    def __init__(self, comm) -> None:
        self._comm, self.used = comm, []

    def __getattr__(self, name: str):
        if name not in self.QUIET:
            self.used.append(name)
        return getattr(self._comm, name)
