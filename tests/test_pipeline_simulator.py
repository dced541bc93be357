"""Pipeline simulator (issue 4, point 4): makespan, bubble, stash and the trace against the formulas."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar import trace as mtrace
from minipar.parallel.pipeline import ScheduleError, make_schedule, simulate, validate

F, B = 1.0, 2.0


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(4, 8), (2, 1), (3, 5), (5, 16)])
def test_gpipe_and_1f1b_makespan_and_bubble(kind, p, m):
    res = simulate(make_schedule(kind, p, m), forward=F, backward=B)
    assert res.makespan == (m + p - 1) * (F + B)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert res.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-12)
    assert res.idle == {r: (p - 1) * (F + B) for r in range(p)}
    assert res.busy == {r: m * (F + B) for r in range(p)}


def test_peak_stash_gpipe_m_and_1f1b_p_minus_stage():
    p, m = 4, 8
    assert simulate(make_schedule("gpipe", p, m)).peak_stash == {r: m for r in range(p)}
    assert simulate(make_schedule("1f1b", p, m)).peak_stash == {r: p - r for r in range(p)}
    assert simulate(make_schedule("naive", p, m)).peak_stash == {r: 1 for r in range(p)}


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (2, 4, 2), (3, 6, 3)])
def test_interleaved_divides_bubble_by_v(p, m, v):
    inter = simulate(make_schedule("interleaved", p, m, v))
    flat = simulate(make_schedule("1f1b", p, m))
    # F and B are per chunk: a rank's ideal time is v m (F + B); the bubble stays (p - 1)(F + B).
    assert inter.makespan == (v * m + p - 1) * (F + B)
    assert inter.bubble_ratio == pytest.approx(flat.bubble_ratio / v, rel=1e-12)
    assert inter.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert inter.peak_stash == {r: min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)}


def test_interleaved_with_m_equal_p_runs_all_forwards_first():
    # Megatron-LM's interleaved schedule with as many micro-batches as ranks: no 1F1B steady state.
    sched = make_schedule("interleaved", 3, 3, 2)
    for r, acts in sched.items():
        assert [a.op for a in acts] == ["F"] * 6 + ["B"] * 6, r
    res = simulate(sched)
    assert res.makespan == (2 * 3 + 3 - 1) * (F + B)
    assert res.peak_stash == {r: 6 for r in range(3)}


def test_naive_keeps_one_rank_busy():
    res = simulate(make_schedule("naive", 3, 4))
    assert res.makespan == 4 * 3 * (F + B)
    assert res.bubble_fraction == pytest.approx(2 / 3, rel=1e-12)


def test_latency_adds_two_trips_through_the_pipeline():
    p, m, lat = 4, 6, 0.25
    res = simulate(make_schedule("gpipe", p, m), latency=lat)
    assert res.makespan == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * lat, rel=1e-12)


def test_per_stage_durations():
    # rank 0: F0 0-1, F1 1-2; rank 1: F0 1-4, F1 4-7, B0 7-9, B1 9-11; rank 0: B0 9-11, B1 11-13.
    res = simulate(make_schedule("gpipe", 2, 2), forward=[1.0, 3.0], backward=[2.0, 2.0])
    assert res.makespan == 13.0
    assert res.busy == {0: 6.0, 1: 10.0}
    assert res.idle == {0: 7.0, 1: 3.0}
    spans = [(e.name, e.microbatch, e.t0, e.t1) for e in res.trace.select("compute", rank=0)]
    assert spans == [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 0, 9.0, 11.0), ("B", 1, 11.0, 13.0)]
    with pytest.raises(ValueError, match="has 3 durations but the schedule has 2 stages"):
        simulate(make_schedule("gpipe", 2, 2), forward=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must be >= 0"):
        simulate(make_schedule("gpipe", 2, 2), backward=-1.0)


def test_trace_round_trips_and_matches_result(tmp_path):
    p, m, v = 2, 4, 2
    path = tmp_path / "pipe.json"
    res = simulate(make_schedule("interleaved", p, m, v), trace_path=path, message_bytes=64)
    tr = mtrace.load(path)
    assert tr.meta["paradigm"] == "pipeline" and tr.meta["backend"] == "simulator"
    assert (tr.meta["schedule"], tr.meta["p"], tr.meta["m"], tr.meta["v"]) == ("interleaved", p, m, v)
    compute = tr.select("compute")
    assert sorted((e.name, e.stage, e.microbatch) for e in compute) == \
        sorted((n, s, i) for n in "FB" for s in range(p * v) for i in range(m))
    assert all(e.chunk == e.stage // p and e.rank == e.stage % p for e in compute)
    # every stage boundary carries one activation and one gradient per micro-batch, seen by both ends
    messages = 2 * (p * v - 1) * m
    assert len(tr.select("comm", name="send")) == len(tr.select("comm", name="recv")) == messages
    assert sum(tr.bytes_sent(r) for r in range(p)) == 64 * messages
    for r in range(p):
        spans = sorted((e.t0, e.t1) for e in compute if e.rank == r)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap on a rank
        assert sum(t1 - t0 for t0, t1 in spans) == res.busy[r]
        stash = [e.nbytes for e in tr.select("memory", rank=r, name="activations")]
        assert max(stash) == res.peak_stash[r] and stash[-1] == 0
    assert max(e.t1 for e in tr.events) == res.makespan
    assert len(tr.events) == len(res.trace.events)


def test_invalid_schedule_is_rejected_before_writing(tmp_path):
    path = tmp_path / "never.json"
    with pytest.raises(ScheduleError, match="can never proceed"):
        simulate({0: ["0F0", "0B0"], 1: ["1B0", "1F0"]}, trace_path=path)
    assert not path.exists()


def test_hand_written_schedule_simulates():
    res = simulate({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]})
    assert res.makespan == (2 + 2 - 1) * (F + B)
    assert res.trace.meta["schedule"] == "custom"


@budget(25)
@given(kind=st.sampled_from(["naive", "gpipe", "1f1b", "interleaved"]), p=st.integers(2, 6),
       m=st.integers(1, 16), v=st.integers(2, 3))
def test_every_generated_schedule_validates_and_simulates(kind, p, m, v):
    if kind == "interleaved":
        m = p * max(1, m // p)
    else:
        v = 1
    sched = make_schedule(kind, p, m, v)
    validate(sched)
    res = simulate(sched)
    assert sorted((e.name, e.stage, e.microbatch) for e in res.trace.select("compute")) == \
        sorted((n, s, i) for n in "FB" for s in range(p * v) for i in range(m))
    expected = {"naive": m * p, "gpipe": m + p - 1, "1f1b": m + p - 1, "interleaved": v * m + p - 1}[kind]
    assert res.makespan == expected * (F + B)
    stash = {"naive": {r: 1 for r in range(p)}, "gpipe": {r: m for r in range(p)},
             "1f1b": {r: min(p - r, m) for r in range(p)},
             "interleaved": {r: v * m if m == p else min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
                             for r in range(p)}}[kind]
    assert res.peak_stash == stash
