"""DDP overlaps the gradient all-reduce with backward under real mpiexec, read from the trace.

With ``overlap=True`` the last layer's bucket is launched from its gradient hook while backward
still has the wide layers to go (an order on the rank's own thread), and the async worker thread (the
rank's second thread) finishes the first bucket's all-reduce before the "B" span ends on the replayed
clock (one core per rank: on a loaded machine the wall clock may not give the worker a core in time);
with ``overlap=False`` no all-reduce message starts before the last gradient is ready. The threads-backend twin is
``test_data_parallel.test_first_bucket_starts_before_backward_ends_only_with_overlap``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from minipar import Tensor, datasets, launch, trace
from minipar import functional as F
from minipar.comm.asyncwork import Worker
from minipar.nn import MLP
from minipar.optim import SGD
from minipar.parallel.ddp import DistributedDataParallel, train_step
from minipar.replay import cluster_named, replay
from minipar.testing import run
from minipar.trace import Trace

pytestmark = pytest.mark.mpi

SIZES = [128, 512, 512, 512, 512, 8]  # four 512-wide layers keep backward busy after the first bucket
ROWS = 256  # samples per rank
CAP = 512 * 512 * 8  # one 512 x 512 float64 weight per bucket
STEPS = 2
CASES = [("ring", True), ("ring", False), ("native", True), ("native", False)]


def traced_steps(comm) -> list[tuple[str, bool, list[trace.Event]]]:
    """Every case of ``CASES`` on this rank: ``STEPS`` traced DDP steps each."""
    x, y = datasets.regression(ROWS * comm.size, SIZES[0], SIZES[-1], seed=1)
    out = []
    for algorithm, overlap in CASES:
        model = MLP(SIZES, seed=0)
        ddp = DistributedDataParallel(model, comm, bucket_cap_bytes=CAP, algorithm=algorithm, overlap=overlap)
        opt = SGD(model.parameters(), lr=0.01)
        with trace.recording(comm.rank) as rec:
            for _ in range(STEPS):
                train_step(ddp, opt, lambda m, a, b: F.mse_loss(m(Tensor(a)), Tensor(b)), x, y)
        out.append((algorithm, overlap, rec.events))
    return out


def test_first_bucket_allreduce_starts_before_backward_ends_under_mpiexec():
    per_rank = run(traced_steps, 2, backend="mpi", timeout=60, comm_timeout=30)
    # buckets by hand (layer i: weight Wi, bias bi; reverse order, cap 2 MiB, a 512 x 512 weight is exactly
    # 2 MiB): [b4 64 B, W4 32 KiB, b3 4 KiB], [W3], [b2], [W2], [b1], [W1], [b0 4 KiB, W0 512 KiB]
    n_buckets = 7
    # the overlapped cases replayed once each (one core per rank, NVLink), both ranks' events together
    replayed = {case: replay(Trace({"world_size": 2}, [e for cases in per_rank for e in cases[i][2]]),
                             cluster_named("nvlink")) for i, case in enumerate(CASES) if case[1]}
    for rank, cases in enumerate(per_rank):
        for algorithm, overlap, events in cases:
            where = f"rank {rank}, {algorithm}, overlap={overlap}"
            forwards = [e for e in events if e.name == "F"]
            backwards = [e for e in events if e.name == "B"]
            marks = [e for e in events if e.kind == "mark" and e.name == "bucket"]
            assert len(forwards) == len(backwards) == STEPS and len(marks) == STEPS * n_buckets, where
            for step, (f, b) in enumerate(zip(forwards, backwards)):
                launches = [m.t0 for m in marks[step * n_buckets:(step + 1) * n_buckets]]
                if overlap:  # launched as backward goes (an order: no duration a busy core could stretch)
                    assert sum(t < b.t1 for t in launches) >= n_buckets - 1, (where, step)
                else:  # nothing starts before the last gradient is ready
                    first_message = min(e.t0 for e in events if e.kind == "comm" and e.op == "allreduce"
                                        and e.t0 > f.t0)
                    assert launches[0] >= b.t1 and first_message >= b.t1, (where, step)
            if overlap:  # the worker talks while backward runs: on the replayed clock (one core per rank,
                # NVLink), where a busy machine cannot delay the worker thread, the first bucket's
                # all-reduce (36 KiB, microseconds) ends under the four 512-wide layers' backward still to go
                mine = [e for e in replayed[(algorithm, overlap)].events if e.rank == rank]
                for step, b in enumerate(e for e in mine if e.name == "B"):
                    ends = sorted(e.t0 for e in mine if e.name == "async end" and e.t0 > b.t0)
                    assert ends and ends[0] < b.t1, (where, step)
            # every bucket is all-reduced once per step: 2(p-1) = 2 ring messages sent, or one native event
            sent = [e for e in events if e.kind == "comm" and e.op == "allreduce" and
                    (e.src == rank if algorithm == "ring" else e.name == "native")]
            assert len(sent) == STEPS * n_buckets * (2 if algorithm == "ring" else 1), where


# ---- the non-blocking collectives' worker: pauses while its rank computes, not while it waits ------------
class _MpiLike:
    """What ``asyncwork.Worker`` reads of an MPI communicator: its wait's spin, pace and pause."""

    world_rank = 0

    def __init__(self, spin: float, paused: list[float]) -> None:
        self.spin, self.pace, self.rest = spin, 1 / 32, paused.append

    def close(self) -> None:
        pass


@pytest.mark.parametrize("spin", [1e-3, 0.0])
def test_the_worker_pauses_between_tests_unless_its_rank_waits_for_it(spin: float) -> None:
    """Each rank a core of its own (spin > 0): while the rank waits for a job (``hurry``) the worker
    tests without pausing (nothing left to preempt; DDP on 2 ranks: step 8.0 -> 6.4 ms,
    benchmarks/replay_stability.py); more ranks than cores (spin 0): it always pauses."""
    paused: list[float] = []
    worker = Worker(_MpiLike(spin, paused))
    try:
        assert (worker.comm.spin, worker.comm.pace) == (0.0, 0.5)
        worker.comm.rest(1e-4)
        worker.hurry.set()
        worker.comm.rest(2e-4)
        worker.hurry.clear()
        worker.comm.rest(3e-4)
        assert paused == ([1e-4, 3e-4] if spin else [1e-4, 2e-4, 3e-4])
    finally:
        worker.close()


def _hurried_while_waited(comm) -> tuple[bool, bool]:
    comm.iallreduce(np.ones(2)).wait()  # the worker exists
    worker = comm._async
    req = worker.submit_call(comm, "probe", lambda c: (time.sleep(0.05), worker.hurry.is_set())[1])
    return req.wait(), worker.hurry.is_set()


def test_a_wait_for_a_job_hurries_the_worker_until_it_ends() -> None:
    assert launch(_hurried_while_waited, 2) == [(True, False), (True, False)]
