"""The named device mesh: coordinates, one sub-communicator per axis (and per pair), axis of a message.

Property: for every mesh whose degrees multiply to the world size, each rank's group along an axis
is exactly the ranks that differ from it in that coordinate alone (hand-written grids below, then
drawn meshes against a brute-force enumeration), and a mesh that does not match the world is
refused on every rank before any message.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minipar import trace
from minipar.mesh import AXES, DeviceMesh, MeshShape
from minipar.testing import run


def test_grid_by_hand() -> None:
    # 8 ranks, pp=2 x dp=2 x tp=2: rank = (pp * 2 + dp) * 2 + tp
    shape = MeshShape(pp=2, dp=2, tp=2)
    assert shape.coords(5) == {"pp": 1, "dp": 0, "sp": 0, "tp": 1}
    assert shape.rank_of(pp=1, dp=1, tp=0) == 6
    assert shape.group(5, "tp") == [4, 5]
    assert shape.group(5, "dp") == [5, 7]
    assert shape.group(5, "pp") == [1, 5]
    assert shape.group(5, "dp", "sp") == [5, 7]
    assert shape.axis_of(4, 5) == "tp" and shape.axis_of(1, 7) == "pp+dp"
    assert shape.axis_of(0, 7) == "pp+dp+tp" and shape.axis_of(3, 3) == ""
    assert str(shape) == "PP(2)-DP(2)-SP(1)-TP(2)"
    assert shape.meta() == {"axes": ["pp", "dp", "sp", "tp"], "shape": [2, 2, 1, 2]}


def _brute_group(degrees: dict[str, int], rank: int, axes: tuple[str, ...]) -> list[int]:
    grid = list(itertools.product(*(range(degrees[a]) for a in AXES)))  # row-major: tp fastest
    mine = grid[rank]
    keep = [i for i, a in enumerate(AXES) if a not in axes]
    return [r for r, c in enumerate(grid) if all(c[i] == mine[i] for i in keep)]


@st.composite
def meshes(draw: st.DrawFn) -> dict[str, int]:
    world = draw(st.sampled_from([1, 2, 4, 8, 6]))
    degrees, left = {}, world
    for a in AXES[:-1]:
        d = draw(st.sampled_from([k for k in range(1, left + 1) if left % k == 0]))
        degrees[a], left = d, left // d
    degrees["tp"] = left
    return degrees


@given(meshes(), st.data())
def test_groups_are_the_ranks_differing_in_one_coordinate(degrees: dict[str, int], data: st.DataObject) -> None:
    shape = MeshShape(**degrees)
    rank = data.draw(st.integers(0, shape.size - 1))
    for axes in [(a,) for a in AXES] + [("dp", "sp")]:
        assert shape.group(rank, *axes) == _brute_group(degrees, rank, axes)
    other = data.draw(st.integers(0, shape.size - 1))
    diff = [a for i, a in enumerate(AXES) if np.unravel_index(rank, shape.shape)[i] != np.unravel_index(
        other, shape.shape)[i]]
    assert shape.axis_of(rank, other) == "+".join(diff)


def mesh_rank(comm, degrees: dict[str, int]) -> dict:
    mesh = DeviceMesh(comm, **degrees)
    out = {"coords": mesh.coords, "str": str(mesh)}
    for axes in [(a,) for a in AXES] + [("dp", "sp")]:
        sub = mesh.group(*axes)
        out["/".join(axes)] = (sub.group_ranks, sub.rank, sub.allgather_object(comm.rank))
    return out


@pytest.mark.parametrize("degrees", [{"dp": 2, "pp": 2}, {"tp": 2, "sp": 2}, {"dp": 4}, {"pp": 2, "tp": 2}])
def test_device_mesh_threads(degrees: dict[str, int]) -> None:
    results = run(mesh_rank, 4, "threads", degrees=degrees)
    shape = MeshShape(**degrees)
    for rank, out in enumerate(results):
        assert out["coords"] == shape.coords(rank)
        for axes in [(a,) for a in AXES] + [("dp", "sp")]:
            members, sub_rank, seen = out["/".join(axes)]
            want = _brute_group({**{a: 1 for a in AXES}, **degrees}, rank, axes)
            assert members == want and seen == want and sub_rank == want.index(rank)
    assert results[3]["str"].startswith(str(shape)) and "Rank(3:" in results[3]["str"]


@pytest.mark.mpi
@pytest.mark.mpi8
def test_device_mesh_mpiexec() -> None:
    results = run(mesh_rank, 8, "mpi", timeout=120, degrees={"pp": 2, "dp": 2, "tp": 2})
    assert [r["tp"][0] for r in results] == [[2 * (r // 2), 2 * (r // 2) + 1] for r in range(8)]
    assert results[5]["dp"][0] == [5, 7] and results[5]["pp"][0] == [1, 5]


def bad_mesh(comm, path: str) -> str:
    with trace.record(path, comm=comm):
        try:
            DeviceMesh(comm, dp=2, tp=3)
        except ValueError as exc:
            return str(exc)
    return "no error"


def test_mesh_not_matching_world_refused_on_every_rank(tmp_path) -> None:
    path = str(tmp_path / "t.json")
    msgs = run(bad_mesh, 4, "threads", path=path)
    assert len(set(msgs)) == 1 and "dp=2 x tp=3 = 6 ranks but the world has 4" in msgs[0]
    assert "mpiexec -n 6" in msgs[0]
    assert [e for e in trace.load(path).events if e.kind == "comm"] == []
    with pytest.raises(ValueError, match="positive int"):
        MeshShape(dp=0)
    with pytest.raises(ValueError, match="no axis"):
        MeshShape(dp=2).rank_of(ep=1)
