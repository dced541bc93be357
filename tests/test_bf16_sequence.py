"""bf16 sequence parallelism: a bfloat16 ``SequenceParallelGPT`` sends its Ulysses all-to-alls and
Ring Attention's K/V blocks as bfloat16, 2 bytes an element (``minipar.parallel.sequence.comm_ops``).

Exact: every value sent is bf16 already (or, projected and sent in one op, rounded before the
all-to-all instead of after it, the same as an all-to-all only moves elements), so a step equals the
same bf16 model carrying those values as float32 bit for bit: loss and every averaged gradient. The
dK/dV accumulators are float32 partial sums and stay float32 (as ring-flash-attention sends them).

Bytes per rank and op: ``cost.sequence.step_bytes_by_op(itemsize=2, accumulator_itemsize=4)``, and
(independently) half the float32 model's measured bytes for the all-to-alls, the K/V blocks and the
gradient all-reduce, the same bytes for the dK/dV accumulators.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs

from minipar import launch, trace
from minipar.autograd import BF16
from minipar.cost import sequence as formulas
from minipar.parallel.sequence import SequenceParallelGPT, comm_ops
from minipar.testing import run_each
from viz.analysis import sent_by_op

TO_WIRE = comm_ops.to_wire  # the bf16 wire; fp32_wire() swaps it for the identity
FP32 = np.dtype(np.float32)


def config(method: str, p: int, zigzag: bool = True, layers: int = 1, seed: int = 3) -> dict:
    pu = {"ulysses": p, "ring": 1, "hybrid": 2}[method]
    return {"method": method, "p": p, "pu": pu, "zigzag": zigzag and method != "ulysses", "layers": layers,
            "batch": 2, "seq": 2 * p, "heads": pu, "d_head": 2, "vocab": 8, "seed": seed}


@st.composite
def configs(draw: st.DrawFn, p: int | None = None) -> dict:
    p = draw(st.sampled_from([2, 4])) if p is None else p
    method = draw(st.sampled_from(["ulysses", "ring", "hybrid"] if p == 4 else ["ulysses", "ring"]))
    pu = {"ulysses": p, "ring": 1, "hybrid": 2}[method]
    return {"method": method, "p": p, "pu": pu, "zigzag": method != "ulysses" and draw(st.booleans()),
            "layers": draw(st.integers(1, 2)), "batch": draw(st.integers(1, 2)), "seq": 2 * p * draw(st.integers(1, 2)),
            "heads": pu * draw(st.integers(1, 2)), "d_head": draw(st.integers(1, 3)), "vocab": 8,
            "seed": draw(st.integers(0, 2**16))}


def step(comm, c: dict, dtype: np.dtype) -> dict:
    """One training step's loss, averaged gradients (float32) and bytes sent by op."""
    kw = {"ulysses": c["pu"]} if c["method"] == "hybrid" else {}
    m = SequenceParallelGPT(c["vocab"], c["seq"], c["heads"] * c["d_head"], c["heads"], c["layers"], comm,
                            method=c["method"], zigzag=c["zigzag"], seed=c["seed"], dtype=dtype, **kw)
    idx, tgt = np.random.default_rng(c["seed"]).integers(0, c["vocab"], (2, c["batch"], c["seq"]))
    with trace.recording(comm.rank) as rec:
        loss = m.loss(m.shard(idx), m.shard(tgt))
        loss.backward()
        m.sync_grads()
    return {"loss": loss.data.astype(FP32), "grads": [p.grad.astype(FP32) for p in m.parameters()],
            "n_params": sum(p.size for p in m.parameters()),
            "sent": {k: v for k, v in sent_by_op(rec.events, comm.rank).items() if v}}


def fp32_wire(comm, c: dict) -> dict:
    """The bf16 model's step with its sequence-parallel messages carried as float32. Every rank
    swaps the module's ``to_wire`` between barriers (threads share the module)."""
    comm.barrier()
    comm_ops.to_wire = lambda a, bf16: a
    try:
        return step(comm, c, BF16)
    finally:
        comm.barrier()
        comm_ops.to_wire = TO_WIRE


def run(comm, c: dict) -> dict:
    return {"bf16": step(comm, c, BF16), "fp32 wire": fp32_wire(comm, c), "fp32": step(comm, c, FP32)}


def expected(c: dict, n_params: int, rank: int, itemsize: int, accumulator_itemsize: int | None = None) -> dict:
    """``rank``'s bytes by op from ``cost.sequence`` (``step_bytes_by_op`` gives rank 0's all-reduce:
    the ring's chunks differ by rank when P does not divide the gradient's length)."""
    pu = c["pu"] if c["method"] == "hybrid" else None
    want = formulas.step_bytes_by_op(c["method"], c["batch"], c["seq"], c["heads"] * c["d_head"], c["layers"],
                                     c["p"], n_params, pu, itemsize, accumulator_itemsize)
    return want | {"allreduce": formulas.grad_sync_bytes(n_params, c["p"], itemsize, rank)}


def check(c: dict, results: list[dict]) -> None:
    for rank, got in enumerate(results):
        bf, wide, fp = got["bf16"], got["fp32 wire"], got["fp32"]
        assert np.array_equal(bf["loss"], wide["loss"])
        assert all(np.array_equal(a, b) for a, b in zip(bf["grads"], wide["grads"], strict=True))
        assert bf["sent"] == expected(c, bf["n_params"], rank, 2, accumulator_itemsize=4)
        assert fp["sent"] == expected(c, fp["n_params"], rank, 4)
        half = {k: v if k == "ring_dkv" else v // 2 for k, v in fp["sent"].items()}
        assert bf["sent"] == half
        assert wide["sent"]["allreduce"] == bf["sent"]["allreduce"]  # the gradients: bf16 either way
        assert {k: v for k, v in wide["sent"].items() if k != "allreduce"} == {
            k: v for k, v in fp["sent"].items() if k != "allreduce"}


@budget(4)
@given(c=configs())
@example(c=config("ulysses", 2))
@example(c=config("ring", 2))
@example(c=config("ring", 4, zigzag=False, layers=2))
@example(c=config("hybrid", 4))
def test_bf16_sequence_parallel_threads(c: dict) -> None:
    check(c, launch(run, c["p"], c=c))


@pytest.mark.mpi
@budget(1)
@given(job=mpi_jobs(configs, worlds=(2, 2), min_size=1, max_size=2))
@example(job=(2, [config("ulysses", 2), config("ring", 2)]))
@example(job=(4, [config("hybrid", 4), config("ring", 4, zigzag=False)]))
def test_bf16_sequence_parallel_mpiexec(job: tuple[int, list[dict]]) -> None:
    n, cs = job
    for c, results in zip(cs, run_each(run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check(c, results)
