"""bf16 tensor x data parallelism (``HybridGPT`` with ``dtype=bfloat16``, ``zero_stage=0``): the dp
average of the gradients in ``reduce_dtype`` "bf16" or "fp32", fp32 masters (``MasterAdamW``).

Against the same model on the tp ranks alone (dp = 1) running the recipe by hand: each replica's half
of the batch forward and backward, its bf16 gradients cast to the reduce dtype, the two added and
halved in it (a 2-rank ring adds the same two terms: equal bit for bit), one MasterAdamW step. Losses,
reduced gradients and updated bf16 parameters are equal bit for bit. Bytes per rank: the tp traffic of
``cost.tensor.expected_bytes(itemsize=2, loss_itemsize=4)`` on the replica's rows, plus the dp
all-reduce of this rank's P parameters, 2 (dp-1)/dp P w, with w = 2 or 4 as the reduce dtype says.
Bad recipes are refused in one line on every rank, before any message.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs

from minipar import launch, trace
from minipar.autograd import BF16
from minipar.cost import tensor as formulas
from minipar.mesh import DeviceMesh
from minipar.parallel.hybrid import HybridGPT
from minipar.testing import run_each
from viz.analysis import sent_by_op

WIRE = {"bf16": BF16, "fp32": np.dtype(np.float32)}


def config(reduce: str, sp: bool, batch: int = 4, seed: int = 1) -> dict:
    return {"reduce": reduce, "sp": sp, "vocab": 8, "seq": 4, "d": 8, "heads": 2, "ff": 12, "layers": 2,
            "batch": batch, "seed": seed}


@st.composite
def configs(draw: st.DrawFn, world: int = 4) -> dict:
    return {"reduce": draw(st.sampled_from(list(WIRE))), "sp": draw(st.booleans()),
            "vocab": 2 * draw(st.integers(1, 4)), "seq": 2 * draw(st.integers(1, 2)), "d": 4 * draw(st.integers(1, 2)),
            "heads": 2, "ff": 2 * draw(st.integers(1, 3)), "layers": draw(st.integers(1, 2)),
            "batch": 2 * draw(st.integers(1, 2)), "seed": draw(st.integers(0, 2**16))}


def build(comm, c: dict, dp: int) -> HybridGPT:
    return HybridGPT(DeviceMesh(comm, dp=dp, tp=2), c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"],
                     sequence_parallel=c["sp"], dtype=BF16, reduce_dtype=c["reduce"], seed=c["seed"], lr=1e-2,
                     weight_decay=0.1)


def tokens(c: dict) -> np.ndarray:
    return np.random.default_rng(c["seed"]).integers(0, c["vocab"], (2, c["batch"], c["seq"]))


def as32(d: dict) -> dict:
    return {k: v.astype(np.float32) for k, v in d.items()}


def one_step(model: HybridGPT, c: dict) -> dict:
    """One step of ``model`` on ``tokens(c)``: the loss, reduced gradients, parameters after it, bytes sent."""
    idx, tgt = tokens(c)
    with trace.recording(model.mesh.comm.rank) as rec:
        loss = model.forward_backward(idx, tgt)
    grads = as32(model.full_grads())
    model.optimizer_step()
    return {"loss": loss, "grads": grads, "final": as32(model.full_state_dict()), "events": rec.events}


def hybrid_run(comm, c: dict) -> dict:
    """tp 2 x dp 2: one step; the loss, reduced gradients, parameters after it, bytes sent, P on this rank."""
    model = build(comm, c, 2)
    got = one_step(model, c)
    return got | {"sent": {k: v for k, v in sent_by_op(got.pop("events"), comm.rank).items() if v},
                  "params": sum(p.size for p in model.module.parameters())}


def by_hand(model: HybridGPT, c: dict, wire: np.dtype) -> dict:
    """``model`` (dp = 1) runs the two replicas' halves of ``tokens(c)``; their gradients are cast to
    ``wire``, added and halved (as a 2-rank ring all-reduce and the division do), then one step."""
    idx, tgt = tokens(c)
    params = list(model.module.parameters())
    losses, terms = [], []
    for rows in np.split(np.arange(c["batch"]), 2):
        losses.append(model.forward_backward(idx[rows], tgt[rows]))
        terms.append([p.grad.astype(wire) for p in params])
        model.optimizer.zero_grad()
    for p, (a, b) in zip(params, zip(*terms, strict=True), strict=True):
        total = a + b
        total /= 2
        p.grad = total
    grads = as32(model.full_grads())
    model.optimizer_step()
    return {"loss": float(np.mean(losses)), "grads": grads, "final": as32(model.full_state_dict())}


def reference_run(comm, c: dict) -> dict:
    """tp 2 alone: the two replicas' halves by hand, their gradients averaged in the reduce dtype."""
    return by_hand(build(comm, c, 1), c, WIRE[c["reduce"]])


def check(c: dict, results: list[dict]) -> None:
    want = launch(reference_run, 2, c=c)[0]
    w = WIRE[c["reduce"]].itemsize
    tp = formulas.expected_bytes(2, c["batch"] // 2, c["seq"], c["d"], c["layers"], 2, c["sp"], c["seq"],
                                 loss_itemsize=4)
    for got in results:
        assert got["loss"] == want["loss"]
        for k in want["grads"]:
            assert np.array_equal(got["grads"][k], want["grads"][k]), k
            assert np.array_equal(got["final"][k], want["final"][k]), k
        expect = dict(tp)
        expect["allreduce"] = expect.get("allreduce", 0) + got["params"] * w  # 2 (dp-1)/dp P w, dp = 2
        assert got["sent"] == expect


@budget(3)
@given(c=configs())
@example(c=config("bf16", True))
@example(c=config("fp32", False))
def test_bf16_hybrid_equals_by_hand_threads(c: dict) -> None:
    check(c, launch(hybrid_run, 4, c=c))


@pytest.mark.mpi
@budget(1)
@given(job=mpi_jobs(configs, worlds=(4, 4), min_size=1, max_size=1))
@example(job=(4, [config("bf16", False), config("fp32", True)]))
def test_bf16_hybrid_equals_by_hand_mpiexec(job: tuple[int, list[dict]]) -> None:
    n, cs = job
    for c, results in zip(cs, run_each(hybrid_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check(c, results)


BAD = [({"dtype": np.float64, "reduce_dtype": "fp32"}, "reduce_dtype='fp32' is for precision='bf16'"),
       ({"dtype": BF16, "reduce_dtype": "e4m3"}, "reduce_dtype='e4m3' cannot hold a gradient sum's range"),
       ({"dtype": BF16, "reduce_dtype": "fp16"}, "reduces a bf16 model's gradients in 'bf16' or 'fp32'"),
       ({"dtype": BF16, "zero_stage": 1}, "zero_stage=1 trains in float64 here")]


def bad_run(comm) -> list[str]:
    out = []
    with trace.recording(comm.rank) as rec:
        for kw in (k for k, _ in BAD):
            try:
                HybridGPT(DeviceMesh(comm, dp=2, tp=2), 8, 4, 8, 2, 2, 12, **kw)
            except ValueError as exc:
                out.append(str(exc))
    assert not [e for e in rec.events if e.kind == "comm"]
    return out


def test_bad_bf16_recipes_refused_on_every_rank() -> None:
    results = launch(bad_run, 4)
    assert all(r == results[0] for r in results)
    for msg, (_, want) in zip(results[0], BAD, strict=True):
        assert want in msg and "\n" not in msg, msg
