"""``minipar.replay`` (issue 27): a recorded trace re-timed on a modelled cluster, checked against
expectations computed without it.

- a pipeline step of every schedule kind, run by the real runtime on threads, with each span's CPU time
  set to one unit per forward (two per backward, ...) and a network that costs nothing, replays to the
  schedule simulator's timeline, action by action;
- a ring all-reduce of n bytes replays to 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma exactly;
- DDP with overlap, by hand: a fast link hides every bucket's all-reduce but the last under the
  backward, a slow one adds the exposed tail computed below;
- version-1 traces load and refuse replay in one line; the CLI's one-line errors.

Only CPU times written by the test and modelled links enter an expectation: no test asserts a wall time.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from minipar import cli, datasets, launch, testing
from minipar import functional as F
from minipar import trace as mtrace
from minipar.autograd import Tensor
from minipar.cost.cluster import Cluster, Link
from minipar.nn import MLP
from minipar.optim import SGD
from minipar.parallel.ddp import DistributedDataParallel, train_step
from minipar.parallel.offload import ZeroOffload
from minipar.parallel.pipeline import (
    Chimera,
    Pipeline,
    make_schedule,
    mlp,
    pipedream,
    pipedream_2bw,
    simulate,
    simulate_chimera,
)
from minipar.parallel.tensor import TensorParallelGPT
from minipar.replay import ReplayError, replay
from minipar.tiers import Tiers
from minipar.trace import Trace

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "U": 0.5}  # simulate's defaults: W = I = B / 2; U set below


def cluster(alpha: float = 0.0, beta: float = 0.0, gamma: float = 0.0, per_node: int = 64) -> Cluster:
    return Cluster("test", per_node, 1e9, 1.0, 1e9, Link(alpha, beta), Link(alpha, beta), gamma)


def unit_costs(events: list[mtrace.Event], cost: dict[str, float]) -> Trace:
    """The recorded events with every compute span's CPU time set to ``cost[name]`` (0 for the others:
    the optimizer); nothing inside these spans is communication, so no point splits them."""
    out = [replace(e, c0=0.0, c1=cost.get(e.name, 0.0)) if e.kind == "compute" else e for e in events]
    return Trace({"world_size": 1 + max(e.rank for e in events), "clock": "wall"}, out)


def _pipeline_step(comm, kind: str, p: int, m: int, v: int) -> list[mtrace.Event]:
    x, y = datasets.regression(2 * m, 4, 4, seed=1)
    if kind == "chimera":
        pipe = Chimera(comm, mlp([4] * (p + 1), seed=0), m)
        with mtrace.record(None, comm) as rec:
            pipe.step(x, y)
        return rec.events
    sched = {"pipedream": lambda: pipedream(p, m), "2bw": lambda: pipedream_2bw(p, m)}.get(
        kind, lambda: make_schedule(kind, p, m, v))()
    updates = kind in ("pipedream", "2bw")
    pipe = Pipeline(comm, mlp([4] * (sched.virtual_stages + 1), seed=0), sched,
                    optimizer=(lambda ps: SGD(ps, lr=0.01)) if updates else None)
    with mtrace.record(None, comm) as rec:
        pipe.step(x, y) if updates else pipe.step(x, y, SGD(pipe.parameters(), lr=0.01))
    return rec.events


def _timeline(events, names=tuple(COST)) -> dict[tuple, tuple[float, float]]:
    return {(e.rank, e.name, e.stage, e.microbatch, e.chunk): (e.t0, e.t1)
            for e in events if e.kind == "compute" and e.name in names}


KINDS = [("naive", 4, 2, 1), ("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 4, 8, 1),
         ("zb-v", 4, 4, 2), ("pipedream", 4, 6, 1), ("2bw", 4, 8, 1), ("chimera", 4, 8, 2)]


@pytest.mark.parametrize("kind,p,m,v", KINDS, ids=[k[0] for k in KINDS])
def test_unit_cost_pipeline_replays_to_the_simulator(kind, p, m, v):
    events = [e for rank in launch(_pipeline_step, p, "threads", kind, p, m, v) for e in rank]
    out = replay(unit_costs(events, COST), cluster())
    if kind == "chimera":
        sim = simulate_chimera(p, m, COST["F"], COST["B"])
    else:
        sched = {"pipedream": lambda: pipedream(p, m), "2bw": lambda: pipedream_2bw(p, m)}.get(
            kind, lambda: make_schedule(kind, p, m, v))()
        sim = simulate(sched, COST["F"], COST["B"], update=COST["U"])
    want, got = _timeline(sim.trace.events), _timeline(out.events)
    assert len(want) == sum(len([a for a in acts if a.is_compute]) for acts in sim.program.values())
    assert got == want
    assert out.meta["clock"] == "replay" and out.meta["cluster"] == "test"


def _allreduce(comm, n: int, algorithm: str) -> list[mtrace.Event]:
    with mtrace.record(None, comm) as rec:
        comm.allreduce(np.ones(n // 8), algorithm=algorithm)
    return rec.events


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_allreduce_replays_to_its_formula(p):
    n, a, b, g = 24 * 8, 0.5, 2.0**-6, 2.0**-7  # 24 float64: p divides it; dyadic numbers: sums are exact
    events = [e for rank in launch(_allreduce, p, "threads", n, "ring") for e in rank]
    want = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    for per_node in (p, 1):  # every rank in one node, or each its own (intra == inter here)
        out = replay(Trace({"world_size": p}, events), cluster(a, b, g, per_node))
        assert max(e.t1 for e in out.events) == want
        assert min(e.t0 for e in out.events) == 0.0


def test_native_allreduce_replays_as_the_ring_formula():
    p, n, a, b, g = 4, 64 * 8, 0.25, 2.0**-8, 2.0**-9
    events = [e for rank in launch(_allreduce, p, "threads", n, "native") for e in rank]
    out = replay(Trace({"world_size": p}, events), cluster(a, b, g))
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g  # NATIVE_AS: MPI's is not visible
    assert {(e.t0, e.t1) for e in out.events} == {(0.0, ring)}


def _native(comm, op: str) -> list[mtrace.Event]:
    x = np.ones(32)  # 256 bytes
    with mtrace.record(None, comm) as rec:
        {"broadcast": lambda: comm.broadcast(x, algorithm="native"), "barrier": lambda: comm.barrier("native"),
         "all_to_all": lambda: comm.all_to_all(x, algorithm="native")}[op]()
    return rec.events


@pytest.mark.parametrize("op,by_hand", [("broadcast", 2 * (0.5 + 256 / 64)), ("barrier", 2 * 0.5),
                                        ("all_to_all", 3 * (0.5 + 64 / 64))])
def test_native_rooted_and_personalised_collectives_by_hand(op, by_hand):
    # 4 ranks: binomial broadcast ceil(lg 4) = 2 rounds of alpha + n beta; dissemination barrier 2 alpha;
    # pairwise all-to-all 3 steps of alpha + n/4 beta (alpha 1/2, beta 1/64 s per byte, n = 256 bytes)
    events = [e for rank in launch(_native, 4, "threads", op) for e in rank]
    out = replay(Trace({"world_size": 4}, events), cluster(0.5, 1 / 64))
    assert {(e.t0, e.t1) for e in out.events} == {(0.0, by_hand)}


def _overlap(comm) -> list[mtrace.Event]:
    with mtrace.record(None, comm) as rec:
        if comm.rank == 0:
            comm.send(np.ones(64), 1)  # 512 bytes
        else:
            req = comm.irecv(0)
            with mtrace.span("F"):
                pass
            req.wait()
    return rec.events


@pytest.mark.parametrize("beta,done", [(2.0**-9, 5.0), (2.0**-6, 8.0)])
def test_a_non_blocking_receive_overlaps_the_compute_before_its_wait(beta, done):
    # rank 1 posts the receive, computes 5 units, waits: the 512 bytes arrive at 512 beta = 1 or 8
    events = [e for rank in launch(_overlap, 2, "threads") for e in rank]
    out = replay(unit_costs(events, {"F": 5.0}), cluster(0.0, beta))
    (recv,) = [e for e in out.events if e.rank == 1 and e.kind == "comm"]
    assert (recv.t0, recv.tw, recv.t1) == (0.0, 5.0, done)


# ---- DDP: the bucket all-reduces overlap the backward ------------------------------------------------
# MLP 8 -> 16 -> 16 -> 4, one bucket per parameter (cap 1 byte), buckets in reverse parameter order:
# bias 2 (4 float64 = 32 B), weight 2 (16x4: 512 B), bias 1 (128 B), weight 1 (2048 B), bias 0 (128 B),
# weight 0 (8x16: 1024 B). CPU times set by the test: forward 1, backward 6 with buckets 0..4 launched
# 1, 2, 3, 4, 5 units into it (bucket 5 when the last gradient is ready: its end), optimizer 1.
BUCKETS = [32, 512, 128, 2048, 128, 1024]


def _ddp_step(comm) -> list[mtrace.Event]:
    ddp = DistributedDataParallel(MLP([8, 16, 16, 4], seed=0), comm, bucket_cap_bytes=1)
    opt = SGD(ddp.parameters(), lr=0.1)
    x, y = datasets.regression(8, 8, 4, seed=0)
    with mtrace.record(None, comm) as rec:
        train_step(ddp, opt, lambda m, a, b: F.mse_loss(m(a), b), x, y)
    return rec.events


def _ddp_costs(events: list[mtrace.Event]) -> Trace:
    spans = {"F": (0.0, 1.0), "B": (10.0, 16.0), "opt": (0.0, 1.0)}
    out = []
    for e in events:
        if e.kind == "compute":
            e = replace(e, c0=spans[e.name][0], c1=spans[e.name][1])
        elif e.name == "async posted":  # inside the backward span: CPU 11..15; the last one after it
            e = replace(e, c0=10.0 + min(e.args["job"] + 1, 6))
        out.append(e)
    return Trace({"world_size": 2}, out)


def test_ddp_overlap_hides_the_buckets_on_a_fast_link_and_shows_the_tail_on_a_slow_one():
    events = [e for rank in launch(_ddp_step, 2, "threads") for e in rank]
    assert [e.args["nbytes"] for e in events if e.rank == 0 and e.name == "bucket"] == BUCKETS
    trace = _ddp_costs(events)

    def run(link: Cluster) -> tuple[dict[str, tuple[float, float]], list[float]]:
        out = replay(trace, link)
        spans = {e.name: (e.t0, e.t1) for e in out.events if e.rank == 0 and e.kind == "compute"}
        ends = [e.t0 for e in sorted(out.events, key=lambda e: e.args.get("job", -1))
                if e.rank == 0 and e.name == "async end"]
        return spans, ends

    # fast: p = 2, a ring all-reduce of n bytes is 2 steps of alpha + n/2 beta: 2^-10 + n 2^-20 < 0.003
    fast, ends = run(cluster(2.0**-10, 2.0**-20))
    assert fast["F"] == (0.0, 1.0) and fast["B"] == (1.0, 7.0)
    assert all(end < 7.0 for end in ends[:5])  # under the backward
    last = 2 * 2.0**-10 + BUCKETS[5] * 2.0**-20  # the bucket launched at the backward's end
    assert fast["opt"] == (7.0 + last, 8.0 + last)
    # slow: alpha 1/4, beta 2^-10, so bucket k takes 1/2 + n_k/1024: 0.53125, 1, 0.625, 2.5, 0.625, 1.5;
    # launched at 2, 3, 4, 5, 6, 7, one after another on the worker:
    # 2 -> 2.53125; 3 -> 4; 4 -> 4.625; 5 -> 7.5; 7.5 -> 8.125; 8.125 -> 9.625: the tail after the
    # backward (ends at 7) is 2.625 units, and the optimizer starts there.
    slow, ends = run(cluster(0.25, 2.0**-10))
    assert ends == [2.53125, 4.0, 4.625, 7.5, 8.125, 9.625]
    assert slow["B"] == (1.0, 7.0) and slow["opt"] == (9.625, 10.625)
    assert slow["opt"][1] - (fast["opt"][1] - last) == 2.625


# ---- ZeRO-Offload's delayed parameter update: the CPU AdamW beside the next forward and backward ------
def _dpu_steps(comm) -> list[mtrace.Event]:
    off = ZeroOffload(MLP([8, 16, 4], seed=0), comm, Tiers(1 << 30), delayed_update=True)
    x, y = datasets.regression(8, 8, 4, seed=0)
    with mtrace.record(None, comm) as rec:
        for _ in range(3):
            off.backward(F.mse_loss(off(Tensor(x)), Tensor(y)))
            off.step()
        off.flush()
    off.close()
    return rec.events


def _running_cpu(events: list[mtrace.Event], cost: dict[str, float]) -> Trace:
    """Each thread's CPU clock advanced by ``cost[name]`` at every compute span's end and by nothing
    else: spans and marks get the clock's reading where they are."""
    out, clock = list(events), {}
    points = sorted([(e.t0, 1, i) for i, e in enumerate(events)] + [(e.t1, 0, i) for i, e in enumerate(events)
                                                                     if e.kind == "compute"])
    for _, is_start, i in points:
        e, lane = out[i], (out[i].rank, out[i].thread)
        now = clock.setdefault(lane, 0.0)
        if is_start:
            out[i] = replace(e, c0=now, c1=now if e.kind != "compute" else None)
        else:
            clock[lane] = now + cost.get(e.name, 0.0)
            out[i] = replace(e, c1=clock[lane])
    return Trace({"world_size": 1}, out)


