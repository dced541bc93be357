"""Ring Attention never holds the whole sequence's K, V or dK, dV: what a rank allocates in one
layer's forward and backward (tracemalloc, on P = 8 threads-ranks, with a hidden size large against
the score blocks) is bounded by a count of (b, S/P, h) blocks that does not grow with P.

Forward, new arrays per rank: K and V stacked to travel (2 blocks), the next pair arriving (2), the
running output and the result (2), a temporary of the online softmax's rescaling (1): at most 7
blocks (score blocks of (S/2P)^2 per head are small here; measured 6.0). Backward: dq (1), the K/V
pair held and the one arriving (4), the rank's own dK/dV, the accumulator being computed, the one
arriving and the one last sent (8), the incoming gradient, delta and temporaries: at most 18
(measured 16.4). Keeping every block that passes through would add 2 (P - 2) blocks forward and
2 (P - 2) backward, 12 more at P = 8, above either bound (measured: 17.0 blocks forward keeping
every K/V pair; 25.3 backward keeping every accumulator sent, as ring.py did before)."""

from __future__ import annotations

import tracemalloc

import numpy as np

from minipar.autograd import Tensor
from minipar.comm import launch
from minipar.parallel.sequence import SequenceGroup, check_sequence_config

P, S, HEADS, D_HEAD, B = 8, 64, 8, 64, 1
H = HEADS * D_HEAD
BLOCK = B * (S // P) * H * 8  # one (b, S/P, h) float64 block


def peaks(comm) -> tuple[int, int] | None:
    """Process-wide tracemalloc peaks of the forward and of the backward of one ring layer (rank 0
    reports; every rank runs inside the same window)."""
    rng = np.random.default_rng(comm.rank)
    q, k, v, g = (rng.standard_normal((B, S // P, H)) for _ in range(4))
    group = SequenceGroup(comm, check_sequence_config(comm, S, HEADS, H, "ring", zigzag=True), "ring")
    inputs = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    out = []

    def window(fn):
        comm.barrier()
        if comm.rank == 0:
            tracemalloc.start()
        comm.barrier()
        result = fn()
        comm.barrier()
        if comm.rank == 0:
            out.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        return result

    y = window(lambda: (group.attention(*inputs, HEADS, True) * Tensor(g)).sum())
    window(y.backward)
    return (out[0], out[1]) if comm.rank == 0 else None


def test_ring_attention_holds_a_bounded_number_of_blocks() -> None:
    forward, backward = launch(peaks, P)[0]
    assert forward / P <= 7 * BLOCK, forward / P / BLOCK
    assert backward / P <= 18 * BLOCK, backward / P / BLOCK
