"""Zero bubble with tensor and sequence parallelism (issue 30, item 3): HybridGPT under ZB-H1, ZB-H2,
ZB-V and DualPipeV with tp or sp > 1 equals one process; each parallel op's collective runs once per
backward.

Property: for every drawn pp = 2 mesh with tensor (Megatron, Megatron-SP) or sequence parallelism
(Ulysses, Ring Attention, USP) and a zero-bubble schedule, two AdamW steps give the single-process
``nn.GPT``'s losses, gradients and parameters (``test_hybrid.check_hybrid``: every rank's bytes per
mesh axis equal ``cost.hybrid.traffic_by_axis``, so no collective ran twice, once in I and again in
W); the bytes each rank sends inside its W spans equal ``cost.hybrid.w_regather_bytes`` (Megatron-SP's
re-gathers, nothing else) and every ``re-gather`` mark lies inside a W span. At the layer: asked for
I then W, each parallel linear gives one backward's gradients bit for bit, sends its input-gradient
collective in I only and its re-gather in W only, and keeps between the two the sequence shard of its
input, not the gathered input.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget
from test_hybrid import STEPS, check_hybrid, config, hybrid_run, layout_of

from minipar import nn, trace
from minipar.autograd import Tensor
from minipar.cost.hybrid import split_backwards, w_regather_bytes
from minipar.mesh import MeshShape
from minipar.parallel.pipeline import make_schedule
from minipar.parallel.sequence.comm_ops import linear_seq_to_heads
from minipar.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minipar.split_backward import WeightGradients
from minipar.testing import run, run_each

EXAMPLES = [
    config({"pp": 2, "dp": 2, "tp": 2}, schedule="zb-h1"),  # the brief's pp 2 x tp 2 x dp 2
    config({"pp": 2, "dp": 2, "tp": 2}, schedule="zb-v", chunks=2, microbatches=3, batch=12, sequence_parallel=True,
           zero_stage=1),
    config({"pp": 2, "dp": 2, "tp": 2}, schedule="zb-h2", microbatches=3, batch=6, sequence_parallel=True),
    config({"pp": 2, "sp": 2}, schedule="zb-v", chunks=2, microbatches=3, batch=6, sp_method="ring", zigzag=True),
    config({"pp": 2, "sp": 4}, schedule="zb-h1", sp_method="hybrid", ulysses=2),
    config({"pp": 2, "dp": 2, "tp": 2}, schedule="dualpipev", chunks=2, microbatches=4, batch=8,
           sequence_parallel=True),
    config({"pp": 2, "sp": 2}, schedule="dualpipev", chunks=2, microbatches=5, batch=5, sp_method="ulysses"),
]


@st.composite
def zb_configs(draw: st.DrawFn, world: int) -> dict:
    """One HybridGPT run on ``world`` (4 or 8) ranks: pp = 2, tp or sp of 2 (or 4), dp the rest, a
    zero-bubble schedule, Megatron-SP on or off, any sequence-parallel method, DDP or ZeRO-1."""
    inner = draw(st.sampled_from(["tp", "sp"]))
    k = draw(st.sampled_from([2, 4] if world == 8 else [2]))
    degrees = {"pp": 2, "dp": world // (2 * k), inner: k}
    schedule = draw(st.sampled_from(["zb-h1", "zb-h2", "zb-v", "dualpipev"]))
    chunks = 2 if schedule in ("zb-v", "dualpipev") else 1
    m = draw(st.integers(4, 5) if schedule == "dualpipev" else st.integers(1, 3))  # DualPipeV: m >= 2p
    heads = k * draw(st.integers(1, 2))
    method = draw(st.sampled_from(["ulysses", "ring"] + (["hybrid"] if k == 4 else []))) if inner == "sp" else "ulysses"
    return config(degrees, vocab=k * draw(st.integers(3, 5)), seq=2 * k, d=heads * draw(st.sampled_from([2, 4])),
                  heads=heads, layers=2 * chunks + draw(st.integers(0, 1)), batch=degrees["dp"] * m * draw(
                      st.integers(1, 2)), schedule=schedule, microbatches=m, chunks=chunks,
                  sequence_parallel=inner == "tp" and draw(st.booleans()), sp_method=method,
                  ulysses=2 if method == "hybrid" else None, zero_stage=draw(st.sampled_from([0, 1])),
                  seed=draw(st.integers(0, 2**16)), zigzag=method == "ring" and draw(st.booleans()))


def check_w(c: dict, path: str) -> None:
    """Per rank: bytes sent inside W spans equal ``w_regather_bytes`` (all-gathers only); every
    re-gather mark is inside a W span, or a B span (DualPipeV's full backwards), never in I."""
    events, layout = trace.load(path).events, layout_of(c)
    for r in range(MeshShape(**c["degrees"]).size):
        mine = [e for e in events if e.rank == r]

        def inside(e: trace.Event, names: str, mine: list = mine) -> bool:
            return any(s.kind == "compute" and s.name in names and s.t0 <= e.t0 <= s.t1 for s in mine)

        sent = [e for e in mine if e.kind == "comm" and e.src == r and inside(e, "W")]
        assert sum(e.nbytes for e in sent) == STEPS * w_regather_bytes(layout, r), r
        assert {e.op for e in sent} <= {"allgather"}, r
        marks = [e for e in mine if e.kind == "mark" and e.name == "re-gather"]
        assert all(inside(e, "WB") for e in marks), r
        assert bool(marks) == (layout.sequence_parallel and layout.tp > 1), r


def check(c: dict, results: list[dict], path: str) -> None:
    check_hybrid(c, results, path)
    check_w(c, path)


@budget(10)
@given(c=st.sampled_from([4, 8]).flatmap(zb_configs))
@example(c=EXAMPLES[0])
@example(c=EXAMPLES[1])
@example(c=EXAMPLES[2])
@example(c=EXAMPLES[3])
@example(c=EXAMPLES[4])
@example(c=EXAMPLES[5])
@example(c=EXAMPLES[6])
def test_zero_bubble_with_tp_and_sp_equals_single_process_threads(c: dict, tmp_path_factory) -> None:
    path = str(tmp_path_factory.mktemp("zb") / "t.json")
    check(c, run(hybrid_run, MeshShape(**c["degrees"]).size, "threads", comm_timeout=60, c=c, path=path), path)


@pytest.mark.mpi
@pytest.mark.mpi8
@budget(1)
@given(drawn=st.lists(zb_configs(8), min_size=1, max_size=1))
def test_zero_bubble_pp2_tp2_dp2_mpiexec(drawn: list[dict], tmp_path_factory) -> None:
    tmp = str(tmp_path_factory.mktemp("zb8"))
    cs = [*EXAMPLES[:3], EXAMPLES[5], *drawn]
    jobs = [{"c": c, "path": os.path.join(tmp, f"t{i}.json")} for i, c in enumerate(cs)]
    for job, results in zip(jobs, run_each(hybrid_run, 8, jobs, timeout=300, comm_timeout=60), strict=True):
        check(job["c"], results, job["path"])


def test_w_regather_bytes_by_hand() -> None:
    """EXAMPLES[2] (Megatron-SP, ZB-H2, m = 3, b = 6 / (2 x 3) = 1): each re-gather sends one shard of
    S/t b d e = 4 x 1 x 16 x 8 = 512 bytes; pp rank 0 holds the embedding and 2 blocks (4 re-gathers
    per micro-batch), pp rank 1 2 blocks and the head (5); without Megatron-SP or zero bubble, none."""
    layout = layout_of(EXAMPLES[2])
    assert [w_regather_bytes(layout, r) for r in range(8)] == [3 * 4 * 512] * 4 + [3 * 5 * 512] * 4
    assert w_regather_bytes(layout_of({**EXAMPLES[2], "schedule": "1f1b"}), 0) == 0
    # DualPipeV, p = 2, m = 4, b = 1: stages 0 | 1 | 2 | 3 on pp ranks 0 1 1 0 hold embedding + block |
    # block | block | block + head and split 2 | 1 | 1 | 1 backwards: pp rank 0 2 x 2 + 1 x 3 re-gathers,
    # pp rank 1 1 x 2 + 1 x 2, each of 512 bytes
    assert [w_regather_bytes(layout_of(EXAMPLES[5]), r) for r in (0, 4)] == [7 * 512, 4 * 512]
    assert w_regather_bytes(layout_of(EXAMPLES[0]), 0) == 0


@pytest.mark.parametrize("p", range(1, 7))
def test_split_backwards_counts_the_schedules_w_actions(p: int) -> None:
    """``split_backwards`` (a formula per schedule) equals the W actions of each stage in the schedule
    the runtime runs, for every stage and several m."""
    for kind in ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"):
        for m in range(2 * p, 2 * p + 3):
            sched = make_schedule(kind, p, m)
            ws = [sum(a.op == "W" and a.stage == s for acts in sched.values() for a in acts)
                  for s in range(sched.virtual_stages)]
            assert [split_backwards(kind, p, m, s) for s in range(sched.virtual_stages)] == ws, (kind, m)


# ---- one layer: I then W -----------------------------------------------------------------------------
def layer_run(comm, kind: str, sp: bool, path: str) -> dict:
    """One parallel linear's backward split in I and W on ``comm`` (t ranks), against one backward."""
    rng = np.random.default_rng(comm.rank)
    t, d = comm.size, 8
    x = rng.normal(size=(4 // t if sp else 4, 2, d)) if kind != "row" else rng.normal(size=(4, 2, d // t))
    gy = rng.normal(size=(4 // t if sp else 4, 2, d) if kind == "row" else (4, 2, d // t))
    if kind == "ulysses":
        x, gy = rng.normal(size=(2, 4 // t, d)), rng.normal(size=(2, 4, d // t))
    if kind == "ulysses":  # every rank holds the whole projection
        lin: nn.Module = nn.Linear(d, d)
    else:
        lin = (RowParallelLinear if kind == "row" else ColumnParallelLinear)(d, d, comm, sequence_parallel=sp)
    lin.init_parameters(5)

    def forward(inp: Tensor) -> Tensor:
        if kind == "ulysses":
            return linear_seq_to_heads.apply(inp, lin.weight, lin.bias, comm)
        return lin(inp)

    inp = Tensor(x, requires_grad=True)
    forward(inp).backward(gy)
    want = [inp.grad, lin.weight.grad, lin.bias.grad]
    lin.zero_grad()
    inp = Tensor(x, requires_grad=True)
    later = WeightGradients(lin.parameters())
    out = forward(inp)
    with trace.record(path, comm=comm):
        with trace.span("I"):
            out.backward(gy, weights=later)
        kept = later.nbytes()
        with trace.span("W"):
            later.run()
    return {"want": want, "got": [inp.grad, lin.weight.grad, lin.bias.grad], "kept": kept, "x": x.nbytes,
            "gy": gy.nbytes}


@pytest.mark.parametrize(("kind", "sp", "t"), [("column", False, 2), ("column", True, 2), ("row", False, 2),
                                              ("row", True, 4), ("column", True, 4), ("ulysses", False, 2)])
def test_layer_i_then_w_sends_each_collective_once(kind: str, sp: bool, t: int, tmp_path) -> None:
    path = str(tmp_path / "t.json")
    results = run(layer_run, t, "threads", comm_timeout=60, kind=kind, sp=sp, path=path)
    events = trace.load(path).events
    for r, res in enumerate(results):
        for got, want in zip(res["got"], res["want"], strict=True):
            np.testing.assert_array_equal(got, want)  # the same products summed in the same order
        ops = {span: sorted({e.op for e in events if e.rank == r and e.kind == "comm" and e.src == r and any(
            s.t0 <= e.t0 <= s.t1 for s in events if s.rank == r and s.name == span and s.kind == "compute")})
            for span in ("I", "W")}
        gathered = t * res["gy"]  # the row-parallel / Ulysses gradient as W reads it: every position
        if kind == "column":  # I: f's all-reduce or the reduce-scatter; W: the re-gather (SP) or nothing
            assert ops == {"I": ["reduce_scatter" if sp else "allreduce"], "W": ["allgather"] if sp else []}
            assert res["kept"] == res["x"] + res["gy"]  # the input's shard, not the gathered input
        elif kind == "row":  # I: g-bar's all-gather of the gradient (SP), kept for W, which sends nothing
            assert ops == {"I": ["allgather"] if sp else [], "W": []}
            assert res["kept"] == res["x"] + res["gy"] + (gathered if sp else 0)
        else:  # Ulysses: I brings the gradient back by an all-to-all and keeps it for W
            assert ops == {"I": ["all_to_all"], "W": []}
            assert res["kept"] == res["x"] + res["gy"] + res["gy"]