def test_dpu_cpu_adam_replays_beside_the_next_forward_and_backward():
    # by hand, F 1, B 2, CPU AdamW 4 (the background thread), the rest free: step i posts its AdamW when
    # its backward ends; step i + 1's forward and backward (3 units) run beside it, then its step waits
    # for it (1 unit exposed): AdamW 3-7, 7-11, 11-15 (flush waits for the last): 15, not 3 x 7 = 21
    events = [e for rank in launch(_dpu_steps, 1, "threads") for e in rank]
    out = replay(_running_cpu(events, {"F": 1.0, "B": 2.0, "cpu adam": 4.0}), cluster())
    spans = {(e.name, e.thread, e.t0, e.t1) for e in out.events if e.kind == "compute" and e.name != "opt"}
    assert spans == {("F", None, 0.0, 1.0), ("B", None, 1.0, 3.0), ("cpu adam", 1, 3.0, 7.0),
                     ("F", None, 3.0, 4.0), ("B", None, 4.0, 6.0), ("cpu adam", 1, 7.0, 11.0),
                     ("F", None, 7.0, 8.0), ("B", None, 8.0, 10.0), ("cpu adam", 1, 11.0, 15.0)}
    assert max(e.t1 for e in out.events) == 15.0


def _library_spans(comm) -> list[mtrace.Event]:
    """A tensor-parallel GPT's step (its blocks' backward spans), ZeRO-Offload with and without DPU."""
    idx = np.arange(16).reshape(2, 8) % 16
    with mtrace.record(None, comm) as rec:
        TensorParallelGPT(16, 8, 8, 2, 1, comm).loss(idx, idx).backward()
        for delayed in (False, True):
            off = ZeroOffload(MLP([8, 16, 4], seed=0), comm, Tiers(1 << 30), delayed_update=delayed)
            x, y = datasets.regression(8, 8, 4, seed=0)
            off.backward(F.mse_loss(off(Tensor(x)), Tensor(y)))
            off.step()
            off.close()
    return rec.events


