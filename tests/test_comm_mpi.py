"""The same properties under real ``mpiexec`` (2-4 ranks), through the equivalence harness.

Hypothesis draws the configurations here, in the pytest process; each example is one ``mpiexec``
job running a drawn list of configurations (``minipar.testing.run_each``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import budget, mpi_jobs
from test_comm_collectives import check_movers, check_reductions, run_movers, run_reductions
from test_comm_p2p import check_grid, grid

from minipar import trace
from minipar.comm.watchdog import SPIN, spin_for
from minipar.testing import HarnessError, run, run_each

pytestmark = pytest.mark.mpi


def everything(comm, seed, shape, dtype, op, rows, trailing, root):
    out = run_reductions(comm, seed, shape, dtype, op)
    out.update(run_movers(comm, seed, rows, trailing, dtype, root))
    req = comm.iallreduce(np.full(3, float(comm.rank)), algorithm="recursive_doubling")
    out["iallreduce"] = req.wait()
    return out


@st.composite
def collective_configs(draw: st.DrawFn, p: int) -> dict:
    """Arguments of ``everything`` on p ranks: buffers (empty ones too), dtype, op, per-rank rows, root."""
    return {"seed": draw(st.integers(0, 10**6)), "shape": draw(st.lists(st.integers(0, 5), max_size=2).map(tuple)),
            "dtype": draw(st.sampled_from(["float64", "float32"])), "op": draw(st.sampled_from(["sum", "mean", "max"])),
            "rows": draw(st.lists(st.integers(0, 3), min_size=p, max_size=p)), "trailing": (2,),
            "root": draw(st.integers(0, p - 1))}


def config(seed: int, shape: tuple, dtype: str, op: str, rows: list[int], root: int) -> dict:
    return {"seed": seed, "shape": shape, "dtype": dtype, "op": op, "rows": rows, "trailing": (2,), "root": root}


# every job runs every all-reduce algorithm (ring, recursive doubling, naive, native) on each
# configuration; these always run too: "mean", non-empty buffers, p = 3 (not a power of two) and 4
@budget(1)  # the simplest drawn job (p = 2) beside the @examples; thorough: 10 drawn jobs
@given(mpi_jobs(collective_configs))
@example((4, [config(7, (5, 3), "float32", "mean", [2, 0, 3, 1], 3), config(8, (6,), "float64", "max", [1] * 4, 0)]))
@example((3, [config(11, (7,), "float64", "mean", [1, 2, 0], 1), config(12, (2, 4), "float32", "sum", [0, 3, 1], 2)]))
def test_collectives_under_mpiexec(job):
    p, cfgs = job
    for c, res in zip(cfgs, run_each(everything, p, cfgs, timeout=60, comm_timeout=20)):
        check_reductions(res, c["seed"], c["shape"], c["dtype"], c["op"])
        check_movers(res, c["seed"], c["rows"], c["trailing"], c["dtype"], c["root"])
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
    chunks = [3, 3, 2, 2]  # 10 elements on 4 ranks: 10 // 4 each, one more for the first 10 % 4
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


def test_waits_do_not_spin_when_ranks_outnumber_cores() -> None:
    assert spin_for(2, cores=2) == SPIN == 1e-3
    assert spin_for(4, cores=2) == 0.0 and spin_for(1, cores=1) == SPIN
