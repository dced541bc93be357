"""Start-up and shutdown under deadlines: the two waits of an MPI job that are single C calls.

``MPI_Init`` and ``MPI_Finalize`` each wait for every rank of the job (MPICH's Hydra: a PMI barrier),
and mpi4py calls them holding the GIL, so no Python thread can run meanwhile: a rank lost before MPI
starts, or after it said goodbye, left the others waiting for ever (a rank SIGKILLed at import under
``mpiexec -disable-auto-cleanup``: still waiting after 60 s). Here both are called through ``ctypes``,
which releases the GIL for the call, with a watcher thread beside them:

- **Start-up** (``StartupWatch``, from before ``MPI_Init`` until the failure detector's communicator
  exists): every rank has the launcher's folder (``MINIPAR_ELASTIC_STATUS``; ``minipar run`` makes
  one per attempt), where each rank's shell wrote ``pid<r>`` before it started Python and writes its
  exit status ``rank<r>`` when it ends. The watch touches ``alive<r>`` every heartbeat period and
  reads the others'. A peer is lost, and this rank exits 1 with one line naming it, when
  (1) its status is there (it ended before MPI could start: it will never join), or
  (2) its ``alive`` file is older than the deadline (it stopped: frozen, or its machine went), or
  (3) it never reached minipar: its process is stopped (SIGSTOP) for the deadline, gone, or still not
  here after the watchdog's timeout (``MINIPAR_TIMEOUT``: a slow import is not a loss).
  ``up<r>`` marks a rank past start-up (the detector watches it from then on). Without the folder
  (a plain ``mpiexec``, whose Hydra kills the job when a rank dies anyway) the watch can only say,
  after the watchdog's timeout, that start-up did not complete.
- **Shutdown** (``finalize``): every rank has said goodbye before ``MPI_Finalize`` (``detector.py``),
  so a peer that dies or freezes inside it is no longer watched; ``MPI_Finalize`` gets twice the
  deadline, then the rank exits with its own status, its work done.

A rank that declares peers lost (here, or its detector later) writes them to ``declared<r>`` in the
folder: ``minipar run --elastic`` kills a declared rank whose process is still there (a frozen one,
which would otherwise keep ``mpiexec`` waiting) and restarts without it. The pid and state checks
read ``/proc``: one machine (as the folder itself, and the checkpoints, assume one filesystem).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

FOLDER = "MINIPAR_ELASTIC_STATUS"


def folder() -> Path | None:
    """The launcher's folder of this attempt, if the job was started with one."""
    raw = os.environ.get(FOLDER)
    return Path(raw) if raw and os.path.isdir(raw) else None


