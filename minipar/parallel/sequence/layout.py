"""Which sequence positions each rank holds, and the checks that run before any message.

P = P_u x P_r ranks (Unified sequence parallelism, Fang & Zhao 2024, "USP: A Unified Sequence
Parallelism Approach for Long Context Generative AI"): rank ``r`` sits at ring index ``r // P_u`` and
Ulysses index ``r % P_u``, so a Ulysses group is P_u consecutive ranks and a ring group is every
P_u-th rank. Pure Ulysses is P_r = 1, pure Ring Attention is P_u = 1.

The sequence (S positions) is first cut into P_r **ring blocks**, then each ring block into P_u
equal contiguous parts of its position list, one per rank of the Ulysses group, so the Ulysses
all-to-all gathers exactly one ring block.

- contiguous split: ring block i is positions ``[i S/P_r, (i+1) S/P_r)``.
- zigzag split (Brandon et al. 2023, "Striped Attention"; the zigzag of ring-flash-attention and
  Llama 3's context parallelism): the sequence is cut into 2 P_r chunks of c = S/(2 P_r) and ring
  block i is chunks ``i`` and ``2 P_r - 1 - i``. Under a causal mask, query chunk a sees key chunk b
  (b <= a) so the chunk pairs one rank computes are (i + 1) + (2 P_r - i) = 2 P_r + 1 for every i:
  the work is balanced. The contiguous split gives ring block i the pairs of chunks 2i and 2i + 1:
  4i + 3, from 3 to 4 P_r - 1.

A ring block is a list of **pieces**, contiguous position ranges ``(start, stop)`` (one piece
contiguous, two zigzag). Ring Attention computes one score block per (query piece, key piece) pair
and skips pairs the causal mask hides completely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from minipar.checks import index, whole

Piece = tuple[int, int]  # positions [start, stop)
METHODS = ("ulysses", "ring", "hybrid")


@dataclass(frozen=True)
class SequenceLayout:
    """The split of ``seq_len`` positions over ``ulysses`` x ``ring`` ranks (checked on creation)."""

    seq_len: int  # S
    ulysses: int = 1  # P_u
    ring: int = 1  # P_r
    zigzag: bool = False

    def __post_init__(self) -> None:
        problems = sequence_problems(self.seq_len, self.ulysses, self.ring, self.zigzag)
        if problems:
            raise ValueError("sequence parallelism: " + "; ".join(problems))

    @property
    def degree(self) -> int:
        """P = P_u x P_r."""
        return self.ulysses * self.ring

    def coords(self, rank: int) -> tuple[int, int]:
        """(ring index, Ulysses index) of ``rank``."""
        return divmod(index("SequenceLayout", "rank", rank, self.degree, "ranks of the layout"), self.ulysses)

    def ring_pieces(self, i: int) -> list[Piece]:
        """The position ranges of ring block ``i``, in the order the block's rows hold them."""
        if not self.zigzag:
            n = self.seq_len // self.ring
            return [(i * n, (i + 1) * n)]
        c = self.seq_len // (2 * self.ring)
        j = 2 * self.ring - 1 - i
        return [(i * c, (i + 1) * c), (j * c, (j + 1) * c)]

    def positions(self, rank: int) -> np.ndarray:
        """The sequence positions ``rank`` holds: its part of its ring block's position list."""
        i, u = self.coords(rank)
        block = np.concatenate([np.arange(a, b) for a, b in self.ring_pieces(i)])
        n = self.seq_len // self.degree
        return block[u * n:(u + 1) * n]

    def shard(self, tokens: np.ndarray, rank: int) -> np.ndarray:
        """This rank's columns of ``tokens`` (batch, S, ...): ``tokens[:, positions(rank)]``."""
        tokens = np.asarray(tokens)
        if tokens.ndim < 2 or tokens.shape[1] != self.seq_len:
            raise ValueError(f"SequenceLayout.shard: tokens of shape {tokens.shape} must be (batch, {self.seq_len}, "
                             f"...): the whole sequence of seq_len={self.seq_len} positions on axis 1")
        return np.ascontiguousarray(tokens[:, self.positions(rank)])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sequence_problems(seq_len: int, ulysses: int, ring: int, zigzag: bool) -> list[str]:
    """What is wrong with splitting ``seq_len`` positions over a ``ulysses`` x ``ring`` grid."""
    if not all(isinstance(n, int | np.integer) for n in (seq_len, ulysses, ring)):
        return [f"sequence length {seq_len!r} and degrees {ulysses!r} x {ring!r} must be whole numbers"]
    p = ulysses * ring
    if ulysses < 1 or ring < 1:
        return [f"the grid {ulysses} x {ring} needs at least one rank on each axis"]
    problems = []
    if seq_len % p:
        problems.append(f"sequence length {seq_len} is not divisible by P={p} ranks; use a multiple of {p} "
                        f"(e.g. {seq_len + (-seq_len) % p})")
    if zigzag and seq_len % (2 * ring):
        unit = math.lcm(p, 2 * ring)
        problems.append(f"the zigzag split cuts the sequence into 2 x {ring} chunks, and {seq_len} is not "
                        f"divisible by {2 * ring}; use a multiple of {unit} (e.g. {seq_len + (-seq_len) % unit}) "
                        "or the contiguous split")
    return problems


