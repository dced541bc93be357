"""Bytes per rank read from the trace equal the formulas; the trace survives save/load/Chrome export."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget

from minipar import trace
from minipar.chrome import to_chrome
from minipar.comm import launch


def traced(comm, n, dtype, algorithm):
    x = np.ones(n, dtype=dtype)
    with trace.record(None, comm) as rec:
        comm.allreduce(x, algorithm=algorithm)
    return rec.events


def sent(events, rank, op="allreduce"):
    return sum(e.nbytes for e in events
               if e.kind == "comm" and e.src == rank and e.name == "send" and e.op == op)


@budget(20)
@given(p=st.integers(2, 8), n=st.integers(0, 40), dtype=st.sampled_from(["float64", "float32"]))
@example(p=4, n=10, dtype="float64")  # chunks 3, 3, 2, 2
@example(p=5, n=3, dtype="float32")  # fewer elements than ranks: empty chunks
def test_ring_bytes_are_exactly_the_chunks_sent(p, n, dtype):
    item = np.dtype(dtype).itemsize
    chunks = [n // p + (1 if i < n % p else 0) for i in range(p)]  # the first n % p chunks one longer
    res = launch(traced, p, "threads", n, dtype, "ring")
    for r, events in enumerate(res):
        assert sent(events, r) == item * (2 * n - chunks[r] - chunks[(r + 1) % p])
        steps = {e.step for e in events if e.name == "send"}
        assert steps == set(range(2 * (p - 1)))
        got = sum(e.nbytes for e in events if e.name == "recv")
        assert got == item * (2 * n - chunks[(r - 1) % p] - chunks[r])  # what the left neighbour sent


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_formula_when_p_divides_n(p):
    n = 24 * p
    for r, events in enumerate(launch(traced, p, "threads", n, "float64", "ring")):
        assert sent(events, r) == 2 * (p - 1) * (n * 8) // p


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_recursive_doubling_bytes(p):
    n, nbytes = 10, 80
    pp = 1 << (p.bit_length() - 1)
    extra, lg = p - pp, pp.bit_length() - 1
    for r, events in enumerate(launch(traced, p, "threads", n, "float64", "recursive_doubling")):
        if r < 2 * extra:
            want = nbytes if r % 2 == 0 else nbytes * (lg + 1)  # fold-in: send in / send the result back
        else:
            want = nbytes * lg  # n log2 p for powers of two
        assert sent(events, r) == want


def test_naive_and_other_collectives_bytes():
    p, n = 4, 12

    def fn(comm):
        x = np.ones(n)
        with trace.record(None, comm) as rec:
            comm.allreduce(x, algorithm="naive")
            comm.reduce_scatter(x)
            comm.allgather(x)
            comm.all_to_all(x)
            comm.broadcast(x if comm.rank == 0 else None)
            comm.barrier()
            comm.allreduce(x, algorithm="native")
        return rec.events
    for r, ev in enumerate(launch(fn, p)):
        assert sent(ev, r) == (8 * n * (p - 1) if r == 0 else 8 * n)
        assert sent(ev, r, "reduce_scatter") == 8 * n * (p - 1) // p
        assert sent(ev, r, "allgather") == 8 * n * (p - 1)
        assert sent(ev, r, "all_to_all") == 8 * n * (p - 1) // p
        assert sent(ev, r, "broadcast") == {0: 16 * n, 1: 0, 2: 8 * n, 3: 0}[r]
        assert sent(ev, r, "barrier") == 0
        assert len([e for e in ev if e.op == "barrier" and e.name == "send"]) == 2
        native = [e for e in ev if e.algorithm == "native"]
        assert len(native) == 1 and native[0].src is None and native[0].nbytes == 8 * n


def test_sub_communicator_messages_use_world_ranks():
    def fn(comm):
        col = comm.split(comm.rank % 2)
        with trace.record(None, comm) as rec:
            col.allreduce(np.ones(4))
        return [(e.rank, e.src, e.dst) for e in rec.events if e.kind == "comm"]
    for r, triples in enumerate(launch(fn, 4)):
        partner = r ^ 2
        assert triples and all(t[0] == r and {t[1], t[2]} == {r, partner} for t in triples)


def test_point_to_point_labels_land_on_each_sides_event():
    """stage/microbatch/chunk given to send/isend/recv/irecv/sendrecv are recorded on that side's
    event; unlabelled messages carry none; a bad label is refused before anything is sent."""
    def fn(comm):
        r, peer = comm.rank, 1 - comm.rank
        with trace.record(None, comm) as rec:
            if r == 0:
                comm.send(np.zeros(3), 1, tag=1, stage=2, microbatch=5, chunk=1)
                comm.isend(np.zeros(2), 1, tag=2, microbatch=np.int64(4)).wait()
                comm.recv(1, tag=3)
            else:
                comm.irecv(0, tag=1, stage=3, microbatch=5).wait()
                comm.recv(0, tag=2, chunk=0)
                comm.send(np.zeros(1), 0, tag=3)
            comm.sendrecv(np.zeros(4), peer, peer, stage=r, microbatch=7)
            errors = []
            for bad in ({"stage": -1}, {"microbatch": 1.5}, {"chunk": True}):
                try:
                    comm.isend(np.zeros(1), peer, **bad)
                except (TypeError, ValueError) as exc:
                    errors.append(str(exc))
        labels = [(e.name, e.src, e.dst, e.nbytes, e.stage, e.microbatch, e.chunk)
                  for e in rec.events if e.kind == "comm"]
        return labels, errors
    (l0, err0), (l1, _) = launch(fn, 2)
    assert sorted(l0) == sorted([("send", 0, 1, 24, 2, 5, 1), ("send", 0, 1, 16, None, 4, None),
                                 ("recv", 1, 0, 8, None, None, None), ("recv", 1, 0, 32, 0, 7, None),
                                 ("send", 0, 1, 32, 0, 7, None)])
    assert sorted(l1) == sorted([("recv", 0, 1, 24, 3, 5, None), ("recv", 0, 1, 16, None, None, 0),
                                 ("send", 1, 0, 8, None, None, None), ("recv", 0, 1, 32, 1, 7, None),
                                 ("send", 1, 0, 32, 1, 7, None)])
    assert err0 == ["send: stage must be a non-negative int or None, got -1",
                    "send: microbatch must be a non-negative int or None, got 1.5",
                    "send: chunk must be a non-negative int or None, got True"]


def test_trace_round_trip_and_chrome_export(tmp_path):
    path, chrome = tmp_path / "run.json", tmp_path / "chrome.json"

    def fn(comm):
        with trace.record(path, comm, paradigm="collectives"):
            with trace.span("F", microbatch=0):
                x = np.ones(6) * comm.rank
            trace.memory("activations", x.nbytes)
            comm.allreduce(x, algorithm="ring")
            comm.iallreduce(x).wait()
    launch(fn, 3)
    tr = trace.load(path)
    assert tr.meta["paradigm"] == "collectives" and tr.meta["world_size"] == 3
    assert tr.meta["backend"] == "threads"
    msgs = tr.select("comm", op="allreduce", algorithm="ring")
    assert len(msgs) == 4 * 2 * 3 * 2  # 2(p-1) steps x (send + recv event) x 3 ranks x 2 all-reduces
    assert all(tr.bytes_sent(r, op="allreduce") == 2 * (2 * 2 * 48 // 3) for r in range(3))  # 2(p-1)/p n
    assert len(tr.select("compute", name="F")) == 3 and len(tr.select("memory")) == 3
    to_chrome(tr, chrome)
    doc = json.loads(chrome.read_text())
    names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert "allreduce:send 0->1" in names and "allreduce:recv 2->0" in names and names.count("F0") == 3
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert len(spans) == len(tr.select("comm")) + len(tr.select("compute"))
    assert {e["pid"] for e in spans} == {0, 1, 2}  # a process per rank: its own memory counter
    assert sorted(e["pid"] for e in doc["traceEvents"] if e.get("ph") == "C") == [0, 1, 2]
    assert_nested(spans)


def assert_nested(spans):
    """Chrome-trace 'X' events of one thread must nest (Perfetto drops the others)."""
    threads = {}
    for e in spans:
        a = round(e["ts"] * 1000)
        threads.setdefault((e["pid"], e["tid"]), []).append((a, a + round(e["dur"] * 1000)))
    for key, intervals in threads.items():
        open_ends = []
        for a, b in sorted(intervals, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= a:
                open_ends.pop()
            assert not open_ends or b <= open_ends[-1], f"thread {key}: [{a}, {b}] overlaps an open span"
            open_ends.append(b)


def test_chrome_export_packs_overlapping_spans_into_nested_threads(tmp_path):
    ev = [trace.Event(0, "compute", "B", 0.0, 10.0), trace.Event(0, "compute", "layer", 1.0, 3.0),
          # this message crosses the end of B: it cannot nest on B's thread
          trace.Event(0, "comm", "send", 2.0, 12.0, src=0, dst=1, nbytes=8, op="allreduce"),
          trace.Event(0, "comm", "recv", 4.0, 5.0, src=1, dst=0, nbytes=8, op="allreduce"),
          trace.Event(0, "comm", "send", 11.0, 13.0, src=0, dst=1, nbytes=8, op="allreduce")]
    to_chrome(trace.Trace({"world_size": 1}, ev), tmp_path / "c.json")
    doc = json.loads((tmp_path / "c.json").read_text())
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert_nested(spans)
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in sorted(spans, key=lambda e: e["ts"])] == [
        ("B", 0, 0.0, 10e6), ("layer", 0, 1e6, 2e6), ("allreduce:send 0->1", 1, 2e6, 10e6),
        ("allreduce:recv 1->0", 0, 4e6, 1e6), ("allreduce:send 0->1", 0, 11e6, 2e6)]
    threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == {0: "main", 1: "overlap 1"}


def test_a_trace_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    path = tmp_path / "run.json"
    bad = trace.Trace({"world_size": 1, "weird": object.__new__(type("Unprintable", (), {"__str__": None}))}, [])
    with pytest.raises(TypeError):
        trace.save(bad, path)
    assert list(tmp_path.iterdir()) == []  # neither the trace nor its temporary file


def test_memory_states_samples_each_state_in_order():
    with trace.recording(0) as rec:
        trace.memory_states({"parameters": 80, "gradients": 64, "optimizer state": 160})
    assert [(e.kind, e.name, e.nbytes) for e in rec.events] == [
        ("memory", "parameters", 80), ("memory", "gradients", 64), ("memory", "optimizer state", 160)]
    trace.memory_states({"parameters": 80})  # nothing recording: no sample, no error
