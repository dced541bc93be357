"""Honest labels in the report (issue 28, item 3), on hand-made traces whose times are chosen below:

- a collective the rank's own thread runs inside a compute span is drawn inside it (a hatched strip on
  the compute lane), one on a worker thread or under other compute stays on the comm lane, and so does
  a point-to-point message the rank did not wait for there;
- every op/algorithm minipar's communicator has, and every point-to-point op, has a colour of its own,
  shared with no other kind, so no two kinds drawn in one report look alike;
- a parameter server's pushes are messages, not one collective call spanning the run;
- the report opens with the run's own figure: a pipeline's grids, a ZeRO run's model states (a data
  parallel run's after its timelines); the summary says over how many steps its totals are;
- titles name the clock and the costs (a unit grid says unit costs, whatever the trace's durations);
- the model states chart of many bars names ranks r0, r1, ... and wraps long group labels;
- an interleaved schedule's stash counts say they count chunk micro-batches (1/v of a micro-batch each).
"""

from __future__ import annotations

import re

from rich.console import Console
from viz_traces import one_f_one_b, ring_allreduce, simulated

from minipar.comm.collectives import ALGORITHMS_BY_OP
from minipar.trace import Event, Trace
from viz import analysis as A
from viz import figures, memory_stack, report, style
from viz import messages as M
from viz.overview import print_overview
from viz.terminal import print_timeline, traffic_tables
from viz.timeline import INSIDE_OFFSET, lanes

POINT_TO_POINT = ("send", "recv", "pull", "push", "ring_kv", "ring_dkv")


def call(rank: int, t0: float, t1: float, op: str = "allreduce", algorithm: str | None = "ring",
         thread: int | None = None, step: int = 0) -> list[Event]:
    """One step of a collective on ``rank`` (a send to and a receive from rank 1 - rank) from t0 to t1."""
    peer = 1 - rank
    return [Event(rank, "comm", "send", t0, t1, src=rank, dst=peer, nbytes=800, op=op, algorithm=algorithm,
                  step=step, thread=thread),
            Event(rank, "comm", "recv", t0, t1, src=peer, dst=rank, nbytes=800, op=op, algorithm=algorithm,
                  step=step, thread=thread)]


def nested() -> Trace:
    """Per rank r of 2: F [0, 10] on its own thread. Inside it: an all-reduce [2, 4] (blocking: nothing else
    computes); an all-gather [5, 8] with an inner compute span [6, 7] (overlapped, as Ring Attention's
    K/V pass). A reduce-scatter [3, 9] on the worker thread (DDP's buckets). An all-reduce [11, 12] after F,
    a broadcast of no duration at F's end (10: at its edge, not in it)."""
    events = []
    for r in range(2):
        events += [Event(r, "compute", "F", 0.0, 10.0), Event(r, "compute", "attention F", 6.0, 7.0)]
        events += call(r, 2.0, 4.0) + call(r, 5.0, 8.0, "allgather") + call(r, 3.0, 9.0, "reduce_scatter", thread=1)
        events += call(r, 11.0, 12.0, step=1) + call(r, 10.0, 10.0, "broadcast", "tree")
    return Trace({"world_size": 2, "clock": "wall"}, events)


def test_a_collective_inside_a_compute_span_is_drawn_inside_it():
    t = nested()
    spans = M.collective_spans(t)
    inside = dict(zip(((s.rank, s.op, s.t0) for s in spans), M.inside_compute(t, spans), strict=True))
    assert inside == {(r, op, t0): (op, t0) == ("allreduce", 2.0) for r in range(2)
                      for op, t0 in (("allreduce", 2.0), ("allgather", 5.0), ("reduce_scatter", 3.0),
                                     ("allreduce", 11.0), ("broadcast", 10.0))}
    lane = lanes(t)
    assert lane.compute == {0: 0, 1: 2} and lane.comm == {0: 1, 1: 3}
    bars = {b.name: b for b in figures.timeline(t).data if b.type == "bar"}
    strip = bars["allreduce ring, inside compute"]
    assert list(strip.y) == [0 + INSIDE_OFFSET, 2 + INSIDE_OFFSET] and list(strip.base) == [2.0, 2.0]
    assert strip.marker.pattern.shape == "/" and strip.marker.color == style.comm_color("allreduce/ring")
    assert list(bars["allreduce ring"].y) == [1, 3] and list(bars["allreduce ring"].base) == [11.0, 11.0]
    assert list(bars["allgather ring"].y) == [1, 3] and list(bars["reduce_scatter ring"].y) == [1, 3]
    assert list(bars["broadcast tree"].y) == [1, 3]
    # every call inside a compute span: no comm lane at all, one lane per rank
    only = Trace(t.meta, [e for e in t.events if e.kind == "compute" or e.t0 == 2.0])  # the all-reduce in F
    assert lanes(only).ticks == [(0, "rank 0"), (1, "rank 1")]
    assert {b.name for b in figures.timeline(only).data if b.type == "bar"} == {
        "forward", "other", "allreduce ring, inside compute", "messages (steps)"}


