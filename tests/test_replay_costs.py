"""The replay's span costs: every repeat of the same work lasts the median of their CPU times
(``costs="median"``, the default), or each span its own (``costs="cpu"``). Expected durations are
worked out here by hand from the spans' CPU times."""

from __future__ import annotations

import pytest

from minipar import cli
from minipar import trace as mtrace
from minipar.cost.cluster import Cluster, Link
from minipar.replay import ReplayError, replay
from minipar.span_costs import earlier_steps, median_scales
from minipar.trace import Event, Trace


def free() -> Cluster:
    return Cluster(name="free", gpus_per_node=8, peak_flops=1.0, efficiency=1.0, memory_bytes=1.0,
                   intra=Link(0.0, 0.0), inter=Link(0.0, 0.0), gamma=0.0)


def span(name: str, t0: float, cpu: float, **fields) -> Event:
    """A compute span at wall time ``t0`` that took 3x its CPU time on the wall clock (time-shared);
    the spans of a test are 20 ms apart, so none overlaps the next."""
    return Event(0, "compute", name, t0, t0 + 3 * cpu, c0=t0, c1=t0 + cpu, **fields)


def durations(trace: Trace) -> list[float]:
    return [round(e.t1 - e.t0, 9) for e in sorted(trace.events, key=lambda e: e.t0)]


def test_repeats_of_the_same_work_cost_their_median_and_other_work_its_own() -> None:
    # three forwards of stage 0 (micro-batches 0-2, iterations numbered in args): CPU 1, 1, 4 ms; a
    # forward of stage 1 (other work) 4 ms, alone; two backwards 2 and 3 ms
    events = [span("F", 0.00, 1e-3, stage=0, microbatch=0, args={"iteration": 0, "action": "F0"}),
              span("F", 0.02, 1e-3, stage=0, microbatch=1, args={"iteration": 0, "action": "F1"}),
              span("F", 0.04, 4e-3, stage=0, microbatch=2, args={"iteration": 1, "action": "F2"}),
              span("F", 0.06, 4e-3, stage=1, microbatch=0),
              span("B", 0.08, 2e-3, stage=0, microbatch=0),
              span("B", 0.10, 3e-3, stage=0, microbatch=1)]
    trace = Trace({"world_size": 1, "clock": "wall"}, events)
    assert median_scales(events) == pytest.approx({0: 1.0, 1: 1.0, 2: 0.25, 4: 1.25, 5: 2.5 / 3})
    median = replay(trace, free())
    assert durations(median) == pytest.approx([1e-3, 1e-3, 1e-3, 4e-3, 2.5e-3, 2.5e-3])
    assert median.meta["replay"]["costs"] == "median"
    own = replay(trace, free(), costs="cpu")
    assert durations(own) == pytest.approx([1e-3, 1e-3, 4e-3, 4e-3, 2e-3, 3e-3])
    assert own.meta["replay"]["label"].endswith("span costs: own CPU time")


def test_spans_whose_args_describe_other_work_are_not_pooled() -> None:
    # ring attention's pieces: (q_piece, k_piece) say which block of scores a span computes
    events = [span("attention F", 0.00, 1e-3, step=0, args={"q_piece": 0, "k_piece": 0}),
              span("attention F", 0.02, 3e-3, step=1, args={"q_piece": 0, "k_piece": 1}),
              span("attention F", 0.04, 2e-3, step=0, args={"q_piece": 0, "k_piece": 0})]
    assert median_scales(events) == pytest.approx({0: 1.5, 2: 0.75})
    out = replay(Trace({"world_size": 1, "clock": "wall"}, events), free())
    assert durations(out) == pytest.approx([1.5e-3, 3e-3, 1.5e-3])


def test_unknown_costs_are_refused_in_one_line() -> None:
    trace = Trace({"world_size": 1, "clock": "wall"}, [span("F", 0.0, 1e-3)])
    with pytest.raises(ReplayError, match=r"^costs='mean': choose one of median, cpu$"):
        replay(trace, free(), costs="mean")


def test_cli_replay_takes_the_costs(tmp_path, capsys) -> None:
    events = [span("F", 0.00, 1e-3), span("F", 0.02, 3e-3)]
    mtrace.save(Trace({"world_size": 1, "clock": "wall"}, events), tmp_path / "t.json")
    for costs in ("median", "cpu"):
        out = tmp_path / f"{costs}.json"
        argv = ["replay", str(tmp_path / "t.json"), "--cluster", "local", "--costs", costs, "-o", str(out)]
        assert cli.main(argv) == 0
        got = mtrace.load(out)
        assert got.meta["replay"]["costs"] == costs
        assert durations(got) == pytest.approx([2e-3, 2e-3] if costs == "median" else [1e-3, 3e-3])
    capsys.readouterr()


