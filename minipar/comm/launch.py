"""One launcher for both backends, and the world communicator."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from minipar.comm.collectives import Communicator
from minipar.comm.errors import Aborted, CommTimeout, rank_error
from minipar.comm.watchdog import default_timeout

BACKENDS = ("threads", "mpi", "auto")


def world(timeout: float | None = None, deadline: float | None = None) -> Communicator:
    """The world communicator: from ``mpiexec`` when run under it (mpi backend, cached per
    process), otherwise a size-1 in-process (threads backend) communicator.
    ``timeout``: watchdog seconds (default ``MINIPAR_TIMEOUT`` or 60); ``deadline``: seconds of
    silence after which a peer is declared dead (``detector.py``; ``MINIPAR_PEER_DEADLINE``)."""
    from minipar.comm.mpi import mpi_world, under_mpiexec

    if under_mpiexec():
        return mpi_world(timeout, deadline)
    from minipar.comm.threads import make_world

    return make_world(1, default_timeout(timeout))[1][0]


def launch(fn: Callable[..., Any], world_size: int, backend: str = "threads", *args: Any,
           timeout: float | None = None, deadline: float | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` ranks; returns the results by rank.

    backend="threads": ``world_size`` threads in this process. If a rank raises, the other ranks
    are woken out of their waits at once (they raise ``Aborted``) and the first failure is
    re-raised here as ``RankError`` naming the rank (also an instance of the original exception's
    class, see ``errors.rank_error``), with every rank's status listed.
    backend="mpi": only under ``mpiexec -n world_size``; runs ``fn`` on this process's rank and
    returns a list of length ``world_size`` holding this rank's result at index ``comm.rank``
    (None elsewhere), so ``launch(...)[comm.rank]`` reads the same on both backends.
    backend="auto": "mpi" under ``mpiexec``, else "threads".
    ``timeout`` (keyword only, not passed to ``fn``): watchdog seconds for every wait; ``deadline``
    (keyword only): the failure detector's (``detector.py``). On threads, a rank that calls
    ``faults.kill`` stops there (its result is None) and raises nothing itself; the survivors see it die.
    """
    from minipar.comm.mpi import under_mpiexec

    if backend not in BACKENDS:
        raise ValueError(f"launch: backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if backend == "auto":
        backend = "mpi" if under_mpiexec() else "threads"
    if backend == "mpi":
        if not under_mpiexec():
            raise RuntimeError(f"launch(backend='mpi') must run under mpiexec: "
                               f"mpiexec -n {world_size} python your_script.py (or use backend='threads')")
        comm = world(timeout, deadline)
        if comm.size != world_size:
            raise ValueError(f"launch: world_size={world_size} but mpiexec started {comm.size} ranks; "
                             f"run mpiexec -n {world_size} or pass world_size={comm.size}")
        results: list[Any] = [None] * world_size
        results[comm.rank] = fn(comm, *args, **kwargs)
        return results
    return _launch_threads(fn, world_size, default_timeout(timeout), deadline, args, kwargs)


def _launch_threads(fn: Callable[..., Any], n: int, timeout: float, deadline: float | None,
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    from minipar.comm.faults import Killed
    from minipar.comm.threads import make_world

    world_, comms = make_world(n, timeout, deadline)
    results: list[Any] = [None] * n
    errors: dict[int, tuple[float, BaseException]] = {}

    def body(r: int) -> None:
        try:
            results[r] = fn(comms[r], *args, **kwargs)
        except Killed:  # a simulated dead process: it just stops
            pass
        except BaseException as exc:  # re-raised in the caller below
            errors[r] = (time.monotonic(), exc)
            if not isinstance(exc, Aborted):
                world_.abort(f"rank {r} failed with {type(exc).__name__}")

    threads = [threading.Thread(target=body, args=(r,), name=f"minipar-rank-{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.1)
    except BaseException:
        world_.abort("the launching thread was interrupted")
        raise
    finally:
        if world_.heartbeat is not None:
            world_.heartbeat.stop()
        for c in list(world_.comms):
            c.close()
    if not errors:
        return results
    real = {r: e for r, e in errors.items() if not isinstance(e[1], Aborted)} or errors
    # A timeout that waited for a rank which did not fail itself is the root cause: the others
    # waited, transitively, for the rank that timed out.
    roots = {r: e for r, e in real.items()
             if isinstance(e[1], CommTimeout) and any(p not in errors for p in e[1].peers)} or real
    first = min(roots, key=lambda r: roots[r][0])
    status = []
    for r in range(n):
        if r not in errors:
            status.append(f"  rank {r}: returned")
        else:
            exc = errors[r][1]
            line = str(exc).splitlines()[0] if str(exc) else ""
            status.append(f"  rank {r}: {type(exc).__name__}: {line[:200]}")
    raise rank_error(first, real[first][1], "\nall ranks:\n" + "\n".join(status)) from real[first][1]
