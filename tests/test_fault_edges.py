"""Faults at the edges (review of issue 18): a parameter server on a sub-communicator (the detector's
world ranks against the communicator's ranks), a trace whose block raises after a rank was killed
(no side file left behind) and a ZeRO checkpoint save whose first broadcast meets a dead peer (no
temporary directory left behind); and (issue 29) the next start removing the leftovers of crashed
saves, never the complete checkpoint. All on the threads backend, each well under a second."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fault_helpers import SIZES, ps_batch, ps_loss

import minipar
from minipar import elastic, trace
from minipar.comm import PeerLost, RankError, faults
from minipar.nn import MLP
from minipar.optim import SGD
from minipar.parallel import param_server as ps
from minipar.parallel.zero import checkpoint
from minipar.testing import ROOT


# ---- M4: the parameter server translates world ranks <-> communicator ranks ---------------------------
def _ps_on_a_split(comm: minipar.Communicator) -> Any:
    sub = comm.split(int(comm.rank > 0))  # world rank 0 sits out: sub rank r is world rank r + 1
    if comm.rank == 0:
        return None
    with trace.recording(comm.world_rank) as rec:
        res = ps.train(sub, MLP(SIZES, seed=1), ps_loss, ps_batch, 6, mode="async", silence_timeout=3.0,
                       optimizer=lambda p: SGD(p, lr=0.1), die_at={2: 2})  # sub rank 2 = world rank 3 dies
    marks = [e.args for e in rec.events if e.kind == "mark" and e.name in ("worker dropped", "apply")]
    return res, marks


def test_parameter_server_on_a_sub_communicator_drops_the_dead_worker_only() -> None:
    out = minipar.launch(_ps_on_a_split, 5, deadline=0.3, timeout=6)
    assert out[0] is None and out[3] is None  # world rank 3 (sub rank 2) was killed
    server, marks = out[1]
    assert server.role == "server" and server.dropped == [2]  # sub ranks; before the fix: [3], the live one
    assert Counter(a[0] for a in server.applied) == {1: 6, 3: 6, 2: 2}
    assert sorted({(a[0], a[1]) for a in server.applied}) == (
        [(1, c) for c in range(6)] + [(2, 0), (2, 1)] + [(3, c) for c in range(6)])
    dropped = [m for m in marks if "reason" in m]
    assert [(m["worker"], m["reason"]) for m in dropped] == [(3, "dead")]  # trace marks: world rank 3
    assert {m["worker"] for m in marks if "reason" not in m} == {2, 3, 4}  # world ranks of the workers
    for r in (2, 4):  # the live workers ran every step
        assert out[r][0].role == "worker" and len(out[r][0].losses) == 6


def _sync_ps_on_a_split(comm: minipar.Communicator) -> Any:
    sub = comm.split(int(comm.rank > 0))
    if comm.rank == 0:
        return None
    try:
        ps.train(sub, MLP(SIZES, seed=1), ps_loss, ps_batch, 6, mode="sync", silence_timeout=3.0,
                 optimizer=lambda p: SGD(p, lr=0.1), die_at={2: 2})
    except ps.WorkerLost as exc:
        return exc.rank, str(exc)
    except PeerLost as exc:
        return "PeerLost", exc.rank
    return "finished"


def test_sync_parameter_server_on_a_sub_communicator_names_the_dead_worker() -> None:
    out = minipar.launch(_sync_ps_on_a_split, 5, deadline=0.3, timeout=6)
    rank, message = out[1]  # the server
    assert rank == 3  # a world rank, like every PeerLost's
    assert "worker rank 2 died (world rank 3;" in message  # before the fix: no WorkerLost, a CommTimeout
    assert out[0] is None and out[3] is None and out[2] == out[4] == ("PeerLost", 3)


# ---- L4: a trace whose block raises leaves no side file -----------------------------------------------
def _kill_in_a_trace(comm: minipar.Communicator, path: str) -> None:
    with trace.record(path, comm):
        if comm.rank == 2:
            faults.kill(comm)  # spills its events to <path>.rank2.lost, then leaves
        comm.barrier()  # the survivors fail fast: PeerLost out of the recorded block


def test_a_trace_that_raises_leaves_no_side_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    with pytest.raises(RankError, match=r"PeerLost"):
        minipar.launch(_kill_in_a_trace, 3, deadline=0.3, timeout=5, path=str(path))
    assert sorted(os.listdir(tmp_path)) == []  # before the fix: ['t.json.rank2.lost']


def _kill_in_a_tolerant_trace(comm: minipar.Communicator, path: str) -> int:
    with trace.record(path, comm):
        if comm.rank == 2:
            faults.kill(comm)
    return comm.rank


def test_a_trace_that_completes_still_merges_the_side_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    assert minipar.launch(_kill_in_a_tolerant_trace, 3, deadline=0.3, timeout=5, path=str(path)) == [0, 1, None]
    t = trace.load(path)
    assert t.meta["lost_ranks"] == [2]
    assert [(e.rank, e.name) for e in t.events if e.kind == "mark"] == [(2, "killed")]
    assert sorted(os.listdir(tmp_path)) == ["t.json"]


# ---- L5: a peer lost during the save's first broadcast leaves no temporary directory -------------------
AGREE = checkpoint._agree  # the real one; the test patches the module's for all ranks at once


def _agree_then_die(c: Any, errors: list[str], what: str, extra: Any = None) -> list[Any]:
    out = AGREE(c, errors, what, extra)
    if c.rank == 1:
        faults.kill(c)  # right after the arguments are agreed, before rank 0's broadcast of the tmp
    return out


def _save_meeting_a_dead_peer(comm: minipar.Communicator, directory: str) -> str:
    if comm.rank == 0:  # rank 0's broadcast waits for the death (a wait that a dead peer ends)
        real = comm.broadcast_object

        def broadcast_to_the_dead(obj: Any = None, root: int = 0) -> Any:
            comm.broadcast_object = real  # type: ignore[method-assign]
            det = comm.state.detector
            while 1 not in det.dead:
                det.check()
            det.raise_if_lost("broadcast_object (root)", [1, 2], True)
            return real(obj, root)

        comm.broadcast_object = broadcast_to_the_dead  # type: ignore[method-assign]
    try:
        checkpoint.save(directory, comm, {"w": np.arange(2.0)}, {"w": 2 * comm.size})
    except PeerLost as exc:
        return f"PeerLost {exc.rank}"
    return "saved"


def test_a_save_whose_broadcast_meets_a_dead_peer_leaves_no_temporary(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # patched here, before any rank starts, and undone after: a rank patching a module's global while
    # another reads it left the killer in place for the next tests of the process
    monkeypatch.setattr(checkpoint, "_agree", _agree_then_die)
    directory = tmp_path / "ckpt"
    out = minipar.launch(_save_meeting_a_dead_peer, 3, deadline=0.2, timeout=5, directory=str(directory))
    assert out == ["PeerLost 1", None, "PeerLost 1"]
    assert sorted(os.listdir(tmp_path)) == []  # before the fix: ['ckpt.tmp-<12 hex>']


# ---- issue 29: the next start tidies up after crashed saves, never deleting a complete checkpoint --------
def _save_step(comm: minipar.Communicator, directory: str, step: int) -> None:
    checkpoint.save(directory, comm, {"w": np.full(2, float(step))}, {"w": 2 * comm.size}, {"step": step})


def _start(comm: minipar.Communicator, directory: str) -> bool:
    from minipar.elastic import checkpoint_exists

    return checkpoint_exists(directory, comm)


@pytest.mark.parametrize("crash", ["before the commit", "between the renames", "after the renames", "first save"])
def test_the_next_start_removes_leftovers_and_keeps_the_complete_checkpoint(tmp_path: Path, crash: str) -> None:
    ckpt, hexes = tmp_path / "ckpt", "0123456789ab"
    tmp, old = tmp_path / f"ckpt.tmp-{hexes}", tmp_path / f"ckpt.old-{hexes}"
    minipar.launch(_save_step, 3, directory=str(ckpt), step=1)
    want = 1
    if crash == "first save":  # no checkpoint yet; the first save's directory, files written, no meta.json
        ckpt.rename(tmp)
        (tmp / "meta.json").unlink()
        want = None
    elif crash == "before the commit":  # every file and meta.json written, no rename yet: the old one stays
        minipar.launch(_save_step, 3, directory=str(tmp_path / "new"), step=2)
        (tmp_path / "new").rename(tmp)
    else:  # step 2's commit: ckpt -> ckpt.old-X, then ckpt.tmp-X -> ckpt (interrupted after the first rename)
        minipar.launch(_save_step, 3, directory=str(tmp_path / "new"), step=2)
        ckpt.rename(old)
        (tmp_path / "new").rename(tmp if crash == "between the renames" else ckpt)
        want = 2
    assert minipar.launch(_start, 3, directory=str(ckpt)) == [want is not None] * 3
    assert sorted(os.listdir(tmp_path)) == (["ckpt"] if want else [])  # no ckpt.tmp-X, no ckpt.old-X
    if want:
        assert checkpoint.consolidate(ckpt)[1] == {"step": want}


TRANSPORT_SCRIPT = """
import sys
from minipar.comm import CommError, PeerLost, faults, world
comm = world()  # minipar initialises MPI (mpi4py's own initialisation would set ERRORS_RETURN itself)
from mpi4py import MPI
assert MPI.COMM_WORLD.Get_errhandler() == MPI.ERRORS_RETURN  # an MPI error comes back, not an abort