def test_every_span_the_library_records_has_cpu_times():
    events = [e for rank in launch(_library_spans, 2, "threads") for e in rank]
    spans = [e for e in events if e.kind == "compute"]
    assert {e.name for e in spans} >= {"F", "B", "opt", "cpu adam"}
    assert [e for e in spans if e.c0 is None or e.c1 is None] == []


def test_ddp_reads_no_cpu_clock_when_nothing_records(monkeypatch):
    def refuse() -> float:
        raise AssertionError("time.thread_time read while no trace records")

    def step(comm) -> None:
        ddp = DistributedDataParallel(MLP([8, 16, 4], seed=0), comm, bucket_cap_bytes=1)
        x, y = datasets.regression(8, 8, 4, seed=0)
        train_step(ddp, SGD(ddp.parameters(), lr=0.1), lambda m, a, b: F.mse_loss(m(a), b), x, y)

    monkeypatch.setattr(mtrace, "cpu", refuse)
    launch(step, 2, "threads")


def test_compute_sleep_is_charged_as_cpu_time_so_a_replay_keeps_a_straggler():
    # a plain sleep uses no CPU time (a replay would drop a slept straggler); compute_sleep charges it
    with mtrace.recording(0) as rec:
        with mtrace.span("F"):
            mtrace.compute_sleep(0.05)
        with mtrace.span("B"):
            pass
    f, b = rec.events
    assert f.c1 - f.c0 >= 0.05 and b.c0 >= f.c1  # the thread's CPU clock moved on by the charge, and stays so
    out = replay(Trace({"world_size": 1, "clock": "wall"}, rec.events), cluster())
    assert out.events[0].t1 - out.events[0].t0 >= 0.05


