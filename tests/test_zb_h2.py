"""ZB-H2 (issue 30): the order, its bubble and peak stash against the paper and the formulas, validation,
and the runtime (threads, mpiexec) equal to one process.

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2.2, Figure 3 bottom and Table 2: ZB-H2 runs
more warm-up forwards than ZB-H1 and holds W's back to the end, so the step is a parallelogram: with
F = I = W and m >= 2p - 1 micro-batches no rank has a gap between its first and its last action (the
paper's bubble (p - 1)(F + I - 2W) = 0), at a peak of 2p - 1 micro-batches kept until their W (the
paper's (2p - 1) M_B; 1F1B and ZB-H1: p). Every expected number here is computed from those
definitions in the test, never by the code it checks.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_pipeline_runtime import check, config, pipeline_run
from test_zero_bubble import _gaps

from minipar import datasets, testing
from minipar import trace as mtrace
from minipar.cost import pipeline as pipe_cost
from minipar.parallel.pipeline import Pipeline, format_schedule, make_schedule, mlp, simulate, validate

# p = 4, m = 8 (one step of unit time per row: every rank busy from step r to step r + 23, none idle
# in between): rank r runs 2(p - r) - 1 = 7, 5, 3, 1 forwards before its first I, then I's alternating
# with F's, and with W's once 2p - 1 = 7 micro-batches are held; the W's held back fill the end.
ZB_H2_4_8 = {
    0: "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0W0 0I1 0F7 0I2 0W1 0I3 0W2 0I4 0W3 0I5 0W4 0I6 0W5 0W6 0I7 0W7",
    1: "1F0 1F1 1F2 1F3 1F4 1I0 1F5 1I1 1F6 1I2 1W0 1I3 1F7 1I4 1W1 1I5 1W2 1I6 1W3 1W4 1I7 1W5 1W6 1W7",
    2: "2F0 2F1 2F2 2I0 2F3 2I1 2F4 2I2 2F5 2I3 2F6 2I4 2W0 2I5 2F7 2I6 2W1 2W2 2I7 2W3 2W4 2W5 2W6 2W7",
    3: "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 3W2 3W3 3W4 3W5 3W6 3W7",
}


def test_zb_h2_order_p4_m8() -> None:
    assert {r: " ".join(a) for r, a in format_schedule(make_schedule("zb-h2", 4, 8)).items()} == ZB_H2_4_8


# ---- validation and shape ---------------------------------------------------------------------------
@budget(20)
@given(p=st.integers(1, 6), m=st.integers(1, 14))
@example(p=4, m=7)  # m = 2p - 1: the first m with the parallelogram
@example(p=5, m=2)  # fewer micro-batches than the warm-up wants
def test_zb_h2_is_valid_with_the_paper_warm_up(p: int, m: int) -> None:
    """Every rank's order runs (``validate``), holds F, I, W of its own stage for every micro-batch,
    and starts with min(2(p - r) - 1, m) forwards (ZB-H1: min(p - r, m))."""
    sched = make_schedule("zb-h2", p, m)
    validate(sched)
    assert sched.kind == "zb-h2" and sched.chunks == 1 and sched.virtual_stages == p
    for r, acts in sched.items():
        assert sorted((a.op, a.stage, a.microbatch) for a in acts) == sorted(
            (op, r, i) for op in "FIW" for i in range(m))
        first_i = next(k for k, a in enumerate(acts) if a.op == "I")
        assert [a.op for a in acts[:first_i]] == ["F"] * min(2 * (p - r) - 1, m)


# ---- simulated bubble and memory against the paper -----------------------------------------------------
@budget(20)
@given(p=st.integers(1, 6), m=st.integers(1, 16))
@example(p=4, m=8)
@example(p=3, m=4)  # p <= m < 2p - 1: the step's length holds, gaps on the first ranks
def test_zb_h2_bubble_and_peak_stash_equal_the_formulas(p: int, m: int) -> None:
    """F = I = W = 1 (backward 2 split into I = W = 1). Each rank computes 3m. Rank r waits r for the
    first forward to reach it and, when m < 2(p - r) - 1, 2(p - r) - 1 - m more inside its work (its
    warm-up cannot be filled); the step lasts 3m + p - 1 + max(0, p - m). Every rank keeps
    min(2p - 1, m) micro-batches until their W: at most 2p (the brief), 1F1B's p and one less."""
    sim = simulate(make_schedule("zb-h2", p, m), forward=1.0, backward=2.0, weight=1.0)
    makespan = 3 * m + p - 1 + max(0, p - m)
    assert sim.makespan == pytest.approx(makespan)
    assert _gaps(sim) == pytest.approx({r: max(0, 2 * (p - r) - 1 - m) for r in range(p)})
    assert sim.bubble_fraction == pytest.approx((makespan - 3 * m) / makespan, rel=1e-12)
    peaks = {r: min(2 * p - 1, m) for r in range(p)}
    assert sim.peak_stash == peaks and max(peaks.values()) <= 2 * p
    assert sim.peak_stash == {r: pipe_cost.peak_stash("zb-h2", p, m, r) for r in range(p)}
    assert pipe_cost.stash_peaks("zb-h2", p, m) == list(peaks.values())
    if m >= p:  # the formula's range
        assert pipe_cost.bubble_fraction("zb-h2", p, m) == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-12)
        assert pipe_cost.bubble_fraction("zb-h2", p, m) == pytest.approx(sim.bubble_fraction, rel=1e-12)
    else:
        with pytest.raises(ValueError, match=f"needs m >= {p} micro-batches"):
            pipe_cost.bubble_fraction("zb-h2", p, m)


