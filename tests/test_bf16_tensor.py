"""bf16 tensor parallelism: Megatron's f / g all-reduces and sequence parallelism's all-gathers and
reduce-scatters carry a bfloat16 model's values as bfloat16, 2 bytes an element
(``minipar.parallel.tensor.comm_ops``).

Against one process running the same recipe by hand: every rank's GEMM on its own operands (fp32
sums of bf16 products), the partial sums a collective adds rounded to bf16 and added in bf16
(``ml_dtypes``: float32 add, round). What no rank sums across ranks (column-parallel outputs and
weight gradients, row-parallel input and weight gradients, everything gathered) is equal bit for bit
for any t. The two cross-rank sums (the row-parallel output, the column-parallel input gradient) are
equal bit for bit on t = 2 (the ring adds the same two terms) and, on t = 4 (the ring adds in
another order than the reference), within two recursive sums' bound (Higham 2002, Sec. 4.2: each is
within gamma_{t-1} sum |p_r| of the exact sum, gamma_k = k u / (1 - k u), u = 2^-8); the row-parallel
output's bias add then rounds once more in float32 and once in bf16, each at most u |value| away.

Bytes: a bf16 GPT step sends, per rank and collective, ``cost.tensor.expected_bytes(itemsize=2,
loss_itemsize=4)``, and (independently) half the fp32 model's bytes except the vocabulary-parallel
loss's three all-reduces, which stay float32 (Megatron's cross entropy in fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs

from minipar import launch, trace
from minipar.autograd import BF16, bf16_round
from minipar.cost import tensor as formulas
from minipar.parallel.bf16 import from_wire
from minipar.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TensorParallelGPT
from minipar.testing import run_each
from viz.analysis import sent_by_op

U = 2.0**-8  # bfloat16's unit roundoff
U32 = 2.0**-24


def config(t: int, sp: bool, k: int = 2, seed: int = 5) -> dict:
    return {"t": t, "sp": sp, "seq": t * k, "batch": 2, "d": 2 * t, "ff": 3 * t, "vocab": 2 * t, "heads": t,
            "seed": seed}


@st.composite
def configs(draw: st.DrawFn, t: int | None = None) -> dict:
    t = draw(st.sampled_from([2, 4])) if t is None else t
    return {"t": t, "sp": draw(st.booleans()), "seq": t * draw(st.integers(1, 2)), "batch": draw(st.integers(1, 2)),
            "d": t * draw(st.integers(1, 2)), "ff": t * draw(st.integers(1, 3)), "vocab": t * draw(st.integers(1, 2)),
            "heads": t, "seed": draw(st.integers(0, 2**16))}


def data(c: dict) -> dict[str, np.ndarray]:
    """bf16 values (float32 arrays): inputs, weights, biases and output gradients of both linears."""
    rng = np.random.default_rng(c["seed"])
    s, b, d, ff = c["seq"], c["batch"], c["d"], c["ff"]
    shapes = {"X": (s, b, d), "Wc": (d, ff), "bc": (ff,), "dYc": (s, b, ff),
              "Z": (s, b, ff), "Wr": (ff, d), "br": (d,), "dYr": (s, b, d)}
    return {k: bf16_round(rng.normal(size=shape)) for k, shape in shapes.items()}


def cut(c: dict, r: int) -> tuple[slice, slice]:
    """Rank r's sequence rows (everything without SP) and its slice of ff."""
    k, m = c["seq"] // c["t"], c["ff"] // c["t"]
    return (slice(r * k, (r + 1) * k) if c["sp"] else slice(None)), slice(r * m, (r + 1) * m)


def own(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a)


def layers_run(comm, c: dict) -> dict:
    """Both linears on this rank's part of ``data(c)``: outputs, gradients, bytes sent by op."""
    a, (rows, mine) = data(c), cut(c, comm.rank)
    with trace.recording(comm.rank) as rec:
        col = ColumnParallelLinear(c["d"], c["ff"], comm, sequence_parallel=c["sp"], dtype=BF16)
        col.weight.data[...], col.bias.data[...] = a["Wc"][:, mine], a["bc"][mine]
        x = from_wire(own(a["X"][rows]).astype(BF16))
        y = col(x)
        y.backward(own(a["dYc"][..., mine]))
        row = RowParallelLinear(c["ff"], c["d"], comm, sequence_parallel=c["sp"], dtype=BF16)
        row.weight.data[...], row.bias.data[...] = a["Wr"][mine], a["br"]
        z = from_wire(own(a["Z"][..., mine]).astype(BF16))
        yr = row(z)
        yr.backward(own(a["dYr"][rows]))
    return {"col": (y.data, x.grad, col.weight.grad.astype(np.float32)), "row": (yr.data, z.grad,
            row.weight.grad.astype(np.float32)), "sent": sent_by_op(rec.events, comm.rank)}


def ring_sum(parts: list[np.ndarray]) -> np.ndarray:
    total = parts[0].astype(BF16)
    for p in parts[1:]:
        total = total + p.astype(BF16)
    return total.astype(np.float32)


