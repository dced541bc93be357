"""Communication cost formulas that traces are held against (DESIGN.md, "Reference formulas").

- ``ring_bytes(op, nbytes, p)``: the closed form for one rank in a ring collective on ``p`` ranks:
  all-reduce ``2(p-1)/p n``, reduce-scatter and all-gather ``(p-1)/p n``.
- ``allreduce_bytes(numel, itemsize, p, rank, algorithm)``: the exact payload bytes ``rank`` sends in
  one all-reduce as ``minipar.comm`` runs it, for any length (chunks cut like ``np.array_split``).
"""

from __future__ import annotations

from minipar.comm.ring import chunk_bounds

ALLREDUCE_ALGORITHMS = ("ring", "recursive_doubling", "naive", "native")


def ring_bytes(op: str, nbytes: float, p: int) -> float:
    """Bytes one rank sends in a ring ``op`` on ``p`` ranks; ``nbytes`` = the (full) array's size."""
    if op == "allreduce":
        return 2 * (p - 1) / p * nbytes
    if op in ("allgather", "reduce_scatter"):
        return (p - 1) / p * nbytes
    raise ValueError(f"no ring formula for {op!r}")


def allreduce_bytes(numel: int, itemsize: int, p: int, rank: int, algorithm: str) -> int:
    """Exact payload bytes ``rank`` sends in one all-reduce of ``numel`` elements (see comm/ring.py).

    ring: reduce-scatter sends every chunk but chunk ``rank``, all-gather every chunk but chunk
    ``rank+1``, which is ``2(p-1)/p * n`` when ``p`` divides ``numel`` and averages to exactly that
    over the ranks otherwise. recursive_doubling: ``lg p`` rounds of ``n`` (with ``p`` not a power of
    two, the paired ranks below ``2(p - 2^lg p)`` send ``n`` once (even) or ``(lg p + 1) n`` (odd)).
    naive: rank 0 sends ``(p-1) n``, the others ``n``. native: 0 (MPI's own messages are not visible
    in the trace).
    """
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose one of {ALLREDUCE_ALGORITHMS}")
    n = numel * itemsize
    if p == 1 or algorithm == "native":
        return 0
    if algorithm == "ring":
        sizes = [b - a for a, b in chunk_bounds(numel, p)]
        return (2 * numel - sizes[rank] - sizes[(rank + 1) % p]) * itemsize
    if algorithm == "naive":
        return (p - 1) * n if rank == 0 else n
    pp = 1 << (p.bit_length() - 1)
    extra, lg = p - pp, pp.bit_length() - 1
    if rank < 2 * extra:
        return n if rank % 2 == 0 else (lg + 1) * n
    return lg * n