# ---- refusals: version 1, no CPU times, the CLI --------------------------------------------------------
def _version_1(tmp_path) -> str:
    doc = {"format": "minipar-trace", "version": 1, "meta": {"world_size": 1},
           "events": [{"rank": 0, "kind": "compute", "name": "F", "t0": 0.0, "t1": 1.0}]}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_version_1_traces_load_and_refuse_replay_in_one_line(tmp_path):
    old = mtrace.load(_version_1(tmp_path))
    assert old.version == 1 and old.events[0].c0 is None and not mtrace.has_cpu_times(old)
    with pytest.raises(ReplayError, match=r"^trace format version 1 has no CPU times") as err:
        replay(old, cluster())
    assert "\n" not in str(err.value)


def test_a_replayed_trace_saves_loads_and_is_not_replayed_again(tmp_path):
    events = [e for rank in launch(_allreduce, 2, "threads", 64, "ring") for e in rank]
    out = replay(Trace({"world_size": 2, "clock": "wall"}, events), cluster(1.0))
    mtrace.save(out, tmp_path / "r.json")
    back = mtrace.load(tmp_path / "r.json")
    assert back.meta["clock"] == "replay" and back.meta["replay"]["label"].endswith("network test")
    assert len(back.events) == len(events)
    with pytest.raises(ReplayError, match="already a replay"):
        replay(back, cluster())


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cli_replay_writes_a_replayed_trace(tmp_path, capsys):
    events = [e for rank in launch(_allreduce, 2, "threads", 64, "ring") for e in rank]
    mtrace.save(Trace({"world_size": 2, "clock": "wall"}, events), tmp_path / "t.json")
    status, out, _ = _cli(capsys, "replay", str(tmp_path / "t.json"), "--cluster", "nvlink", "-o",
                          str(tmp_path / "r.json"))
    assert status == 0 and "network nvlink" in out
    assert mtrace.load(tmp_path / "r.json").meta["cluster"] == "nvlink"
    status, _, err = _cli(capsys, "view", str(tmp_path / "t.json"), "--terminal", "--width", "60")
    assert status == 0 and "network local" in err
    status, _, err = _cli(capsys, "view", str(tmp_path / "t.json"), "--clock", "wall", "--terminal")
    assert status == 0 and "replayed" not in err
    status, _, err = _cli(capsys, "view", str(tmp_path / "r.json"), "--terminal")  # a replay: as it is
    assert status == 0 and "replayed" not in err
    mtrace.save(Trace({"world_size": 2, "lost_ranks": [1]}, events), tmp_path / "lost.json")
    status, _, err = _cli(capsys, "view", str(tmp_path / "lost.json"), "--terminal")
    assert status == 0 and "times as recorded: the trace lost ranks [1]" in err