def test_a_message_is_inside_when_the_rank_waited_for_it_there():
    """Rank 0's F [0, 10]: a K/V receive [2, 3] waited for from 2.1 (in it), a send [4, 6] never waited
    for (posted and left to finish: beside), a receive [7, 9] first waited for at 8.9 (computed over:
    beside), a send [0, 0.5] posted as F began (a replay puts the previous step's send there: beside)."""
    def msg(name: str, t0: float, t1: float, tw: float | None, src: int = 1, dst: int = 0) -> Event:
        return Event(0, "comm", name, t0, t1, src=src, dst=dst, nbytes=64, op="ring_kv", step=0, tw=tw)

    t = Trace({"world_size": 2}, [Event(0, "compute", "F", 0.0, 10.0), msg("recv", 2.0, 3.0, 2.1),
                                  msg("send", 4.0, 6.0, None, 0, 1), msg("recv", 7.0, 9.0, 8.9),
                                  msg("send", 0.0, 0.5, 0.0, 0, 1)])
    spans = M.collective_spans(t)
    assert [(s.t0, i) for s, i in zip(spans, M.inside_compute(t, spans), strict=True)] == [
        (0.0, False), (2.0, True), (4.0, False), (7.0, False)]


def test_every_kind_has_its_own_colour():
    keys = [f"{op}/{alg}" for op, algs in ALGORITHMS_BY_OP.items() for alg in algs] + list(POINT_TO_POINT)
    assert set(keys) <= set(style.COMM_COLORS)  # every op and algorithm of the communicator, named
    colours = [c.upper() for c in [*style.COMM_COLORS.values(), *style.COLORS.values()]]
    assert len(set(colours)) == len(colours)  # no two kinds (collectives, messages, compute) alike
    assert style.comm_color("all_to_all/pairwise") != style.comm_color("ring_kv")  # they were one colour


def test_no_two_kinds_drawn_in_one_report_share_a_colour():
    kinds = [("all_to_all", "pairwise"), ("ring_kv", None), ("ring_dkv", None), ("allgather", "ring"),
             ("reduce_scatter", "ring"), ("allreduce", "ring"), ("push", None), ("pull", None)]
    t = Trace({"world_size": 2}, [Event(r, "compute", name, 20.0 * i, 20.0 * i + 1) for r in range(2)
                                  for i, name in enumerate(("F", "B", "opt", "W"))]
              + [e for i, (op, alg) in enumerate(kinds) for r in range(2) for e in call(r, 2.0 * i + 1.5,
                                                                                       2.0 * i + 2.5, op, alg)])
    fig = report.timeline_figure(t, "kinds")
    drawn = {b.name: b.marker.color for b in fig.data if b.type == "bar" and b.name != "messages (steps)"}
    assert len(drawn) == 4 + len(kinds) and len(set(drawn.values())) == len(drawn)


def test_pushes_are_messages_not_one_call():
    pushes = [e for c in range(3) for e in call(0, 3.0 * c, 3.0 * c + 1, "push", None, step=c)]
    spans = M.collective_spans(Trace({"world_size": 2}, pushes))
    assert [(s.op, s.t0, len(s.events)) for s in spans] == [
        ("push", 3.0 * c, 1) for c in range(3) for _ in range(2)]  # a send and a receive each, never merged
    console = Console(width=80, record=True, color_system=None)
    print_timeline(Trace({"world_size": 2}, pushes + [Event(0, "compute", "F", 0.5, 0.7)]), console=console)
    text = console.export_text()
    assert "one collective call" not in text and "~ message (sending or waiting)" in text