@budget(20)
@given(p=st.integers(1, 6), extra=st.integers(0, 6), t=st.sampled_from([1.0, 0.5, 3.0]))
@example(p=4, extra=0, t=1.0)
def test_zb_h2_zero_bubble_when_f_i_w_equal(p: int, extra: int, t: float) -> None:
    """m >= 2p - 1, F = I = W = t: no rank has a gap between its first and last action (the paper's
    zero bubble, (p - 1)(F + I - 2W) = 0); the flushed step idles (p - 1) t per rank at its edges."""
    m = 2 * p - 1 + extra
    sim = simulate(make_schedule("zb-h2", p, m), forward=t, backward=2 * t, weight=t)
    gaps, idle = _gaps(sim), sim.idle
    assert [gaps[r] for r in range(p)] + [idle[r] for r in range(p)] == pytest.approx(
        [0.0] * p + [(p - 1) * t] * p, abs=1e-9)
    assert [sim.makespan, pipe_cost.bubble_time("zb-h2", p, t, t, t)] == pytest.approx([(3 * m + p - 1) * t, idle[0]])


@budget(20)
@given(p=st.integers(2, 6), extra=st.integers(0, 5), f=st.sampled_from([0.5, 1.0, 1.5, 2.0]),
       i=st.sampled_from([0.5, 1.0, 1.5, 2.0]), share=st.sampled_from([0.25, 0.5, 0.75, 1.0]))
@example(p=4, extra=1, f=1.0, i=1.5, share=0.5)  # F + I - 2W = 1.5 > F: the gap inside is the larger
@example(p=4, extra=1, f=1.0, i=1.2, share=0.8)  # F + I - 2W = 0.6 < F
def test_zb_h2_bubble_with_other_costs(p: int, extra: int, f: float, i: float, share: float) -> None:
    """m >= 2p - 1, W <= F and W <= I (W = share x min(F, I)): the largest wait inside a rank's work is
    the paper's ZB-H2 bubble (p - 1)(F + I - 2W) (0 when 2W >= F + I), and every rank idles (p - 1)
    max(F, F + I - 2W) in the flushed step (its start r F late, or that wait, whichever is longer)."""
    m, w = 2 * p - 1 + extra, share * min(f, i)
    sim = simulate(make_schedule("zb-h2", p, m), forward=f, backward=i + w, weight=w)
    assert max(_gaps(sim).values()) == pytest.approx((p - 1) * max(0.0, f + i - 2 * w), abs=1e-9)
    idle = (p - 1) * max(f, f + i - 2 * w)
    assert sim.idle == pytest.approx(dict.fromkeys(range(p), idle), abs=1e-9)
    assert pipe_cost.bubble_time("zb-h2", p, f, i, w) == pytest.approx(idle, abs=1e-12)


