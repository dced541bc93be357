"""Communication inside the autograd graph: Megatron's conjugate operators ``f`` and ``g``, and the
all-gather / reduce-scatter pair of sequence parallelism that takes their places.

Megatron-LM (Shoeybi et al. 2019, Sec. 3, Fig. 3): "f is an identity operator in the forward pass
and all reduce in the backward pass while g is an all reduce in the forward pass and identity in
the backward pass." ``f`` enters a tensor-parallel region (every rank needs the whole input; the
input's gradient is a sum of every rank's partial gradient), ``g`` leaves it (every rank holds a
partial sum of the output).

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.2.2, Fig. 5): "g is all-gather in the forward pass and reduce-scatter
in the backward pass. g-bar is reduce-scatter in forward pass and all-gather in backward pass."
Their ``g`` takes the place of Megatron's ``f`` and their ``g-bar`` takes the place of Megatron's
``g`` (``sp_reduce_scatter`` here), so layer norms and residual adds work on a 1/t sequence shard.
"A ring all-reduce is composed of two steps: a reduce-scatter followed by an all-gather", so the
bytes sent are the same as with ``f``/``g``.

Where a region is entered, the entry operator (``f``, or Korthikanti et al.'s ``g``) is fused with
the column-parallel linear that follows it (``layers.ColumnParallelMatmul``): keeping only the
sequence shard means its backward must all-gather again, which only the fused op can do. The exit
operators live here as ``Function``s (``g``, ``sp_reduce_scatter``, used by the vocabulary-parallel
embedding) and, fused with the bias and residual add, in ``layers.RowParallelMatmul``.

Layout: the comm layer gathers and scatters along axis 0, so activations inside the blocks are
Megatron's ``[seq, batch, hidden]``: rank r's sequence shard is rows ``[r T/t, (r+1) T/t)``.

Costs per call on t ranks for an activation of n bytes (ring): ``f``/``g`` all-reduce sends
2(t-1)/t n bytes per rank; the all-gather and the reduce-scatter send (t-1)/t n each.

A bfloat16 model (``minipar.parallel.bf16``) communicates in its own dtype, as Megatron-LM does
(activations and their gradients travel in the model's dtype): ``allreduce`` / ``reduce_scatter`` /
``allgather`` below send bfloat16, 2 bytes an element. Gathered values are bf16 already (exact);
a sum's terms (a row-parallel partial ``X_r A_r``, a column-parallel ``dX_r``, summed in float32
by the GEMM) are rounded to bf16 before they leave, as a GPU's bf16 GEMM output is, and the ring
rounds each partial sum to bf16 (``ml_dtypes`` adds in float32 and rounds). The vocabulary-parallel
loss's statistics stay float32 (Megatron's cross entropy runs in fp32).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import BF16, Context, Function, Tensor

ALGORITHM = "ring"  # hand-written ring collectives: every message is in the trace


def is_bf16(x: Tensor) -> bool:
    """Whether ``x`` holds a bfloat16 model's values (a bf16 parameter or an op's bf16-rounded result)."""
    return x._bf16 or x.data.dtype == BF16


def allreduce(comm: Any, a: np.ndarray, bf16: bool) -> np.ndarray:
    """Sum ``a`` over the group; with ``bf16`` in bfloat16 on the wire, back as float32 (module docstring)."""
    if not bf16:
        return comm.allreduce(a, op="sum", algorithm=ALGORITHM)
    return comm.allreduce(a.astype(BF16), op="sum", algorithm=ALGORITHM).astype(np.float32)


def reduce_scatter(comm: Any, a: np.ndarray, bf16: bool) -> np.ndarray:
    """Sum ``a`` over the group, keep this rank's axis-0 shard; bfloat16 on the wire with ``bf16``."""
    if not bf16:
        return comm.reduce_scatter(a, op="sum", algorithm=ALGORITHM)
    return comm.reduce_scatter(a.astype(BF16), op="sum", algorithm=ALGORITHM).astype(np.float32)


def allgather(comm: Any, a: np.ndarray, bf16: bool) -> np.ndarray:
    """Concatenate the ranks' ``a`` on axis 0; with ``bf16`` (values already bf16: exact) 2 bytes each."""
    if not bf16:
        return comm.allgather(a, algorithm=ALGORITHM)
    return comm.allgather(a.astype(BF16), algorithm=ALGORITHM).astype(np.float32)


