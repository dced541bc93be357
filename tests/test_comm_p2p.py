"""Point-to-point, objects, split/dup, failure handling, watchdog and debug mode (threads backend)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import budget

from minipar.comm import Aborted, CollectiveMismatch, CommTimeout, RankError, launch


@budget(15)
@given(shape=st.lists(st.integers(0, 4), max_size=4).map(tuple),
       dtype=st.sampled_from(["float64", "float32", "int64", "uint8", "bool"]))
def test_send_recv_carries_shape_and_dtype(shape, dtype):
    def fn(comm):
        if comm.rank == 0:
            x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape).astype(dtype)
            comm.send(x, 1, tag=3)
            x[...] = 0  # the sender may reuse its buffer at once
            return None
        return comm.recv(0, tag=3)
    got = launch(fn, 2)[1]
    assert got.shape == shape and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, np.arange(int(np.prod(shape))).reshape(shape).astype(dtype))


def test_messages_match_in_order_per_tag_and_nonblocking():
    def fn(comm):
        if comm.rank == 0:
            reqs = [comm.isend(np.full(2, i), 1, tag=i % 2) for i in range(6)]
            for r in reqs:
                r.wait()
            return None
        odd = [comm.irecv(0, tag=1) for _ in range(3)]
        even = [comm.irecv(0, tag=0) for _ in range(3)]
        return [r.wait()[0] for r in reversed(odd)], [r.wait()[0] for r in even]
    odd, even = launch(fn, 2)[1]
    assert odd == [5, 3, 1] and even == [0, 2, 4]


def test_sendrecv_ring_and_test():
    def fn(comm):
        p, r = comm.size, comm.rank
        got = comm.sendrecv(np.array([r]), (r + 1) % p, (r - 1) % p)
        req = comm.irecv((r - 1) % p, tag=7)
        comm.barrier()
        comm.send(np.array([10 * r]), (r + 1) % p, tag=7)
        while not req.test():
            time.sleep(0.001)
        return int(got[0]), int(req.wait()[0])
    assert launch(fn, 5) == [((r - 1) % 5, 10 * ((r - 1) % 5)) for r in range(5)]


def test_objects():
    def fn(comm):
        if comm.rank == 0:
            comm.send_object({"a": [1, 2]}, 2, tag=4)
        got = comm.recv_object(0, tag=4) if comm.rank == 2 else None
        b = comm.broadcast_object({"cfg": 1} if comm.rank == 1 else None, root=1)
        return got, b, comm.gather_object(comm.rank * 10, root=2), comm.allgather_object(str(comm.rank))
    res = launch(fn, 3)
    assert res[2][0] == {"a": [1, 2]}
    assert all(r[1] == {"cfg": 1} for r in res)
    assert res[2][2] == [0, 10, 20] and res[0][2] is None
    assert all(r[3] == ["0", "1", "2"] for r in res)


def grid(comm):
    """A 2x2 grid: ranks 0 1 / 2 3; rows and columns as sub-communicators."""
    row = comm.split(comm.rank // 2)
    col = comm.split(comm.rank % 2, key=-comm.rank)  # key reverses the order within a column
    x = np.array([float(comm.rank)])
    return (row.rank, row.size, row.group_ranks, row.allreduce(x)[0],
            col.rank, col.group_ranks, col.allreduce(x, algorithm="recursive_doubling")[0],
            col.allgather(np.array([comm.world_rank])).tolist(), row.dup().broadcast(x, root=1)[0])


def check_grid(res):
    for r, (rrank, rsize, rgroup, rsum, crank, cgroup, csum, cgather, rb) in enumerate(res):
        assert (rrank, rsize, rgroup, rsum) == (r % 2, 2, [2 * (r // 2), 2 * (r // 2) + 1], 4 * (r // 2) + 1)
        assert cgroup == [r % 2 + 2, r % 2] and crank == 1 - r // 2
        assert csum == 2 * (r % 2) + 2 and cgather == cgroup and rb == 2 * (r // 2) + 1


def test_split_grid_rows_and_columns():
    check_grid(launch(grid, 4))


def test_rank_failure_names_the_rank_and_wakes_the_others():
    def fn(comm):
        if comm.rank == 2:
            raise KeyError("boom")
        comm.allreduce(np.ones(3))  # would wait for rank 2 until the watchdog
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 2 failed: KeyError") as info:
        launch(fn, 4, timeout=30)
    assert time.monotonic() - t0 < 10  # woken by the failure, not by the 30 s watchdog (10 s: a loaded machine)
    assert isinstance(info.value, KeyError) and info.value.rank == 2
    assert "rank 0: Aborted" in str(info.value)


def test_skipped_collective_times_out_naming_the_missing_rank():
    def fn(comm):
        if comm.rank != 1:
            comm.allreduce(np.ones(4))
    t0 = time.monotonic()
    # two ranks: only rank 0 waits, and only for rank 1 (with three, rank 0 also waits for rank 2, which
    # waits for rank 1, and which of them times out first depends on the machine's load)
    with pytest.raises(CommTimeout, match=r"allreduce\(ring\).*waiting for rank\(s\) \[1\]") as info:
        launch(fn, 2, timeout=1.5)
    assert 1.5 <= time.monotonic() - t0 < 10  # the 1.5 s timeout, then the report (10 s: a loaded machine)
    assert "rank 1: returned" in str(info.value)
    assert not isinstance(info.value.error, Aborted)


def test_timeout_error_lists_last_completed_operations():
    def fn(comm):
        comm.barrier()
        if comm.rank == 0:
            comm.recv(1, tag=9)
    with pytest.raises(CommTimeout, match=r"send from rank 1 .*last completed operations: barrier"):
        launch(fn, 2, timeout=0.5)


def test_debug_mode_reports_mismatch_by_rank(monkeypatch):
    monkeypatch.setenv("MINIPAR_DEBUG", "1")

    def fn(comm):
        if comm.rank == 2:
            return comm.allgather(np.ones((1, 3)))
        return comm.allreduce(np.ones((2, 2)))
    with pytest.raises(CollectiveMismatch) as info:
        launch(fn, 3, timeout=5)
    msg = str(info.value)
    assert "rank 0 (world 0): allreduce(" in msg and "shape=(2, 2)" in msg
    assert "rank 2 (world 2): allgather(" in msg and "trailing=(3,)" in msg


def test_timeout_env_and_bad_values(monkeypatch):
    from minipar.comm.watchdog import default_timeout

    monkeypatch.setenv("MINIPAR_TIMEOUT", "7")
    assert default_timeout() == 7.0 and default_timeout(2) == 2.0
    monkeypatch.setenv("MINIPAR_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MINIPAR_TIMEOUT"):
        default_timeout()
    with pytest.raises(ValueError, match="backend"):
        launch(lambda c: None, 2, backend="gpu")
    with pytest.raises(RuntimeError, match="mpiexec -n 2"):
        launch(lambda c: None, 2, backend="mpi")


def test_world_outside_mpiexec_is_size_one():
    from minipar.comm import world

    comm = world()
    assert (comm.rank, comm.size, comm.world_rank, comm.group_ranks) == (0, 1, 0, [0])
    np.testing.assert_array_equal(comm.allreduce(np.arange(3.0), op="mean"), np.arange(3.0))
