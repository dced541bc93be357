"""Chimera (issue 16, point 5; Li & Hoefler 2021, SC'21): two pipelines in opposite directions.

The p = 4, m = 4 order is written out by hand from the paper's slot picture (section 3.1, Figure 3);
each direction alone is the 1F1B of ``make_schedule`` with m/2 micro-batches (the paper: "each pipeline
schedules N/2 micro-batches using 1F1B"); the merged order runs (a cross-direction swap deadlocks and
is caught); the joint simulation's bubble and peak stash equal the paper's table with equal slots and
a timeline worked out by hand with F = 1, B = 2; training equals one process (losses, both replicas'
gradients and parameters after 2 steps) on threads and under mpiexec for p in {2, 4}; bad
configurations are refused on every rank before any message, with the values that work.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, pipeline_configs
from test_pipeline_runtime import _batches, _model, _optimizer, assert_equal_to_reference, config, reference

from minipar import testing
from minipar.cost import pipeline as pipeline_cost
from minipar.parallel.pipeline import make_schedule, mlp, simulate, validate
from minipar.parallel.pipeline.chimera import (
    Chimera,
    chimera_schedule,
    direction_schedules,
    joint_program,
    simulate_chimera,
)
from minipar.parallel.pipeline.schedule import Action, ScheduleError

# ---- the schedule as data ----------------------------------------------------------------------
# Slots of the paper's picture for p = 4, m = 4 (down micro-batches 0, 1; up 2, 3). "d0F0": down
# stage 0, forward of micro-batch 0; "u3F2": up stage 3 (on rank 0), forward of micro-batch 2.
# Micro-batch i of a direction: forward at stage s in slot s + 2i, backward in slot 7 - s + 2i.
BY_HAND = {  # slot: 0     1       2       3       4       5       6       7       8       9
    0: ["d0F0", "d0F1", "u3F2", "u3B2", "u3F3", "u3B3", "d0B0", "d0B1"],  # idle in slots 1 and 8
    1: ["d1F0", "u2F2", "d1F1", "u2F3", "u2B2", "d1B0", "u2B3", "d1B1"],  # idle in slots 0 and 9
    2: ["u1F2", "d2F0", "u1F3", "d2F1", "d2B0", "u1B2", "d2B1", "u1B3"],  # idle in slots 0 and 9
    3: ["u0F2", "u0F3", "d3F0", "d3B0", "d3F1", "d3B1", "u0B2", "u0B3"],  # idle in slots 1 and 8
}


def _text(schedule) -> dict[int, list[str]]:
    return {r: [f"{d[0]}{a}" for d, a in acts] for r, acts in schedule.items()}


def _parse(text: dict[int, list[str]]):
    return {r: [("down" if t[0] == "d" else "up", Action.parse(t[1:])) for t in acts] for r, acts in text.items()}


def test_p4_m4_order_is_the_papers_figure():
    assert _text(chimera_schedule(4, 4)) == BY_HAND


@pytest.mark.parametrize("p", [2, 4, 6])
def test_each_direction_is_1f1b_on_half_the_microbatches(p):
    """m = p: down on ranks 0..p-1 and up on the reversed ranks are each 1F1B with m/2 micro-batches."""
    parts = direction_schedules(chimera_schedule(p, p))
    want = make_schedule("1f1b", p, p // 2)
    for direction in ("down", "up"):
        assert {r: list(a) for r, a in parts[direction].items()} == {r: list(a) for r, a in want.items()}
        validate(parts[direction])


@pytest.mark.parametrize("p,m", [(2, 6), (4, 8), (6, 12)])
def test_more_microbatches_each_direction_valid_and_merged_order_finishes(p, m):
    sched = chimera_schedule(p, m)
    for part in direction_schedules(sched).values():
        validate(part)  # raises ScheduleError if the direction alone cannot run
    by_rank = {r: sorted((d, a.op, a.microbatch) for d, a in acts) for r, acts in sched.items()}
    for r in range(p):  # every micro-batch once forward, once backward, on the direction its number says
        want = [("down" if i < m // 2 else "up", op, i) for i in range(m) for op in "BF"]
        assert by_rank[r] == sorted(want)
    sim = simulate_chimera(p, m, 1.0, 1.0)
    assert sorted((e.args["direction"], e.name, e.stage, e.microbatch) for e in sim.trace.events
                  if e.kind == "compute") == sorted((d, a.op, a.stage, a.microbatch) for acts in sched.values()
                                                    for d, a in acts)


def test_joint_program_puts_each_directions_messages_around_its_action():
    prog = joint_program(chimera_schedule(4, 4))
    # rank 1: down stage 1 gets its input from rank 0 and sends to rank 2; up stage 2 is on up-rank 2,
    # gets its input from up-rank 1 (world rank 2) and sends to up-rank 3 (world rank 0)
    assert [f"{d[0]}{a}" for d, a in prog[1][:6]] == [
        "d1RECV_F0<-0", "d1F0", "d1SEND_F0->2", "u2RECV_F0<-1", "u2F0", "u2SEND_F0->3"]


def test_a_cross_direction_swap_deadlocks_and_is_caught():
    """Each direction's order alone stays valid, but rank 0 waiting for up micro-batch 2 before sending
    down micro-batch 0, while rank 1 waits for that down micro-batch first, never finishes."""
    text = {r: list(a) for r, a in BY_HAND.items()}
    text[0] = ["u3F2", "d0F0", "d0F1"] + text[0][3:]
    for part in direction_schedules(_parse(text)).values():
        validate(part)
    with pytest.raises(ScheduleError, match="never finishes: rank 0 step 0: up 3RECV_F0<-2"):
        simulate_chimera(4, 4, schedule=_parse(text))


# ---- bubble and activation memory against the paper --------------------------------------------
@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_equal_slots_bubble_and_peak_are_the_papers_table(p, k):
    """F = B = 1 slot: bubble share (p - 2)/(2m + p - 2) (1F1B: (p - 1)/(m + p - 1)); activations held
    from p/2 + 1 (end ranks) to p (middle ranks): p/2 + 1 + min(r, p - 1 - r)."""
    m = k * p
    sim = simulate_chimera(p, m, 1.0, 1.0)
    assert sim.makespan == 2 * m + p - 2
    assert sim.bubble_fraction == pytest.approx((p - 2) / (2 * m + p - 2), abs=1e-12)
    assert all(idle == p - 2 for idle in sim.idle.values())
    assert [sim.peak_stash[r] for r in range(p)] == [p // 2 + 1 + min(r, p - 1 - r) for r in range(p)]
    assert [pipeline_cost.chimera_peak_stash(p, r) for r in range(p)] == [sim.peak_stash[r] for r in range(p)]
    assert pipeline_cost.chimera_bubble_time(p, 1.0, 1.0) == sim.idle[0] == p - 2
    assert pipeline_cost.chimera_bubble_fraction(p, m) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    with pytest.raises(ValueError, match="F = B only"):
        pipeline_cost.chimera_bubble_time(p, 1.0, 2.0)
    one_f_one_b = simulate(make_schedule("1f1b", p, m), 1.0, 1.0)
    assert one_f_one_b.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert all(idle == 2 * (p - 1) for idle in one_f_one_b.idle.values())  # the paper's 2(D - 1) bubbles


def test_p4_m4_backward_twice_forward_by_hand():
    """F = 1, B = 2, the order above, each action as soon as its input is there:
    rank 0: F0 0-1, F1 1-2, F2 3-4 (up stage 2 ends 3), B2 4-6, F3 6-7 (up F3 reaches it at 5), B3 7-9,
            B0 10-12 (down stage 1's B0: 8-10), B1 14-16 (down stage 1's B1: 12-14);
    rank 1: F0 1-2, F2 2-3, F1 3-4, F3 4-5, B2 6-8, B0 8-10, B3 10-12, B1 12-14; ranks 3, 2 mirror 0, 1.
    Makespan 16, each rank busy 4 F + 4 B = 12, idle 4 = (p - 2) B (1F1B: (m + p - 1)(F + B) = 21, idle 9)."""
    sim = simulate_chimera(4, 4, 1.0, 2.0)
    assert sim.makespan == 16
    assert sim.idle == {0: 4, 1: 4, 2: 4, 3: 4} and sim.bubble_fraction == 0.25
    assert sim.peak_stash == {0: 3, 1: 4, 2: 4, 3: 3}
    span = {(e.rank, f"{e.args['direction'][0]}{e.stage}{e.name}{e.microbatch}"): (e.t0, e.t1)
            for e in sim.trace.events if e.kind == "compute"}
    assert span[(0, "u3F2")] == (3, 4) and span[(0, "u3F3")] == (6, 7)
    assert span[(0, "d0B0")] == (10, 12) and span[(0, "d0B1")] == (14, 16)
    assert span[(1, "u2B2")] == (6, 8) and span[(1, "d1B1")] == (12, 14)
    assert simulate(make_schedule("1f1b", 4, 4), 1.0, 2.0).makespan == 21


def test_latency_by_hand():
    """p = m = 2, F = 1, B = 2, latency L: rank 0 runs down 0F0 (0-1), up 1F1 when rank 1's 0F1 output
    arrives (1 + L to 2 + L), up 1B1 (to 4 + L), down 0B0 when rank 1's 1B0 gradient arrives: rank 1
    ran 1F0 from 1 + L and 1B0 to 4 + L, so 4 + 2L to 6 + 2L; rank 1 mirrors it."""
    for latency in (0.0, 0.5, 3.0):
        sim = simulate_chimera(2, 2, 1.0, 2.0, latency)
        assert sim.makespan == 6 + 2 * latency
        assert sim.idle == {0: 2 * latency, 1: 2 * latency}


# ---- training equals one process ------------------------------------------------------------------
def chimera_run(comm, cfgs: list[dict]) -> list[dict]:
    out = []
    for cfg in cfgs:
        layers = cfg["counts"] if cfg["given_counts"] else None
        chimera = Chimera(comm, _model(cfg), cfg["m"], layers=layers,
                          optimizer=lambda params, cfg=cfg: _optimizer(cfg, params))
        losses, peaks = [], []
        for x, y in _batches(cfg):
            losses.append(chimera.step(x, y))
            peaks.append(chimera.peak_stash)
        out.append({"losses": losses, "peaks": peaks,
                    "state": [chimera.down.full_state_dict(None), chimera.up.full_state_dict(None)],
                    "grads": [chimera.down.full_grads(None), chimera.up.full_grads(None)]})
    return out


def _configs(p: int) -> list[dict]:
    return [config("chimera", p, p, opt="sgd", seed=3),
            config("chimera", p, 2 * p, counts=[2] + [1] * (p - 1), opt="adamw", seed=7),
            config("chimera", p, p, model="gpt", counts=[2] * p, opt="adamw", seed=1)]


def _check(cfgs: list[dict], results: list[list[dict]]) -> None:
    p = len(results)
    for i, cfg in enumerate(cfgs):
        ref_losses, ref_state, ref_grads = reference(cfg)
        sim = simulate_chimera(p, cfg["m"])
        for r in range(p):
            got = results[r][i]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-10, abs=1e-12), (r, cfg)
            assert got["peaks"] == [sim.peak_stash[r]] * 2  # measured on the rank = simulated
        for replica in (0, 1):  # down and up: both equal the single-process model
            got = results[0][i]
            assert_equal_to_reference(cfg, got["state"][replica], got["grads"][replica], ref_state, ref_grads)


@st.composite
def chimera_configs(draw: st.DrawFn, p: int) -> dict:
    """A drawn pipeline configuration (model, layers per stage, widths, seed, optimizer) for p ranks,
    with m = p or 2 p micro-batches."""
    return draw(pipeline_configs(p=p, kind="1f1b")) | {"kind": "chimera", "m": p * draw(st.integers(1, 2))}


def chimera_jobs() -> st.SearchStrategy:
    """(p, [configurations]) with p in {2, 4}: one job."""
    return st.sampled_from([2, 4]).flatmap(
        lambda p: st.tuples(st.just(p), st.lists(chimera_configs(p), min_size=1, max_size=3)))


@budget(4)
@given(job=chimera_jobs())
@example(job=(2, _configs(2)))
@example(job=(4, _configs(4)))
def test_equals_single_process_on_threads(job):
    p, cfgs = job
    _check(cfgs, testing.run(chimera_run, p, "threads", cfgs=cfgs))


@pytest.mark.mpi
@budget(1)
@given(job=chimera_jobs())
@example(job=(2, _configs(2)))
@example(job=(4, _configs(4)))
def test_equals_single_process_under_mpiexec(job):
    p, cfgs = job
    _check(cfgs, testing.run(chimera_run, p, "mpi", timeout=90, cfgs=cfgs))


# ---- refused before any message ------------------------------------------------------------------
class Watched:
    """A communicator that records every method called on it (split, send, ...); size/rank are free."""

    def __init__(self, comm) -> None:
        self._comm, self.calls = comm, []

    def __getattr__(self, name: str):
        value = getattr(self._comm, name)
        if callable(value):
            self.calls.append(name)
        return value


def rejected_run(comm, cases: list[tuple[int, int]]) -> list[tuple[str, list[str]]]:
    out = []
    for m, n_layers in cases:
        watched = Watched(comm)
        try:
            Chimera(watched, mlp([3] * (n_layers + 1)), m)
            out.append(("", watched.calls))
        except ValueError as exc:
            out.append((str(exc), watched.calls))
    return out


REFUSED = {  # p -> [(m, layers, message)]
    3: [(6, 6, "even number of ranks p >= 2 (two pipelines in opposite directions, Li & Hoefler 2021 take an "
               "even depth D), got p=3; use p=2 or 4")],
    2: [(3, 4, "microbatches to be a multiple of p=2 (units of p micro-batches, p/2 per direction), got m=3; "
               "use microbatches=2 or 4")],
    4: [(6, 4, "got m=6; use microbatches=4 or 8"), (2, 4, "got m=2; use microbatches=4"),
        (5, 4, "got m=5; use microbatches=4 or 8"), (4, 3, "cannot cut 3 layers into 4 stages")],
}


def _check_refused(p: int, results) -> None:
    for i, (_, _, text) in enumerate(REFUSED[p]):
        assert len({res[i][0] for res in results}) == 1, "every rank raises the same error"
        for message, calls in (res[i] for res in results):
            assert text in message, message
            assert calls == [], f"nothing may be sent before the error: {calls}"


@pytest.mark.parametrize("p", sorted(REFUSED))
def test_bad_configurations_refused_on_every_rank_before_any_message(p):
    cases = [(m, n) for m, n, _ in REFUSED[p]]
    _check_refused(p, testing.run(rejected_run, p, "threads", cases=cases))


@pytest.mark.mpi
def test_bad_configurations_refused_under_mpiexec():
    cases = [(m, n) for m, n, _ in REFUSED[4]]
    _check_refused(4, testing.run(rejected_run, 4, "mpi", timeout=60, cases=cases))


def test_batch_not_divisible_refused():
    def run(comm):
        chimera = Chimera(comm, mlp([3, 4, 2]), 2)
        with pytest.raises(ValueError, match="divisible by m=2"):
            chimera.step(np.zeros((3, 3)), np.zeros((3, 2)))
        return True

    assert testing.run(run, 2, "threads") == [True, True]
