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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import trace
from minipar.autograd import Context, Function, Tensor

ALGORITHM = "ring"  # hand-written ring collectives: every message is in the trace


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
    """Megatron's ``g``: all-reduce (sum of the ranks' partial outputs) forward, identity backward."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any) -> np.ndarray:
        return comm.allreduce(x, op="sum", algorithm=ALGORITHM)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        return grad, None


class sp_reduce_scatter(Function):  # Korthikanti et al.'s ``g-bar``
    """Sequence-parallel ``g-bar``: reduce-scatter the partial sums along the sequence (axis 0)
    forward, all-gather the shards' gradients backward. Replaces Megatron's ``g``."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Any) -> np.ndarray:
        ctx.comm = comm
        return comm.reduce_scatter(x, op="sum", algorithm=ALGORITHM)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray, None]:
        return ctx.comm.allgather(grad, algorithm=ALGORITHM), None


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
    """Out of a tensor-parallel region (partial sums): ``g`` (or ``sp_reduce_scatter``)."""
    return sp_reduce_scatter.apply(x, comm) if sequence_parallel else g.apply(x, comm)


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
