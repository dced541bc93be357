"""Agreement checks (issue 31, item 4; ``minipar/sharding/agree.py``): ranks that make a global tensor
with other placements, shapes or meshes all raise one line naming them, before any traced message;
meshes compare by value; in debug mode an op's operands are compared before its first message."""

from __future__ import annotations

import numpy as np
import pytest
from refusals import refusal

from minipar import trace
from minipar.comm import launch
from minipar.mesh import DeviceMesh
from minipar.sharding import GlobalTensor, Replicate, Shard, matmul
from minipar.sharding.ops import add, embedding
from minipar.testing import run_each

B, S0, S1 = Replicate(), Shard(0), Shard(1)
PLACEMENTS = "GlobalTensor: ranks disagree on placements: ranks 0, 2 [S(0), B]; ranks 1, 3 [B, B]"


def make_disagreeing(comm, what: str) -> tuple[str, int]:
    """Ranks with tp coordinate 0 (world 0, 2) pass one layout, the others another."""
    mesh = DeviceMesh(comm, dp=2, tp=2)
    odd = mesh.coords["tp"] == 1
    shape, placements = (4, 4), [S0, B]
    if what == "placements":
        placements = [B, B] if odd else placements
    elif what == "shape":
        shape = (8, 4) if odd else shape
    return refusal(comm, lambda: GlobalTensor.zeros(shape, mesh, ("dp", "tp"), placements))


@pytest.mark.parametrize(("what", "want"), [
    ("placements", PLACEMENTS),
    ("shape", "GlobalTensor: ranks disagree on shape: ranks 0, 2 (4, 4); ranks 1, 3 (8, 4)"),
    ("nothing", "no error"),
])
def test_ranks_that_disagree_all_raise_one_line_naming_them(what: str, want: str) -> None:
    assert launch(make_disagreeing, 4, "threads", what) == [(want, 0)] * 4


def test_the_raw_constructor_is_checked_too() -> None:
    """Each rank's (4, 2) piece fits its own arguments: a (4, 4) tensor under S(1) on rank 0, an (8, 2)
    one under S(0) on rank 1."""
    def run(comm) -> str:
        mesh = DeviceMesh(comm, tp=2)
        shape, pl = ((4, 4), [S1]) if comm.rank == 0 else ((8, 2), [S0])
        with pytest.raises(ValueError) as err:
            GlobalTensor(np.zeros((4, 2)), shape, mesh, ("tp",), pl)
        return str(err.value)
    want = "GlobalTensor: ranks disagree on shape and placements: rank 0 (4, 4), [S(1)]; rank 1 (8, 2), [S(0)]"
    assert launch(run, 2, "threads") == [want] * 2


def count_agreements(comm) -> tuple[int, int, int]:
    """Control-plane collectives and traced messages of making one tensor, then another and a matmul."""
    mesh = DeviceMesh(comm, tp=4)
    calls = [0]
    gather = comm.allgather_object

    def counted(obj):
        calls[0] += 1
        return gather(obj)

    comm.allgather_object = counted
    with trace.recording(comm.world_rank) as rec:
        a = GlobalTensor.from_global(np.ones((4, 8)), mesh, ("tp",), [S1])
        made = calls[0]
        b = GlobalTensor.from_global(np.ones((8, 4)), mesh, ("tp",), [S0])
        matmul(a, b)  # S(1) x S(0) -> P: no message; its result is not checked (it follows from a and b)
    return made, calls[0], sum(e.kind == "comm" for e in rec.events)


@pytest.mark.parametrize(("debug", "want"), [("0", 2), ("1", 3)])
def test_the_check_costs_one_untraced_collective_per_tensor_made(monkeypatch, debug: str, want: int) -> None:
    """One allgather_object per GlobalTensor a caller makes (a, b), one more per op in debug mode (the
    matmul), none of it in the trace."""
    monkeypatch.setenv("MINIPAR_DEBUG", debug)
    assert launch(count_agreements, 4, "threads") == [(1, want, 0)] * 4


def equal_meshes(comm) -> tuple[bool, bool]:
    """Two DeviceMesh objects of equal value (the second on a duplicate communicator)."""
    m1, m2 = DeviceMesh(comm, tp=4), DeviceMesh(comm.dup(), tp=4)
    x, y = np.arange(32.0).reshape(4, 8), np.arange(32.0).reshape(8, 4) / 7
    c = matmul(GlobalTensor.from_global(x, m1, ("tp",), [S1]), GlobalTensor.from_global(y, m2, ("tp",), [S0]))
    s = add(GlobalTensor.from_global(x, m1, ("tp",), [S0]), GlobalTensor.from_global(x, m2, ("tp",), [B]))
    return bool(np.allclose(c.to_global(), x @ y)), bool(np.array_equal(s.to_global(), 2 * x))


