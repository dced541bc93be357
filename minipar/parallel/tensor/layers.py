"""Megatron's parallel layers (Shoeybi et al. 2019, Sec. 3): column- and row-parallel linears, the
vocabulary-parallel embedding and the vocabulary-parallel cross-entropy.

With ``Y = X A`` and ``A`` of shape ``(in, out)`` (``minipar.nn.Linear``'s layout):

- column parallel, ``A = [A_1, ..., A_t]``: rank r computes ``Y_r = X A_r``, a slice of the output
  columns; no communication in forward (``f`` is the identity), one all-reduce of ``dX`` backward.
- row parallel, ``A = [A_1; ...; A_t]`` and ``X = [X_1, ..., X_t]`` already split by columns: rank
  r computes the partial sum ``X_r A_r``; ``Y = sum_r X_r A_r`` needs one all-reduce forward (``g``).
  The bias is added once, after the reduction.

The two linears run as single autograd ops, as Megatron-LM runs them: ``ColumnParallelMatmul``
(enter the region and multiply: Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``)
and ``RowParallelMatmul`` (multiply, leave the region, add the bias and the residual: its
row-parallel linear followed by bias-dropout-add, without dropout). Each keeps only its input for
backward, which is what Korthikanti et al. 2022 (Sec. 4.1) count.

Split backward (zero bubble, ``minipar.split_backward``; Qi et al. 2024, Sec. 2): asked for the
input's gradient alone (``I``), a linear runs the input-gradient GEMM and the collective that goes
with it (``f``'s all-reduce, the sequence-parallel reduce-scatter, ``g-bar``'s all-gather of the
gradient); asked for the weights' alone (``W``), it runs ``X^T dY`` and ``sum dY``, local, except
that under sequence parallelism the column-parallel input is gathered again inside ``W``: the
re-gather Megatron-LM runs in backward anyway, now a communication of its own that the schedule
places with its ``W`` (a ``re-gather`` mark inside the ``W`` span; ``cost.hybrid.w_regather_bytes``).
Re-gathering rather than keeping the gathered input keeps the activations a W waits with at the
sequence shard, ``1/t`` of the gathered input. The row-parallel linear keeps the gradient ``g-bar``
gathered in ``I`` for its ``W`` (Megatron's zero-bubble ``WeightGradStore`` keeps ``grad_output``):
gathering it again would cost a second all-gather. Each collective runs once per backward either way.

Every sharded weight is a ``Parameter`` with ``full_shape`` and ``shard``, so each rank generates
only its slice of the single-process initialisation: the model starts identical.
``gather_state_dict`` / ``gather_grads`` put the shards back together (all-gathers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import functional as F
from minipar import trace
from minipar.autograd import BF16, Context, Function, Tensor
from minipar.nn import Module, Parameter
from minipar.parallel.tensor import fp8 as tp_fp8
from minipar.parallel.tensor.comm_ops import ALGORITHM, allgather, allreduce, exit_region, gather_last, reduce_scatter


def _split(n: int, t: int, rank: int, what: str, fix: str) -> tuple[int, int]:
    if n % t:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel degree t={t}; {fix}")
    k = n // t
    return rank * k, (rank + 1) * k


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` as a matrix of rows (every leading axis flattened): for weight gradients ``X^T dY``."""
    return a.reshape(-1, a.shape[-1])


