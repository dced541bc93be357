"""Every hand-written collective equals numpy's reduction of all ranks' inputs (threads backend)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget

from minipar.comm import ALGORITHMS_BY_OP, launch

SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
DTYPES = st.sampled_from(["float64", "float32", "int64"])


def data(seed: int, rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if dtype == "int64":
        return rng.integers(-50, 50, size=shape).astype(np.int64)
    return rng.standard_normal(shape).astype(dtype)


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(inputs)
    if op == "max":
        return np.asarray(stack.max(axis=0))
    total = np.asarray(stack.sum(axis=0, dtype=stack.dtype))
    return np.asarray(total / len(inputs)) if op == "mean" else total


def close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    tol = 1e-5 if a.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def run_reductions(comm, seed, shape, dtype, op):
    x = data(seed, comm.rank, shape, dtype)
    before = x.copy()
    out = {alg: comm.allreduce(x, op=op, algorithm=alg) for alg in ALGORITHMS_BY_OP["allreduce"]}
    out.update({f"rs_{alg}": comm.reduce_scatter(x, op=op, algorithm=alg)
                for alg in ALGORITHMS_BY_OP["reduce_scatter"]})
    out["reduce"] = comm.reduce(x, root=comm.size - 1, op=op)
    assert np.array_equal(x, before), "a collective modified its input"
    return out


@budget(25)
@given(p=st.integers(1, 8), shape=SHAPES, dtype=DTYPES, op=st.sampled_from(["sum", "mean", "max"]),
       seed=st.integers(0, 10**6))
@example(p=5, shape=(7, 3), dtype="float32", op="mean", seed=1)  # p not a power of two, uneven chunks
@example(p=4, shape=(8, 2), dtype="int64", op="max", seed=2)  # axis 0 divisible: blocks of rows
def test_reductions_equal_numpy(p, shape, dtype, op, seed):
    if op == "mean" and dtype == "int64":
        op = "sum"
    check_reductions(launch(run_reductions, p, "threads", seed, shape, dtype, op), seed, shape, dtype, op)


def check_reductions(results, seed, shape, dtype, op):
    """``run_reductions``' results (by rank) equal numpy's reduction of every rank's input."""
    p = len(results)
    want = reference([data(seed, r, shape, dtype) for r in range(p)], op)
    for r, res in enumerate(results):
        for alg in ALGORITHMS_BY_OP["allreduce"]:
            close(res[alg], want)
        if len(shape) >= 1 and shape[0] % p == 0:  # p equal blocks of rows
            mine = np.split(want, p)[r]
        else:  # the flat array cut np.array_split's way: the first size % p chunks one longer
            mine = np.array_split(want.reshape(-1), p)[r]
        for alg in ALGORITHMS_BY_OP["reduce_scatter"]:
            close(res[f"rs_{alg}"], mine)
        if r == p - 1:
            close(res["reduce"], want)
        else:
            assert res["reduce"] is None
    # every rank holds bit-identical all-reduce results (replicas must not drift apart); "native"
    # is the MPI library's business
    for alg in ("ring", "recursive_doubling", "naive"):
        assert all(np.array_equal(res[alg], results[0][alg]) for res in results)


def test_reduce_scatter_chunking_rule():
    def fn(comm):
        return (comm.reduce_scatter(np.arange(12.0).reshape(6, 2)),  # axis 0 divisible by 3
                comm.reduce_scatter(np.arange(10.0)))  # not divisible: array_split of the flat array
    res = launch(fn, 3)
    for r in range(3):
        np.testing.assert_array_equal(res[r][0], 3 * np.arange(12.0).reshape(6, 2)[2 * r:2 * r + 2])
        np.testing.assert_array_equal(res[r][1], 3 * np.array_split(np.arange(10.0), 3)[r])
    assert [res[r][1].size for r in range(3)] == [4, 3, 3]