class f(Function):  # the paper's name
    """Megatron's ``f``: identity forward, all-reduce (sum over the tensor-parallel group) backward.
    The layers fuse it with the column-parallel linear (``layers.ColumnParallelMatmul``); on its
    own it shows the operator, as in the lesson's walkthrough."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any) -> np.ndarray:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        return ctx.comm.allreduce(grad, op="sum", algorithm=ALGORITHM), None


class g(Function):  # the paper's name
    """Megatron's ``g``: all-reduce (sum of the ranks' partial outputs) forward, identity backward.
    ``bf16`` (given by ``exit_region``): the partial outputs are a bfloat16 model's, summed in bfloat16."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any, bf16: bool | None = None) -> np.ndarray:
        ctx.n = 1 if bf16 is None else 2  # arguments after x: a gradient (None) each
        return allreduce(comm, x, bool(bf16))

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return (grad, *[None] * ctx.n)


class sp_reduce_scatter(Function):  # Korthikanti et al.'s ``g-bar``
    """Sequence-parallel ``g-bar``: reduce-scatter the partial sums along the sequence (axis 0)
    forward, all-gather the shards' gradients backward. Replaces Megatron's ``g``; ``bf16`` as ``g``'s."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any, bf16: bool) -> np.ndarray:
        ctx.comm, ctx.bf16 = comm, bf16
        return reduce_scatter(comm, x, bf16)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return (allgather(ctx.comm, grad, ctx.bf16), None, None)


class gather_last(Function):  # Megatron's gather_from_tensor_model_parallel_region
    """All-gather along the LAST axis forward (a column-parallel output made whole), keep this
    rank's slice of the gradient backward (no communication)."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any) -> np.ndarray:
        ctx.rank, ctx.width = comm.rank, x.shape[-1]
        whole = comm.allgather(np.ascontiguousarray(np.moveaxis(x, -1, 0)), algorithm=ALGORITHM)
        return np.ascontiguousarray(np.moveaxis(whole, 0, -1))

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        lo = ctx.rank * ctx.width
        return np.ascontiguousarray(grad[..., lo:lo + ctx.width]), None


def exit_region(x: Tensor, comm: Any, sequence_parallel: bool) -> Tensor:
    """Out of a tensor-parallel region (partial sums): ``g`` (or ``sp_reduce_scatter``), in bfloat16 for
    a bf16 model's ``x``."""
    return (sp_reduce_scatter if sequence_parallel else g).apply(x, comm, is_bf16(x))


class ActivationMeter:
    """Bytes of activations kept for backward on this rank, by label, sampled into the trace.

    The model feeds it bytes measured from its autograd graph (``memory.held_buffers``), by the
    region whose code allocated each buffer. Labels: ``activations/ln`` (layer-norm and residual
    region, on the sequence shard under sequence parallelism: layer-norm outputs, reduced outputs
    of ``g`` / ``sp_reduce_scatter``, bias and residual sums, the embedding's reduced sum),
    ``activations/tp`` (made inside the tensor-parallel regions: gathered inputs, local q, k, v,
    scores and softmax, local MLP hidden, row-parallel and embedding partial sums) and
    ``activations/logits`` (the vocabulary-parallel logits and what the loss saves). ``peak``
    keeps the largest total per label since the last ``reset``.
    """

    LABELS = ("activations/ln", "activations/tp", "activations/logits")

    def __init__(self) -> None:
        self.held = dict.fromkeys(self.LABELS, 0)
        self.peak = dict.fromkeys(self.LABELS, 0)

    def hold(self, label: str, nbytes: int) -> None:
        self.held[label] += int(nbytes)
        self.peak[label] = max(self.peak[label], self.held[label])
        trace.memory(label, self.held[label])

    def release(self, label: str, nbytes: int) -> None:
        self.held[label] = max(0, self.held[label] - int(nbytes))
        trace.memory(label, self.held[label])

    def reset(self) -> None:
        """Forget everything held (a new forward pass starts); samples zeros for labels in use."""
        for label in self.LABELS:
            if self.held[label]:
                self.held[label] = 0
                trace.memory(label, 0)
        self.peak = dict.fromkeys(self.LABELS, 0)
