"""Sequence parallelism (``minipar.parallel.sequence``): bytes per rank per layer, the largest score
buffer, causal work per rank, activation bytes. Derivations in ``docs/formulas.md``, section 5.

Symbols: batch ``b``, sequence length ``s`` (S), hidden ``h = H d`` (``n_heads`` = H), MLP width
``d_ff``, ``e`` bytes per number (8: float64), ``p`` ranks (P) = ``P_u x P_r`` (Ulysses x ring
degree, Fang & Zhao 2024). Every rank holds ``n = b s/P`` positions of every activation.

Bytes one rank sends in one layer's attention (the rest of the block is local):

- Ulysses (Jacobs et al. 2023, Sec. 3.2): 4 all-to-alls (q, k, v before attention, the output
  after), each sending ``P-1`` of the ``P`` head-blocks of a ``(b, s/P, h)`` shard:
  ``4 (P-1)/P b (s/P) h e`` forward, the same backward (each all-to-all's backward is the
  transposed all-to-all). With ``s`` and ``P`` growing together it stays below ``4 b (s/P) h e``.
- Ring Attention (Liu et al. 2023, Sec. 3): the K/V block ``(2, b, s/P, h)`` (K and V stacked as
  one message) moves ``P-1`` times forward, ``(P-1) 2 b (s/P) h e``; backward moves K/V again and
  the dK/dV accumulator ``P-1`` hops home: twice forward.
- Hybrid (Fang & Zhao 2024, USP, Sec. 4): Ulysses' 4 all-to-alls among ``P_u`` ranks on the
  ``(b, s/P, h)`` shard plus the ring among ``P_r`` ranks on blocks ``(b, s/P_r, h/P_u)``.
- Megatron-SP (Korthikanti et al. 2022, Sec. 4.2.2), for comparison: 2 all-gathers and 2
  reduce-scatters of the whole ``(b, s, h)`` activation forward, ``4 (t-1)/t b s h e``: it grows
  with ``s`` however many ranks share it.

Score memory (``score_bytes``): Ulysses' attention keeps the softmax of its ``H/P`` heads over the
whole sequence, ``b (H/P) s^2 e``; Ring Attention computes one block of scores at a time, ``b H
(s/P)^2 e`` (contiguous) or ``b H (s/(2P))^2 e`` (zigzag pieces), and keeps none.

Causal work (``causal_blocks``): under a causal mask ring rank ``r`` of the contiguous split sees
key blocks ``0..r``: ``r + 1`` score blocks; with the zigzag split each rank holds chunks ``r`` and
``2P-1-r`` of ``2P``, and computes ``(r + 1) + (2P - r) = 2P + 1`` chunk pairs: balanced.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from minipar.checks import divisible, number, one_of, whole, wholes
from minipar.cost.collectives import allreduce_bytes, ring_bytes
from minipar.cost.tensor import collectives_per_block

METHODS = ("ulysses", "ring", "hybrid")


def _grid(who: str, method: str, p: int, ulysses: int | None) -> tuple[int, int]:
    """(P_u, P_r) of ``method`` on ``p`` ranks (``ulysses`` = P_u, for "hybrid" only)."""
    one_of(who, "method", method, METHODS)
    p = whole(who, "p", p)
    if method == "hybrid":
        if isinstance(ulysses, bool) or not isinstance(ulysses, numbers.Integral) or ulysses < 1 or p % ulysses:
            raise ValueError(f"{who}: hybrid needs a Ulysses degree P_u that divides p={p}, got ulysses={ulysses!r}")
        return ulysses, p // ulysses
    return (p, 1) if method == "ulysses" else (1, p)


def _heads(who: str, n_heads: int, p_u: int) -> int:
    """H/P_u: Ulysses gives each of its P_u ranks whole heads."""
    if whole(who, "n_heads", n_heads) % p_u:
        raise ValueError(f"{who}: n_heads={n_heads} is not divisible by the Ulysses degree P_u={p_u} (each rank "
                         "needs whole heads)")
    return n_heads // p_u


def ulysses_bytes(b: int, s: int, h: int, p: int, itemsize: int = 8, *, n_heads: int | None = None) -> int:
    """Bytes one rank sends in one layer's Ulysses attention, forward (backward is the same):
    4 all-to-alls of the ``(b, s/P, h)`` shard, each ``(P-1)/P`` of it. Given ``n_heads``, refuses
    head counts P does not divide (the bytes do not depend on it)."""
    wholes("ulysses_bytes", b=b, s=s, h=h, p=p, itemsize=itemsize)
    if n_heads is not None:
        _heads("ulysses_bytes", n_heads, p)
    return 4 * (p - 1) * b * divisible("ulysses_bytes", "s", s, p, "p") * divisible("ulysses_bytes", "h", h, p, "p") \
        * itemsize


def ring_attention_bytes(b: int, s: int, h: int, p: int, itemsize: int = 8, backward: bool = False) -> int:
    """Bytes one rank sends in one layer's Ring Attention: ``P-1`` K/V blocks of ``2 b (s/P) h e``
    forward; backward ``P-1`` K/V blocks plus ``P-1`` dK/dV accumulators (twice forward)."""
    wholes("ring_attention_bytes", b=b, s=s, h=h, p=p, itemsize=itemsize)
    forward = (p - 1) * 2 * b * divisible("ring_attention_bytes", "s", s, p, "p") * h * itemsize
    return 2 * forward if backward else forward


def hybrid_bytes(b: int, s: int, h: int, ulysses: int, ring: int, itemsize: int = 8,
                 backward: bool = False, *, n_heads: int | None = None) -> int:
    """Bytes one rank sends in one layer's USP attention on a ``ulysses x ring`` grid: 4 all-to-alls
    among P_u ranks of the ``(b, s/P, h)`` shard, plus Ring Attention among P_r ranks of
    ``(b, s/P_r, h/P_u)`` blocks. Given ``n_heads``, refuses head counts P_u does not divide."""
    wholes("hybrid_bytes", b=b, s=s, h=h, ulysses=ulysses, ring=ring, itemsize=itemsize)
    if n_heads is not None:
        _heads("hybrid_bytes", n_heads, ulysses)
    n = divisible("hybrid_bytes", "s", s, ulysses * ring, "ulysses x ring")
    width = divisible("hybrid_bytes", "h", h, ulysses, "ulysses")
    all_to_alls = 4 * (ulysses - 1) * b * n * width * itemsize
    return all_to_alls + ring_attention_bytes(b, s, width, ring, itemsize, backward)


def attention_bytes(method: str, b: int, s: int, h: int, p: int, ulysses: int | None = None, itemsize: int = 8,
                    backward: bool = False, *, n_heads: int | None = None) -> int:
    """Bytes one rank sends in one layer's attention by ``method`` ("ulysses" | "ring" | "hybrid";
    ``ulysses`` = P_u for "hybrid"), forward or backward; given ``n_heads``, refuses head counts
    P_u does not divide."""
    pu, pr = _grid("attention_bytes", method, p, ulysses)
    if method == "ulysses":
        return ulysses_bytes(b, s, h, p, itemsize, n_heads=n_heads)
    if method == "ring":
        return ring_attention_bytes(b, s, h, p, itemsize, backward)
    return hybrid_bytes(b, s, h, pu, pr, itemsize, backward, n_heads=n_heads)


def megatron_sp_bytes(b: int, s: int, h: int, t: int, itemsize: int = 8, backward: bool = False) -> int:
    """Bytes one rank sends in one layer with Megatron's sequence parallelism (Korthikanti et al.
    2022, Sec. 4.2.2), ``(t-1)/t A`` per collective of ``A = b s h e``: forward 2 all-gathers and 2
    reduce-scatters, backward 4 all-gathers (2 of them re-gathers) and 2 reduce-scatters
    (``minipar.cost.tensor.collectives_per_block``)."""
    wholes("megatron_sp_bytes", b=b, s=s, h=h, t=t, itemsize=itemsize)
    a = s * b * h * itemsize
    calls = collectives_per_block(True)["backward" if backward else "forward"]
    return round(sum(n * ring_bytes(op, a, t) for op, n in calls.items()))


def score_bytes(method: str, b: int, s: int, n_heads: int, p: int, ulysses: int | None = None,
                zigzag: bool = False, itemsize: int = 8) -> int:
    """The largest score buffer a rank holds at once: Ulysses the softmax of H/P heads over the
    whole sequence (``b (H/P) s^2 e``, kept for backward); Ring Attention one block, ``b (H/P_u)
    (s/P_r)^2 e`` (P_u = 1 for "ring"), with zigzag pieces ``(s/(2 P_r))^2``."""
    pu, pr = _grid("score_bytes", method, p, ulysses)
    wholes("score_bytes", b=b, s=s, itemsize=itemsize)
    heads = _heads("score_bytes", n_heads, pu)
    if method == "ulysses":
        return b * heads * s * s * itemsize
    piece = divisible("score_bytes", "s", s, 2 * pr if zigzag else pr, "2 P_r" if zigzag else "P_r")
    return b * heads * piece * piece * itemsize


def causal_blocks(p: int, zigzag: bool) -> list[int]:
    """Score blocks (query piece x key piece not fully masked) each of ``p`` ring ranks computes under
    a causal mask: contiguous ``r + 1`` (blocks of s/P), zigzag ``2P + 1`` (pieces of s/(2P))."""
    return [2 * p + 1 if zigzag else r + 1 for r in range(whole("causal_blocks", "p", p))]


def causal_score_elements(s: int, p: int, zigzag: bool) -> list[int]:
    """Score elements each ring rank computes per head and batch element under a causal mask:
    contiguous ``(r + 1)(s/P)^2``, zigzag ``(2P + 1)(s/(2P))^2`` (masked entries of the diagonal
    blocks included: they are computed, then set to -inf)."""
    wholes("causal_score_elements", s=s, p=p)
    piece = divisible("causal_score_elements", "s", s, 2 * p if zigzag else p, "2 p" if zigzag else "p")
    return [n * piece * piece for n in causal_blocks(p, zigzag)]


def activation_terms(method: str, b: int, s: int, h: int, n_heads: int, d_ff: int, p: int,
                     ulysses: int | None = None, itemsize: int = 8) -> dict[str, int]:
    """Bytes one pre-norm transformer block's autograd graph keeps on one rank, term by term, in the
    order the block makes them. Every non-leaf tensor of the graph holds its array, and the ops keep
    (``ctx.save_for_backward``) only arrays of such tensors: ``_LayerNorm`` its input, ``F.linear``
    its input, ``_Gelu`` its input, ``_Attention`` q, k, v and the softmax, ``RingAttention`` q, k,
    v, its output and the log-sum-exp; the all-to-alls keep nothing. With ``n = b s/P`` positions:

    - ln1 output (q k v input), ``n h e``; q, k, v (three linears), ``3 n h e``; Ulysses and
      hybrid: the same ``3 n h e`` after the all-to-all ((b, s/P_r, h/P_u)), projected and sent in
      one op (``comm_ops.linear_seq_to_heads``), so not kept before it;
    - Ulysses: the softmax ``b (H/P) s^2 e``; ring and hybrid: the log-sum-exp ``b (H/P_u)(s/P_r) e``
      (``= b H s e / P``) instead of any score matrix;
    - attention output ``n h e``; Ulysses and hybrid: the output after the all-to-all back, ``n h e``;
    - attention's proj output ``n h e`` (the residual add's input), residual 1 (ln2 input) ``n h e``,
      ln2 output (fc input) ``n h e``, fc output (GELU input) ``n d_ff e``, GELU output (MLP proj
      input) ``n d_ff e``, MLP proj output ``n h e``, residual 2 (next ln1 input) ``n h e``.

    Every term is ``1/P`` of the method's own one-process value (the softmax too: ``H/P`` heads).
    Against ``nn.Block`` on one process (``10 b s h e + 2 b s d_ff e + b H s^2 e``) the ring keeps
    ``1/P`` of everything but the score matrix, which it replaces by the log-sum-exp; Ulysses keeps
    ``b s h e / P`` more (the attention output before and after its all-to-all back)."""
    who = "activation_terms"
    pu, pr = _grid(who, method, p, ulysses)
    wholes(who, b=b, s=s, h=h, d_ff=d_ff, itemsize=itemsize)
    heads = _heads(who, n_heads, pu)
    divisible(who, "h", h, n_heads, "n_heads")
    e = itemsize
    n = b * divisible(who, "s", s, p, "p")
    act = n * h * e
    terms = {"ln1 output (q k v input)": act}
    terms["q k v" if method == "ring" else "q k v after the all-to-all"] = 3 * act
    if method == "ulysses":
        terms["softmax"] = b * heads * s * s * e
    else:
        terms["log-sum-exp"] = b * heads * (s // pr) * e
    terms["attention output"] = act
    if method != "ring":
        terms["attention output after the all-to-all (proj input)"] = act
    terms.update({"proj output": act, "residual 1 (ln2 input)": act, "ln2 output (fc input)": act,
                  "gelu input": n * d_ff * e, "gelu output (proj input)": n * d_ff * e, "mlp output": act,
                  "residual 2 (next ln1 input)": act})
    return terms


def activation_bytes(method: str, b: int, s: int, h: int, n_heads: int, d_ff: int, p: int,
                     ulysses: int | None = None, itemsize: int = 8) -> int:
    """Bytes one transformer block's autograd graph keeps on one rank: the sum of
    ``activation_terms``."""
    return sum(activation_terms(method, b, s, h, n_heads, d_ff, p, ulysses, itemsize).values())


def grad_sync_bytes(n_params: int, p: int, itemsize: int = 8, rank: int = 0) -> int:
    """Bytes ``rank`` sends in ``SequenceParallelGPT.sync_grads``: one ring all-reduce of the
    ``n_params`` gradient numbers, ``2 (P-1)/P n_params e`` when P divides n_params."""
    return allreduce_bytes(n_params, itemsize, p, rank, "ring")


def step_bytes_by_op(method: str, b: int, s: int, h: int, layers: int, p: int, n_params: int,
                     ulysses: int | None = None, itemsize: int = 8, accumulator_itemsize: int | None = None
                     ) -> dict[str, int]:
    """Bytes rank 0 sends in one training step of a ``layers``-block ``SequenceParallelGPT`` with
    ``n_params`` parameters, by op (a trace's ``expected_bytes``): every layer's attention forward and
    backward (Ulysses' ``all_to_all``; the ring's K/V blocks, ``ring_kv``, in forward and again in
    backward, and the dK/dV accumulators travelling home, ``ring_dkv``; the hybrid both) and
    ``sync_grads``' ring ``allreduce`` of every gradient. ``accumulator_itemsize``: the dK/dV
    accumulators' bytes a number (4 under a bfloat16 model, whose accumulators stay float32;
    ``itemsize`` if not given)."""
    p_u, p_r = _grid("step_bytes_by_op", method, p, ulysses)
    whole("step_bytes_by_op", "layers", layers)
    acc = itemsize if accumulator_itemsize is None else whole("step_bytes_by_op", "accumulator_itemsize",
                                                              accumulator_itemsize)
    out = {"allreduce": grad_sync_bytes(n_params, p, itemsize)}
    ring = 0  # the ring's bytes in attention_bytes' forward and backward: K/V three times
    if method != "ulysses":
        kv = ring_attention_bytes(b, s, h // p_u, p_r, itemsize)  # one pass of the K/V blocks
        out["ring_kv"], ring = 2 * layers * kv, 3 * layers * kv
        out["ring_dkv"] = layers * ring_attention_bytes(b, s, h // p_u, p_r, acc)
    if method != "ring":
        total = sum(attention_bytes(method, b, s, h, p, ulysses, itemsize, backward) for backward in (False, True))
        out["all_to_all"] = layers * total - ring
    return out


def longest_sequence(need: Callable[[int], int], budget: int, multiple: int, limit: int = 2**30) -> int:
    """The longest sequence length ``s``, a multiple of ``multiple`` (2P for the zigzag split), whose
    ``need(s)`` bytes (growing with ``s``) fit ``budget``: doubling, then bisection; ``multiple`` when
    even that does not fit, at most ``limit``."""
    if not callable(need):
        raise ValueError(f"longest_sequence: need={need!r} must be a function of the sequence length")
    number("longest_sequence", "budget", budget)
    whole("longest_sequence", "limit", limit, least=whole("longest_sequence", "multiple", multiple))
    lo, hi = multiple, 2 * multiple
    while need(hi) <= budget and hi < limit:
        lo, hi = hi, 2 * hi
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
    return lo
