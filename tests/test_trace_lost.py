"""A trace survives a lost rank: the survivors' events are gathered, the killed rank's events (spilled
to a side file by ``faults.kill``) merged, ``meta["lost_ranks"]`` names it; and the viewers draw where
its lane stops and when each survivor declared it dead (positions checked against hand-made times)."""

from __future__ import annotations

import os
import time

import minipar
from minipar import trace
from minipar.comm import faults
from minipar.comm.errors import PeerLost
from minipar.trace import Event, Trace
from viz import analysis as A
from viz import faults as vf
from viz import terminal, timeline


def _killed_run(comm: minipar.Communicator, path: str | None) -> str | None:
    with trace.record(path, comm, lesson="test"):
        with trace.span("F", step=0):
            time.sleep(0.01)
        if comm.rank == 2:
            faults.kill(comm)
        try:
            comm.barrier()
        except PeerLost as exc:
            return str(exc)
    return None


def test_a_killed_rank_leaves_its_events_and_the_survivors_write_the_trace(tmp_path) -> None:
    path = tmp_path / "t.json"
    stale = trace.spill_path(path, 2)
    with open(stale, "w") as fh:  # an earlier run's side file must not be merged
        fh.write('[{"rank": 2, "kind": "mark", "name": "stale", "t0": 0, "t1": 0}]')
    out = minipar.launch(_killed_run, 3, deadline=0.3, timeout=5, path=str(path))
    assert out[2] is None and all("rank 2 (world) is dead" in out[r] for r in (0, 1))
    t = trace.load(path)
    assert t.meta["lost_ranks"] == [2] and t.meta["world_size"] == 3
    assert [(e.kind, e.name) for e in t.by_rank(2)] == [("compute", "F"), ("mark", "killed")]
    killed = t.by_rank(2)[-1].t0
    declared = {e.rank: e for e in t.select("mark", name="peer declared dead")}
    assert sorted(declared) == [0, 1] and all(e.args["dead"] == 2 and e.args["deadline"] == 0.3
                                              for e in declared.values())
    # never met: 2x the deadline, checked every period (0.06 s), plus 0.5 s for a thread to get a core and the
    # GIL on a loaded machine
    assert all(0 < e.t0 - killed <= 2 * 0.3 + 0.06 + 0.5 for e in declared.values())
    assert sorted(os.listdir(tmp_path)) == ["t.json"]  # the side file merged and removed


def test_no_side_file_without_a_trace_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = minipar.launch(_killed_run, 3, deadline=0.3, timeout=5, path=None)
    assert out[2] is None and out[0] is not None
    assert os.listdir(tmp_path) == []


def _hand_made() -> Trace:
    """Ranks 0-2: F spans 0-0.5 and 0.5-1.0 (rank 2 only the first), rank 2 killed at 0.65; ranks 0 and
    1 declare it dead at 1.5 and 1.6, rank 0 (a server) drops it at 1.5; a message 1.0-2.0 on rank 0."""
    ev = [Event(r, "compute", "F", 0.5 * i, 0.5 * (i + 1)) for r in range(3) for i in range(2) if (r, i) != (2, 1)]
    ev += [Event(2, "mark", "killed", 0.65, 0.65, args={"rank": 2})]
    ev += [Event(r, "mark", "peer declared dead", t, t, args={"dead": 2, "by": r, "silence": 0.9, "deadline": 0.5})
           for r, t in ((0, 1.5), (1, 1.6))]
    ev += [Event(0, "mark", "worker dropped", 1.5, 1.5, args={"worker": 2, "step": 1, "reason": "dead"})]
    ev += [Event(0, "comm", "send", 1.0, 2.0, src=0, dst=1, nbytes=8, op="send")]
    return Trace({"world_size": 3, "lost_ranks": [2], "backend": "hand-made"}, ev)


def test_lane_ends_and_detections() -> None:
    t = _hand_made()
    assert vf.lane_ends(t) == {2: 0.65}
    assert [(e.rank, e.t0) for e in vf.detections(t)] == [(0, 1.5), (1, 1.6)]
    t.events = [e for e in t.events if e.name != "killed"]  # killed from outside: its last event's end
    assert vf.lane_ends(t) == {2: 0.5}


def test_a_detection_after_the_last_span_stretches_the_window() -> None:
    t = _hand_made()
    t.events = [e for e in t.events if e.kind != "comm"]
    assert A.window(t) == (0.0, 1.6)


def test_timeline_draws_the_lost_lane_the_kill_and_the_detections() -> None:
    fig = timeline.timeline(_hand_made())
    by_name = {d.name: d for d in fig.data}
    lost = by_name["lost (killed)"]  # ranks have compute (y 2r) and comm (y 2r + 1) lanes
    assert sorted(lost.y) == [4, 5] and list(lost.base) == [0.65, 0.65] and list(lost.x) == [1.35, 1.35]
    kill = by_name["killed (its lane ends)"]
    assert list(kill.x) == [0.65] and list(kill.y) == [4]
    declared = by_name["peer declared dead (detector)"]
    assert list(declared.x) == [1.5, 1.6] and list(declared.y) == [0, 2]
    assert list(declared.text) == ["rank 2 dead", "rank 2 dead"]
    dropped = by_name["worker dropped (server)"]
    assert list(dropped.x) == [1.5] and list(dropped.y) == [0]


def test_no_fault_no_fault_traces() -> None:
    t = _hand_made()
    t.events = [e for e in t.events if e.kind != "mark"]
    t.meta.pop("lost_ranks")
    names = {d.name for d in timeline.timeline(t).data}
    assert not names & {"lost (killed)", "killed (its lane ends)", "peer declared dead (detector)"}


def test_terminal_lane_ends_in_x_and_survivors_show_the_detection() -> None:
    t = _hand_made()  # window 0..2.0; 20 cells of 0.1: the kill in cell 6, detections in cells 15 and 16
    lanes = [str(x) for x in terminal.lanes(t, 20)[0]]
    assert lanes[2] == "F    .X" + " " * 13  # F, idle, the kill; the lane stops: blank after the X
    assert lanes[0][15] == "!" and lanes[1][16] == "!"
    assert "!" not in lanes[0][:15] + lanes[0][16:] and "!" not in lanes[2]
