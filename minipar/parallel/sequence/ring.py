"""Ring Attention: every rank keeps its query block; key/value blocks travel around a ring (Liu et
al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context", Sec. 3, Alg. 1;
Li et al. 2021, "Sequence Parallelism: Long Sequence Training from System Perspective", Sec. 3.2).

Forward, P ranks, rank r, ring step s = 0 .. P-1, key/value block j = (r - s) mod P::

    post: receive block j-1 from rank r-1, send block j to rank r+1   (skipped at s = P-1)
    compute: fold scores(q_r, k_j) into the online softmax              (overlaps the transfer)
    wait: the next block has arrived

"we can overlap the communication of key-value blocks with the computation of blockwise attention"
(Liu et al., Sec. 3). Softmax is computed blockwise (``blockwise.OnlineSoftmax``); a rank keeps its
q, k, v, the output and the log-sum-exp for backward, never a score matrix wider than one block.

Backward is a second ring. K, V travel as in forward; each block's gradient accumulator dK_j, dV_j
travels one step behind them (as ring-flash-attention does; Liu et al.'s Alg. 1 rotates dK, dV
with K, V for P hops): rank r adds its share of block j's gradient and passes the sum on, so after
visiting every rank it arrives home. The owner adds its own share (step 0) without sending it, so
the accumulator makes P-1 hops and ends at its owner; a rank keeps only the one it last sent::

    step 0:      dK_r, dV_r += share of (q_r, block r)            kept at home
    step s >= 1: acc = share of (q_r, block j) [+ acc received from r-1 for block j, s >= 2]; send to r+1
    end:         dK_r, dV_r += acc received from r-1

Bytes per rank per layer (K and V of one block: 2 b (S/P) H d_head itemsize = 2 B bytes):
forward (P-1) 2B; backward (P-1) 2B for K, V plus (P-1) 2B for dK, dV: ``minipar.cost.sequence``.

bfloat16 (``minipar.parallel.bf16``): a bf16 model's K/V blocks travel as bfloat16, 2 bytes an
element, exactly (they are bf16 values). The dK/dV accumulators are float32 partial sums and travel
as float32, as ring-flash-attention keeps them (zhuzilin/ring-flash-attention, ``ring_flash_attn.py``:
``dk = block_dk_buffer.to(torch.float32)`` before ``send_recv_kv``); rounding them to bf16 at every
hop would round the sum P-1 times instead of once, at the end, as one process does.

Causal masking: score blocks the mask hides completely are not computed (``blockwise.visibility``);
ranks still pass those K, V on. With the zigzag split (``layout``) every rank computes the same
number of blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from minipar import trace
from minipar.autograd import Context, Function, Tensor
from minipar.comm import Communicator, Request
from minipar.functional import _Attention
from minipar.parallel.sequence.blockwise import HIDDEN, OnlineSoftmax, block_backward, scores, visibility
from minipar.parallel.sequence.comm_ops import Both, pass_on
from minipar.parallel.sequence.layout import Piece, block_rows, check_attention
from minipar.parallel.tensor.comm_ops import is_bf16

TAG_KV, TAG_KV_BACK, TAG_DKV = 11, 12, 13
heads = _Attention.heads  # (b, n, H d) -> (b, H, n, d), a view


def block_pairs(q_pieces: Sequence[Piece], k_pieces: Sequence[Piece], causal: bool
                ) -> Iterator[tuple[int, slice, Piece, int, slice, Piece]]:
    """The score blocks to compute: (q piece index, its rows, its positions, k piece index, its
    rows, its positions) for every pair of pieces the causal mask does not hide completely."""
    q0 = 0
    for qi, qp in enumerate(q_pieces):
        k0 = 0
        for ki, kp in enumerate(k_pieces):
            if visibility(qp, kp, causal) != HIDDEN:
                yield qi, slice(q0, q0 + qp[1] - qp[0]), qp, ki, slice(k0, k0 + kp[1] - kp[0]), kp
            k0 += kp[1] - kp[0]
        q0 += qp[1] - qp[0]


def _progress(*requests: Request | Both | None) -> None:
    """Poll the transfers in flight between score blocks: an MPI library moves a large message only
    inside its calls, so without these polls the transfer would wait for the ``wait()`` after the
    compute instead of overlapping it."""
    for r in requests:
        if r is not None:
            r.test()


def _labels(q_piece: int, k_piece: int, score_bytes: int | None = None) -> dict[str, int]:
    """A score block's trace labels beside ``step`` and ``chunk`` (the K/V block): which query and
    key pieces, and (forward) the bytes of its score buffer."""
    labels = {"q_piece": q_piece, "k_piece": k_piece}
    return labels if score_bytes is None else {**labels, "score_bytes": score_bytes}


class RingAttention(Function):
    """softmax(q k^T / sqrt(d)) v for this rank's query block against every rank's keys and values,
    which travel around ``comm``'s ring. ``blocks[j]``: the pieces of positions ring rank j holds."""

    @staticmethod
    def forward(ctx: Context, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, comm: Communicator,
                blocks: Sequence[Sequence[Piece]], causal: bool, bf16: bool) -> np.ndarray:
        me, p = comm.rank, comm.size
        b, n, width = q.shape
        scale = 1.0 / float(np.sqrt(width // n_heads))
        qh = heads(q, n_heads)
        soft = OnlineSoftmax(b, n_heads, n, width // n_heads, q.dtype)
        kv = np.stack([k, v])  # K and V travel as one message
        for step in range(p):
            j = (me - step) % p
            nxt = pass_on(comm, kv, TAG_KV, "ring_kv", step, j, bf16) if step < p - 1 else None
            kh, vh = heads(kv[0], n_heads), heads(kv[1], n_heads)
            for qi, rows, qp, ki, cols, kp in block_pairs(blocks[me], blocks[j], causal):
                with trace.span("attention F", step=step, chunk=j,
                                args=_labels(qi, ki, b * n_heads * (rows.stop - rows.start) * (cols.stop - cols.start)
                                             * q.itemsize)):
                    soft.update(rows, scores(qh[:, :, rows], kh[:, :, cols], scale, qp, kp, causal),
                                vh[:, :, cols])
                _progress(nxt)
            if nxt is not None:
                kv = nxt.wait()
        out = np.empty_like(q)
        lse = soft.result(heads(out, n_heads))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.n_heads, ctx.comm, ctx.blocks, ctx.causal, ctx.scale = n_heads, comm, blocks, causal, scale
        ctx.bf16 = bf16
        return out

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        q, k, v, out, lse = ctx.saved
        comm, blocks, causal, scale, h = ctx.comm, ctx.blocks, ctx.causal, ctx.scale, ctx.n_heads
        me, p = comm.rank, comm.size
        qh, gh = heads(q, h), heads(g, h)
        delta = np.einsum("bhnd,bhnd->bhn", gh, heads(out, h))  # rowsum(dout * out)
        dq = np.zeros_like(q)
        dqh = heads(dq, h)
        kv = np.stack([k, v])
        home = np.zeros_like(kv)  # dK, dV of this rank's own block
        sent = None  # the accumulator last sent on (one at a time: never the whole sequence's dK, dV)
        for step in range(p):
            j = (me - step) % p
            nxt = pass_on(comm, kv, TAG_KV_BACK, "ring_kv", step, j, ctx.bf16) if step < p - 1 else None
            arriving = comm.irecv((me - 1) % p, TAG_DKV, op="ring_dkv", step=step, chunk=j) if step >= 2 else None
            acc = home if step == 0 else np.zeros_like(kv)
            kh, vh, dkh, dvh = (heads(a, h) for a in (kv[0], kv[1], acc[0], acc[1]))
            for qi, rows, qp, ki, cols, kp in block_pairs(blocks[me], blocks[j], causal):
                with trace.span("attention B", step=step, chunk=j, args=_labels(qi, ki)):
                    block_backward(qh[:, :, rows], kh[:, :, cols], vh[:, :, cols], gh[:, :, rows],
                                   lse[:, :, rows], delta[:, :, rows], scale, qp, kp, causal,
                                   dqh[:, :, rows], dkh[:, :, cols], dvh[:, :, cols])
                _progress(nxt, arriving, sent)
            if arriving is not None:
                acc += arriving.wait()
            if sent is not None:  # posted a step ago; rank r+1 has posted its receive since
                sent.wait()
            if step >= 1:
                sent = comm.isend(acc, (me + 1) % p, TAG_DKV, op="ring_dkv", step=step, chunk=j)
            if nxt is not None:
                kv = nxt.wait()
        if p > 1:
            home += comm.recv((me - 1) % p, TAG_DKV, op="ring_dkv", step=p, chunk=me)
        if sent is not None:
            sent.wait()
        return dq, home[0], home[1], None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, n_heads: int, comm: Communicator,
                   blocks: Sequence[Sequence[Piece]], causal: bool = True) -> Tensor:
    """Ring Attention over ``comm`` for (b, n, H d) blocks q, k, v whose rows hold the positions
    ``blocks[comm.rank]``; returns this rank's (b, n, H d) output. Refuses, before any message,
    operands whose rows are not that block's positions. K and V travel as bfloat16 when both hold a
    bf16 model's values."""
    n = block_rows("ring_attention", blocks, comm.size, comm.rank)
    check_attention("ring_attention", q, k, v, n_heads, 1, n,
                    f"the {n} positions of this rank's ring block (blocks[comm.rank])")
    return RingAttention.apply(q, k, v, n_heads, comm, blocks, causal, is_bf16(k) and is_bf16(v))
