"""bf16 pipeline x data and pipeline x tensor parallelism: ``HybridGPT(dtype=bfloat16)`` on pp 2 x dp 2
and pp 2 x tp 2 equals the same recipe without the pipeline bit for bit: the model on the tp ranks
alone (one process for pp x dp), each replica's half of the batch cut in the same m micro-batches
(each loss x 1/m, bf16 gradients accumulated in micro-batch order, as every stage accumulates them),
the two replicas' gradients cast to the reduce dtype, added and halved by hand (a 2-rank ring adds
the same two terms), one ``MasterAdamW`` step. The order of every sum is the same, so no bound is
needed: losses, reduced gradients and the bf16 parameters after the step are equal.

Bytes per rank: every stage boundary message is one micro-batch's activation or gradient in bf16
(``2 b s d`` bytes), a rank's total ``cost.pipeline.send_bytes``; the dp all-reduce of this rank's
``P`` parameters is ``cost.collectives.allreduce_bytes(P, w)``, w = 2 or 4 as the reduce dtype says.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs
from test_bf16_hybrid import WIRE, by_hand, one_step

from minipar import launch
from minipar.autograd import BF16
from minipar.cost.collectives import allreduce_bytes
from minipar.cost.pipeline import send_bytes
from minipar.mesh import DeviceMesh
from minipar.parallel.hybrid import HybridGPT
from minipar.testing import run_each
from viz.analysis import sent_by_op


def config(other: str, schedule: str = "1f1b", m: int = 2, reduce: str = "bf16", layers: int = 2,
           seed: int = 1) -> dict:
    return {"other": other, "schedule": schedule, "m": m, "reduce": reduce, "vocab": 8, "seq": 4, "d": 8,
            "heads": 2, "ff": 12, "layers": layers, "batch": 2 * m, "seed": seed}


@st.composite
def configs(draw: st.DrawFn, world: int = 4) -> dict:
    m = draw(st.integers(1, 3))
    return {"other": draw(st.sampled_from(["dp", "tp"])), "schedule": draw(st.sampled_from(["1f1b", "gpipe"])),
            "m": m, "reduce": draw(st.sampled_from(list(WIRE))), "vocab": 2 * draw(st.integers(1, 4)),
            "seq": 2 * draw(st.integers(1, 2)), "d": 4 * draw(st.integers(1, 2)), "heads": 2,
            "ff": 2 * draw(st.integers(1, 3)), "layers": draw(st.integers(2, 3)),
            "batch": 2 * m * draw(st.integers(1, 2)), "seed": draw(st.integers(0, 2**16))}


def build(comm, c: dict, pp: int) -> HybridGPT:
    """pp x (dp or tp) 2; ``pp = 1``: the reference, the tp ranks alone (dp = 1)."""
    mesh = DeviceMesh(comm, pp=pp, **{c["other"]: 2}) if pp > 1 else DeviceMesh(comm, tp=comm.size)
    return HybridGPT(mesh, c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"], schedule=c["schedule"],
                     microbatches=c["m"], dtype=BF16, reduce_dtype=c["reduce"] if c["other"] == "dp" else None,
                     seed=c["seed"], lr=1e-2, weight_decay=0.1)


def hybrid_run(comm, c: dict) -> dict:
    model = build(comm, c, 2)
    got = one_step(model, c)
    events = got.pop("events")
    return got | {"sends": [e.nbytes for e in events if e.kind == "comm" and e.op == "send" and e.src == comm.rank],
                  "sent": sent_by_op(events, comm.rank), "params": sum(p.size for p in model.module.parameters()),
                  "coords": dict(model.mesh.coords)}


def reference_run(comm, c: dict) -> dict:
    """No pipeline: pp x dp the replicas' halves by hand in the reduce dtype; pp x tp the tp ranks' step."""
    model = build(comm, c, 1)
    return one_step(model, c) if c["other"] == "tp" else by_hand(model, c, WIRE[c["reduce"]])


def check(c: dict, results: list[dict]) -> None:
    want = launch(reference_run, 2 if c["other"] == "tp" else 1, c=c)[0]
    boundary = 2 * (c["batch"] // (2 if c["other"] == "dp" else 1) // c["m"]) * c["seq"] * c["d"]
    w = WIRE[c["reduce"]].itemsize
    for got in results:
        assert got["loss"] == want["loss"]
        assert sorted(got["grads"]) == sorted(want["grads"])
        for k in want["grads"]:
            assert np.array_equal(got["grads"][k], want["grads"][k]), k
            assert np.array_equal(got["final"][k], want["final"][k]), k
        assert got["sends"] and all(n == boundary for n in got["sends"])  # bf16 on every boundary
        assert sum(got["sends"]) == send_bytes([0, 1], c["m"], boundary)[got["coords"]["pp"]]
        if c["other"] == "dp":
            assert got["sent"]["allreduce"] == allreduce_bytes(got["params"], w, 2, got["coords"]["dp"], "ring")


@budget(3)
@given(c=configs())
@example(c=config("dp"))
@example(c=config("dp", "gpipe", m=3, reduce="fp32", layers=3))
@example(c=config("tp"))
def test_bf16_pipeline_hybrid_equals_no_pipeline_threads(c: dict) -> None:
    check(c, launch(hybrid_run, 4, c=c))


@pytest.mark.mpi
@budget(1)
@given(job=mpi_jobs(configs, worlds=(4, 4), min_size=1, max_size=1))
@example(job=(4, [config("dp", reduce="fp32"), config("tp", "gpipe", m=3)]))
def test_bf16_pipeline_hybrid_equals_no_pipeline_mpiexec(job: tuple[int, list[dict]]) -> None:
    n, cs = job
    for c, results in zip(cs, run_each(hybrid_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check(c, results)
