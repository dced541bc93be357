"""minipar.cost: the formulas against independent derivations (the simulator, hand-worked cases)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar.cost import collective_time
from minipar.cost import data as data_cost
from minipar.cost import pipeline as pipe_cost
from minipar.cost.collectives import tree_broadcast_bytes
from minipar.parallel.pipeline import make_schedule, simulate


@budget(20)
@given(kind=st.sampled_from(["naive", "gpipe", "1f1b", "interleaved"]), p=st.integers(1, 6),
       k=st.integers(1, 4), v=st.integers(2, 3))
def test_pipeline_formulas_equal_the_simulated_schedules(kind: str, p: int, k: int, v: int) -> None:
    m = p * k  # interleaved needs m a multiple of p
    chunks = v if kind == "interleaved" else 1
    sim = simulate(make_schedule(kind, p, m, chunks), forward=1.0, backward=2.0)
    assert pipe_cost.bubble_fraction(kind, p, m, chunks) == pytest.approx(sim.bubble_fraction, rel=1e-12)
    assert {r: pipe_cost.peak_stash(kind, p, m, r, chunks) for r in range(p)} == sim.peak_stash


def test_send_bytes_by_hand() -> None:
    a, m = 10, 3
    assert pipe_cost.send_bytes(pipe_cost.stage_owner(4), m, a) == [30, 60, 60, 30]
    # interleaved v = 2 on 2 ranks: stages 0 1 2 3 on ranks 0 1 0 1, three boundaries cross ranks
    assert pipe_cost.send_bytes(pipe_cost.stage_owner(2, 2), m, [1, 2, 4]) == [3 * (1 + 2 + 4), 3 * (1 + 2 + 4)]
    assert pipe_cost.send_bytes([0, 0, 1], m, 5) == [15, 15]  # the boundary inside rank 0 is free
    with pytest.raises(ValueError, match="one non-negative int per stage boundary"):
        pipe_cost.send_bytes([0, 1], m, [1, 2])


def test_parameter_server_bytes_by_hand() -> None:
    shards = [100, 60]  # 2 servers, ranks 2, 3, 4 workers
    got = data_cost.ps_bytes(shards, 5, steps=2)
    assert got == {"pull": [2 * 3 * 100, 2 * 3 * 60, 0, 0, 0], "push": [0, 0, 320, 320, 320]}
    links = data_cost.ps_link_bytes(shards, 5, steps=2)
    assert links[(0, 3)] == links[(3, 0)] == 200 and links[(1, 4)] == 120 and len(links) == 12


def test_ddp_bytes_add_the_buckets() -> None:
    # ring on 4 ranks, buckets of 8 and 6 float64 numbers: chunks (2,2,2,2) and (2,2,1,1)
    # rank 2 sends every chunk but its own and its right neighbour's in each bucket
    assert data_cost.ddp_bytes([(8, 8), (6, 8)], 4, 2, "ring") == (16 - 2 - 2) * 8 + (12 - 1 - 1) * 8
    assert data_cost.ddp_bytes([(8, 8)], 4, 0, "naive") == 3 * 64


def test_alpha_beta_gamma_by_hand() -> None:
    alpha, beta, gamma, n = 1e-6, 1e-9, 1e-10, 8e6
    rs = collective_time("reduce_scatter", "ring", n, 4, alpha, beta, gamma)
    ag = collective_time("allgather", "ring", n, 4, alpha, beta)
    # a ring all-reduce is a reduce-scatter followed by an all-gather (Patarasuk & Yuan 2009)
    assert collective_time("allreduce", "ring", n, 4, alpha, beta, gamma) == pytest.approx(rs + ag)
    assert ag == pytest.approx(3 * alpha + 0.75 * n * beta)
    assert collective_time("allreduce", "recursive_doubling", n, 8, alpha, beta, gamma) == \
        pytest.approx(3 * (alpha + n * beta + n * gamma))
    # p = 3 = 2 + 1: rank 2 folds into rank 0 (a message and a sum), one round, the result sent back
    assert collective_time("allreduce", "recursive_doubling", n, 3, alpha, beta, gamma) == \
        pytest.approx(3 * (alpha + n * beta) + 2 * n * gamma)
    assert collective_time("allreduce", "recursive_doubling", n, 6, alpha, beta, gamma) == \
        pytest.approx(4 * (alpha + n * beta) + 3 * n * gamma)
    # ring reduce-scatter written out: p - 1 steps, each one chunk n/p sent and added
    assert rs == pytest.approx(3 * (alpha + n / 4 * beta + n / 4 * gamma))
    assert collective_time("allreduce", "ring", n, 1, alpha, beta) == 0.0
    with pytest.raises(ValueError, match="no alpha-beta-gamma formula"):
        collective_time("gather", "linear", n, 4, alpha, beta)


def test_tree_broadcast_bytes_by_hand() -> None:
    # binomial tree from root 0 on 8 ranks: 0 -> 4, 2, 1; 4 -> 6, 5; 2 -> 3; 6 -> 7
    assert [tree_broadcast_bytes(10, 8, r) for r in range(8)] == [30, 0, 10, 0, 20, 0, 10, 0]
    # 3 ranks from root 2: relative 0 (rank 2) -> 2 (rank 1), 1 (rank 0)
    assert [tree_broadcast_bytes(8, 3, r, root=2) for r in range(3)] == [0, 0, 16]
    assert tree_broadcast_bytes(8, 1, 0) == 0


@budget(20)
@given(p=st.integers(1, 6), extra=st.integers(0, 6), costs=st.sampled_from(
    [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (3.0, 4.0, 2.0), (1.0, 2.0, 0.5), (2.0, 2.0, 1.0)]))
def test_zero_bubble_formulas_equal_the_simulated_schedules(p: int, extra: int, costs: tuple) -> None:
    """Qi et al. 2024, Table 2 (m >= p, W <= F): ZB-H1 idles (p-1)(F + I - W) per rank, 1F1B with the
    same work (p-1)(F + I + W); ZB-H1 keeps min(p, m) micro-batches on every rank, 1F1B's most."""
    f, i, w = costs
    m = p + extra
    zb = simulate(make_schedule("zb-h1", p, m), forward=f, backward=i + w, weight=w)
    one = simulate(make_schedule("1f1b", p, m), forward=f, backward=i + w)
    assert zb.idle == pytest.approx(dict.fromkeys(range(p), pipe_cost.bubble_time("zb-h1", p, f, i, w)), abs=1e-12)
    assert one.idle == pytest.approx(dict.fromkeys(range(p), pipe_cost.bubble_time("1f1b", p, f, i, w)), abs=1e-12)
    assert zb.idle[0] == pytest.approx((p - 1) * (f + i - w)) and one.idle[0] == pytest.approx((p - 1) * (f + i + w))
    assert zb.peak_stash == {r: pipe_cost.peak_stash("zb-h1", p, m, r) for r in range(p)}
    assert max(zb.peak_stash.values()) == max(one.peak_stash.values()) == min(p, m)
    unit = simulate(make_schedule("zb-h1", p, m), forward=1.0, backward=2.0)  # I = W = 1 by default
    assert pipe_cost.bubble_fraction("zb-h1", p, m) == pytest.approx(unit.bubble_fraction, rel=1e-12)


def test_stash_peaks_of_every_kind_the_runtime_runs() -> None:
    assert pipe_cost.stash_peaks("1f1b", 4, 8) == [4, 3, 2, 1]
    assert pipe_cost.stash_peaks("pipedream", 4, 8) == pipe_cost.stash_peaks("2bw", 4, 8) == [4, 3, 2, 1]
    assert pipe_cost.stash_peaks("zb-h1", 4, 8) == [4, 4, 4, 4]
    assert pipe_cost.stash_peaks("zb-v", 4, 8) == [8, 8, 8, 8]  # 2p chunk-micro-batches
    assert pipe_cost.stash_peaks("chimera", 4, 8) == [3, 4, 4, 3]  # p/2 + 1 + min(r, p-1-r)
