"""Collective operations of a ``Communicator``: argument checks, debug-mode mismatch checks, and
dispatch to the hand-written algorithms (``ring.py``, ``tree.py``) or the library's own ("native").

Every collective returns a NEW array and never modifies its input. Reduction ops: "sum", "mean"
(sum / size; floating dtypes only), "max". Arguments are checked on every rank before any message
is sent, so a bad call fails the same way everywhere.

"native": on the mpi backend MPI's own non-blocking collective (``Iallreduce`` ...) polled under
the watchdog; on the threads backend a direct shared-memory exchange (every rank reads the others'
arrays). Either way the trace gets ONE comm event per rank, ``name="native"``, ``src = dst =
None`` (the library's internal messages are invisible), ``nbytes`` = this rank's input bytes; so
``Trace.bytes_sent`` does not count it. ``args["group"]`` names the world ranks of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from minipar import trace
from minipar.comm import ring, tree
from minipar.comm.base import PointToPoint, Request, as_array
from minipar.comm.errors import CollectiveMismatch

BF16 = np.dtype(ml_dtypes.bfloat16)  # a float numpy does not know as one (not np.inexact)

OPS = ("sum", "mean", "max")
ALGORITHMS_BY_OP = {
    "allreduce": ("ring", "recursive_doubling", "naive", "native"),
    "reduce_scatter": ("ring", "native"),
    "allgather": ("ring", "native"),
    "all_to_all": ("pairwise", "native"),
    "broadcast": ("tree", "native"),
    "reduce": ("tree", "native"),
    "barrier": ("dissemination", "native"),
}


def reduce_list(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """Combine arrays in rank order (the reference every algorithm is tested against)."""
    acc = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        ring.combine(acc, a, op)
    ring.finish_mean(acc, op, len(arrays))
    return acc


def scatter_shape(shape: tuple[int, ...], size: int, rank: int) -> tuple[int, ...]:
    """Shape of ``rank``'s ``reduce_scatter`` result for an input of ``shape`` (see ``ring.py``)."""
    if len(shape) >= 1 and shape[0] % size == 0:
        return (shape[0] // size, *shape[1:])
    a, b = ring.chunk_bounds(int(np.prod(shape)), size)[rank]
    return (b - a,)


class Communicator(PointToPoint):
    """Point-to-point (``base.py``) plus collectives. Created by ``launch``, ``world()``,
    ``split`` and ``dup``; never constructed directly."""

    # ---- checks ----------------------------------------------------------------------------
    def _check(self, name: str, algorithm: str, arr: np.ndarray | None = None, op: str | None = None) -> None:
        if algorithm not in ALGORITHMS_BY_OP.get(name, (algorithm,)):
            raise ValueError(f"{name}: unknown algorithm {algorithm!r}; choose one of {ALGORITHMS_BY_OP[name]}")
        if op is not None:
            if op not in OPS:
                raise ValueError(f"{name}: unknown op {op!r}; choose one of {OPS}")
            if op == "mean" and arr is not None and not (np.issubdtype(arr.dtype, np.inexact) or arr.dtype == BF16):
                raise ValueError(f"{name}: op='mean' needs a floating dtype, got {arr.dtype}; "
                                 "cast first or use op='sum'")

    def _enter(self, name: str, **sig: Any) -> None:
        """Debug mode: check that every rank entered the same collective with matching arguments."""
        if not self.debug or self.size == 1:
            return
        mine = (name, tuple(sorted(sig.items())))
        table = self.allgather_object(mine)
        if any(t != table[0] for t in table):
            rows = "\n".join(
                f"  rank {r} (world {self.group_ranks[r]}): {n}("
                + ", ".join(f"{k}={v!r}" for k, v in s) + ")"
                for r, (n, s) in enumerate(table))
            raise CollectiveMismatch(f"rank {self.world_rank}: ranks of group {self.group_ranks} entered "
                                     f"different collectives:\n{rows}")

    def _run(self, name: str, algorithm: str, fn: Callable[[], Any]) -> Any:
        out = fn()
        self.state.done(f"{name}({algorithm}) on group {self.group_ranks}")
        return out

    def _native_traced(self, name: str, arr: np.ndarray | None, **kw: Any) -> Any:
        t0, c0 = trace.now(), trace.cpu()
        out = self._native(name, arr, **kw)
        rec = trace.current()
        if rec is not None:  # the group and cid let minipar.replay meet the ranks of one call
            rec.add("comm", "native", t0, trace.now(), nbytes=0 if arr is None else arr.nbytes, op=name,
                    algorithm="native", c0=c0, c1=trace.cpu(), cid=self.cid, args={"group": self.group_ranks})
        return out

    def _native(self, name: str, arr: np.ndarray | None, **kw: Any) -> Any:
        """The library's own collective; default: exchange every rank's array and compute locally."""
        arrays = self._exchange_arrays(arr)
        p, r = self.size, self.rank
        if name == "allreduce":
            return reduce_list(arrays, kw["op"])
        if name == "reduce":
            return reduce_list(arrays, kw["op"]) if r == kw["root"] else None
        if name == "reduce_scatter":
            a, b = ring.chunk_bounds(arrays[0].size, p)[r]
            full = reduce_list([x.reshape(-1)[a:b] for x in arrays], kw["op"])
            return full.reshape(scatter_shape(arrays[0].shape, p, r))
        if name == "allgather":
            return np.concatenate(arrays, axis=0)
        if name == "all_to_all":
            b = arrays[0].shape[0] // p
            return np.concatenate([x[r * b:(r + 1) * b] for x in arrays], axis=0)
        if name == "broadcast":
            return np.array(arrays[kw["root"]], copy=True)
        if name == "barrier":
            return None
        raise ValueError(f"{name}: no native implementation")

    def _exchange_arrays(self, arr: np.ndarray | None) -> list[Any]:
        return self.allgather_object(arr)

    # ---- all-reduce family ------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, op: str = "sum", algorithm: str = "ring") -> np.ndarray:
        """Every rank gets the reduction of all ranks' arrays (same shape and dtype as the input).
        algorithm: "ring" | "recursive_doubling" | "naive" | "native" (costs in ``ring.py``)."""
        arr = as_array(array, "allreduce")
        self._check("allreduce", algorithm, arr, op)
        self._enter("allreduce", algorithm=algorithm, op=op, shape=arr.shape, dtype=str(arr.dtype))
        if self.size == 1:
            return reduce_list([arr], op)
        fns = {"ring": ring.allreduce_ring, "recursive_doubling": ring.allreduce_recursive_doubling,
               "naive": ring.allreduce_naive}
        if algorithm == "native":
            return self._run("allreduce", algorithm, lambda: self._native_traced("allreduce", arr, op=op))
        return self._run("allreduce", algorithm, lambda: fns[algorithm](self, arr, op))

    def reduce_scatter(self, array: np.ndarray, op: str = "sum", algorithm: str = "ring") -> np.ndarray:
        """This rank's chunk of the reduction. Chunking: if axis 0 divides by ``size``, rank r gets
        rows ``[r*n0/size, (r+1)*n0/size)`` (shape ``(n0/size, ...)``); otherwise the flattened array
        is cut like ``np.array_split(flat, size)`` and rank r gets 1-D chunk r. ``scatter_shape``
        gives the result's shape. Ring: (p-1) steps, (p-1)/p n bytes out per rank."""
        arr = as_array(array, "reduce_scatter")
        self._check("reduce_scatter", algorithm, arr, op)
        self._enter("reduce_scatter", algorithm=algorithm, op=op, shape=arr.shape, dtype=str(arr.dtype))
        shape = scatter_shape(arr.shape, self.size, self.rank)
        if algorithm == "native" and self.size > 1:
            return self._run("reduce_scatter", algorithm,
                             lambda: self._native_traced("reduce_scatter", arr, op=op))

        def go() -> np.ndarray:
            if self.size == 1:
                return reduce_list([arr], op).reshape(shape)
            src = np.ascontiguousarray(arr).reshape(-1)
            mine = ring.ring_reduce_scatter(self, np.empty_like(src), op, src=src)
            return mine.copy().reshape(shape)

        return self._run("reduce_scatter", algorithm, go)

    def allgather(self, array: np.ndarray, algorithm: str = "ring") -> np.ndarray:
        """Concatenation along axis 0 of every rank's array, by rank; axis-0 lengths may differ
        (the other axes and the dtype must match). Ring: (p-1) steps."""
        arr = as_array(array, "allgather")
        self._check("allgather", algorithm)
        if arr.ndim == 0:
            raise ValueError("allgather: needs at least one axis to concatenate along; pass array[None]")
        self._enter("allgather", algorithm=algorithm, trailing=arr.shape[1:], dtype=str(arr.dtype))
        if self.size == 1:
            return arr.copy()
        if algorithm == "native":
            return self._run("allgather", algorithm, lambda: self._native_traced("allgather", arr))
        return self._run("allgather", algorithm, lambda: ring.ring_allgather(self, arr))

    def all_to_all(self, array: np.ndarray, algorithm: str = "pairwise") -> np.ndarray:
        """Axis 0 is cut into ``size`` equal blocks; block j goes to rank j; the result stacks the
        received blocks by source rank (same shape as the input). Pairwise: (p-1) steps."""
        arr = as_array(array, "all_to_all")
        self._check("all_to_all", algorithm)
        if arr.ndim == 0 or arr.shape[0] % self.size:
            raise ValueError(f"all_to_all: axis 0 of shape {arr.shape} must divide into {self.size} "
                             "equal blocks (one per rank)")
        self._enter("all_to_all", algorithm=algorithm, shape=arr.shape, dtype=str(arr.dtype))
        if self.size == 1:
            return arr.copy()
        if algorithm == "native":
            return self._run("all_to_all", algorithm, lambda: self._native_traced("all_to_all", arr))
        return self._run("all_to_all", algorithm, lambda: tree.all_to_all_pairwise(self, arr))

    # ---- rooted -----------------------------------------------------------------------------
    def broadcast(self, array: np.ndarray | None, root: int = 0, algorithm: str = "tree") -> np.ndarray:
        """``root``'s array on every rank (non-roots may pass None). Binomial tree: ceil(lg p) rounds."""
        self._check_root(root, "broadcast")
        self._check("broadcast", algorithm)
        arr = as_array(array, "broadcast") if self.rank == root else None
        self._enter("broadcast", algorithm=algorithm, root=root)
        if self.size == 1:
            assert arr is not None
            return arr.copy()
        if algorithm == "native":
            return self._run("broadcast", algorithm, lambda: self._native_traced("broadcast", arr, root=root))
        return self._run("broadcast", algorithm, lambda: tree.broadcast_tree(self, arr, root))

    def reduce(self, array: np.ndarray, root: int = 0, op: str = "sum",
               algorithm: str = "tree") -> np.ndarray | None:
        """The reduction on ``root`` (None on the other ranks). Binomial tree: ceil(lg p) rounds."""
        self._check_root(root, "reduce")
        arr = as_array(array, "reduce")
        self._check("reduce", algorithm, arr, op)
        self._enter("reduce", algorithm=algorithm, op=op, root=root, shape=arr.shape, dtype=str(arr.dtype))
        if self.size == 1:
            return reduce_list([arr], op)
        if algorithm == "native":
            return self._run("reduce", algorithm,
                             lambda: self._native_traced("reduce", arr, op=op, root=root))
        return self._run("reduce", algorithm, lambda: tree.reduce_tree(self, arr, root, op))

    def gather(self, array: np.ndarray, root: int = 0) -> np.ndarray | None:
        """Concatenation along axis 0 of every rank's array on ``root`` (None elsewhere); axis-0
        lengths may differ. Linear: the root receives p-1 messages."""
        self._check_root(root, "gather")
        arr = as_array(array, "gather")
        if arr.ndim == 0:
            raise ValueError("gather: needs at least one axis to concatenate along; pass array[None]")
        self._enter("gather", root=root, trailing=arr.shape[1:], dtype=str(arr.dtype))
        if self.size == 1:
            return arr.copy()
        return self._run("gather", "linear", lambda: tree.gather_linear(self, arr, root))

    def scatter(self, array: np.ndarray | None, root: int = 0) -> np.ndarray:
        """Root's array cut along axis 0 like ``np.array_split(array, size)`` (the first
        ``len % size`` blocks one row longer); rank r gets block r. Non-roots may pass None."""
        self._check_root(root, "scatter")
        arr = as_array(array, "scatter") if self.rank == root else None
        if arr is not None and arr.ndim == 0:
            raise ValueError("scatter: the root's array needs an axis 0 to cut into blocks")
        self._enter("scatter", root=root)
        if self.size == 1:
            assert arr is not None
            return arr.copy()
        return self._run("scatter", "linear", lambda: tree.scatter_linear(self, arr, root))

    def barrier(self, algorithm: str = "dissemination") -> None:
        """Return only after every rank has entered. Dissemination: ceil(lg p) rounds of 0 bytes."""
        self._check("barrier", algorithm)
        self._enter("barrier", algorithm=algorithm)
        if self.size == 1:
            return
        if algorithm == "native":
            self._run("barrier", algorithm, lambda: self._native_traced("barrier", None))
        else:
            self._run("barrier", algorithm, lambda: tree.barrier_dissemination(self))

    # ---- non-blocking -----------------------------------------------------------------------
    def iallreduce(self, array: np.ndarray, op: str = "sum", algorithm: str = "ring") -> Request:
        """Start ``allreduce`` on a background thread; ``wait()`` returns the result.

        One FIFO worker thread per communicator runs the started collectives in order, on a
        ``dup()`` of this communicator (its messages never mix with the caller's). Every rank must
        start its non-blocking collectives in the same order. The input is copied at the call, so
        the caller may reuse its buffer at once."""
        arr = as_array(array, "iallreduce")
        self._check("allreduce", algorithm, arr, op)
        return self._submit("allreduce", arr, op=op, algorithm=algorithm)

    def ireduce_scatter(self, array: np.ndarray, op: str = "sum", algorithm: str = "ring") -> Request:
        """Non-blocking ``reduce_scatter`` (see ``iallreduce``)."""
        arr = as_array(array, "ireduce_scatter")
        self._check("reduce_scatter", algorithm, arr, op)
        return self._submit("reduce_scatter", arr, op=op, algorithm=algorithm)

    def iallgather(self, array: np.ndarray, algorithm: str = "ring") -> Request:
        """Non-blocking ``allgather`` (see ``iallreduce``)."""
        arr = as_array(array, "iallgather")
        self._check("allgather", algorithm)
        return self._submit("allgather", arr, algorithm=algorithm)

    def _submit(self, name: str, arr: np.ndarray, **kw: Any) -> Request:
        from minipar.comm.asyncwork import Worker

        if self._async is None:
            self._async = Worker(self.dup())
        return self._async.submit(self, name, arr.copy(), kw)