def env_rank_size() -> tuple[int, int] | None:
    """This process's rank and the world size from the launcher's environment (before ``MPI_Init``)."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return None


def outside_mpiexec_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) without an enclosing mpiexec's variables (``PMI_``,
    ``PMIX_``, ``HYDI_``, ``HYDRA_``): what a rank passes to an ``mpiexec`` it starts itself, so that the
    new job is a world of its own, not a part of this one."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not k.startswith(("PMI_", "PMIX_", "HYDI_", "HYDRA_"))}


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader sees the old content or the new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def note_declared(where: Path | None, rank: int, dead: Iterable[int]) -> None:
    """Add ``dead`` to the ranks this ``rank`` declared lost (``declared<rank>``), for the launcher."""
    if where is None:
        return
    path = where / f"declared{rank}"
    try:
        old = set(path.read_text().split()) if path.exists() else set()
        _write(path, " ".join(sorted(old | {str(d) for d in dead}, key=int)) + "\n")
    except OSError:  # the launcher's folder is gone: the attempt is over anyway
        pass


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc`` (``T``: stopped, ``Z``: a zombie), or None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def describe_status(status: int) -> str:
    return f"killed by signal {status - 128}" if status > 128 else f"exit status {status}"


class StartupWatch:
    """The watcher of one rank's start-up (module docstring). ``done`` ends it."""

    def __init__(self, rank: int, size: int, deadline: float | None, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self.deadline = deadline if deadline is not None else timeout / 2
        self.where = folder()
        self.start = time.monotonic()
        self.stopped_since: dict[int, float] = {}
        self.stop = threading.Event()
        self.touch()
        self.thread = threading.Thread(target=self._loop, name="minipar-startup", daemon=True)
        self.thread.start()

    @property
    def period(self) -> float:
        return min(1.0, max(0.01, self.deadline / 5))

    def touch(self) -> None:
        if self.where is not None:
            try:
                (self.where / f"alive{self.rank}").touch()
            except OSError:
                pass

    def lost(self, now: float) -> dict[int, str]:
        """The peers lost so far, with why (module docstring's rules)."""
        out: dict[int, str] = {}
        where, waited = self.where, now - self.start
        if where is None:
            if waited > self.timeout:
                out[-1] = f"MPI start-up did not complete in {waited:.1f} s (MINIPAR_TIMEOUT)"
            return out
        wall = time.time()
        for p in range(self.size):
            if p == self.rank or (where / f"up{p}").exists():
                continue
            gave_up = where / f"declared{p}"  # a peer that abandoned start-up itself: its losses are ours
            if gave_up.exists():
                for q in map(int, gave_up.read_text().split()):
                    if q == self.rank:
                        out[p] = "gave up start-up, declaring this rank lost"
                    else:
                        out.setdefault(q, f"declared lost by rank {p}")
                continue
            status = read_int(where / f"rank{p}")
            if status is not None:
                out[p] = f"ended before MPI started ({describe_status(status)})"
                continue
            try:
                silent = wall - (where / f"alive{p}").stat().st_mtime
            except OSError:
                silent = None
            if silent is not None:
                if silent > self.deadline:
                    out[p] = f"silent for {silent:.1f} s during MPI start-up (deadline {self.deadline} s)"
                continue
            pid = read_int(where / f"pid{p}")
            state = None if pid is None else process_state(pid)
            if state == "T":
                since = self.stopped_since.setdefault(p, now)
                if now - since > self.deadline:
                    out[p] = f"stopped (SIGSTOP) before MPI started, for {now - since:.1f} s"
            elif pid is not None and state in (None, "Z"):
                out[p] = "its process is gone (before MPI started)"
            elif waited > self.timeout:
                out[p] = f"not at MPI start-up after {waited:.1f} s (MINIPAR_TIMEOUT)"
            if state != "T":
                self.stopped_since.pop(p, None)
        return out

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            self.touch()
            lost = self.lost(time.monotonic())
            if lost and not self.stop.is_set():
                gave_up = {p for p in lost if self.where is not None and (self.where / f"declared{p}").exists()}
                note_declared(self.where, self.rank, [p for p in lost if p >= 0 and p not in gave_up])
                why = "; ".join(f"rank {p} lost: {w}" if p >= 0 else w for p, w in sorted(lost.items()))
                sys.stderr.write(f"[minipar] rank {self.rank}: start-up abandoned: {why}\n")
                sys.stderr.flush()
                os._exit(1)

    def done(self) -> None:
        """Start-up is over on this rank: stop watching, mark ``up<rank>``."""
        self.stop.set()
        self.thread.join()
        if self.where is not None:
            try:
                (self.where / f"up{self.rank}").touch()
            except OSError:
                pass


def libmpi() -> Any:
    """The MPI library this process loaded (``ctypes``: its calls release the GIL), or None where
    ``/proc/self/maps`` does not say (then mpi4py initialises MPI itself, with no watch)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.MPI_Init_thread, lib.MPI_Finalize  # noqa: B018 -- both must be there
            return lib
        except (OSError, AttributeError):
            continue
    return None


def init_mpi(deadline: float | None, timeout: float) -> StartupWatch | None:
    """Initialise MPI (mpi4py imported with ``rc.initialize`` off) under a ``StartupWatch``; returns
    the watch, to be ``done`` once the detector's communicator exists (None: no watch possible)."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # both are ours (mpi.py's _at_exit)
    from mpi4py import MPI

    ids, lib = env_rank_size(), libmpi()
    if ids is None or lib is None:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return None
    watch = StartupWatch(*ids, deadline, timeout)
    provided = ctypes.c_int()
    if lib.MPI_Init_thread(None, None, MPI.THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
        raise RuntimeError("MPI_Init_thread failed")
    return watch


def finalize(limit: float, status: int, rank: int) -> None:
    """``MPI_Finalize`` (GIL released); after ``limit`` seconds the rank exits with ``status``: a peer
    left and then died or froze, and MPICH's finalize would wait for it for ever."""
    from mpi4py import MPI

    lib = libmpi()
    if lib is None:
        MPI.Finalize()
        return
    finished = threading.Event()

    def watch() -> None:
        if not finished.wait(limit):
            sys.stderr.write(f"[minipar] rank {rank}: MPI_Finalize did not complete in {limit:.1f} s (a peer left, "
                             f"then died or froze): exiting without it, status {status}\n")
            sys.stderr.flush()
            os._exit(status)

    threading.Thread(target=watch, name="minipar-finalize", daemon=True).start()
    lib.MPI_Finalize()
    finished.set()
