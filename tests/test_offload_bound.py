"""The largest model ZeRO-Offload trains in a device budget, measured, against its formula
(``minipar.cost.offload.zero_offload_device_need`` / ``zero_offload_reach``; docs/formulas.md, section 7).

Mixed precision on N = 2 thread ranks, a GPT of vocabulary 5, sequence 3, 1 head and 6 layers, one
bucket per parameter (cap 1 byte), width d drawn by bisection: each probe builds the model and trains
two steps on a 64 KiB device (``DeviceOutOfMemory``: it does not fit). The formula, from the parameter
counts by hand, says the largest width is d = 19 (Psi = 27,759): 2 x 27,842 bytes of parameters (each
bucket padded to an even size), 2 x 1,444 of the largest bucket (4 d^2) and 1,444 of its half going up,
60,016 bytes, while d = 20 needs 66,120 > 65,536. Measured on a budget large enough not to
refuse, the device's peak equals the formula's need at both widths, byte for byte. Model states 16 Psi
are 7.40x the need at d = 19: the reach stays below 8 because the fp16 parameters (2 of the 16 bytes)
stay resident beside a gradient bucket and an upload.
"""

from __future__ import annotations

import numpy as np

from minipar import launch, nn
from minipar.cost.offload import zero_offload_device_need, zero_offload_reach
from minipar.parallel.offload import ZeroOffload
from minipar.tiers import DeviceOutOfMemory, Tiers

VOCAB, SEQ, LAYERS, WORLD, BUDGET = 5, 3, 6, 2, 64 * 1024


def groups(d: int) -> list[int]:
    """Every parameter's elements by hand (one bucket each): embeddings V d and S d; per block two
    layer norms (2 d each), q, k, v, proj (d^2 + d each), the feed-forward d -> 4d -> d; the final
    layer norm; the head d V."""
    block = [d, d] + [d * d, d] * 4 + [d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [VOCAB * d, SEQ * d] + block * LAYERS + [d, d, d * VOCAB]


def run(comm, d: int, budget: int) -> int | None:
    """The device's peak after two mixed-precision steps of width ``d`` on ``budget`` bytes; None if
    it did not fit."""
    model = nn.GPT(VOCAB, SEQ, d, 1, LAYERS, seed=0, dtype=np.float16)
    tiers = Tiers(budget)
    try:
        off = ZeroOffload(model, comm, tiers, precision="mixed", bucket_cap_bytes=1)
        for step in range(2):
            x, y = np.random.default_rng(step).integers(0, VOCAB, (2, 2 * WORLD, SEQ))
            rows = slice(2 * comm.rank, 2 * comm.rank + 2)
            off.backward(off.loss(x[rows], y[rows]))
            off.step()
        assert off.skipped == 0  # every step applied: the upload was made
        off.close()
    except DeviceOutOfMemory:
        return None
    return tiers.peak_device_bytes


def fits(d: int) -> bool:
    peaks = launch(run, WORLD, d=d, budget=BUDGET)
    assert len(set(peaks)) == 1  # the same on every rank
    return peaks[0] is not None


def test_largest_width_that_trains_is_the_formulas() -> None:
    need = {d: zero_offload_device_need(groups(d), WORLD, 2)["total"] for d in range(1, 65)}
    bound = max(d for d in need if need[d] <= BUDGET)
    assert (bound, sum(groups(bound)), need[bound], need[bound + 1]) == (19, 27759, 60016, 66120)
    lo, hi = 1, 64  # fits(lo), not fits(hi): bisect on real runs
    assert fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    assert lo == bound
    for d in (bound, bound + 1):  # the peak, measured where nothing refuses, is the formula's need
        assert launch(run, WORLD, d=d, budget=1 << 30) == [need[d]] * WORLD
    assert sum(p.size for p in nn.GPT(VOCAB, SEQ, bound, 1, LAYERS, seed=0).parameters()) == sum(groups(bound))
    assert round(zero_offload_reach(groups(bound), WORLD, 2), 2) == 7.40  # 16 Psi / need: below 8


def test_reach_stays_below_eight() -> None:
    # 8 Psi / (sum L + max L (1 + 1/N)) items: 8 only in the limit of buckets small against the model
    for layers, d in ((6, 20), (48, 64), (96, 256)):  # even d: no padding on N = 2
        g = [4 * d * d] * (2 * layers) + [d * d] * (4 * layers)  # the matrices; one bucket each
        reach = zero_offload_reach(g, WORLD, 2)
        assert reach == 16 * sum(g) / (2 * (sum(g) + 4 * d * d + 2 * d * d)) < 8
