"""DualPipeV (issue 30): the orders against PyTorch's ``ScheduleDualPipeV``, the bubble and memory against
the DeepSeek-V3 report's table, validation, and the runtime (threads, mpiexec) equal to one process.

DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 3.2.1, Table 2 (DualPipe: bubble (PP/2 - 1)(F&B
+ B - 3W), parameters 2x, activations PP + 1); deepseek-ai/DualPipe's README gives DualPipeV, its
cut-in-half V on PP/2 devices, the same bubble and activations with 1x parameters.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_pipeline_runtime import check, config, pipeline_run

from minipar import datasets, testing
from minipar import trace as mtrace
from minipar.cost import pipeline as pipe_cost
from minipar.parallel.pipeline import (
    Pipeline,
    ScheduleError,
    format_schedule,
    lower,
    make_schedule,
    mlp,
    simulate,
    validate,
)
from minipar.parallel.pipeline.dualpipe import overlapped_program
from minipar.parallel.pipeline.simulate import simulate_overlapped

# ---- orders of torch.distributed.pipelining.ScheduleDualPipeV ------------------------------------------
# How these were checked: ScheduleDualPipeV._calculate_single_rank_operations (pytorch/pytorch at commit
# 1fd7abc2f521, torch/distributed/pipelining/schedules.py; torch is not installed here) was executed
# outside the suite by a line-for-line transcription (counters per (stage, op); a FULL_BACKWARD advances
# the I and W counters; an I queues its W; a W pops the oldest; an OVERLAP_F_B's sub-actions, F then B,
# written as two actions). Its output equals make_schedule("dualpipev") for every p = 1..6 and
# m = 2p..2p+8; the cases below are that output, and p = 2, m = 4 was also followed by hand:
# rank 0 (stages 0, 3): step 1 two F0's, step 2 one (F0, F3), step 3 one (I3, W3, F3), step 4 one
# iteration ((0F3 3B1), (3F2 0B0)), step 5 one (3B2, (3F3 0B1)), step 6 (3B3, then 0I2: rank 0 even
# splits from its stage-a backward of step 6's middle), step 7 one (W, I0) and step 8 the last W.
# deepseek-ai/DualPipe's dualpipev.py (DualPipeV.step, steps 1-8) runs the same order.
TORCH_DUALPIPEV = {
    (1, 2): {0: "0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1"},
    (2, 4): {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    },
    (2, 6): {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 0F5 3B3 3F4 0B2 3B4 3F5 0B3 3B5 "
           "0I4 0W4 0I5 0W5",
        1: "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 1F4 2B2 2F4 1B2 1F5 2B3 2F5 1B3 2B4 1B4 2I5 1I5 "
           "2W5 1W5",
    },
    (3, 6): {
        0: "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 0B2 5B5 "
           "0I3 0W3 0I4 0W4 0I5 0W5",
        1: "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 1F4 4B1 4F3 1B0 1F5 4B2 4F4 1B1 4B3 4F5 1B2 4B4 1B3 4I5 "
           "1I4 4W5 1I5 1W4 1W5",
        2: "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 2I4 3I5 "
           "2I5 2W4 3W5 2W5",
    },
    (4, 8): {
        0: "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3 7F4 0B0 7B4 7F5 0B1 "
           "7B5 7F6 0B2 7B6 7F7 0B3 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
        1: "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 1F6 6B2 6F4 1B0 1F7 6B3 6F5 1B1 6B4 6F6 "
           "1B2 6B5 6F7 1B3 6B6 1B4 6I7 1I5 6W7 1I6 1W5 1I7 1W6 1W7",
        2: "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2F5 5B1 5F4 2B0 2F6 5B2 5F5 2B1 2F7 5B3 5F6 2B2 5B4 "
           "5F7 2B3 5B5 2B4 5B6 2I5 5I7 2I6 2W5 2I7 5W7 2W6 2W7",
        3: "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4 3B0 3F5 4B1 4F5 3B1 3F6 4B2 4F6 3B2 3F7 4B3 4F7 3B3 "
           "4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7",
    },
}


@pytest.mark.parametrize(("p", "m"), sorted(TORCH_DUALPIPEV))
def test_dualpipev_order_equals_pytorch(p: int, m: int) -> None:
    got = {r: " ".join(acts) for r, acts in format_schedule(make_schedule("dualpipev", p, m)).items()}
    assert got == TORCH_DUALPIPEV[(p, m)]


@budget(20)
@given(p=st.integers(1, 6), extra=st.integers(0, 6))
def test_dualpipev_is_valid_v_shaped_and_counts(p: int, extra: int) -> None:
    """Every rank holds stages r and 2p-1-r, runs each (stage, micro-batch) forward once and its backward
    once (a B, or an I and a W); rank r splits 2p - 1 - r backwards (steps 3, 6 and 7 of the rule)."""
    m = 2 * p + extra
    sched = make_schedule("dualpipev", p, m)
    validate(sched)
    validate(overlapped_program(p, m))
    assert sched.chunks == 2 and sched.virtual_stages == 2 * p and make_schedule("dualpipev", p, m, chunks=2) == sched
    for r, acts in sched.items():
        mine = (r, 2 * p - 1 - r)
        assert sorted((a.op, a.stage, a.microbatch) for a in acts if a.op == "F") == [
            ("F", s, i) for s in mine for i in range(m)]
        split = {(a.stage, a.microbatch) for a in acts if a.op == "I"}
        assert split == {(a.stage, a.microbatch) for a in acts if a.op == "W"} and len(split) == 2 * p - 1 - r
        assert sorted((a.stage, a.microbatch) for a in acts if a.op in "BI") == [(s, i) for s in mine for i in range(m)]


# ---- bubble and memory against the report ------------------------------------------------------------------
@budget(20)
@given(p=st.integers(1, 6), extra=st.integers(0, 6), t=st.sampled_from([1.0, 0.5, 3.0]))
def test_dualpipev_order_idles_like_zb_v_and_keeps_pp_plus_one(p: int, extra: int, t: float) -> None:
    """Run as its order (each pair's F, then its B), F = I = W = t: every rank idles (p-1) t in a flushed
    step (ZB-V's), the makespan is 6 m t + (p-1) t; every rank keeps 2p + 1 chunk-micro-batches at its
    peak, the report's PP + 1 (2p stages): rank 0's 2p - 1 warm-up forwards of stage 0, one of stage 2p-1,
    and a pair's forward before its backward frees one (counted by hand from the rule's steps 1-4)."""
    m = 2 * p + extra
    sim = simulate(make_schedule("dualpipev", p, m), forward=t, backward=2 * t, weight=t)
    assert sim.idle == pytest.approx(dict.fromkeys(range(p), (p - 1) * t), abs=1e-9)
    assert sim.makespan == pytest.approx(6 * m * t + (p - 1) * t)
    assert pipe_cost.bubble_time("dualpipev", p, t, t, t) == pytest.approx((p - 1) * t)
    assert sim.peak_stash == dict.fromkeys(range(p), 2 * p + 1)
    assert pipe_cost.stash_peaks("dualpipev", p, m) == [2 * p + 1] * p
    unit = simulate(make_schedule("dualpipev", p, m))
    assert pipe_cost.bubble_fraction("dualpipev", p, m) == pytest.approx(unit.bubble_fraction, rel=1e-12)
    assert unit.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), rel=1e-12)


@budget(30)
@given(p=st.integers(2, 5), extra=st.integers(0, 4), f=st.sampled_from([1.0, 2.0, 3.0]),
       w_share=st.sampled_from([0.25, 0.5, 1.0]), overlap_share=st.floats(0.0, 1.0))
@example(p=4, extra=0, f=1.0, w_share=1.0, overlap_share=1.0)  # F = I = W, no overlap gain: 2 (p-1) F
@example(p=4, extra=0, f=1.0, w_share=1.0, overlap_share=0.0)  # F&B = B = 2F: (p-1) F
def test_overlapped_pairs_meet_the_reports_bubble(p: int, extra: int, f: float, w_share: float,
                                                  overlap_share: float) -> None:
    """Each overlapped pair one unit of F&B that starts once both its inputs arrived (DeepSeek's runtime):
    the busiest rank idles (PP/2 - 1)(F&B + B - 3W) with PP = 2p, for I = F, W <= F and any F&B between
    max(F, B) and F + B. The expectation is the report's formula written here."""
    m = 2 * p + extra
    w = f * w_share
    b = f + w
    fb = b + overlap_share * f  # from max(F, B) = B to F + B
    sim = simulate_overlapped(p, m, f, b, w, fb)
    pp = 2 * p  # the report counts stages
    want = (pp // 2 - 1) * (fb + b - 3 * w)
    assert max(sim.idle.values()) == pytest.approx(want, abs=1e-9)
    assert pipe_cost.dualpipe_bubble_time(p, f, b, w, fb) == pytest.approx(want)
    assert sim.peak_stash == dict.fromkeys(range(p), 2 * p + 1)


def test_overlap_makes_a_pair_wait_for_both_inputs() -> None:
    """p = 4, m = 8, F = I = W = 1: the plain order idles 3 per rank; pairs that wait for both inputs and
    gain nothing (F&B = F + B = 3) idle 6 = (p-1)(F + 2B - 3W); overlap to F&B = 2 brings the busiest back
    to 3 (ranks 0..3: 1, 2, 3, 3)."""
    plain = simulate(make_schedule("dualpipev", 4, 8), forward=1.0, backward=2.0, weight=1.0)
    assert plain.idle == dict.fromkeys(range(4), 3.0)
    assert simulate_overlapped(4, 8, 1.0, 2.0, 1.0, 3.0).idle == dict.fromkeys(range(4), 6.0)
    assert simulate_overlapped(4, 8, 1.0, 2.0, 1.0, 2.0).idle == {0: 1.0, 1: 2.0, 2: 3.0, 3: 3.0}


# ---- bad configurations: one line saying what to change --------------------------------------------------
def test_bad_dualpipev_configurations_say_what_works() -> None:
    with pytest.raises(ValueError, match=r"^dualpipev needs microbatches >= 2 x stages .*m=5 with p=3; "
                                         r"use microbatches=6 or more$"):
        make_schedule("dualpipev", 3, 5)
    with pytest.raises(ValueError, match=r"exactly 2 model chunks.*chunks=3; use chunks=2"):
        make_schedule("dualpipev", 2, 4, chunks=3)
    with pytest.raises(ValueError, match=r"needs m >= 4 micro-batches"):
        pipe_cost.bubble_fraction("dualpipev", 2, 3)
    with pytest.raises(ValueError, match=r"F = B - W, W <= F"):
        pipe_cost.dualpipe_bubble_time(4, 1.0, 2.0, 0.5, 2.5)
    with pytest.raises(ValueError, match=r"overlap=4.0 .* between max\(F, B\) = 2.0 and F \+ B = 3.0"):
        simulate_overlapped(2, 4, 1.0, 2.0, 1.0, 4.0)
    broken = {r: list(acts) for r, acts in make_schedule("dualpipev", 2, 4).items()}
    broken[0].remove(broken[0][4])  # 3I0 gone: its W has no I
    with pytest.raises(ScheduleError, match="3W0"):
        validate(broken)


# ---- runtime: equal to one process --------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [config("dualpipev", 2, 4, v=2, model="gpt", opt="adamw"),
                                 config("dualpipev", 3, 7, v=2, counts=[1, 2, 1, 1, 2, 1])])
def test_dualpipev_runtime_equals_single_process_on_threads(cfg: dict) -> None:
    """Loss, gradients, updated parameters, messages and the measured stash (``check``) equal one process
    and the simulator."""
    check(cfg, testing.run(pipeline_run, len(cfg["counts"]) // 2, "threads", cfgs=[cfg]))


@pytest.mark.mpi
def test_dualpipev_runtime_equals_single_process_under_mpiexec() -> None:
    cfgs = [config("dualpipev", 3, 6, v=2, model="gpt"), config("dualpipev", 3, 8, v=2, opt="adamw")]
    results = testing.run(pipeline_run, 3, "mpi", timeout=90, cfgs=cfgs)
    for i, cfg in enumerate(cfgs):
        check(cfg, results, i)


def _both_programs(comm, p: int, m: int) -> list[tuple[float, dict]]:
    """(loss, gradients) on this rank from the plain lowering and from ``overlapped_program``."""
    x, y = datasets.regression(2 * m, 3, 2)
    out = []
    for schedule in ("dualpipev", overlapped_program(p, m)):
        pipe = Pipeline(comm, mlp([3] + [4] * (2 * p - 1) + [2], seed=1), schedule, microbatches=m)
        out.append((pipe.step(x, y), pipe.grads()))
    return out


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7)])
def test_overlapped_program_runs_and_computes_the_same(p: int, m: int) -> None:
    """DeepSeek's communication placement (both receives of a pair first, both sends after) runs in the
    runtime and, the compute order being the same, gives bit-equal losses and gradients on every rank."""
    assert overlapped_program(p, m) != lower(make_schedule("dualpipev", p, m))  # other message positions
    for (plain_loss, plain), (loss, grads) in testing.run(_both_programs, p, "threads", p=p, m=m):
        assert loss == plain_loss and grads.keys() == plain.keys()
        assert all((grads[k] == plain[k]).all() for k in plain)


def _refusal(comm) -> tuple[str, int]:
    """(the error of a DualPipeV pipeline with m = 3 on this rank, the trace events recorded before it)."""
    with mtrace.recording(comm.world_rank) as rec:
        try:
            Pipeline(comm, mlp([3, 4, 4, 4, 2], seed=0), "dualpipev", microbatches=3)
        except ValueError as exc:
            return str(exc), len(rec.events)
    return "", len(rec.events)


def test_too_few_microbatches_refused_on_every_rank_before_any_message() -> None:
    results = testing.run(_refusal, 2, "threads")
    assert [n for _, n in results] == [0, 0] and len({text for text, _ in results}) == 1
    assert results[0][0] == ("dualpipev needs microbatches >= 2 x stages (m >= 2p, as PyTorch's ScheduleDualPipeV and "
                             "DeepSeek's DualPipeV): m=3 with p=2; use microbatches=4 or more")
