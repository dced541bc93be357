"""Collectives: bytes per rank and time in the alpha-beta-gamma model.

- ``ring_bytes(op, nbytes, p)``: the closed form for one rank in a ring collective on ``p`` ranks:
  all-reduce ``2(p-1)/p n``, reduce-scatter and all-gather ``(p-1)/p n``.
- ``allreduce_bytes(numel, itemsize, p, rank, algorithm)``: the exact payload bytes ``rank`` sends in
  one all-reduce, for any length (chunks cut like ``np.array_split``), derived here from the
  algorithms' definitions, not from ``minipar.comm``'s code.
- ``collective_time(op, algorithm, nbytes, p, alpha, beta, gamma)``: the alpha-beta-gamma model of
  Thakur, Rabenseifner and Gropp 2005 (and Chan et al. 2007): a message of ``m`` bytes costs
  ``alpha + m beta``, reducing ``m`` bytes ``m gamma``; the ring all-reduce is Patarasuk and Yuan
  2009's (a ring reduce-scatter, Thakur et al.'s pairwise exchange, then a ring all-gather).
"""

from __future__ import annotations

from minipar.checks import index, number, one_of, whole
from minipar.comm.collectives import ALGORITHMS_BY_OP

ALLREDUCE_ALGORITHMS = ALGORITHMS_BY_OP["allreduce"]


def ring_bytes(op: str, nbytes: float, p: int) -> float:
    """Bytes one rank sends in a ring ``op`` on ``p`` ranks; ``nbytes`` = the (full) array's size."""
    one_of("ring_bytes", "op", op, ("allreduce", "allgather", "reduce_scatter"))
    number("ring_bytes", "nbytes", nbytes)
    whole("ring_bytes", "p", p)
    if op == "allreduce":
        return 2 * (p - 1) / p * nbytes
    return (p - 1) / p * nbytes


