"""All-reduce and its halves, written on top of send/recv so the trace shows every message.

Cost model (DESIGN.md): sending ``m`` bytes costs ``alpha + m*beta``; reducing ``m`` bytes costs
``m*gamma``. ``p`` ranks, ``n`` bytes per rank.

Chunking rule (relied on by ``reduce_scatter`` and data/ZeRO parallel code): the flattened
(C-order) array of ``N`` elements is cut like ``np.array_split(flat, p)``: chunk ``i`` has
``N // p + 1`` elements when ``i < N % p`` and ``N // p`` otherwise. When ``N`` is a multiple of
``p`` all chunks are equal; when axis 0 is a multiple of ``p`` they are exactly the axis-0 blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from minipar.comm.base import COLL

if TYPE_CHECKING:
    from minipar.comm.base import Request
    from minipar.comm.collectives import Communicator


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the ``p`` chunks of ``n`` elements (the ``np.array_split`` rule)."""
    q, extra = divmod(n, p)
    bounds, start = [], 0
    for i in range(p):
        stop = start + q + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def combine(acc: np.ndarray, other: np.ndarray, op: str, mine: np.ndarray | None = None) -> None:
    """``acc <- mine (op) other`` (``mine`` defaults to ``acc``: in place); "sum" and "mean" add
    (mean divides once, at the end)."""
    first = acc if mine is None else mine
    if op == "max":
        np.maximum(first, other, out=acc)
    else:
        np.add(first, other, out=acc)


def finish_mean(acc: np.ndarray, op: str, p: int) -> None:
    if op == "mean":
        acc /= p


