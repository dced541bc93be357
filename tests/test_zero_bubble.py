"""Zero-bubble schedules (issue 16): ZB-V and ZB-H1 against PyTorch's orders, the paper's bubble and
peak memory, validation, and the runtime (threads, mpiexec, HybridGPT pp-only) equal to one process.

Qi et al. 2024, "Zero Bubble Pipeline Parallelism": ZB-H1 Sec. 2.1 / Table 2, ZB-V Sec. 6 (zero
bubble when F = I = W, peak activation memory p M_B like 1F1B; the authors' README table: bubble
rate 0, activation memory 1x 1F1B's, pipeline communication 2x).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget
from test_hybrid import GRAD_TOL, LOSS_REL, assert_final_equals, hybrid_reference, hybrid_run
from test_hybrid import config as hybrid_config
from test_pipeline_runtime import check, config, pipeline_run

from minipar import testing
from minipar.cost import pipeline as pipe_cost
from minipar.parallel.pipeline import ScheduleError, format_schedule, make_schedule, simulate, validate

# ---- orders of torch.distributed.pipelining ---------------------------------------------------------
# Obtained by hand-executing torch/distributed/pipelining/schedules.py (pytorch/pytorch at commit
# 00722e648b74; torch is not installed here): ScheduleZBVZeroBubble._calculate_single_rank_operations
# (counters f0/f1/b0/b1: 2(p-r)-1 forwards of chunk 0; r x (F chunk 1, F chunk 0); p-r x (F, I, W chunk
# 1); then [F0] I0 W0 F1 I1 W1 while forwards remain, built for max(2p-1, m) micro-batches; cool-down
# r x (I0, I1), p-r x (I0, W0), the W1's, the W0's; actions of micro-batches >= m become None). The
# None slots (timing padding) are left out: only each rank's order of actions is compared.
TORCH_ZBV = {
    (2, 4): {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    },
    (3, 6): {
        0: "0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 5I2 5W2 0F5 0I0 0W0 5F3 5I3 5W3 0I1 0W1 5F4 5I4 5W4 "
           "0I2 0W2 5F5 5I5 5W5 0I3 0W3 0I4 0W4 0I5 0W5",
        1: "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 4I1 4W1 1F4 1I0 1W0 4F3 4I2 4W2 1F5 1I1 1W1 4F4 4I3 4W3 1I2 1W2 "
           "4F5 4I4 4W4 1I3 4I5 1I4 1W3 1I5 1W4 4W5 1W5",
        2: "2F0 3F0 2F1 3F1 2F2 3F2 3I0 3W0 2F3 2I0 2W0 3F3 3I1 3W1 2F4 2I1 2W1 3F4 3I2 3W2 2F5 2I2 2W2 3F5 3I3 3W3 "
           "2I3 3I4 2I4 3I5 2I5 2W3 3W4 3W5 2W4 2W5",
    },
    (3, 2): {  # m < 2p - 1: built for 5 micro-batches, 2..4 dropped
        0: "0F0 0F1 5F0 5I0 5W0 5F1 5I1 5W1 0I0 0W0 0I1 0W1",
        1: "1F0 1F1 4F0 4F1 4I0 4W0 4I1 4W1 1I0 1W0 1I1 1W1",
        2: "2F0 3F0 2F1 3F1 3I0 3W0 2I0 2W0 3I1 3W1 2I1 2W1",
    },
}
# PyTorch has no one-chunk ZB-H1 class; ScheduleInterleavedZeroBubble (the paper's ZB1P) with one stage
# per rank is ZB-H1. Hand-executed from the same file: _get_warmup_ops(multiply_factor=1) = p-1-r
# forwards (at most m), then _get_1f1b_rank_ops(enable_zero_bubble=True, num_1f1b_microbatches=r): F, I,
# and a W once r I's have run; cool-down I (and W); the remaining W's. (It accepts m with
# m % max(1, m // p) == 0, which both cases satisfy.)
TORCH_ZB1P_ONE_STAGE = {
    (3, 4): {
        0: "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        1: "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        2: "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    },
    (4, 2): {  # warm-up capped at m = 2 on rank 0
        0: "0F0 0F1 0I0 0W0 0I1 0W1",
        1: "1F0 1F1 1I0 1I1 1W0 1W1",
        2: "2F0 2F1 2I0 2I1 2W0 2W1",
        3: "3F0 3I0 3F1 3I1 3W0 3W1",
    },
}


def _orders(kind: str, p: int, m: int) -> dict[int, str]:
    return {r: " ".join(acts) for r, acts in format_schedule(make_schedule(kind, p, m)).items()}


@pytest.mark.parametrize(("p", "m"), sorted(TORCH_ZBV))
def test_zb_v_order_equals_pytorch(p: int, m: int) -> None:
    assert _orders("zb-v", p, m) == TORCH_ZBV[(p, m)]


@pytest.mark.parametrize(("p", "m"), sorted(TORCH_ZB1P_ONE_STAGE))
def test_zb_h1_order_equals_pytorch_zb1p_with_one_stage_per_rank(p: int, m: int) -> None:
    assert _orders("zb-h1", p, m) == TORCH_ZB1P_ONE_STAGE[(p, m)]


# ---- simulated bubble and memory against the paper --------------------------------------------------
def _gaps(res) -> dict[int, float]:
    """Per rank: time between its first action's start and its last action's end not spent computing."""
    out = {}
    for r, busy in res.busy.items():
        spans = [(e.t0, e.t1) for e in res.trace.events if e.kind == "compute" and e.rank == r]
        out[r] = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans) - busy
    return out


@budget(20)
@given(p=st.integers(1, 6), extra=st.integers(0, 6), t=st.sampled_from([1.0, 0.5, 3.0]))
def test_zb_v_zero_bubble_and_1f1b_memory_when_f_i_w_equal(p: int, extra: int, t: float) -> None:
    """m >= 2p - 1, F = I = W = t per chunk: no rank has a gap between its first and last action (the
    paper's zero bubble); the flushed step idles (p-1) t per rank, rank r starting r t late (micro-batch
    0's forward reaches stage r) and ending r t after rank 0. Every rank keeps 2p chunk-micro-batches
    = p whole stages: 1F1B's first rank's p M_B (1F1B simulated with a whole stage's F, I, W)."""
    m = 2 * p - 1 + extra
    zbv = simulate(make_schedule("zb-v", p, m), forward=t, backward=2 * t, weight=t)
    assert _gaps(zbv) == pytest.approx(dict.fromkeys(range(p), 0.0), abs=1e-9)
    assert zbv.idle == pytest.approx(dict.fromkeys(range(p), (p - 1) * t), abs=1e-9)
    assert zbv.makespan == pytest.approx(6 * m * t + (p - 1) * t)
    assert zbv.idle[0] == pytest.approx(pipe_cost.bubble_time("zb-v", p, t, t, t))
    one = simulate(make_schedule("1f1b", p, m), forward=2 * t, backward=4 * t)
    assert zbv.peak_stash == dict.fromkeys(range(p), 2 * p) and max(one.peak_stash.values()) == p
    assert zbv.peak_stash == {r: pipe_cost.peak_stash("zb-v", p, m, r) for r in range(p)}
    unit = simulate(make_schedule("zb-v", p, m))  # F = 1, B = 2 split into I = W = 1
    assert unit.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), rel=1e-12)
    assert pipe_cost.bubble_fraction("zb-v", p, m) == pytest.approx(unit.bubble_fraction, rel=1e-12)


