"""Agreement checks: every rank of a mesh must hold the same layout of a global tensor.

A ``GlobalTensor`` is made by every rank of its mesh with arguments that should be equal (SPMD); a
rank that passes other placements, another shape or another mesh would compute on a piece that does
not fit its peers' and return a wrong result without any error. So:

- ``tensor(t)`` runs ALWAYS when a caller makes a ``GlobalTensor`` (its constructor, ``from_global``,
  ``zeros``, ``ops.constant``): one ``allgather_object`` of an 8-byte digest of the mesh, axes, shape
  and placements over the mesh's communicator. Cost: one small control-plane collective per tensor
  made (on threads a shared-memory rendezvous; under MPI ``gather_object`` then ``broadcast_object``:
  ``2 (P - 1)`` pickled messages of a few dozen bytes; wall clock on a 2-core machine, 4 ranks:
  about 0.37 ms per tensor on threads, 0.57 ms under ``mpiexec``). Control-plane messages are not traced
  (``comm/base.py``), so traces, byte counts and the lessons' formulas are unchanged. The ops' results
  and gradients skip it (``check=False``): their layout follows from checked inputs on every rank
  alike. Measured on one Megatron block's forward and backward (tp = 4 threads, wall clock): 5 checks
  (the caller's tensors) where checking every result would be 214, about 95 ms against 62 ms.
- ``op(name, inputs, ...)`` runs before the first message of every op and of ``redistribute`` when the
  communicator is in debug mode (``MINIPAR_DEBUG=1``, ``watchdog.debug_enabled``): the op's name, its
  arguments and each input's layout, digested the same way (one more such collective per op).

Only when the digests differ is each rank's description gathered (a second collective, on every rank
alike since all hold the same table), and every rank raises the same one-line ``ValueError`` naming
the ranks of each distinct value of what differs. The digest is ``hashlib.blake2b`` of a canonical
text, equal across processes (Python's ``hash`` of a string is salted per process).

Meshes are compared by value: their degrees and the world ranks of their communicator in rank order
(``mesh_difference``); two equal but distinct ``DeviceMesh`` objects hold tensors that ops may combine.
The comparison spans every rank of the mesh, also along axes a tensor is not laid out on: replicas
(a tensor over ``tp`` on a ``dp x tp`` mesh) make it with the same shape and placements too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from minipar.mesh import DeviceMesh
from minipar.sharding.placement import describe


def mesh_text(mesh: DeviceMesh) -> str:
    """A mesh's value: ``dp=2 x tp=2 on ranks [0, 1, 2, 3]`` (degrees other than 1, world ranks)."""
    degrees = " x ".join(f"{a}={d}" for a, d in mesh.shape.degrees().items() if d > 1) or "1"
    return f"{degrees} on ranks {list(mesh.comm.group_ranks)}"


def mesh_difference(a: DeviceMesh, b: DeviceMesh) -> str:
    """What differs between two meshes' values (``""`` when equal, even for distinct objects)."""
    if a is b:
        return ""
    ta, tb = mesh_text(a), mesh_text(b)
    return "" if ta == tb else f"{ta} vs {tb}"


def check_same(what: str, x: Any, y: Any) -> None:
    """``ValueError`` unless global tensors ``x`` and ``y`` are on equal meshes (by value) and axes."""
    differ = mesh_difference(x.mesh, y.mesh)
    if differ:
        raise ValueError(f"{what}: the tensors are on different meshes ({differ}); make both on one mesh")
    if x.axes != y.axes:
        raise ValueError(f"{what}: both tensors must be on the same mesh and axes, got {x.axes} and {y.axes}; "
                         "lay both out over the same axes")


def layout(t: Any, prefix: str = "") -> dict[str, str]:
    """A global tensor's layout, field by field, as canonical text."""
    return {f"{prefix}mesh": mesh_text(t.mesh), f"{prefix}axes": str(tuple(t.axes)),
            f"{prefix}shape": str(tuple(t.shape)), f"{prefix}placements": describe(t.placements)}


def digest(fields: dict[str, str]) -> int:
    """An int64 digest of ``fields``, equal in every process for equal fields."""
    text = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def disagreement(what: str, table: Sequence[dict[str, str]], world: Sequence[int]) -> str:
    """The one-line error for the fields of ``table`` (one dict by rank, ranks named by ``world``)
    that are not equal on every rank: the ranks holding each distinct value."""
    every = list(dict.fromkeys(k for row in table for k in row))  # in order; an op may have more inputs
    keys = [k for k in every if any(row.get(k) != table[0].get(k) for row in table)]
    if "op" in keys:  # ranks in different ops: no one op's name starts the line
        what = "sharding ops"
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, row in zip(world, table, strict=True):
        groups.setdefault(tuple(row.get(k, "(none)") for k in keys), []).append(r)
    held = "; ".join(f"{_ranks(rs)} " + ", ".join(str(v) for v in vals) for vals, rs in groups.items())
    return f"{what}: ranks disagree on {' and '.join(keys)}: {held}"


def agree(what: str, mesh: DeviceMesh, fields: dict[str, str]) -> None:
    """``ValueError`` on every rank of ``mesh`` unless all hold equal ``fields`` (module docstring)."""
    comm = mesh.comm
    if comm.size == 1:
        return
    if len(set(comm.allgather_object(digest(fields)))) == 1:
        return
    raise ValueError(disagreement(what, comm.allgather_object(fields), comm.group_ranks))


def tensor(t: Any) -> None:
    """The always-on check of a new ``GlobalTensor`` (module docstring)."""
    agree("GlobalTensor", t.mesh, layout(t))


def op(name: str, inputs: Sequence[Any], args: str = "") -> None:
    """In debug mode only: every rank runs op ``name`` with equal ``args`` on inputs of equal layouts,
    checked before the op's first message (module docstring)."""
    mesh = inputs[0].mesh
    if not mesh.comm.debug:
        return
    fields = {"op": name, "arguments": args}
    for i, t in enumerate(inputs):
        fields.update(layout(t, f"input {i} " if len(inputs) > 1 else "input "))
    agree(name, mesh, fields)
