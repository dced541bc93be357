"""Unified sequence parallelism (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach
for Long Context Generative AI", Sec. 4): Ulysses inside groups of P_u ranks, Ring Attention across
the P_r groups, P = P_u x P_r.

    q, k, v (b, S/P, H d)  --Ulysses all-to-all in the group-->  (b, S/P_r, H/P_u d): one ring block
      --Ring Attention over the P_r ranks holding the same heads-->  (b, S/P_r, H/P_u d)
      --Ulysses all-to-all back-->  (b, S/P, H d)

Ulysses alone is limited to P <= H (each rank needs whole heads); the ring has no such limit, so the
grid lets the sequence-parallel degree exceed the head count. Bytes per rank per layer: Ulysses'
four all-to-alls on P_u ranks plus the ring's transfers among P_r ranks of blocks with H/P_u heads
(``minipar.cost.sequence``).
"""

from __future__ import annotations

from collections.abc import Sequence

from minipar.autograd import Tensor
from minipar.comm import Communicator
from minipar.parallel.sequence.comm_ops import heads_to_seq, seq_to_heads
from minipar.parallel.sequence.layout import Piece, block_rows, check_attention
from minipar.parallel.sequence.ring import ring_attention
from minipar.parallel.tensor.comm_ops import is_bf16


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, n_heads: int, ulysses: Communicator, ring: Communicator,
                     blocks: Sequence[Sequence[Piece]], causal: bool = True) -> Tensor:
    """Attention of (b, S/P, H d) shards: all-to-all over ``ulysses`` gathers ring block
    ``blocks[ring.rank]`` for H/P_u heads, Ring Attention runs over ``ring``, all-to-all back."""
    block = block_rows("hybrid_attention", blocks, ring.size, ring.rank)
    check_attention("hybrid_attention", q, k, v, n_heads, ulysses.size, block // ulysses.size,
                    f"this rank's {block // ulysses.size} of the {block} positions of its ring block")
    q, k, v = (seq_to_heads.apply(x, ulysses, is_bf16(x)) for x in (q, k, v))
    return hybrid_attention_on_heads(q, k, v, n_heads, ulysses, ring, blocks, causal)


def hybrid_attention_on_heads(q: Tensor, k: Tensor, v: Tensor, n_heads: int, ulysses: Communicator,
                              ring: Communicator, blocks: Sequence[Sequence[Piece]], causal: bool = True) -> Tensor:
    """The same from q, k, v already all-to-all'ed into ring block ``blocks[ring.rank]``, H/P_u
    heads (``linear_seq_to_heads``)."""
    check_attention("hybrid_attention", q, k, v, n_heads, ulysses.size, on_heads=True)
    out = ring_attention(q, k, v, n_heads // ulysses.size, ring, blocks, causal)
    return heads_to_seq.apply(out, ulysses, is_bf16(out))