def check_layers(c: dict, results: list[dict]) -> None:
    a, t = data(c), c["t"]
    gamma = (t - 1) * U / (1 - (t - 1) * U)
    X = a["X"].reshape(-1, c["d"])
    ws = [own(a["Wc"][:, cut(c, r)[1]]).astype(BF16) for r in range(t)]
    dx_parts = [bf16_round(own(a["dYc"][..., cut(c, r)[1]]) @ ws[r].T) for r in range(t)]
    dx, dx_mass = ring_sum(dx_parts), sum(np.abs(p) for p in dx_parts)
    zs = [own(a["Z"][..., cut(c, r)[1]]) for r in range(t)]
    wr = [own(a["Wr"][cut(c, r)[1]]).astype(BF16) for r in range(t)]
    partials = [bf16_round(z @ w) for z, w in zip(zs, wr, strict=True)]
    s, mass = ring_sum(partials), sum(np.abs(p) for p in partials)
    yr = bf16_round(s + a["br"].astype(BF16))
    for r, got in enumerate(results):
        rows, mine = cut(c, r)
        y, gx, gw = got["col"]  # column parallel: nothing summed across ranks but dX
        assert np.array_equal(y, bf16_round(a["X"] @ ws[r] + a["bc"][mine].astype(BF16)))
        assert np.array_equal(gw, bf16_round(X.T @ own(a["dYc"][..., mine]).reshape(-1, mine.stop - mine.start)))
        y, gz, gw = got["row"]  # row parallel: nothing summed across ranks but Y
        dy = a["dYr"]
        assert np.array_equal(gz, bf16_round(dy @ wr[r].T))
        assert np.array_equal(gw, bf16_round(zs[r].reshape(-1, zs[r].shape[-1]).T @ dy.reshape(-1, c["d"])))
        if t == 2:  # the ring adds the reference's two terms
            assert np.array_equal(gx, dx[rows]) and np.array_equal(y, yr[rows])
        else:
            d = 2 * gamma * dx_mass[rows]
            assert (np.abs(gx - dx[rows]) <= d).all()
            d = 2 * gamma * mass[rows]
            assert (np.abs(y - yr[rows]) <= d + 2 * (U + U32) * (np.abs(s[rows]) + np.abs(a["br"]) + d)).all()
        n = c["seq"] * c["batch"] * c["d"] * 2  # bytes of one activation, bf16
        share = (t - 1) * n // t
        want = ({"allgather": 3 * share, "reduce_scatter": 2 * share} if c["sp"]  # col: gather, re-gather, dX;
                else {"allreduce": 4 * share})  # row: Y, dY's gather / f's dX and g's Y all-reduces
        assert {k: v for k, v in got["sent"].items() if v} == want


@budget(6)
@given(c=configs())
@example(c=config(2, False))
@example(c=config(2, True))
@example(c=config(4, False))
@example(c=config(4, True, k=1))
def test_bf16_linears_equal_one_process_threads(c: dict) -> None:
    check_layers(c, launch(layers_run, c["t"], c=c))


def gpt_bytes(comm, c: dict, dtype: np.dtype) -> dict:
    m = TensorParallelGPT(c["vocab"], c["seq"], c["d"], c["heads"], 2, comm, d_ff=c["ff"], sequence_parallel=c["sp"],
                          seed=c["seed"], dtype=dtype)
    idx, tgt = np.random.default_rng(c["seed"]).integers(0, c["vocab"], (2, c["batch"], c["seq"]))
    with trace.recording(comm.rank) as rec:
        loss = m.loss(idx, tgt)
        loss.backward()
        m.sync_grads()
    return {k: v for k, v in sent_by_op(rec.events, comm.rank).items() if v}


def gpt_run(comm, c: dict) -> dict:
    return {"bf16": gpt_bytes(comm, c, BF16), "fp32": gpt_bytes(comm, c, np.dtype(np.float32))}


def check_gpt(c: dict, results: list[dict]) -> None:
    t, s, b = c["t"], c["seq"], c["batch"]
    want = formulas.expected_bytes(t, b, s, c["d"], 2, 2, c["sp"], s, loss_itemsize=4)
    loss = 3 * 2 * (t - 1) * s * b * 4 // t  # max, sum of exponentials, target logit: float32 either way
    for got in results:
        assert got["bf16"] == want
        half = {k: v // 2 for k, v in got["fp32"].items()}
        half["allreduce"] += loss // 2
        assert got["bf16"] == half


@budget(3)
@given(c=configs())
@example(c=config(2, True))
@example(c=config(4, False, k=1))
def test_bf16_gpt_bytes_threads(c: dict) -> None:
    check_gpt(c, launch(gpt_run, c["t"], c=c))


def both_run(comm, c: dict) -> tuple[dict, dict]:
    return layers_run(comm, c), gpt_run(comm, c)


@pytest.mark.mpi
@budget(1)
@given(job=mpi_jobs(configs, worlds=(2, 2), min_size=1, max_size=2))
@example(job=(2, [config(2, True), config(2, False)]))
@example(job=(4, [config(4, True, k=1), config(4, False)]))
def test_bf16_tensor_parallel_mpiexec(job: tuple[int, list[dict]]) -> None:
    n, cs = job
    for c, results in zip(cs, run_each(both_run, n, [{"c": c} for c in cs], timeout=90, comm_timeout=30)):
        check_layers(c, [r[0] for r in results])
        check_gpt(c, [r[1] for r in results])