def test_equal_but_distinct_meshes_are_accepted() -> None:
    assert launch(equal_meshes, 4, "threads") == [(True, True)] * 4


def mixed(comm, case: str) -> tuple[str, int]:
    """Two tensors an op may not combine: on meshes of other values (a matmul), or over other axes (an
    embedding of ids on dp in a table on tp: before the check each rank held a wrong piece)."""
    if case == "meshes":
        m1, m2 = DeviceMesh(comm, tp=4), DeviceMesh(comm, dp=2, tp=2)
        a = GlobalTensor.from_global(np.ones((4, 8)), m1, ("tp",), [B])
        b = GlobalTensor.from_global(np.ones((8, 4)), m2, ("tp",), [B])
        return refusal(comm, lambda: matmul(a, b))
    mesh = DeviceMesh(comm, dp=2, tp=2)
    table = GlobalTensor.from_global(np.arange(32.0).reshape(8, 4), mesh, ("tp",), [S0])
    ids = GlobalTensor.from_global(np.array([1, 5, 7, 2]), mesh, ("dp",), [S0])
    return refusal(comm, lambda: embedding(table, ids))


@pytest.mark.parametrize(("case", "want"), [
    ("meshes", "matmul: the tensors are on different meshes (tp=4 on ranks [0, 1, 2, 3] vs dp=2 x tp=2 on ranks "
               "[0, 1, 2, 3]); make both on one mesh"),
    ("axes", "embedding: both tensors must be on the same mesh and axes, got ('tp',) and ('dp',); "
             "lay both out over the same axes"),
])
def test_distinct_meshes_or_axes_are_refused_saying_what_differs(case: str, want: str) -> None:
    assert launch(mixed, 4, "threads", case) == [(want, 0)] * 4


def op_on_diverged(comm) -> tuple[str, int]:
    """A bug simulated past the constructor: ranks 1 and 3 rewrite their ``a`` to be replicated. Ranks
    0 and 2 would then all-gather ``b`` (S(0) x B -> S(0)) while 1 and 3 send nothing (a hang)."""
    mesh = DeviceMesh(comm, tp=4)
    x = np.arange(32.0).reshape(4, 8)
    a = GlobalTensor.from_global(x, mesh, ("tp",), [S0])
    b = GlobalTensor.from_global(np.ones((8, 4)), mesh, ("tp",), [S0])
    if comm.rank % 2:
        a.placements, a.local = (B,), x
    return refusal(comm, lambda: matmul(a, b))


def test_debug_mode_refuses_an_op_on_diverged_placements_before_any_message(monkeypatch) -> None:
    monkeypatch.setenv("MINIPAR_DEBUG", "1")
    want = "matmul: ranks disagree on input 0 placements: ranks 0, 2 [S(0)]; ranks 1, 3 [B]"
    assert launch(op_on_diverged, 4, "threads") == [(want, 0)] * 4


def different_ops(comm) -> tuple[str, int]:
    """Ranks 0, 2 multiply (all-gathering ``b``); ranks 1, 3 add (no message)."""
    mesh = DeviceMesh(comm, tp=4)
    a, b = (GlobalTensor.from_global(np.eye(4), mesh, ("tp",), [S0]) for _ in range(2))
    return refusal(comm, lambda: (add if comm.rank % 2 else matmul)(a, b))


def test_debug_mode_refuses_ranks_in_different_ops_with_one_line(monkeypatch) -> None:
    monkeypatch.setenv("MINIPAR_DEBUG", "1")
    want = "sharding ops: ranks disagree on op: ranks 0, 2 matmul; ranks 1, 3 add"
    assert launch(different_ops, 4, "threads") == [(want, 0)] * 4


def test_disagreement_under_mpiexec() -> None:
    """Separate processes: equal layouts give equal digests (no salted hash), unequal ones the same line."""
    cases = [{"what": "placements"}, {"what": "nothing"}]
    placements, nothing = run_each(make_disagreeing, 4, cases, timeout=120, comm_timeout=60)
    assert placements == [(PLACEMENTS, 0)] * 4
    assert nothing == [("no error", 0)] * 4