def test_cli_one_line_errors(tmp_path, capsys):
    sim = tmp_path / "sim.json"
    mtrace.save(simulate(make_schedule("1f1b", 2, 2)).trace, sim)
    good = tmp_path / "t.json"
    events = [e for rank in launch(_allreduce, 2, "threads", 64, "ring") for e in rank]
    mtrace.save(Trace({"world_size": 2}, events), good)
    (tmp_path / "bad.json").write_text("{not json")
    out = str(tmp_path / "o.json")
    cases = {
        ("replay", str(sim), "--cluster", "local", "-o", out): "the trace has no CPU times",
        ("replay", _version_1(tmp_path), "--cluster", "local", "-o", out): "trace format version 1 has no CPU times",
        ("replay", str(good), "--cluster", "warp-drive", "-o", out): "no cluster preset 'warp-drive'",
        ("replay", str(good), "--cluster", str(tmp_path / "bad.json"), "-o", out): "not JSON",
        ("replay", str(good), "--cluster", str(tmp_path / "none.json"), "-o", out): "cannot read cluster file",
        ("view", str(sim), "--clock", "replay"): "the trace has no CPU times",
        ("view", str(good), "--clock", "wall", "--cluster", "nvlink"): "--clock wall shows recorded times",
        ("view", str(good), "--cluster", "warp-drive"): "no cluster preset 'warp-drive'",
    }
    for argv, message in cases.items():
        status, stdout, err = _cli(capsys, *argv)
        assert status == 2 and stdout == "", argv
        (line,) = err.strip().splitlines()
        assert line.startswith("minipar: error: ") and message in line, (argv, line)
    assert not (tmp_path / "o.json").exists()


