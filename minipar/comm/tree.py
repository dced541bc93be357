"""Rooted collectives, all-to-all and barrier, written on top of send/recv.

Cost model as in ``ring.py``: ``alpha + m*beta`` per message of m bytes, ``gamma`` per byte reduced;
``p`` ranks, ``n`` bytes per rank. Ranks are renumbered relative to the root, ``v = (r - root) % p``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minipar.comm.ring import combine, finish_mean

if TYPE_CHECKING:
    from minipar.comm.collectives import Communicator


def broadcast_tree(comm: Communicator, arr: np.ndarray | None, root: int) -> np.ndarray:
    """Binomial-tree broadcast (MPICH's): relative rank v receives from v minus its lowest set bit,
    then sends to v + 2^k for every 2^k below that bit, largest first (the root: every 2^k < p).
    ceil(lg p) rounds; the root sends ceil(lg p) messages, a leaf none.
    Cost: ceil(lg p) (alpha + n beta). Shape and dtype travel with the data (non-roots pass None)."""
    p = comm.size
    v = (comm.rank - root) % p
    data = arr
    mask = 1
    while mask < p:
        if v & mask:  # receive from the parent: v with its lowest set bit cleared
            (data,) = comm._step([], [((v - mask + root) % p, None)], "broadcast", "tree",
                                 mask.bit_length() - 1, header=True)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            comm._step([((v + mask + root) % p, data)], [], "broadcast", "tree", mask.bit_length() - 1,
                       header=True)
        mask >>= 1
    assert data is not None
    return data if comm.rank != root else data.copy()


def reduce_tree(comm: Communicator, arr: np.ndarray, root: int, op: str) -> np.ndarray | None:
    """Binomial-tree reduce: in round k a rank with bit k set sends its partial result to v - 2^k
    and drops out; the others combine what they receive from v + 2^k. lg p rounds.
    Cost: ceil(lg p) (alpha + n beta + n gamma). Returns the result on ``root``, None elsewhere."""
    p = comm.size
    v = (comm.rank - root) % p
    acc = arr.copy()
    mask = 1
    while mask < p:
        step = mask.bit_length() - 1
        if v & mask:
            comm._step([((v - mask + root) % p, acc)], [], "reduce", "tree", step)
            return None
        if v + mask < p:
            (got,) = comm._step([], [((v + mask + root) % p, (acc.shape, acc.dtype))], "reduce", "tree", step)
            combine(acc, got, op)
        mask <<= 1
    finish_mean(acc, op, p)
    return acc


def gather_linear(comm: Communicator, arr: np.ndarray, root: int) -> np.ndarray | None:
    """Linear gather: every rank sends its block to the root (one step), which concatenates them
    along axis 0 by rank (blocks may differ in axis-0 length). Cost at the root: (p-1) alpha + (p-1)
    n beta. Returns the concatenation on ``root``, None elsewhere."""
    if comm.rank != root:
        comm._step([(root, arr)], [], "gather", "linear", 0, header=True)
        return None
    others = [q for q in range(comm.size) if q != root]
    got = comm._step([], [(q, None) for q in others], "gather", "linear", 0, header=True)
    blocks = dict(zip(others, got, strict=True))
    blocks[root] = arr
    return np.concatenate([blocks[q] for q in range(comm.size)], axis=0)


def scatter_linear(comm: Communicator, arr: np.ndarray | None, root: int) -> np.ndarray:
    """Linear scatter: the root cuts axis 0 of its array like ``np.array_split`` (the first
    ``len % p`` blocks one row longer) and sends block q to rank q. Cost at the root: (p-1) alpha +
    (p-1)/p n beta. Returns this rank's block."""
    if comm.rank != root:
        (got,) = comm._step([], [(root, None)], "scatter", "linear", 0, header=True)
        return got
    assert arr is not None
    blocks = np.array_split(arr, comm.size, axis=0)
    comm._step([(q, np.ascontiguousarray(blocks[q])) for q in range(comm.size) if q != root], [],
               "scatter", "linear", 0, header=True)
    return blocks[root].copy()


def all_to_all_pairwise(comm: Communicator, arr: np.ndarray) -> np.ndarray:
    """Pairwise all-to-all: axis 0 is cut into p equal blocks, block j goes to rank j. In step
    k = 1..p-1 rank r sends block (r+k) % p to rank (r+k) % p and receives from (r-k) % p.
    Cost: (p-1) alpha + (p-1)/p n beta; bytes out per rank n (p-1)/p. The result stacks the blocks
    by source rank along axis 0 (same shape as the input)."""
    p, r = comm.size, comm.rank
    b = arr.shape[0] // p
    out = np.empty_like(arr)
    out[r * b:(r + 1) * b] = arr[r * b:(r + 1) * b]
    for k in range(1, p):
        dst, src = (r + k) % p, (r - k) % p
        view = out[src * b:(src + 1) * b]
        (got,) = comm._step([(dst, arr[dst * b:(dst + 1) * b])], [(src, view)], "all_to_all", "pairwise",
                            k - 1)
        if not np.may_share_memory(got, out):
            view[...] = got
    return out


def barrier_dissemination(comm: Communicator) -> None:
    """Dissemination barrier (Hensgen, Finkel & Manber 1988): in round k rank r sends an empty
    message to (r + 2^k) % p and waits for one from (r - 2^k) % p. ceil(lg p) rounds, 0 bytes.
    Cost: ceil(lg p) alpha. No rank leaves before every rank has entered."""
    p, r = comm.size, comm.rank
    empty = np.empty(0, dtype=np.uint8)
    k = 0
    while (1 << k) < p:
        d = 1 << k
        comm._step([((r + d) % p, empty)], [((r - d) % p, ((0,), empty.dtype))], "barrier", "dissemination",
                   k)
        k += 1