def allreduce_bytes(numel: int, itemsize: int, p: int, rank: int, algorithm: str) -> int:
    """Exact payload bytes ``rank`` sends in one all-reduce of ``numel`` elements (see comm/ring.py).

    ring: reduce-scatter sends every chunk but chunk ``rank``, all-gather every chunk but chunk
    ``rank+1``, which is ``2(p-1)/p * n`` when ``p`` divides ``numel`` and averages to exactly that
    over the ranks otherwise. recursive_doubling: ``lg p`` rounds of ``n`` (with ``p`` not a power of
    two, the paired ranks below ``2(p - 2^lg p)`` send ``n`` once (even) or ``(lg p + 1) n`` (odd)).
    naive: rank 0 sends ``(p-1) n``, the others ``n``. native: 0 (MPI's own messages are not visible
    in the trace).
    """
    who = "allreduce_bytes"
    one_of(who, "algorithm", algorithm, ALLREDUCE_ALGORITHMS)
    whole(who, "numel", numel, least=0)
    whole(who, "itemsize", itemsize)
    index(who, "rank", rank, whole(who, "p", p), "ranks")
    n = numel * itemsize
    if p == 1 or algorithm == "native":
        return 0
    if algorithm == "ring":
        sizes = [numel // p + (i < numel % p) for i in range(p)]  # np.array_split's chunks
        return (2 * numel - sizes[rank] - sizes[(rank + 1) % p]) * itemsize
    if algorithm == "naive":
        return (p - 1) * n if rank == 0 else n
    pp = 1 << (p.bit_length() - 1)
    extra, lg = p - pp, pp.bit_length() - 1
    if rank < 2 * extra:
        return n if rank % 2 == 0 else (lg + 1) * n
    return lg * n


def tree_broadcast_bytes(nbytes: int, p: int, rank: int, root: int = 0) -> int:
    """Bytes ``rank`` sends in a binomial-tree broadcast of ``nbytes`` from ``root`` (MPICH's
    ``MPIR_Bcast_intra_binomial``): with ``v = (rank - root) mod p``, rank ``v``'s children are
    ``v + 2^k`` for every ``2^k`` below the lowest set bit of ``v`` (every ``2^k < p`` for the root)
    that is a rank: the root sends ``ceil(lg p)`` messages, a leaf none."""
    whole("tree_broadcast_bytes", "nbytes", nbytes, least=0)
    whole("tree_broadcast_bytes", "p", p)
    index("tree_broadcast_bytes", "rank", rank, p, "ranks")
    index("tree_broadcast_bytes", "root", root, p, "ranks")
    v = (rank - root) % p
    low = v & -v if v else 1 << max(p - 1, 1).bit_length()
    return nbytes * sum(1 for k in range(low.bit_length()) if (1 << k) < low and v + (1 << k) < p)


def collective_time(op: str, algorithm: str, nbytes: float, p: int, alpha: float, beta: float,
                    gamma: float = 0.0) -> float:
    """Time of one collective of ``nbytes`` on ``p`` ranks on its critical path (alpha: latency per
    message, beta: seconds per byte, gamma: seconds per byte reduced):

    - ring reduce-scatter ``(p-1) alpha + (p-1)/p n (beta + gamma)``, ring all-gather ``(p-1) alpha +
      (p-1)/p n beta`` (Thakur et al. 2005, Sec. 4), ring all-reduce their sum (Patarasuk & Yuan 2009);
    - recursive-doubling all-reduce ``lg p (alpha + n beta + n gamma)`` for p a power of two; otherwise
      (p = p' + e, p' = 2^floor(lg p)) the ``e`` extra ranks first fold into partners and get the result
      back: ``(lg p' + 2)(alpha + n beta) + (lg p' + 1) n gamma`` (Thakur et al. 2005, Sec. 4.1);
    - naive all-reduce (gather to one rank, reduce, send back; its links are sequential)
      ``2(p-1)(alpha + n beta) + (p-1) n gamma``;
    - binomial-tree broadcast ``ceil(lg p)(alpha + n beta)`` and reduce ``ceil(lg p)(alpha + n beta +
      n gamma)`` (Thakur et al. 2005, Sec. 3 and 4.2); pairwise all-to-all ``(p-1)(alpha + n/p beta)``
      (Sec. 3.5; n = the bytes one rank sends to all); dissemination barrier ``ceil(lg p) alpha``
      (Hensgen, Finkel & Manber 1988).
    """
    whole("collective_time", "p", p)
    for name, value in (("nbytes", nbytes), ("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        number("collective_time", name, value)
    if p == 1:
        return 0.0
    n, steps = nbytes, p - 1
    if algorithm == "ring":
        if op == "allreduce":
            return 2 * steps * alpha + 2 * steps / p * n * beta + steps / p * n * gamma
        if op == "reduce_scatter":
            return steps * alpha + steps / p * n * (beta + gamma)
        if op == "allgather":
            return steps * alpha + steps / p * n * beta
    if op == "allreduce" and algorithm == "recursive_doubling":
        lg = p.bit_length() - 1
        if p == 1 << lg:
            return lg * (alpha + n * beta + n * gamma)
        return (lg + 2) * (alpha + n * beta) + (lg + 1) * n * gamma
    if op == "allreduce" and algorithm == "naive":
        return 2 * steps * (alpha + n * beta) + steps * n * gamma
    rounds = (p - 1).bit_length()  # ceil(lg p)
    if (op, algorithm) == ("broadcast", "tree"):
        return rounds * (alpha + n * beta)
    if (op, algorithm) == ("reduce", "tree"):
        return rounds * (alpha + n * beta + n * gamma)
    if (op, algorithm) == ("all_to_all", "pairwise"):
        return steps * (alpha + n / p * beta)
    if (op, algorithm) == ("barrier", "dissemination"):
        return rounds * alpha
    raise ValueError(f"no alpha-beta-gamma formula for {op} with {algorithm!r}")