def run_movers(comm, seed, rows, trailing, dtype, root):
    p, r = comm.size, comm.rank
    mine = data(seed, r, (rows[r], *trailing), dtype)
    blocks = data(seed + 1, r, (p * rows[0], *trailing), dtype)
    big = data(seed + 2, 0, (sum(rows), *trailing), dtype)
    return {
        "allgather": comm.allgather(mine),
        "allgather_native": comm.allgather(mine, algorithm="native"),
        "gather": comm.gather(mine, root=root),
        "a2a": comm.all_to_all(blocks),
        "a2a_native": comm.all_to_all(blocks, algorithm="native"),
        "bcast": comm.broadcast(mine if r == root else None, root=root),
        "bcast_native": comm.broadcast(mine if r == root else None, root=root, algorithm="native"),
        "scatter": comm.scatter(big if r == root else None, root=root),
        "barrier": [comm.barrier(), comm.barrier(algorithm="native")],
    }


@budget(20)
@given(p=st.integers(1, 8), data_=st.data(), trailing=st.lists(st.integers(0, 3), max_size=2).map(tuple),
       dtype=DTYPES, seed=st.integers(0, 10**6))
def test_data_movement_equals_numpy(p, data_, trailing, dtype, seed):
    rows = data_.draw(st.lists(st.integers(0, 4), min_size=p, max_size=p))
    root = data_.draw(st.integers(0, p - 1))
    check_movers(launch(run_movers, p, "threads", seed, rows, trailing, dtype, root), seed, rows, trailing,
                 dtype, root)


def check_movers(res, seed, rows, trailing, dtype, root):
    """``run_movers``' results (by rank) equal the numpy concatenations, blocks and copies."""
    p = len(res)
    mine = [data(seed, r, (rows[r], *trailing), dtype) for r in range(p)]
    blocks = [data(seed + 1, r, (p * rows[0], *trailing), dtype) for r in range(p)]
    big = data(seed + 2, 0, (sum(rows), *trailing), dtype)
    b = rows[0]
    for r in range(p):
        out = res[r]
        np.testing.assert_array_equal(out["allgather"], np.concatenate(mine))
        np.testing.assert_array_equal(out["allgather_native"], np.concatenate(mine))
        if r == root:
            np.testing.assert_array_equal(out["gather"], np.concatenate(mine))
        else:
            assert out["gather"] is None
        a2a = np.concatenate([blocks[s][r * b:(r + 1) * b] for s in range(p)])
        np.testing.assert_array_equal(out["a2a"], a2a)
        np.testing.assert_array_equal(out["a2a_native"], a2a)
        np.testing.assert_array_equal(out["bcast"], mine[root])
        np.testing.assert_array_equal(out["bcast_native"], mine[root])
        assert out["bcast"].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out["scatter"], np.array_split(big, p)[r])
        assert out["barrier"] == [None, None]


def test_nonblocking_collectives_complete_in_order():
    def fn(comm):
        reqs = [comm.iallreduce(np.full(5, float(comm.rank + i)), algorithm=alg)
                for i, alg in enumerate(["ring", "recursive_doubling", "naive"])]
        rs = comm.ireduce_scatter(np.arange(8.0))
        ag = comm.iallgather(np.array([comm.rank]))
        blocking = comm.allreduce(np.ones(3))  # the caller's own traffic meanwhile
        return [r.wait() for r in reqs], rs.wait(), ag.wait(), blocking
    p = 4
    for out, rs, ag, blocking in launch(fn, p):
        for i, o in enumerate(out):
            np.testing.assert_array_equal(o, np.full(5, sum(range(p)) + p * i))
        assert rs.shape == (2,)
        np.testing.assert_array_equal(ag, np.arange(p))
        np.testing.assert_array_equal(blocking, np.full(3, float(p)))


@pytest.mark.parametrize("call, message", [
    (lambda c: c.allreduce(np.ones(2), algorithm="tree"), "unknown algorithm"),
    (lambda c: c.allreduce(np.ones(2), op="prod"), "unknown op"),
    (lambda c: c.allreduce(np.ones(2, dtype=np.int64), op="mean"), "floating dtype"),
    (lambda c: c.all_to_all(np.ones(3)), "equal blocks"),
    (lambda c: c.broadcast(np.ones(2), root=5), "root=5"),
])
def test_bad_arguments_fail_before_any_message(call, message):
    with pytest.raises(ValueError, match=message) as info:
        launch(call, 2)
    for r in range(2):  # the same error on every rank, none left waiting for a message (Aborted)
        assert f"rank {r}: ValueError: " in str(info.value)
