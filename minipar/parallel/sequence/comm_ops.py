"""The communication of sequence parallelism: DeepSpeed-Ulysses' two all-to-alls as autograd
``Function``s, and Ring Attention's hand-off of a block to the next rank.

Ulysses (Jacobs et al. 2023, Sec. 3.1, Fig. 2): "prior to attention computation, it employs
all-to-all communication collective on the partitioned queries, keys and values such that each GPU
receives the full sequence but only for a non-overlapping subset of the attention heads ... a second
all-to-all to gather the results along the attention heads while re-partitioning along the sequence
dimension." Each is the other's transpose, so each one's backward is the other's forward.

Layout (as ``minipar.nn``): activations are (batch, positions, heads * d_head); heads are contiguous
groups of d_head columns, so "heads H/P at a time" is "columns width/P at a time".

Cost of one all-to-all on P ranks of an activation with n bytes per rank: (P-1)/P n sent per rank.

A bfloat16 model (``minipar.parallel.bf16``; the ops' optional last argument ``bf16``) sends its
activations, their gradients and the ring's K/V blocks as bfloat16, 2 bytes an element: the values
are bf16 already (an op's rounded result, a gradient rounded into one), or, for
``linear_seq_to_heads``, rounded to bf16 before the all-to-all instead of after it, which is the
same since an all-to-all only moves elements. Received, they are read back into float32 exactly, so
every value equals the float32-carrying path's bit for bit.
"""

from __future__ import annotations

import numpy as np

from minipar.autograd import BF16, Context, Function
from minipar.comm import Communicator, Request

ALGORITHM = "pairwise"  # hand-written: every message is in the trace


def _split_over(who: str, x: np.ndarray, axis: int, name: str, p: int) -> None:
    """``x`` is (b, n, w) and its ``axis`` (named ``name``) splits into ``p`` equal parts (checked
    before the all-to-all)."""
    if x.ndim != 3:
        raise ValueError(f"{who}: the activation must be (b, n, w), got shape {x.shape}")
    if x.shape[axis] % p:
        raise ValueError(f"{who}: {name}={x.shape[axis]} of the activation {x.shape} is not divisible by the {p} "
                         "ranks of the all-to-all")


def to_wire(a: np.ndarray, bf16: bool) -> np.ndarray:
    """``a`` as it is sent: bfloat16 (2 bytes an element) for a bf16 model's values, else as it is."""
    return a.astype(BF16) if bf16 else a


def from_wire(a: np.ndarray) -> np.ndarray:
    """A received array as the ops read it: bfloat16 back into float32 (exact), else as it is."""
    return a.astype(np.float32) if a.dtype == BF16 else a


def _all_to_all(send: np.ndarray, comm: Communicator, bf16: bool) -> np.ndarray:
    return from_wire(comm.all_to_all(to_wire(send, bf16), algorithm=ALGORITHM))


def _keep(ctx: Context, comm: Communicator, bf16: bool | None) -> None:
    """What an all-to-all op's backward needs: the group, the wire dtype and a None gradient for
    each argument after the activation (``bf16`` is optional)."""
    ctx.comm, ctx.bf16, ctx.rest = comm, bool(bf16), (None,) * (1 if bf16 is None else 2)


