"""bf16 mixed precision through the pipeline runtime: a bfloat16 GPT cut into stages, every schedule,
equals one process running the same recipe bit for bit (losses, bf16 parameters after the steps): the
global batch cut in m micro-batches, each loss x 1/m backward, bf16 gradients accumulated in
micro-batch order as every stage accumulates them, ``MasterAdamW`` (fp32 master and moments). Each
stage boundary carries bfloat16 (``minipar.parallel.bf16.to_wire``): every message is one
micro-batch's activation or gradient at 2 bytes an element, and a rank sends what
``minipar.cost.pipeline.send_bytes`` says. Threads (hypothesis + examples) and ``mpiexec``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs

from minipar import datasets, nn, trace
from minipar.autograd import BF16
from minipar.comm import launch
from minipar.parallel.bf16 import MasterAdamW
from minipar.parallel.pipeline import Pipeline
from minipar.parallel.pipeline.partition import gpt
from minipar.testing import run_each

LR, MB, STEPS = 1e-2, 2, 2  # MB samples per micro-batch


def config(kind: str, p: int, m: int, v: int = 1, blocks: int = 2, d: int = 4, heads: int = 2, seq: int = 4,
           seed: int = 3) -> dict:
    return {"kind": kind, "p": p, "m": m, "v": v, "blocks": blocks, "d": d, "heads": heads, "seq": seq,
            "vocab": 7, "seed": seed}


@st.composite
def pipeline_configs(draw: st.DrawFn, p: int | None = None) -> dict:
    p = draw(st.integers(2, 4)) if p is None else p
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    v = 2 if kind == "interleaved" else 1
    m = p * draw(st.integers(1, 2)) if kind == "interleaved" else draw(st.integers(1, 4))
    heads = draw(st.integers(1, 2))
    return config(kind, p, m, v, blocks=max(p * v - 2, 1) + draw(st.integers(0, 1)), d=heads * draw(st.integers(2, 3)),
                  heads=heads, seq=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**16)))


def batches(c: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    stream = datasets.token_stream(200, c["vocab"], seed=c["seed"])
    return [datasets.lm_batch(stream, MB * c["m"], c["seq"], step=k) for k in range(STEPS)]


def pipeline_run(comm, c: dict) -> dict:
    """Losses, the whole model's parameters (rank 0) and the bytes of every message this rank sent."""
    model = gpt(c["vocab"], c["seq"], c["d"], c["heads"], c["blocks"], seed=c["seed"], dtype=BF16)
    pipe = Pipeline(comm, model, c["kind"], microbatches=c["m"], chunks=c["v"])
    opt = MasterAdamW(pipe.parameters(), LR)
    losses = []
    with trace.recording(comm.rank) as rec:
        for x, y in batches(c):
            losses.append(pipe.step(x, y, opt))
            opt.zero_grad()
    sent = [e.nbytes for e in rec.events if e.kind == "comm" and e.op == "send" and e.src == comm.rank]
    boundary = 2 * MB * c["seq"] * c["d"]  # one micro-batch's activation, bf16
    formula = pipe.trace_meta(boundary, steps=STEPS)["expected_bytes_by_rank"]["send"][comm.rank]
    return {"losses": losses, "state": pipe.full_state_dict(), "sent": sent, "formula": formula,
            "boundary": boundary}


def reference(c: dict) -> tuple[list[float], dict[str, np.ndarray]]:
    model = nn.GPT(c["vocab"], c["seq"], c["d"], c["heads"], c["blocks"], seed=c["seed"], dtype=BF16)
    opt, m = MasterAdamW(model.parameters(), LR), c["m"]
    losses = []
    for x, y in batches(c):
        total = 0.0
        for i in range(m):
            loss = model.loss(x[i * MB:(i + 1) * MB], y[i * MB:(i + 1) * MB])
            total += loss.item() / m
            (loss * (1.0 / m)).backward()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def check(c: dict, results: list[dict]) -> None:
    losses, state = reference(c)
    got = results[0]["state"]
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        assert got[name].dtype == BF16 and np.array_equal(got[name], value), name
    for r in results:
        assert r["losses"] == losses
        assert r["sent"] and all(n == r["boundary"] for n in r["sent"])  # bf16 on every boundary
        assert sum(r["sent"]) == r["formula"]


@budget(6)
@given(c=pipeline_configs())
@example(c=config("1f1b", 2, 4))
@example(c=config("interleaved", 2, 4, v=2))
@example(c=config("zb-h1", 3, 3, blocks=1))
@example(c=config("gpipe", 4, 2, blocks=2, d=3, heads=1))
def test_bf16_pipeline_equals_single_process_threads(c: dict) -> None:
    check(c, launch(pipeline_run, c["p"], c=c))


@pytest.mark.mpi
@budget(1)
@given(job=mpi_jobs(pipeline_configs, min_size=1, max_size=2))
@example(job=(2, [config("1f1b", 2, 4), config("zb-h1", 2, 2, blocks=1)]))
def test_bf16_pipeline_equals_single_process_mpiexec(job: tuple[int, list[dict]]) -> None:
    n, cs = job
    for c, results in zip(cs, run_each(pipeline_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check(c, results)
