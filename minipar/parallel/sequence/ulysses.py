"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", Sec. 3.1, Fig. 2).

P ranks each hold S/P positions of every activation. Per attention layer::

    q, k, v   (b, S/P, H d)   projected locally, this rank's positions, all heads
      | seq_to_heads x 3      all-to-all
    q, k, v   (b, S, H/P d)   the whole sequence, heads [r H/P, (r+1) H/P)
      | attention             ordinary attention on whole heads (softmax kept: b H/P S S)
    out       (b, S, H/P d)
      | heads_to_seq          all-to-all
    out       (b, S/P, H d)   back to this rank's positions

Bytes per rank per layer, activation n = b (S/P) H d itemsize: forward 4 (P-1)/P n (q, k, v,
output), backward the same four transposed. With S and P growing together n stays fixed, so the
bytes per rank stay below 4n: "communication volume per link is 4Nh/P" (Sec. 3.2). Heads must be
divisible by P (``layout.check_sequence_config`` says which P work; called directly, both
functions refuse other head counts before any message). A bfloat16 model's all-to-alls send
bfloat16, half the bytes, exactly (``comm_ops``).
"""

from __future__ import annotations

from minipar import functional as F
from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.parallel.sequence.comm_ops import heads_to_seq, seq_to_heads
from minipar.parallel.sequence.layout import check_attention
from minipar.parallel.tensor.comm_ops import is_bf16


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, n_heads: int, comm: Communicator,
                      causal: bool = True) -> Tensor:
    """Attention of (b, S/P, H d) sequence shards q, k, v (rank r holds positions
    ``[r S/P, (r+1) S/P)``); returns this rank's (b, S/P, H d) output."""
    check_attention("ulysses_attention", q, k, v, n_heads, comm.size)
    q, k, v = (seq_to_heads.apply(x, comm, is_bf16(x)) for x in (q, k, v))
    return ulysses_attention_on_heads(q, k, v, n_heads, comm, causal)


def ulysses_attention_on_heads(q: Tensor, k: Tensor, v: Tensor, n_heads: int, comm: Communicator,
                               causal: bool = True) -> Tensor:
    """The same from q, k, v already all-to-all'ed to (b, S, H/P d) (``linear_seq_to_heads``: the
    model projects and sends in one op, keeping no projection before the all-to-all)."""
    check_attention("ulysses_attention", q, k, v, n_heads, comm.size, on_heads=True)
    out = F.attention(q, k, v, n_heads // comm.size, causal)
    return heads_to_seq.apply(out, comm, is_bf16(out))