def _seq_to_heads(x: np.ndarray, comm: Communicator, bf16: bool) -> np.ndarray:
    p = comm.size
    _split_over("seq_to_heads", x, 2, "w", p)
    b, n, w = x.shape
    send = np.ascontiguousarray(x.reshape(b, n, p, w // p).transpose(2, 0, 1, 3))  # (P dst heads, b, n, w/P)
    got = _all_to_all(send, comm, bf16)  # (P src positions, b, n, w/P)
    return got.transpose(1, 0, 2, 3).reshape(b, p * n, w // p)  # (b, P n, w/P)


def _heads_to_seq(y: np.ndarray, comm: Communicator, bf16: bool) -> np.ndarray:
    p = comm.size
    _split_over("heads_to_seq", y, 1, "n", p)
    b, big_n, w = y.shape
    n = big_n // p
    send = np.ascontiguousarray(y.reshape(b, p, n, w).transpose(1, 0, 2, 3))  # (P dst positions, b, n, w)
    got = _all_to_all(send, comm, bf16)  # (P src heads, b, n, w)
    return got.transpose(1, 2, 0, 3).reshape(b, n, p * w)  # (b, n, P w)


class seq_to_heads(Function):  # Ulysses' first all-to-all (one each for q, k and v)
    """(b, S/P, H d) sequence shard, all heads -> (b, S, H/P d) whole sequence, this rank's heads.
    Backward: the transposed all-to-all (``heads_to_seq``'s forward)."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, comm: Communicator, bf16: bool | None = None) -> np.ndarray:
        _keep(ctx, comm, bf16)
        return _seq_to_heads(x, comm, ctx.bf16)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return _heads_to_seq(grad, ctx.comm, ctx.bf16), *ctx.rest


class heads_to_seq(Function):  # Ulysses' second all-to-all (the attention output)
    """(b, S, H/P d) this rank's heads -> (b, S/P, H d) sequence shard, all heads.
    Backward: ``seq_to_heads``'s forward."""

    @staticmethod
    def forward(ctx: Context, y: np.ndarray, comm: Communicator, bf16: bool | None = None) -> np.ndarray:
        _keep(ctx, comm, bf16)
        return _heads_to_seq(y, comm, ctx.bf16)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return _seq_to_heads(grad, ctx.comm, ctx.bf16), *ctx.rest


class linear_seq_to_heads(Function):  # a q, k or v projection fused with Ulysses' first all-to-all
    """``seq_to_heads(x W + b)``: the projection of this rank's positions, sent to the ranks owning
    its heads. Keeps ``x`` (the layer norm's output, kept anyway) and the weight, not the projection
    before the all-to-all, which nothing in backward needs (PyTorch frees such a tensor; here it is
    never a node). Backward: the gradient's all-to-all back, then the linear's two GEMMs; split
(zero bubble's I and W, ``minipar.split_backward``), I runs the all-to-all and the input's GEMM and
keeps the gradient it brought back, which W multiplies by ``x`` without sending anything."""

    @staticmethod
    def forward(ctx: Context, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                comm: Communicator, bf16: bool | None = None) -> np.ndarray:
        ctx.save_for_backward(x, weight)
        _keep(ctx, comm, bf16)
        y = x.reshape(-1, x.shape[-1]) @ weight
        if bias is not None:
            y += bias
        return _seq_to_heads(y.reshape(*x.shape[:-1], weight.shape[1]), comm, ctx.bf16)

    @staticmethod
    def backward(ctx: Context, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        x, weight = ctx.saved
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        g = ctx.__dict__.pop("grad_seq", None)  # all-to-all'd by this op's I for its W
        if g is None:
            g = _heads_to_seq(grad, ctx.comm, ctx.bf16).reshape(-1, weight.shape[1])
        if not (want_w or want_b):
            ctx.grad_seq = g  # I of a split backward (zero bubble): its W reads it, sending nothing
        rows = x.reshape(-1, x.shape[-1])
        return ((g @ weight.T).reshape(x.shape) if want_x else None, rows.T @ g if want_w else None,
                g.sum(axis=0) if want_b else None, *ctx.rest)


def pass_on(comm: Communicator, array: np.ndarray, tag: int, op: str, step: int, block: int,
            bf16: bool = False) -> Both:
    """Ring Attention's hand-off: post the receive of the next block from rank r-1, then send
    ``array`` (block ``block``, at ring step ``step``; bfloat16 on the wire with ``bf16``) to rank
    r+1; ``wait()`` gives the received one (float32 if it came as bfloat16). Both events carry
    ``step`` and ``chunk=block`` so the viewer can draw the ring."""
    me, p = comm.rank, comm.size
    incoming = comm.irecv((me - 1) % p, tag, op=op, step=step, chunk=(block - 1) % p)
    outgoing = comm.isend(to_wire(array, bf16), (me + 1) % p, tag, op=op, step=step, chunk=block)
    return Both(incoming, outgoing)


class Both:
    """Wait for a send and a receive; ``wait()`` returns what was received."""

    def __init__(self, incoming: Request, outgoing: Request) -> None:
        self.incoming, self.outgoing = incoming, outgoing

    def test(self) -> bool:
        """Make progress on both; True when both have finished."""
        return self.incoming.test() & self.outgoing.test()

    def wait(self) -> np.ndarray:
        got = self.incoming.wait()
        self.outgoing.wait()
        return from_wire(got)