class ColumnParallelMatmul(Function):
    """Enter the tensor-parallel region and apply column-parallel linears, as one op:
    ``[X A_1 + b_1, ..., X A_n + b_n]`` (concatenated on the last axis) with ``X = f(x)`` (Megatron's
    ``f``: identity) or, under sequence parallelism, ``X = g(x)`` (Korthikanti et al.'s ``g``: the
    all-gather of the sequence shards). Several linears share one entry (q, k and v, as Megatron's
    fused QKV weight does).

    Keeps only ``x``: under sequence parallelism the sequence shard, not the gathered ``X``. Backward
    gathers it again for the weight gradient, as Korthikanti et al. 2022 (Sec. 4.2.2) and Megatron-LM
    do ("an extra all-gather" in backward, marked ``re-gather`` in the trace; split, in W). Backward:
    ``dA_i = X^T dY_i``, ``db_i = sum dY_i``, ``dX = sum_i dY_i A_i^T``, then all-reduced (``f``'s
    backward) or reduce-scattered (``g``'s) to the shape of ``x``.
    Call as ``apply(x, comm, sequence_parallel, A_1, .., A_n, b_1, .., b_n)`` (a bias may be None).
    """

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any, sequence_parallel: bool, *params: Any) -> np.ndarray:
        n = len(params) // 2
        weights, biases = params[:n], params[n:]
        ctx.comm, ctx.sp = comm, sequence_parallel
        ctx.save_for_backward(x, *weights)  # saved, the weights are their parameters: ZeRO-3 may free the arrays
        whole = allgather(comm, x, weights[0].dtype == BF16) if sequence_parallel else x
        outs = [whole @ w if b is None else whole @ w + b for w, b in zip(weights, biases, strict=True)]
        return outs[0] if n == 1 else np.concatenate(outs, axis=-1)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        x, *weights = ctx.saved
        n, needs = len(weights), ctx.needs_input_grad  # I, W or both (module docstring)
        want_x, want_w, want_b = needs[0], needs[3:3 + n], needs[3 + n:]
        whole = None
        if any(want_w) or any(want_b):
            if ctx.sp:
                trace.mark("re-gather", nbytes=x.nbytes)
            whole = allgather(ctx.comm, x, weights[0].dtype == BF16) if ctx.sp else x
        edges = np.cumsum([w.shape[1] for w in weights])[:-1]
        d_weights, d_biases = [None] * n, [None] * n
        dx = np.zeros((x.shape[0] * ctx.comm.size if ctx.sp else x.shape[0], *x.shape[1:]), dtype=grad.dtype)
        for i, (w, g) in enumerate(zip(weights, np.split(grad, edges, axis=-1), strict=True)):
            if want_w[i]:
                d_weights[i] = _rows(whole).T @ _rows(g)
            if want_b[i]:
                d_biases[i] = _rows(g).sum(axis=0)
            if want_x:
                dx += g @ w.T
        if not want_x:
            return (None, None, None, *d_weights, *d_biases)
        dx = (reduce_scatter if ctx.sp else allreduce)(ctx.comm, dx, weights[0].dtype == BF16)
        return (dx, None, None, *d_weights, *d_biases)


class RowParallelMatmul(Function):
    """Multiply, leave the tensor-parallel region, add the bias and the residual, as one op:
    ``y = g(X_r A_r) + b + residual`` with Megatron's ``g`` (all-reduce of the ranks' partial sums)
    or, under sequence parallelism, Korthikanti et al.'s ``g-bar`` (reduce-scatter: each rank keeps
    its sequence shard). Megatron-LM's row-parallel linear followed by its fused bias-dropout-add,
    without dropout.

    Keeps only ``x`` (the partial sum and the reduced output are not kept). Backward: ``g-bar``'s
    all-gather of the gradient (identity for ``g``), then ``dA_r = X_r^T dY``, ``dX_r = dY A_r^T``;
    ``db = sum dY`` and ``d residual = dY`` on this rank's rows. Split, I gathers and keeps ``dY`` for W.
    Call as ``apply(x, comm, sequence_parallel, A_r, b_or_None, residual_or_None)``.
    """

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any, sequence_parallel: bool, weight: np.ndarray,
                bias: np.ndarray | None, residual: np.ndarray | None) -> np.ndarray:
        ctx.comm, ctx.sp = comm, sequence_parallel
        ctx.save_for_backward(x, weight)  # saved, the weight is its parameter (ZeRO-3 frees the array)
        partial = x @ weight
        y = (reduce_scatter if sequence_parallel else allreduce)(comm, partial, weight.dtype == BF16)
        y = y + bias if bias is not None else np.array(y, copy=True)
        if residual is not None:
            y += residual
        return y

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        x, weight = ctx.saved
        want_x, want_w, want_b, want_r = (ctx.needs_input_grad[i] for i in (0, 3, 4, 5))  # I, W or both
        whole = ctx.__dict__.pop("grad_whole", None)  # gathered by this op's I for its W
        if whole is None:
            whole = allgather(ctx.comm, grad, weight.dtype == BF16) if ctx.sp else grad
        if ctx.sp and not want_w:
            ctx.grad_whole = whole  # I of a split backward: W reads it (a frozen weight: freed with the graph)
        return (whole @ weight.T if want_x else None, None, None, _rows(x).T @ _rows(whole) if want_w else None,
                _rows(grad).sum(axis=0) if want_b else None, grad if want_r else None)