def ring_pass(comm: Communicator, steps: int, outgoing: Callable[[int], np.ndarray],
              incoming: Callable[[int], np.ndarray], arrived: Callable[[int, np.ndarray], None],
              name: str, algorithm: str, step0: int) -> None:
    """``steps`` ring steps: step ``s`` sends ``outgoing(s)`` to the right neighbour, receives into
    ``incoming(s)`` from the left one, then calls ``arrived(s, received)``.

    Step s+1's receive is posted as soon as step s's has arrived, before step s's send is known to
    be delivered (unless the two buffers overlap), so MPI can copy the left neighbour's next chunk
    while this rank waits for its right neighbour to take the last one: when ranks outnumber cores
    that wait is long (``benchmarks/collectives.py``: 5-10 % off the all-reduce at p = 4 and 8 on 2
    cores). The messages, their order and their bytes are those of one ``_step`` per step."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p

    def post(s: int) -> Request:
        into = incoming(s)
        return comm._irecv(COLL, left, 0, (into.shape, into.dtype), into, name, algorithm, step0 + s)

    recv = post(0)
    for s in range(steps):
        sent = outgoing(s)
        send = comm._isend(COLL, sent, right, 0, False, name, algorithm, step0 + s)
        what = f"{name}({algorithm}) step {step0 + s}"
        comm._await([recv], what)
        nxt = None
        if s + 1 < steps:
            into = incoming(s + 1)
            if not (np.may_share_memory(into, sent) or np.may_share_memory(into, recv._value)):
                nxt = post(s + 1)
        comm._await([send], what)
        arrived(s, recv._value)
        if s + 1 < steps:
            recv = nxt if nxt is not None else post(s + 1)


def ring_reduce_scatter(comm: Communicator, flat: np.ndarray, op: str, name: str = "reduce_scatter",
                        algorithm: str = "ring", step0: int = 0, src: np.ndarray | None = None) -> np.ndarray:
    """Ring reduce-scatter into the flat work buffer ``flat``; returns this rank's fully reduced
    chunk (a view into ``flat``). ``src``: this rank's input, flat, when it is not ``flat`` itself;
    ``flat`` may then start uninitialised, and every chunk but ``(r-1) % p`` is written (the one
    chunk never received is sent straight from ``src``), so no copy of the input is made.

    Step ``s`` = 0..p-2: send chunk ``(r-s-1) % p`` to the right neighbour, receive chunk
    ``(r-s-2) % p`` from the left and add this rank's own to it, ``flat[c] = received + src[c]``
    (the sum a + b is b + a exactly in floating point, so every order of operands gives the same
    bits). After p-1 steps chunk ``r`` holds the reduction. With a separate ``src`` a receive lands
    in its place in ``flat``; in place, in one of two chunk-sized scratch buffers (step s+1's
    receive is posted while step s's is read: ``ring_pass``). Cost: (p-1) alpha + (p-1)/p n beta +
    (p-1)/p n gamma; bytes sent = every chunk except chunk r.
    """
    p, r = comm.size, comm.rank
    in_place = src is None
    mine = flat if src is None else src
    bounds = chunk_bounds(flat.size, p)
    send_chunk = [bounds[(r - s - 1) % p] for s in range(p - 1)]
    recv_chunk = [bounds[(r - s - 2) % p] for s in range(p - 1)]
    largest = bounds[0][1]  # chunk 0 is a largest one
    scratch = [np.empty(largest, flat.dtype) for _ in range(min(2, p - 1))] if in_place else []

    def outgoing(s: int) -> np.ndarray:
        a, b = send_chunk[s]
        return (mine if s == 0 else flat)[a:b]  # step s > 0 sends what step s-1 reduced

    def incoming(s: int) -> np.ndarray:
        c, d = recv_chunk[s]
        return scratch[s % len(scratch)][:d - c] if in_place else flat[c:d]

    def arrived(s: int, got: np.ndarray) -> None:
        c, d = recv_chunk[s]
        combine(flat[c:d], got, op, mine[c:d])

    ring_pass(comm, p - 1, outgoing, incoming, arrived, name, algorithm, step0)
    a, b = bounds[r]
    finish_mean(flat[a:b], op, p)
    return flat[a:b]


def ring_allgather_chunks(comm: Communicator, flat: np.ndarray, name: str = "allgather",
                          algorithm: str = "ring", step0: int = 0) -> None:
    """Ring all-gather of equal-rule chunks in place: rank r starts with chunk r of ``flat`` final.

    Step ``s`` = 0..p-2: send chunk ``(r-s) % p`` right, receive chunk ``(r-s-1) % p`` from the
    left straight into ``flat`` (``ring_pass``). Cost: (p-1) alpha + (p-1)/p n beta; bytes sent =
    every chunk except chunk (r+1) % p.
    """
    p, r = comm.size, comm.rank
    bounds = chunk_bounds(flat.size, p)

    def chunk(i: int) -> np.ndarray:
        a, b = bounds[i % p]
        return flat[a:b]

    def arrived(s: int, got: np.ndarray) -> None:
        if not np.may_share_memory(got, flat):  # threads backend: a new array; mpi: received in place
            chunk(r - s - 1)[...] = got

    ring_pass(comm, p - 1, lambda s: chunk(r - s), lambda s: chunk(r - s - 1), arrived, name, algorithm, step0)


def ring_allgather(comm: Communicator, arr: np.ndarray, algorithm: str = "ring") -> np.ndarray:
    """Ring all-gather of blocks of any axis-0 length (shapes travel in message headers).

    Step ``s`` = 0..p-2: pass the block received in the previous step (own block first) to the
    right. Result: blocks concatenated along axis 0 by rank. Cost: (p-1) alpha + (p-1)/p n beta
    with n the total gathered bytes (equal blocks).
    """
    p, r = comm.size, comm.rank
    blocks: list[np.ndarray | None] = [None] * p
    blocks[r] = arr
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        (got,) = comm._step([(right, blocks[(r - s) % p])], [(left, None)], "allgather", algorithm, s,
                            header=True)
        blocks[(r - s - 1) % p] = got
    return np.concatenate(blocks, axis=0)


def allreduce_ring(comm: Communicator, arr: np.ndarray, op: str) -> np.ndarray:
    """Ring all-reduce (Patarasuk & Yuan 2009; Baidu/Horovod): ring reduce-scatter, then ring
    all-gather, 2(p-1) steps. Every rank sends and receives 2(p-1)/p n bytes when p divides the
    element count (exactly: all chunks but its own, then all chunks but its right neighbour's).
    Cost: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma -- bandwidth-optimal."""
    src = np.ascontiguousarray(arr).reshape(-1)
    flat = np.empty_like(src)
    ring_reduce_scatter(comm, flat, op, "allreduce", "ring", 0, src=src)
    ring_allgather_chunks(comm, flat, "allreduce", "ring", comm.size - 1)
    return flat.reshape(arr.shape)


def allreduce_recursive_doubling(comm: Communicator, arr: np.ndarray, op: str) -> np.ndarray:
    """Recursive doubling (Thakur, Rabenseifner & Gropp 2005): in round k rank r exchanges its
    whole buffer with rank r XOR 2^k and combines, lg p rounds. Cost: lg p (alpha + n beta +
    n gamma); bytes sent per rank n lg p -- latency-optimal, bandwidth-heavy.

    Not a power of two: with p' the largest power of two below p and e = p - p', ranks 0..2e-1
    pair up first: even rank 2i sends its buffer to 2i+1 (one extra step of n bytes) and waits;
    the p' remaining ranks run recursive doubling; finally 2i+1 sends the result back to 2i.
    """
    p, r = comm.size, comm.rank
    buf = arr.copy()
    pp = 1 << (p.bit_length() - 1)
    extra = p - pp
    step = 0
    name, alg = "allreduce", "recursive_doubling"
    if extra:
        if r < 2 * extra and r % 2 == 0:
            comm._step([(r + 1, buf)], [], name, alg, 0)
            (got,) = comm._step([], [(r + 1, (buf.shape, buf.dtype))], name, alg, pp.bit_length())
            return got
        if r < 2 * extra:
            (got,) = comm._step([], [(r - 1, (buf.shape, buf.dtype))], name, alg, 0)
            lower = got.copy()
            combine(lower, buf, op)
            buf = lower
        step = 1
    vr = r // 2 if r < 2 * extra else r - extra

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    mask = 1
    while mask < pp:
        partner = real(vr ^ mask)
        (got,) = comm._step([(partner, buf)], [(partner, (buf.shape, buf.dtype))], name, alg, step)
        if partner < r:  # combine lower rank first so every rank adds in the same order
            combine(got, buf, op)  # a received array is private to this rank
            buf = got
        else:
            combine(buf, got, op)
        mask <<= 1
        step += 1
    finish_mean(buf, op, p)
    if extra and r < 2 * extra:
        comm._step([(r - 1, buf)], [], name, alg, step)
    return buf


def allreduce_naive(comm: Communicator, arr: np.ndarray, op: str) -> np.ndarray:
    """Naive all-reduce: every rank sends its whole buffer to rank 0, which combines them in rank
    order and sends the result back to each rank (linear reduce + linear broadcast, 2 steps).
    Root sends and receives (p-1) n bytes, the others n each way.
    Cost: 2(p-1)(alpha + n beta) + (p-1) n gamma at the root -- the bottleneck the ring removes."""
    p, r = comm.size, comm.rank
    name, alg = "allreduce", "naive"
    if r != 0:
        comm._step([(0, arr)], [], name, alg, 0)
        (got,) = comm._step([], [(0, (arr.shape, arr.dtype))], name, alg, 1)
        return got
    parts = comm._step([], [(q, (arr.shape, arr.dtype)) for q in range(1, p)], name, alg, 0)
    acc = arr.copy()
    for part in parts:
        combine(acc, part, op)
    finish_mean(acc, op, p)
    comm._step([(q, acc) for q in range(1, p)], [], name, alg, 1)
    return acc