def test_zb_h2_against_zb_h1_p4_m8() -> None:
    """F = I = W = 1, p = 4, m = 8: the flushed steps are equally long (idle 3 per rank), but ZB-H1's
    first ranks idle inside their step ((p - 1)(F + I - W) = 3 on rank 0, Table 2) and ZB-H2's do not,
    bought with 7 micro-batches held on every rank instead of 4."""
    h1 = simulate(make_schedule("zb-h1", 4, 8), forward=1.0, backward=2.0, weight=1.0)
    h2 = simulate(make_schedule("zb-h2", 4, 8), forward=1.0, backward=2.0, weight=1.0)
    assert h1.idle == h2.idle == dict.fromkeys(range(4), 3.0)
    assert _gaps(h1) == {0: 3.0, 1: 2.0, 2: 1.0, 3: 0.0} and _gaps(h2) == dict.fromkeys(range(4), 0.0)
    assert h1.peak_stash == dict.fromkeys(range(4), 4) and h2.peak_stash == dict.fromkeys(range(4), 7)


def test_zb_h2_formulas_refuse_outside_their_range() -> None:
    with pytest.raises(ValueError, match=r"ZB-H2's bubble formula holds for W <= F and W <= I.*simulate"):
        pipe_cost.bubble_time("zb-h2", 4, 1.0, 2.0, 1.5)
    assert pipe_cost.bubble_formula("zb-h2") == "(p-1)/(3m+p-1)"


# ---- runtime: equal to one process ------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [config("zb-h2", 2, 3, model="gpt", opt="adamw"),
                                 config("zb-h2", 2, 1),
                                 config("zb-h2", 4, 7, model="gpt"),
                                 config("zb-h2", 4, 3, counts=[1, 2, 1, 1], opt="adamw")])
def test_zb_h2_runtime_equals_single_process_on_threads(cfg: dict) -> None:
    """Loss, gradients, updated parameters, messages and the measured stash (``check``) equal one
    process and the simulator, on p = 2 and p = 4 with the parallelogram's m = 2p - 1 and fewer."""
    check(cfg, testing.run(pipeline_run, len(cfg["counts"]), "threads", cfgs=[cfg]))


@pytest.mark.mpi
def test_zb_h2_runtime_equals_single_process_under_mpiexec() -> None:
    cfgs = [config("zb-h2", 3, 5, model="gpt"), config("zb-h2", 3, 2, opt="adamw")]
    results = testing.run(pipeline_run, 3, "mpi", timeout=90, cfgs=cfgs)
    for i, cfg in enumerate(cfgs):
        check(cfg, results, i)


# ---- too few micro-batches: refused on every rank before any message ------------------------------------
def _refused(comm, m: int, samples: int) -> tuple[str, int]:
    """(the error, the trace events this rank recorded before it)."""
    x, y = datasets.regression(samples, 3, 2)
    with mtrace.recording(comm.world_rank) as rec:
        try:
            Pipeline(comm, mlp([3, 4, 4, 2], seed=0), "zb-h2", microbatches=m).step(x, y)
        except ValueError as exc:
            return str(exc), len(rec.events)
    return "", len(rec.events)


@pytest.mark.parametrize(("m", "samples", "message"), [
    (0, 4, "microbatches must be >= 1, got 0"),
    (4, 2, "batch of 2 samples is not divisible by m=4"),
])
def test_too_few_microbatches_refused_on_every_rank(m: int, samples: int, message: str) -> None:
    results = testing.run(_refused, 2, "threads", m=m, samples=samples)
    assert len({text for text, _ in results}) == 1 and "\n" not in results[0][0]
    assert message in results[0][0]
    assert [n for _, n in results] == [0, 0]