# ---- under mpiexec: the same unit-cost check on real processes -----------------------------------------
def _mpi_1f1b(comm) -> list[mtrace.Event]:
    return _pipeline_step(comm, "1f1b", 2, 4, 1)


@pytest.mark.mpi
def test_unit_cost_1f1b_under_mpiexec_replays_to_the_simulator():
    events = [e for rank in testing.run(_mpi_1f1b, 2, "mpi") for e in rank]
    out = replay(unit_costs(events, COST), cluster())
    assert _timeline(out.events) == _timeline(simulate(make_schedule("1f1b", 2, 4)).trace.events)


def _two_calls_with_work_between(comm) -> tuple[list[mtrace.Event], float]:
    """One span: an all-reduce, ~30 ms of matmuls, the same all-reduce again (one communicator, op and
    algorithm: two calls, whose steps both count from 0); the work's CPU time measured here."""
    a = np.random.default_rng(comm.rank).standard_normal((96, 96))
    with mtrace.record(None, comm) as rec, mtrace.span("F"):
        comm.allreduce(np.ones(8))
        c0 = mtrace.cpu()
        for _ in range(200):
            a = np.tanh(a @ a / 96)
        work = mtrace.cpu() - c0
        comm.allreduce(np.ones(8))
    return rec.events, work


def test_compute_between_two_calls_of_one_collective_is_charged():
    """Only the gap between one call's steps is the collective's own: the work between two calls of the
    same all-reduce stays in the replayed span (it was dropped when both calls counted as one)."""
    out = launch(_two_calls_with_work_between, 2, "threads")
    replayed = replay(Trace({"world_size": 2}, [e for events, _ in out for e in events]), cluster(0.0, 0.0))
    for rank, (_, work) in enumerate(out):
        (span,) = [e for e in replayed.events if e.rank == rank and e.name == "F"]
        assert span.t1 - span.t0 >= work > 0, (rank, span.t1 - span.t0, work)