def broken():  # what MPICH's Test raises when the sender of a large message died under its copy
    raise MPI.Exception(MPI.ERR_OTHER)

if comm.rank == 1 and comm.size == 3:
    faults.kill(comm)
try:
    comm._wait(broken, "recv from rank 1", [1])
except PeerLost as err:
    print(f"rank {comm.rank}: PeerLost {err.rank}: {err}", flush=True)
    sys.exit(3)
except CommError as err:
    print(f"rank {comm.rank}: CommError: {err}", flush=True)
    sys.exit(4)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_an_mpi_error_in_a_wait_names_the_dead_peer_or_says_what_failed(tmp_path: Path, n: int,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    """MPI's errors come back to the wait (the world's handler is ``ERRORS_RETURN``); with a peer dead
    (n = 3: rank 1 SIGKILLs itself) the wait waits for the detector and raises ``PeerLost`` naming it;
    with every peer alive (n = 2), ``CommError`` with MPI's message after at most the detector's own
    bound (twice the deadline and a heartbeat), never an MPI_Abort of the job."""
    script = tmp_path / "transport.py"
    script.write_text(TRANSPORT_SCRIPT)
    env = {"MINIPAR_PEER_DEADLINE": "0.5", "PYTHONPATH": str(ROOT)}
    result = elastic.mpiexec_launcher([sys.executable, str(script)], extra_env=env)(n, {})
    out = capfd.readouterr().out
    if n == 3:
        assert result.statuses == {0: 3, 1: 137, 2: 3}
        for r in (0, 2):
            assert f"rank {r}: PeerLost 1: rank {r}: recv from rank 1 (MPI: " in out
    else:
        assert result.statuses == {0: 4, 1: 4}
        for r in (0, 1):
            assert f"rank {r}: CommError: rank {r}: recv from rank 1: MPI failed: " in out