def test_the_report_opens_with_the_runs_own_figure_and_totals_say_their_steps():
    sim, measured = simulated("1f1b", 4, 8, forward=[2.0, 2.0, 2.0, 2.0], backward=[5.0] * 4), one_f_one_b()
    page = report.render([measured, sim], ["1F1B", "1F1B simulated"])
    heads = re.findall(r"<h2>([^<]*)</h2>", page)
    assert heads[0] == "the schedules as the papers draw them (unit costs)" and page.count('id="fig-1-schedule"') == 1
    grid = figures.schedule_grid(sim)
    assert grid.layout.title.text == ("1f1b as the papers draw it, 4 ranks (unit costs: forward 1 cell, backward 2 "
                                      "cells, not the trace's times)")
    assert style.clock(sim) == "simulated, costs per stage: forward 2 units, backward 5 units"
    assert style.clock(simulated("1f1b", 2, 4)) == "simulated, unit costs: forward 1, backward 2"

    def states(paradigm: str, steps: int) -> Trace:
        t = ring_allreduce(2, 2000)
        t.meta.update(paradigm=paradigm, steps=steps)
        t.events += [Event(r, "memory", lab, 0.0, 0.0, nbytes=100) for r in range(2)
                     for lab in ("parameters", "optimizer state")]
        return t

    zero = re.findall(r"<h2>([^<]*)</h2>", report.render([states("ZeRO stage 1", 1)] * 2, ["a", "b"]))
    ddp = re.findall(r"<h2>([^<]*)</h2>", report.render([states("data parallel (DDP)", 1)] * 2, ["a", "b"]))
    assert zero[:2] == ["model states per rank", "side by side"]
    assert ddp[:2] == ["side by side", "model states per rank"]
    ps = states("parameter server", 10)
    (row,) = report.summary_rows([ps], ["ps"])
    moved = A.summary(ps)["bytes_moved"]
    assert row["bytes moved"] == f"{A.fmt_bytes(moved)} in 10 steps, {A.fmt_bytes(moved / 10)} per step"
    assert row["time traced"] == f"{A.fmt_time(A.summary(ps)['step_time'])} for 10 steps"
    assert report.summary_rows([states("DDP", 1)], ["ddp"])[0]["bytes moved"] == A.fmt_bytes(moved)
    traffic = next(fig for kind, fig, _ in report.figures_for(ps, "ps") if kind == "traffic")
    assert traffic.layout.title.text == "traffic: ps (bytes of all 10 traced steps)"
    assert [t.title for t in traffic_tables(ps)] == ["bytes sent per rank, all 10 traced steps"]


def test_many_bars_of_model_states_name_ranks_short_and_wrap_long_labels():
    t = Trace({"world_size": 4}, [Event(r, "memory", lab, 0.0, 0.0, nbytes=100) for r in range(4)
                                  for lab in ("parameters", "optimizer state")])
    fig = memory_stack.stacks_figure([t] * 8, ["DDP recursive_doubling", *(f"run {i}" for i in range(7))])
    groups, ranks = fig.data[0].x
    assert list(ranks[:4]) == ["r0", "r1", "r2", "r3"] and groups[0] == "DDP<br>recursive_<br>doubling"
    every = Trace({"world_size": 1}, [Event(0, "memory", lab, 0.0, 0.0, nbytes=100) for lab in
                                      (*memory_stack.MODEL_STATES, "gradient buckets", "other bytes")])
    colours = {b.name: b.marker.color for b in memory_stack.stacks_figure([every], ["e"]).data if b.type == "bar"}
    assert len(colours) == 7 and len(set(colours.values())) == 7  # buckets no longer a red beside master's
    few = memory_stack.stacks_figure([t] * 2, ["DDP recursive_doubling", "b"])
    assert list(few.data[0].x[1][:2]) == ["rank 0", "rank 1"] and few.data[0].x[0][0] == "DDP recursive_doubling"


def test_an_interleaved_stash_names_its_unit():
    (row,) = report.summary_rows([simulated("interleaved", 4, 8, 2)], ["interleaved"])
    peaks = ", ".join(str(n) for n in A.summary(simulated("interleaved", 4, 8, 2))["peak_memory"])
    assert row["peak memory per rank"] == (f"{peaks} chunk micro-batches (1/2 of a micro-batch's activations on "
                                           "the rank each) stashed")
    grid = figures.schedule_grid(simulated("interleaved", 4, 8, 2))
    assert grid.layout.annotations[0].text.startswith("stashed chunk micro-batches (1/2 of")
    assert report.summary_rows([simulated("1f1b", 4, 8)], ["1f1b"])[0]["peak memory per rank"] == (
        "4, 3, 2, 1 micro-batches stashed")


def test_the_overview_of_several_steps_says_so():
    t = simulated("1f1b", 4, 8)
    t.meta["steps"] = 3
    console = Console(width=80, record=True, color_system=None)
    print_overview(t, 80, console)
    assert console.export_text().splitlines()[1] == (f"3 steps traced: {A.fmt_time(A.window(t)[1], 'units')}; "
                                                     "simulated, unit costs: forward 1, backward 2")
