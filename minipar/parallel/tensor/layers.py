"""Megatron's parallel layers (Shoeybi et al. 2019, Sec. 3): column- and row-parallel linears, the
vocabulary-parallel embedding and the vocabulary-parallel cross-entropy.

With ``Y = X A`` and ``A`` of shape ``(in, out)`` (``minipar.nn.Linear``'s layout):

- column parallel, ``A = [A_1, ..., A_t]``: rank r computes ``Y_r = X A_r``, a slice of the output
  columns; no communication in forward (``f`` is the identity), one all-reduce of ``dX`` backward.
- row parallel, ``A = [A_1; ...; A_t]`` and ``X = [X_1, ..., X_t]`` already split by columns: rank
  r computes the partial sum ``X_r A_r``; ``Y = sum_r X_r A_r`` needs one all-reduce forward (``g``).
  The bias is added once, after the reduction.

Every sharded weight is a ``Parameter`` with ``full_shape`` and ``shard``, so ``init_parameters``
gives each rank its slice of the single-process initialisation: the model starts identical.
``gather_state_dict`` / ``gather_grads`` put the shards back together (all-gathers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import functional as F
from minipar.autograd import Context, Function, Tensor
from minipar.nn import Module, Parameter
from minipar.parallel.tensor.comm_ops import ALGORITHM, enter_region, exit_region, gather_last


def _split(n: int, t: int, rank: int, what: str, fix: str) -> tuple[int, int]:
    if n % t:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel degree t={t}; {fix}")
    k = n // t
    return rank * k, (rank + 1) * k


class ColumnParallelLinear(Module):
    """``Y = X A + b`` with ``A``'s columns (and ``b``) split: rank r owns columns ``[r n/t, (r+1) n/t)``.

    ``forward(x)`` enters the region (``f``, or ``sp_gather`` when ``sequence_parallel``: ``x`` is
    then a sequence shard along axis 0) and returns this rank's output columns, or all of them
    when ``gather_output`` (one all-gather along the last axis). ``local(x)`` is the matmul alone,
    for callers that entered the region once for several linears (q, k, v).
    Cost per rank: ``in * out / t`` weights, ``2 m in out / t`` flops for ``m`` rows.
    """

    def __init__(self, in_features: int, out_features: int, comm: Any, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 dtype: Any = np.float64) -> None:
        lo, hi = _split(out_features, comm.size, comm.rank, "out_features",
                        "choose out_features (heads, d_ff or vocabulary) as a multiple of t")
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.col_start = lo
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Parameter((in_features, hi - lo), ("uniform", bound), dtype,
                                full_shape=(in_features, out_features), shard=(slice(None), slice(lo, hi)))
        self.bias = Parameter((hi - lo,), ("uniform", bound), dtype, full_shape=(out_features,),
                              shard=(slice(lo, hi),)) if bias else None

    def local(self, x: Tensor) -> Tensor:
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y

    def forward(self, x: Tensor) -> Tensor:
        y = self.local(enter_region(x, self.comm, self.sequence_parallel))
        return gather_last.apply(y, self.comm) if self.gather_output else y


class RowParallelLinear(Module):
    """``Y = sum_r X_r A_r + b`` with ``A``'s rows split: rank r owns rows ``[r n/t, (r+1) n/t)`` and
    receives ``X_r``, the matching columns of the input (a column-parallel layer's output).

    The partial sums leave the region through ``g`` (all-reduce) or, when ``sequence_parallel``,
    ``sp_reduce_scatter`` (each rank keeps its sequence shard). The bias is replicated and added
    after the reduction; under sequence parallelism each rank sees only its shard's gradient of it,
    so it is marked ``sequence_parallel`` for ``sync_sequence_parallel_grads``.
    """

    def __init__(self, in_features: int, out_features: int, comm: Any, bias: bool = True,
                 sequence_parallel: bool = False, dtype: Any = np.float64) -> None:
        lo, hi = _split(in_features, comm.size, comm.rank, "in_features",
                        "choose in_features (heads or d_ff) as a multiple of t")
        self.comm, self.sequence_parallel = comm, sequence_parallel
        bound = 1.0 / np.sqrt(in_features)  # the full fan-in, as in the single-process layer
        self.weight = Parameter((hi - lo, out_features), ("uniform", bound), dtype,
                                full_shape=(in_features, out_features), shard=(slice(lo, hi), slice(None)))
        self.bias = Parameter((out_features,), ("uniform", bound), dtype) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel

    def partial(self, x: Tensor) -> Tensor:
        """This rank's partial sum ``X_r A_r`` (full size: inside the tensor-parallel region)."""
        return x @ self.weight

    def reduce(self, partial: Tensor) -> Tensor:
        """Leave the region: sum the ranks' partial sums (``g`` or ``sp_reduce_scatter``), add the bias."""
        y = exit_region(partial, self.comm, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(self.partial(x))


class VocabParallelEmbedding(Module):
    """Embedding table split by rows: rank r owns tokens ``[r V/t, (r+1) V/t)`` (Megatron Sec. 3).

    Each rank looks up the tokens it owns, writes zeros for the others, and the ranks' partial
    outputs are summed by one all-reduce (``g``) or, with ``sequence_parallel``, reduce-scattered
    along axis 0 (``idx`` must then be ``[seq, batch]``). Backward needs no communication.
    Memory per rank: ``V d / t`` weights.
    """

    def __init__(self, num_embeddings: int, dim: int, comm: Any, sequence_parallel: bool = False,
                 dtype: Any = np.float64) -> None:
        lo, hi = _split(num_embeddings, comm.size, comm.rank, "vocab_size",
                        "pad the vocabulary to a multiple of t")
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings, self.vocab_start, self.vocab_end = num_embeddings, lo, hi
        self.weight = Parameter((hi - lo, dim), ("normal", 1.0), dtype, full_shape=(num_embeddings, dim),
                                shard=(slice(lo, hi), slice(None)))

    def partial(self, idx: np.ndarray) -> Tensor:
        """This rank's partial sum: its tokens' rows, zeros for the others (every position)."""
        idx = np.asarray(idx)
        check_tokens(idx, self.num_embeddings, "token ids")
        if self.sequence_parallel and (idx.ndim == 0 or idx.shape[0] % self.comm.size):
            raise ValueError(f"sequence parallelism splits axis 0 of the tokens {idx.shape} over t="
                             f"{self.comm.size} ranks; make the sequence length a multiple of t")
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = np.where(outside, 0, idx - self.vocab_start)
        return F.embedding(self.weight, local) * (~outside)[..., None].astype(self.weight.dtype)

    def forward(self, idx: np.ndarray) -> Tensor:
        return exit_region(self.partial(idx), self.comm, self.sequence_parallel)


def check_tokens(idx: np.ndarray, vocab_size: int, what: str) -> None:
    """ValueError (before any communication) unless ``idx`` holds integers in ``[0, vocab_size)``."""
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {idx.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= vocab_size):
        raise ValueError(f"{what} must lie in [0, {vocab_size}); got values in [{idx.min()}, {idx.max()}]")


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy of logits split over the vocabulary, never gathering them (Megatron).

    Rank r holds ``z_r`` = the logits of its vocabulary slice. Three all-reduces of one number per
    position: ``m = max_r max z_r`` (op max), ``S = sum_r sum exp(z_r - m)`` and the target's logit
    ``z_y - m`` (summed; only the owner contributes). ``loss = mean(log S - (z_y - m))``.
    Backward is local: ``(softmax(z_r) - onehot_r(y)) / N``. Memory: the local logits and softmax,
    ``2 N V / t`` numbers; bytes per rank: 3 all-reduces of ``N`` numbers for ``N`` positions.
    """

    @staticmethod
    def forward(ctx: Context, logits: np.ndarray, targets: np.ndarray, comm: Any) -> np.ndarray:
        width = logits.shape[-1]
        start = comm.rank * width
        m = comm.allreduce(logits.max(axis=-1), op="max", algorithm=ALGORITHM)
        soft = np.exp(logits - m[..., None])
        total = comm.allreduce(soft.sum(axis=-1), op="sum", algorithm=ALGORITHM)
        inside = (targets >= start) & (targets < start + width)
        local_t = np.where(inside, targets - start, 0)
        picked = np.take_along_axis(logits, local_t[..., None], axis=-1)[..., 0] - m
        picked = np.where(inside, picked, 0.0).astype(logits.dtype)
        picked = comm.allreduce(picked, op="sum", algorithm=ALGORITHM)
        soft /= total[..., None]
        ctx.save_for_backward(soft, local_t, inside)
        return np.asarray((np.log(total) - picked).mean(), dtype=logits.dtype)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None, None]:
        soft, local_t, inside = ctx.saved
        d = soft.copy()
        at = local_t[..., None]
        np.put_along_axis(d, at, np.take_along_axis(d, at, axis=-1) - inside[..., None], axis=-1)
        d *= grad / local_t.size
        return d, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: np.ndarray, comm: Any) -> Tensor:
    """Cross-entropy of ``logits`` (this rank's vocabulary slice, rank order) against ``targets``
    (full-vocabulary ids, shape ``logits.shape[:-1]``); equal on every rank to ``F.cross_entropy``
    of the gathered logits."""
    targets = np.asarray(targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {targets.shape} do not match logits {logits.shape}: "
                         f"need {logits.shape[:-1]}")
    check_tokens(targets, logits.shape[-1] * comm.size, "targets")
    return VocabParallelCrossEntropy.apply(logits, targets, comm)


# ---- putting the shards back together (tests, lessons, checkpoints) ----------------------------
def gather_array(local: np.ndarray, param: Parameter, comm: Any) -> np.ndarray:
    """The full array of a sharded parameter from every rank's ``local`` piece (an all-gather along
    the sharded axis); a replicated parameter's array is returned as is."""
    if param.shard is None or tuple(param.shape) == tuple(param.full_shape):
        return np.array(local, copy=True)
    axes = [a for a, (n, full) in enumerate(zip(param.shape, param.full_shape)) if n != full]
    if len(axes) != 1:
        raise ValueError(f"parameter sharded along {len(axes)} axes; gather_array handles one")
    moved = np.ascontiguousarray(np.moveaxis(local, axes[0], 0))
    whole = comm.allgather(moved, algorithm=ALGORITHM)
    return np.ascontiguousarray(np.moveaxis(whole, 0, axes[0]))


def gather_state_dict(model: Module, comm: Any) -> dict[str, np.ndarray]:
    """The single-process state dict of a tensor-parallel model (same names, full arrays), on every rank."""
    return {name: gather_array(p.data, p, comm) for name, p in model.named_parameters()}


def gather_grads(model: Module, comm: Any) -> dict[str, np.ndarray]:
    """Full gradients by parameter name (zeros where a parameter got none), on every rank."""
    return {name: gather_array(p.grad if p.grad is not None else np.zeros_like(p.data), p, comm)
            for name, p in model.named_parameters()}