class ColumnParallelLinear(Module):
    """``Y = X A + b`` with ``A``'s columns (and ``b``) split: rank r owns columns ``[r n/t, (r+1) n/t)``.

    ``forward(x)`` enters the region (``f``, or the all-gather when ``sequence_parallel``: ``x`` is
    then a sequence shard along axis 0) and returns this rank's output columns, or all of them
    when ``gather_output`` (one all-gather along the last axis); one ``ColumnParallelMatmul``.
    ``column_parallel(x, [q, k, v])`` enters once for several linears.
    Cost per rank: ``in * out / t`` weights, ``2 m in out / t`` flops for ``m`` rows.
    ``fp8``: an ``fp8.Fp8Meta`` (``fp8.enable``) runs the GEMMs in FP8 (``tp_fp8.column``).
    """

    fp8: Any = None

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

    def forward(self, x: Tensor) -> Tensor:
        y = column_parallel(x, [self])
        return gather_last.apply(y, self.comm) if self.gather_output else y


def column_parallel(x: Tensor, linears: list[ColumnParallelLinear]) -> Tensor:
    """``[lin(x) for lin in linears]`` concatenated on the last axis, entering the region once."""
    first = linears[0]
    if first.fp8 is not None:
        return tp_fp8.column(x, linears)
    return ColumnParallelMatmul.apply(x, first.comm, first.sequence_parallel, *(lin.weight for lin in linears),
                                      *(lin.bias for lin in linears))


class RowParallelLinear(Module):
    """``Y = sum_r X_r A_r + b`` with ``A``'s rows split: rank r owns rows ``[r n/t, (r+1) n/t)`` and
    receives ``X_r``, the matching columns of the input (a column-parallel layer's output).

    The partial sums leave the region through ``g`` (all-reduce) or, when ``sequence_parallel``,
    the reduce-scatter (each rank keeps its sequence shard); ``forward(x, residual)`` adds the bias
    and the residual in the same op (``RowParallelMatmul``). The bias is replicated; under sequence
    parallelism each rank sees only its shard's gradient of it, so ``grad_sync_params`` names it.
    ``fp8``: an ``fp8.Fp8Meta`` (``fp8.enable``) runs the GEMM in FP8 (``tp_fp8.row``).
    """

    fp8: Any = None

    def __init__(self, in_features: int, out_features: int, comm: Any, bias: bool = True,
                 sequence_parallel: bool = False, dtype: Any = np.float64) -> None:
        lo, hi = _split(in_features, comm.size, comm.rank, "in_features",
                        "choose in_features (heads or d_ff) as a multiple of t")
        self.comm, self.sequence_parallel = comm, sequence_parallel
        bound = 1.0 / np.sqrt(in_features)  # the full fan-in, as in the single-process layer
        self.weight = Parameter((hi - lo, out_features), ("uniform", bound), dtype,
                                full_shape=(in_features, out_features), shard=(slice(lo, hi), slice(None)))
        self.bias = Parameter((out_features,), ("uniform", bound), dtype) if bias else None

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if self.fp8 is not None:
            return tp_fp8.row(self, x, residual)
        return RowParallelMatmul.apply(x, self.comm, self.sequence_parallel, self.weight, self.bias, residual)

    def grad_sync_params(self) -> list[Parameter]:
        """Replicated parameters that see only this rank's sequence shard's gradient."""
        return [self.bias] if self.sequence_parallel and self.bias is not None else []


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