def test_zb_h1_steps_do_not_tile_but_zb_v_steps_do() -> None:
    """F = I = W = 1, p = 4, m = 8: both idle (p - 1) per rank in a flushed step, but ZB-H1's first rank
    has that gap inside its step ((p-1)(F + I - W) = 3, Table 2), so steps cannot overlap; ZB-V has none."""
    h1 = simulate(make_schedule("zb-h1", 4, 8), forward=1.0, backward=2.0, weight=1.0)
    v = simulate(make_schedule("zb-v", 4, 8), forward=1.0, backward=2.0, weight=1.0)
    assert h1.idle == v.idle == dict.fromkeys(range(4), 3.0)
    assert _gaps(h1) == {0: 3.0, 1: 2.0, 2: 1.0, 3: 0.0} and _gaps(v) == dict.fromkeys(range(4), 0.0)


@budget(20)
@given(p=st.integers(1, 6), m=st.integers(1, 14))
def test_zb_v_peak_stash_any_m(p: int, m: int) -> None:
    """Rank r holds at most its warm-up forwards of chunk a, min(2p - r - 1, m), plus chunk b's forwards
    up to its first W, min(r + 1, m); after that each F follows a W (counted from the order)."""
    sim = simulate(make_schedule("zb-v", p, m))
    assert sim.peak_stash == {r: min(2 * p - r - 1, m) + min(r + 1, m) for r in range(p)}
    assert sim.peak_stash == {r: pipe_cost.peak_stash("zb-v", p, m, r) for r in range(p)}
    if m >= 2 * p - 1:  # the formula's range; below it the order's gaps are measured, not predicted
        assert pipe_cost.bubble_fraction("zb-v", p, m) == pytest.approx(sim.bubble_fraction, rel=1e-12)
    else:
        with pytest.raises(ValueError, match="needs m >= "):
            pipe_cost.bubble_fraction("zb-v", p, m)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_zb_v_one_microbatch_critical_path(p: int) -> None:
    """m = 1, F = I = W = 1, by hand: rank r runs F_r, F_{2p-1-r}, I_{2p-1-r}, W_{2p-1-r}, I_r, W_r.
    Micro-batch 0's forward crosses the 2p stages (ends at 2p), its input gradient climbs back (2p more),
    except that rank p-1 runs W of stage p between the I's of stages p and p - 1 (+1), and rank 0 ends
    with W of stage 0 (+1): makespan 4p + 2, of which each rank computes 6."""
    sim = simulate(make_schedule("zb-v", p, 1))
    assert sim.makespan == 4 * p + 2
    assert sim.bubble_fraction == pytest.approx((4 * p - 4) / (4 * p + 2))