def test_the_earlier_steps_a_trace_lists_join_its_medians(tmp_path, capsys) -> None:
    # the same forward in three steps: 1 and 2 ms in the two earlier traces, 6 ms in the last one;
    # the last lists the earlier ones (and one that is gone, skipped): median 2 ms
    for k, cpu in ((1, 1e-3), (2, 2e-3)):
        step = Trace({"world_size": 1, "clock": "wall"}, [span("F", 0.0, cpu, stage=0)])
        mtrace.save(step, tmp_path / f"t-step{k}.json")
    meta = {"world_size": 1, "clock": "wall", "earlier_steps": ["t-step1.json", "t-step2.json", "t-step9.json"]}
    last = Trace(meta, [span("F", 0.0, 6e-3, stage=0)])
    mtrace.save(last, tmp_path / "t.json")
    samples = earlier_steps(tmp_path / "t.json", last)
    assert [s.events[0].c1 - s.events[0].c0 for s in samples] == pytest.approx([1e-3, 2e-3])
    out = replay(last, free(), samples=samples)
    assert durations(out) == pytest.approx([2e-3]) and out.meta["replay"]["samples"] == 2
    assert durations(replay(last, free())) == pytest.approx([6e-3])  # alone: its own
    assert cli.main(["replay", str(tmp_path / "t.json"), "--cluster", "local", "-o", str(tmp_path / "r.json")]) == 0
    assert durations(mtrace.load(tmp_path / "r.json")) == pytest.approx([2e-3])
    capsys.readouterr()


def mark(name: str, t: float, cpu: float, thread: int | None = None) -> Event:
    return Event(0, "mark", name, t, t, c0=cpu, thread=thread, args={"cid": "w", "job": 0})


def test_host_puts_the_worker_on_the_ranks_core_and_charges_cpu_outside_spans(tmp_path, capsys) -> None:
    # the rank: F (2 ms of CPU), posts a job, G (2 ms), waits for it, then opt (1 ms); its worker thread
    # takes the job and spends 4 ms of CPU on it outside any span (posting, testing, adding)
    events = [Event(0, "compute", "F", 0.000, 0.003, c0=0.000, c1=0.002),
              mark("async posted", 0.003, 0.002),
              Event(0, "compute", "G", 0.004, 0.007, c0=0.002, c1=0.004),
              mark("async wait", 0.008, 0.004),
              Event(0, "compute", "opt", 0.020, 0.022, c0=0.004, c1=0.005),
              mark("async start", 0.0035, 0.100, thread=1), mark("async end", 0.019, 0.104, thread=1)]
    trace = Trace({"world_size": 1, "clock": "wall"}, events)
    ends = {e.name: round(e.t1, 9) for e in replay(trace, free()).events}
    assert (ends["G"], ends["async end"], ends["opt"]) == pytest.approx((4e-3, 2e-3, 5e-3))  # worker: own core
    out = replay(trace, free(), host=True)
    ends = {e.name: round(e.t1, 9) for e in out.events}
    # the job arrives at 2 ms, between F and G: the worker's 4 ms take the core first (ties go to the
    # thread the replay reaches first), G runs after them (6-8 ms), the wait ends at once, opt 8-9 ms
    assert (ends["G"], ends["async end"], ends["opt"]) == pytest.approx((8e-3, 6e-3, 9e-3))
    assert out.meta["replay"]["host"] is True and out.meta["replay"]["label"].endswith("every thread's CPU on it")
    # CPU outside spans counts on the host: 1 ms between G and the wait, replayed on the main thread
    gap = [*events[:3], mark("async wait", 0.008, 0.005), replace_cpu(events[4], 0.005), *events[5:]]
    ends = {e.name: round(e.t1, 9) for e in replay(Trace(trace.meta, gap), free(), host=True).events}
    assert (ends["async end"], ends["opt"]) == pytest.approx((6e-3, 10e-3))  # the 1 ms after G: 8-9 ms
    mtrace.save(trace, tmp_path / "t.json")
    assert cli.main(["replay", str(tmp_path / "t.json"), "--cluster", "local", "--host", "-o",
                     str(tmp_path / "h.json")]) == 0
    assert mtrace.load(tmp_path / "h.json").meta["replay"]["host"] is True
    capsys.readouterr()


def replace_cpu(e: Event, c0: float) -> Event:
    return Event(e.rank, e.kind, e.name, e.t0, e.t1, c0=c0, c1=c0 + (e.c1 - e.c0))
