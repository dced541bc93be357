"""Faults on purpose, and running jobs that survive them.

``kill(comm)`` ends this rank the way a pre-empted machine does: under ``mpiexec`` the process
SIGKILLs itself (no cleanup, no goodbye); on the threads backend the rank's heartbeats stop and
its thread leaves ``launch``'s function at once (``Killed``), so the survivors' failure detector
(``detector.py``) sees what it would see of a dead process.

``mpiexec_command(n, argv)`` is the command line that lets survivors outlive a dead rank with
MPICH's Hydra: ``-disable-auto-cleanup``, and each rank started under a ``sh`` that ignores SIGUSR1
(Hydra sends it to every survivor of a dead rank; its default action kills) and exits normally with
the rank's status. The shell matters: Hydra's proxy (``pmip.c``) SIGKILLs every process it started
when one of them dies *by a signal*, even with ``-disable-auto-cleanup`` (MPICH 5.0.2, measured);
the shell turns a SIGKILLed rank into an ordinary exit with status 137.

While a trace file records (``trace.record`` with a path), ``kill`` first adds a "killed" mark and
writes the rank's events so far to a side file next to the trace (``trace.spill``), which rank 0
merges: it stands in for a per-rank on-disk log. A real SIGKILL from outside writes nothing, and the
rank's events are lost with it. With no trace recording this costs one thread-local lookup.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from minipar import trace

SPOT_SHELL = 'trap "" USR1; "$0" "$@"; exit $?'


class Killed(BaseException):  # noqa: N818 -- not an error: the simulated end of a rank
    """Raised by ``kill`` on the threads backend: this rank stops, like a killed process."""


def kill(comm: Any) -> NoReturn:
    """End this rank abruptly (SIGKILL under mpiexec; silenced heartbeats + ``Killed`` on threads);
    a recording trace gets a "killed" mark and the rank's events spilled to a side file first."""
    rec = trace.current()
    if rec is not None:
        trace.mark("killed", rank=comm.world_rank)
        trace.spill(rec)
    if comm.backend == "mpi":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.world.heartbeat is not None:
        comm.world.heartbeat.silence(comm.world_rank)
    raise Killed(f"rank {comm.world_rank} killed")


def mpiexec_command(n: int, argv: list[str], mpiexec: str | os.PathLike[str] | None = None) -> list[str]:
    """``mpiexec -disable-auto-cleanup -n n sh -c ... argv``: a job whose survivors outlive a dead rank."""
    exe = str(mpiexec or Path(sys.executable).parent / "mpiexec")
    return [exe, "-disable-auto-cleanup", "-n", str(n), "sh", "-c", SPOT_SHELL, *argv]