@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 8), (5, 2)])
def test_zb_v_sends_twice_1f1b(p: int, m: int) -> None:
    """2p - 1 boundaries, one inside rank p - 1: 2(p - 1) cross ranks, against 1F1B's p - 1, each with m
    activations and m gradients. By hand: rank 0 sends stage 0's activations and stage 2p-1's gradients
    (2m), rank p-1 stage p-1's gradients and stage p's activations (2m; the other two directions stay
    in memory), every other rank both directions of both its stages (4m); 1F1B's end ranks m, others 2m."""
    v = simulate(make_schedule("zb-v", p, m), message_bytes=1)
    one = simulate(make_schedule("1f1b", p, m), message_bytes=1)

    def sent(res):
        return [sum(e.nbytes for e in res.trace.events if e.kind == "comm" and e.name == "send" and e.rank == r)
                for r in range(p)]

    ends = {0, p - 1}
    assert sent(v) == [2 * m if r in ends else 4 * m for r in range(p)]
    assert sent(one) == [m if r in ends else 2 * m for r in range(p)]
    owner = list(range(p)) + list(range(p - 1, -1, -1))
    assert pipe_cost.send_bytes(owner, m, 1) == sent(v)


# ---- validation and bad configurations -----------------------------------------------------------------
@budget(20)
@given(p=st.integers(1, 6), m=st.integers(1, 14))
def test_zb_v_is_valid_and_v_shaped(p: int, m: int) -> None:
    sched = make_schedule("zb-v", p, m)
    validate(sched)
    assert sched.chunks == 2 and sched.virtual_stages == 2 * p
    for r, acts in sched.items():
        assert {a.stage for a in acts} == {r, 2 * p - 1 - r}
        assert sorted((a.op, a.stage, a.microbatch) for a in acts) == sorted(
            (op, s, i) for op in "FIW" for s in (r, 2 * p - 1 - r) for i in range(m))
    assert make_schedule("zb-v", p, m, chunks=2) == sched


def test_bad_zb_v_configurations_say_what_works() -> None:
    with pytest.raises(ValueError, match=r"exactly 2 model chunks.*chunks=3; use chunks=2"):
        make_schedule("zb-v", 4, 8, chunks=3)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        make_schedule("zb-v", 4, 0)
    with pytest.raises(ValueError, match=r"F = I = W only.*simulate"):
        pipe_cost.bubble_time("zb-v", 4, 1.0, 2.0, 1.0)
    broken = {r: list(acts) for r, acts in make_schedule("zb-v", 2, 2).items()}
    broken[0] = [a for a in broken[0] if str(a) != "3I0"] + [a for a in broken[0] if str(a) == "3I0"]  # I after W
    with pytest.raises(ScheduleError, match="3W0"):
        validate(broken)


# ---- runtime: equal to one process -----------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [config("zb-v", 2, 5, v=2, model="gpt", opt="adamw"),
                                 config("zb-v", 3, 2, v=2, counts=[1, 2, 1, 1, 2, 1])])
def test_zb_v_runtime_equals_single_process_on_threads(cfg: dict) -> None:
    check(cfg, testing.run(pipeline_run, len(cfg["counts"]) // 2, "threads", cfgs=[cfg]))


@pytest.mark.mpi
def test_zb_v_runtime_equals_single_process_under_mpiexec() -> None:
    cfgs = [config("zb-v", 3, 5, v=2, model="gpt"), config("zb-v", 3, 1, v=2, opt="adamw")]
    results = testing.run(pipeline_run, 3, "mpi", timeout=90, cfgs=cfgs)
    for i, cfg in enumerate(cfgs):
        check(cfg, results, i)


@pytest.mark.parametrize(("schedule", "chunks"), [("zb-v", 2), ("zb-h2", 1), ("dualpipev", 2)])
def test_hybrid_gpt_pp_only_runs_zero_bubble(tmp_path, schedule: str, chunks: int) -> None:
    """HybridGPT (pp 2 x dp 2) with ZB-V, ZB-H2 (tests/test_zb_h2.py) with m >= 2p - 1 and DualPipeV
    (tests/test_dualpipev.py) with m = 2p: losses, gradients and updated parameters equal one process
    (cost.hybrid's traffic formula assumes interleaved placement, so only the numbers are compared)."""
    import numpy as np

    c = hybrid_config({"pp": 2, "dp": 2}, schedule=schedule, chunks=chunks, microbatches=4)
    results = testing.run(hybrid_run, 4, "threads", c=c, path=str(tmp_path / "t.json"))
    ref = hybrid_reference(c)
    for got in results:
        assert got["losses"] == [pytest.approx(w, rel=rel) for w, rel in zip(ref["losses"], LOSS_REL, strict=True)]
    for name, want in ref["grads"].items():
        np.testing.assert_allclose(results[0]["grads"][name], want, err_msg=name, **GRAD_TOL)
    for name in ref["final"]:
        assert_final_equals(results[0]["final"][name], ref, name)