def check_sequence_config(comm: Any, seq_len: int, n_heads: int, d_model: int, method: str,
                          ulysses: int | None = None, ring: int | None = None,
                          zigzag: bool = False) -> SequenceLayout:
    """The layout for ``method`` on ``comm``'s ranks, or ``ValueError`` naming what to change.

    Pure computation on numbers every rank has, so every rank raises the same message before any
    message is sent. ``ulysses`` and ``ring`` (the degrees P_u, P_r) are for ``"hybrid"``, where
    one of them is enough; ``"ulysses"`` uses every rank (P_u = P) and ``"ring"`` none (P_u = 1).
    """
    p = comm.size
    if method not in METHODS:
        raise ValueError(f"sequence parallelism: method={method!r}; choose one of {', '.join(METHODS)}")
    for what, n in (("ulysses", ulysses), ("ring", ring)):
        if n is not None and not isinstance(n, int | np.integer):
            raise ValueError(f"sequence parallelism: {what}={n!r} must be a whole number of ranks")
    problems = []
    if method == "hybrid" and ring is not None:
        if ulysses is not None and ulysses * ring != p:
            raise ValueError(f"sequence parallelism: the grid P_u x P_r = {ulysses} x {ring} = {ulysses * ring} "
                             f"ranks but the communicator has {p}; launch {ulysses * ring} ranks or pick "
                             f"degrees whose product is {p}")
        if ring < 1 or p % ring:
            raise ValueError(f"sequence parallelism: the hybrid grid needs a ring degree P_r that divides the {p} "
                             f"ranks (got ring={ring}); pick one of {_divisors(p)}")
        ulysses = p // ring
    if method == "hybrid":
        if ulysses is None or ulysses < 1 or p % ulysses:
            problems.append(f"the hybrid grid needs a Ulysses degree P_u that divides the {p} ranks "
                            f"(got ulysses={ulysses}); pick one of {_divisors(p)}")
            ulysses = 1
    else:
        fixed = (p, 1) if method == "ulysses" else (1, p)
        if (ulysses or fixed[0], ring or fixed[1]) != fixed:
            problems.append(f"ulysses={ulysses}, ring={ring} do not fit method={method!r} on {p} ranks "
                            f"(it is the grid {fixed[0]} x {fixed[1]}); use method='hybrid' for another grid")
    pu = {"ulysses": p, "ring": 1}.get(method, ulysses or 1)
    if d_model % n_heads:
        problems.append(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    if n_heads % pu:
        works = [d for d in _divisors(n_heads) if p % d == 0]
        problems.append(f"n_heads={n_heads} is not divisible by the Ulysses degree P_u={pu}: each rank "
                        f"must get whole heads; Ulysses degrees that work: {works}"
                        + ("" if method == "hybrid" else " (or method='hybrid' with one of them)"))
    problems += sequence_problems(seq_len, pu, p // pu, zigzag)
    if problems:
        raise ValueError("sequence parallelism: " + "; ".join(problems))
    return SequenceLayout(seq_len, pu, p // pu, zigzag)


def _or(numbers: list[int]) -> str:
    """"1, 2, 3 or 6"."""
    return " or ".join(filter(None, [", ".join(map(str, numbers[:-1])), str(numbers[-1])]))


def check_attention(who: str, q: Any, k: Any, v: Any, n_heads: int, p_u: int, rows: int | None = None,
                    where: str = "", on_heads: bool = False) -> None:
    """``ValueError`` from ``who`` (one of the attentions) unless q, k, v are one (b, n, H d) shape with
    ``n_heads`` whole heads of width d (``on_heads``: already all-to-all'ed, H/P_u heads), ``n_heads``
    splits over the ``p_u`` Ulysses ranks and (given ``rows``, the positions ``where`` says) n =
    ``rows``. Numbers every rank has (its shapes, the degrees), checked before any message."""
    n_heads = whole(who, "n_heads", n_heads)
    shapes = [tuple(x.shape) for x in (q, k, v)]
    if len(set(shapes)) > 1 or len(shapes[0]) != 3:
        raise ValueError(f"{who}: q, k, v must have one shape (b, n, H d); got q {shapes[0]}, k {shapes[1]}, "
                         f"v {shapes[2]}")
    if n_heads % p_u:
        ranks = _or(_divisors(n_heads))
        raise ValueError(f"{who}: n_heads={n_heads} is not divisible by the Ulysses degree P_u={p_u} (the ranks of "
                         f"its communicator): each rank needs whole heads; use a multiple of {p_u} heads or {ranks} "
                         f"rank{'s' if n_heads > 1 else ''}")
    held = n_heads // p_u if on_heads else n_heads
    if shapes[0][2] % held:
        heads = f"its {held} heads (n_heads={n_heads} over P_u={p_u})" if on_heads else f"n_heads={n_heads}"
        raise ValueError(f"{who}: the width {shapes[0][2]} of q, k, v is not divisible by {heads}")
    if rows is not None and shapes[0][1] != rows:
        raise ValueError(f"{who}: q, k, v must be (b, {rows}, H d), {where}; got q {shapes[0]}, k {shapes[1]}, "
                         f"v {shapes[2]}")


def block_rows(who: str, blocks: Any, ring_size: int, ring_rank: int) -> int:
    """The positions of ring block ``blocks[ring_rank]``, after checking ``blocks`` has one block (a
    list of ``(start, stop)`` pieces) per ring rank."""
    if len(blocks) != ring_size:
        raise ValueError(f"{who}: blocks has {len(blocks)} entries; it needs one per rank of the ring "
                         f"(comm.size={ring_size})")
    return sum(stop - start for start, stop in blocks[ring_rank])
