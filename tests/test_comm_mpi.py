"""The same properties under real ``mpiexec`` (2-4 ranks), through the equivalence harness.

Hypothesis draws the configuration here; each example runs as one ``mpiexec`` job.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_comm_collectives import check_movers, check_reductions, run_movers, run_reductions
from test_comm_p2p import check_grid, grid

from minipar import trace
from minipar.comm import chunk_bounds
from minipar.testing import HarnessError, run

pytestmark = pytest.mark.mpi


def everything(comm, seed, shape, dtype, op, rows, trailing, root):
    out = run_reductions(comm, seed, shape, dtype, op)
    out.update(run_movers(comm, seed, rows, trailing, dtype, root))
    req = comm.iallreduce(np.full(3, float(comm.rank)), algorithm="recursive_doubling")
    out["iallreduce"] = req.wait()
    return out


@settings(max_examples=4, derandomize=True)
@given(p=st.integers(2, 4), shape=st.lists(st.integers(0, 5), max_size=2).map(tuple),
       dtype=st.sampled_from(["float64", "float32"]), op=st.sampled_from(["sum", "mean", "max"]),
       seed=st.integers(0, 10**6), rows=st.lists(st.integers(0, 3), min_size=4, max_size=4),
       root=st.integers(0, 3))
# the 4 derandomized draws hold no "mean" and mostly empty buffers: these two always run as well
@example(p=4, shape=(5, 3), dtype="float32", op="mean", seed=7, rows=[2, 0, 3, 1], root=3)
@example(p=3, shape=(7,), dtype="float64", op="mean", seed=11, rows=[1, 2, 0, 3], root=1)
def test_collectives_under_mpiexec(p, shape, dtype, op, seed, rows, root):
    rows, root = rows[:p], root % p
    res = run(everything, p, backend="mpi", timeout=60, comm_timeout=20, seed=seed, shape=shape, dtype=dtype,
              op=op, rows=rows, trailing=(2,), root=root)
    check_reductions(res, seed, shape, dtype, op)
    check_movers(res, seed, rows, (2,), dtype, root)
    for out in res:
        np.testing.assert_array_equal(out["iallreduce"], np.full(3, float(sum(range(p)))))


def grid_and_bytes(comm):
    """The 2x2 grid, header-mode receives waited in reverse order, and traced ring bytes."""
    g = grid(comm)
    if comm.rank == 0:
        for i in range(4):
            comm.send(np.full(i + 1, i), 1, tag=2)
    got = None
    if comm.rank == 1:
        reqs = [comm.irecv(0, tag=2) for _ in range(4)]
        got = [r.wait().tolist() for r in reversed(reqs)]
    with trace.record(None, comm) as rec:
        comm.allreduce(np.ones(10), algorithm="ring")
        comm.allreduce(np.ones(8), algorithm="recursive_doubling")
    sent = {alg: sum(e.nbytes for e in rec.events if e.src == comm.rank and e.algorithm == alg)
            for alg in ("ring", "recursive_doubling")}
    return g, got, sent


def test_split_fifo_and_traced_bytes_under_mpiexec():
    res = run(grid_and_bytes, 4, backend="mpi", timeout=60, comm_timeout=20)
    check_grid([r[0] for r in res])
    assert res[1][1] == [[3] * 4, [2] * 3, [1] * 2, [0]]
    chunks = [b - a for a, b in chunk_bounds(10, 4)]
    for r, (_, _, sent) in enumerate(res):
        assert sent["ring"] == 8 * (2 * 10 - chunks[r] - chunks[(r + 1) % 4])
        assert sent["recursive_doubling"] == 8 * 8 * 2  # n log2 p


def skips(comm):
    if comm.rank != 1:
        comm.allreduce(np.ones(5))
    return comm.rank


def mismatched(comm):
    return comm.allreduce(np.ones(3 + comm.rank))


def test_skipped_collective_fails_the_job_under_mpiexec():
    with pytest.raises(HarnessError) as info:
        run(skips, 2, backend="mpi", timeout=60, comm_timeout=2)  # 2 ranks: only rank 0 waits, for rank 1
    msg = str(info.value)
    assert info.value.returncode != 0
    assert "CommTimeout" in msg and "waiting for rank(s) [1]" in msg


def test_debug_mode_mismatch_under_mpiexec(monkeypatch):
    monkeypatch.setenv("MINIPAR_DEBUG", "1")
    with pytest.raises(HarnessError) as info:
        run(mismatched, 2, backend="mpi", timeout=60, comm_timeout=10)
    msg = str(info.value)
    assert "CollectiveMismatch" in msg and "shape=(3,)" in msg and "shape=(4,)" in msg
