"""Elastic restart: ``minipar run --elastic -n N script.py`` runs ``mpiexec -n N`` and, when ranks
were lost, runs it again with the survivors; the script resumes from its last complete sharded
checkpoint, re-cut for the new world size, keeping the global batch.

This is torchrun's design (TorchElastic: an agent restarts the whole worker group, each worker
learns ``TORCHELASTIC_RESTART_COUNT`` and ``WORLD_SIZE`` and loads its last checkpoint), and that of
DeepSpeed's elastic training (a global batch kept across world sizes by changing the gradient
accumulation). The loop (``elastic_loop``)::

    run k with N_k ranks  ->  all exited 0: done, status 0
                          ->  no rank lost (a bug, a refusal): stop with that run's status
                          ->  ranks lost: N_{k+1} = N_k - lost (or --restart-n), if >= --min-ranks
                              and fewer than --max-restarts restarts so far: run again

**Which ranks died.** Each rank runs under a tiny ``sh`` (``STATUS_SHELL``) that writes the rank's
exit status to ``<status dir>/rank<PMI_RANK>`` when the rank ends, however it ends. A shell reports
a rank killed by a signal as 128 + the signal: 137 for SIGKILL (a pre-empted machine, the OOM
killer), 143 for SIGTERM (a polite reclaim); a survivor that gave up on a dead peer (``PeerLost``,
the watchdog's ``CommTimeout``) exits with an ordinary non-zero status. So a rank is *lost* when

- its status is 137 or 143 (``LOST_SIGNALS``); another signal (SIGSEGV 139, SIGABRT 134) is the
  program's own crash, which a restart would only repeat; or
- it has no status while other ranks recorded theirs and no rank of the run aborted: its shell died
  with it (the whole machine went). A rank that calls ``MPI_Abort`` first leaves ``aborted<rank>``
  in the folder (``minipar.comm.mpi``'s abort hook), and Hydra then kills every shell: those ranks
  have no status and are torn down, not lost. When no rank recorded anything (Hydra tore the whole
  job down, as it does when a rank's shell is killed on this machine), the loop cannot tell which
  machine went and does not restart; or
- it stopped making progress: a peer declared it dead (``declared<r>`` in the folder, written by the
  peer's failure detector or start-up watch, ``minipar.comm.startup``) while its process was still
  there (frozen by SIGSTOP, or too slow to be told from a dead one), or it was still running
  ``--attempt-timeout`` seconds after another rank ended other than by a loss (ranks leave together,
  each waiting for the others' goodbyes; e.g. one frozen inside ``MPI_Finalize``). The loop, which
  launched it, kills it (SIGKILL, by the pid its shell wrote to ``pid<r>``: ``supervise``) and says
  so. TorchElastic likewise treats a worker that stops making progress like a lost one. The limit
  bounds only the attempt's end, not its length: a healthy run may last as long as it needs.

Why not the others: mpiexec's own exit status is one number for the whole job (Hydra ORs the ranks'
statuses: 1 and 2 give 3, 137 and 3 give 139); the ``PeerLost`` message names the dead rank only
when the failure detector ran and the survivors lived to print it; a heartbeat file per rank would
need a clock and a deadline a second time (the detector has one).

The shell also ignores SIGUSR1, which Hydra sends to the survivors of a dead rank (its default
action kills), and turns a rank killed by a signal into an ordinary exit of the shell, so that
Hydra's proxy, which SIGKILLs all its processes when one of them dies *by a signal* even under
``-disable-auto-cleanup``, lets the survivors finish (``faults.mpiexec_command`` does the same
without recording the status).

A failure with no lost rank is not restarted: a program error or a refusal (a global batch that
does not divide over the survivors) would only fail again (torchrun restarts on any failure). The
loop says which it saw: "ranks [1] lost (a fault, not the program's error): restart ..." or "failed
but lost no rank (a program error or a refusal ...): not restarting".

**What the script sees** (environment, like torchrun's): ``MINIPAR_RESTART_COUNT`` (0 on the first
run), ``MINIPAR_MAX_RESTARTS``, ``MINIPAR_WORLD_SIZE``, ``MINIPAR_LOST_RANKS`` (the previous run's
lost ranks, comma-separated). ``restart_info()`` reads them; ``accumulation`` keeps the global batch
(micro-batches per rank = global batch / (world x micro-batch), refused when not an integer);
``save_ddp`` / ``load_ddp`` checkpoint a DDP replica and its AdamW state as shards
(``minipar.parallel.zero.checkpoint``: each rank writes 1/N, loading at N' re-cuts and all-gathers);
ZeRO and FSDP have ``save_checkpoint`` / ``load_checkpoint``. ``examples/elastic_train.py`` uses them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

LOST_STATUS = 128  # a shell reports a process killed by signal s as 128 + s
LOST_SIGNALS = (9, 15)  # SIGKILL, SIGTERM: the machine was taken away (not the program's own crash)
_RANK = "${PMI_RANK:-${PMIX_RANK:-0}}"
STATUS_SHELL = ('trap "" USR1; '  # an inner sh writes its pid, then becomes the rank (exec): the rank's pid
                f"sh -c 'echo $$ > \"$MINIPAR_ELASTIC_STATUS/pid{_RANK}\"; exec \"$0\" \"$@\"' \"$0\" \"$@\"; s=$?; "
                f'printf "%s\\n" "$s" > "$MINIPAR_ELASTIC_STATUS/rank{_RANK}"; exit "$s"')
POLL = 0.05  # seconds between two looks of the loop at a running attempt's folder


@dataclass(frozen=True)
class RunResult:
    """One ``mpiexec`` run: its world size, mpiexec's exit status, each rank's recorded exit status
    (a rank mpiexec tore down has none), and the wall seconds it took."""

    ranks: int
    returncode: int
    statuses: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    aborted: frozenset[int] = frozenset()  # ranks that called MPI_Abort (their marker files)
    stalled: dict[int, str] = field(default_factory=dict)  # ranks the loop killed, stuck: why

    @property
    def lost(self) -> list[int]:
        """The machines the next run must do without (module docstring): killed by SIGKILL or SIGTERM,
        stuck (killed by the loop), or gone with their shell when no rank aborted."""
        killed = {r for r, s in self.statuses.items() if s - LOST_STATUS in LOST_SIGNALS}
        gone = set() if self.aborted or not self.statuses else set(range(self.ranks)) - set(self.statuses)
        return sorted(killed | gone | set(self.stalled))

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.lost

    def describe(self) -> str:
        """One line: ranks, statuses, what was lost, time."""
        shown = ", ".join(f"{r}:{self.statuses[r]}" if r in self.statuses else f"{r}:-" for r in range(self.ranks))
        lost = "; ".join(f"rank {r} lost ({self.stalled[r]}; killed by minipar run)" if r in self.stalled else
                         f"rank {r} lost (killed by signal {self.statuses[r] - LOST_STATUS})" if r in self.statuses
                         else f"rank {r} lost (gone with its shell)" for r in self.lost)
        torn = ("; '-': none recorded, torn down by mpiexec after an MPI_Abort"
                if self.aborted and len(self.statuses) < self.ranks else "")
        return (f"{self.ranks} ranks, exit status {self.returncode} in {self.seconds:.1f} s "
                f"(rank:status {shown}{torn}){'; ' + lost if lost else ''}")


Launcher = Callable[[int, Mapping[str, str]], RunResult]


def restart_env(count: int, max_restarts: int, ranks: int, lost: Sequence[int]) -> dict[str, str]:
    """The environment a run's ranks get (torchrun's ``TORCHELASTIC_RESTART_COUNT`` & co)."""
    return {"MINIPAR_RESTART_COUNT": str(count), "MINIPAR_MAX_RESTARTS": str(max_restarts),
            "MINIPAR_WORLD_SIZE": str(ranks), "MINIPAR_LOST_RANKS": ",".join(map(str, lost))}


def elastic_loop(n: int, launch: Launcher, max_restarts: int = 3, min_ranks: int = 1,
                 restart_n: int | None = None, log: Callable[[str], None] | None = None) -> tuple[int, list[RunResult]]:
    """Run ``launch(ranks, env)`` until it succeeds, loses no rank, or may not restart any more;
    returns the final run's exit status (the first non-zero of mpiexec's and the ranks') and every
    run. After a run that lost ranks the next has ``restart_n`` ranks if given, else the survivors."""
    if n < 1 or max_restarts < 0 or min_ranks < 1 or (restart_n is not None and restart_n < 1):
        raise ValueError(f"elastic: need -n >= 1, --max-restarts >= 0, --min-ranks >= 1, --restart-n >= 1; got "
                         f"{n}, {max_restarts}, {min_ranks}, {restart_n}")
    if n < min_ranks:
        raise ValueError(f"elastic: -n {n} is below --min-ranks {min_ranks}")
    say = log or (lambda line: print(f"minipar run: {line}", file=sys.stderr, flush=True))
    runs: list[RunResult] = []
    lost: list[int] = []
    while True:
        k = len(runs)
        result = launch(n, restart_env(k, max_restarts, n, lost))
        runs.append(result)
        say(f"run {k}: {result.describe()}")
        status = result.returncode or next((s for _, s in sorted(result.statuses.items()) if s), 0)
        if result.ok:
            return 0, runs
        lost = result.lost
        if not lost:
            say(f"run {k} failed but lost no rank (a program error or a refusal, which a restart would repeat): "
                f"not restarting; exit status {status}")
            return status, runs
        if k >= max_restarts:
            say(f"ranks {lost} lost and {k} of --max-restarts {max_restarts} restarts used: giving up; "
                f"exit status {status}")
            return status, runs
        nxt = restart_n if restart_n is not None else n - len(lost)
        if nxt < min_ranks:
            say(f"ranks {lost} lost: {nxt} ranks left, below --min-ranks {min_ranks}: giving up; exit status {status}")
            return status, runs
        why = f"--restart-n {restart_n}" if restart_n is not None else f"{n} - {len(lost)} lost"
        say(f"ranks {lost} lost (a fault, not the program's error): restart {k + 1} of at most {max_restarts}: "
            f"{nxt} ranks ({why}); the script resumes from its last checkpoint")
        n = nxt


def mpiexec_launcher(argv: Sequence[str], mpiexec: str | os.PathLike[str] | None = None,
                     extra_env: Mapping[str, str] | None = None, attempt_timeout: float | None = None) -> Launcher:
    """A ``Launcher`` running ``mpiexec -disable-auto-cleanup -n N sh -c STATUS_SHELL argv...`` with
    this process's stdout and stderr; each rank's exit status is read back from a fresh folder, and
    stuck ranks are killed while it runs (``supervise``; ``attempt_timeout``: default twice the
    watchdog's ``MINIPAR_TIMEOUT``)."""
    from minipar.comm.watchdog import default_timeout

    exe = str(mpiexec or Path(sys.executable).parent / "mpiexec")

    def launch(n: int, env: Mapping[str, str]) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="minipar-elastic-") as status_dir:
            full = {**os.environ, **(extra_env or {}), **env, "MINIPAR_ELASTIC_STATUS": status_dir}
            limit = attempt_timeout or 2 * default_timeout(None if "MINIPAR_TIMEOUT" not in full else
                                                           float(full["MINIPAR_TIMEOUT"]))
            cmd = [exe, "-disable-auto-cleanup", "-n", str(n), "sh", "-c", STATUS_SHELL, *argv]
            start = time.monotonic()
            proc = subprocess.Popen(cmd, env=full)
            stalled = supervise(proc, Path(status_dir), n, limit)
            seconds = time.monotonic() - start
            statuses = _statuses(Path(status_dir))
            aborted = frozenset(int(f.name[7:]) for f in Path(status_dir).glob("aborted*"))
        return RunResult(n, proc.returncode, statuses, seconds, aborted, stalled)

    return launch


def threads_launcher(fn: Callable[..., Any], results: list[Any] | None = None, **kwargs: Any) -> Launcher:
    """``elastic_loop``'s launcher on the threads backend (notebooks, lessons): each run calls
    ``fn(comm, info=restart_info(env), **kwargs)`` on ``n`` threads (``minipar.launch``; ``deadline=``
    among ``kwargs`` sets the failure detector's). A rank that ``faults.kill`` ended returns None and is
    recorded as killed by SIGKILL, as the status shell records a killed process under ``minipar run
    --elastic``; another's status is its result's ``"status"`` (0 without one). Rank 0's result of each
    run is appended to ``results``."""
    from minipar.comm import launch

    def run(n: int, env: Mapping[str, str]) -> RunResult:
        start = time.monotonic()
        rows = launch(fn, n, "threads", info=restart_info(env), **kwargs)
        if results is not None:
            results.append(rows[0])
        statuses = {r: LOST_STATUS + signal.SIGKILL if row is None else int(row.get("status", 0))
                    if isinstance(row, dict) else 0 for r, row in enumerate(rows)}
        return RunResult(n, max(statuses.values()), statuses, time.monotonic() - start)

    return run


def _statuses(folder: Path) -> dict[int, int]:
    """Each rank's exit status its shell recorded (none yet, or half-written when the shell itself was
    killed: absent)."""
    from minipar.comm.startup import read_int

    found = {int(f.name[4:]): read_int(f) for f in folder.glob("rank*") if f.name[4:].isdigit()}
    return {r: s for r, s in found.items() if s is not None}


def _kill_stuck(folder: Path, rank: int) -> str | None:
    """SIGKILL ``rank``'s process if it is still there; returns its state before ("stopped (SIGSTOP)" or
    "running"), None when it was already gone."""
    from minipar.comm.startup import process_state, read_int

    pid = read_int(folder / f"pid{rank}")
    state = None if pid is None else process_state(pid)
    if pid is None or state in (None, "Z"):
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return "stopped (SIGSTOP)" if state == "T" else "running"


def supervise(proc: subprocess.Popen, folder: Path, n: int, limit: float) -> dict[int, str]:
    """Wait for ``proc`` (an attempt's mpiexec), killing the ranks that cannot end by themselves:

    - a rank some peer declared dead (``declared<r>``, written by its failure detector or start-up
      watch) whose process is still there: frozen, or too slow to be told from a dead one (TorchElastic
      treats a worker that stops making progress like a lost one);
    - a rank still running ``limit`` seconds after another ended other than by a loss (done: ranks
      leave together, each waiting for the others' goodbyes; or given up on a dead peer), e.g. one
      frozen after its goodbye, inside ``MPI_Finalize``.
    Returns the ranks killed, with why. If mpiexec outlives all that by ``limit``, it is killed."""
    stalled: dict[int, str] = {}
    ended: tuple[float, int] | None = None
    killed_all = None
    while proc.poll() is None:
        statuses, now = _statuses(folder), time.monotonic()
        declared: dict[int, list[int]] = {}
        for f in folder.glob("declared*"):
            for dead in f.read_text().split():
                declared.setdefault(int(dead), []).append(int(f.name[8:]))
        for rank, by in sorted(declared.items()):
            if rank not in statuses and rank not in stalled:
                state = _kill_stuck(folder, rank)
                if state:
                    stalled[rank] = f"declared dead by rank {min(by)} while its process was {state}"
        first = [r for r, s in statuses.items() if s - LOST_STATUS not in LOST_SIGNALS and r not in stalled]
        if ended is None and first:
            ended = (now, min(first))
        if ended is not None and now - ended[0] > limit and killed_all is None:
            for rank in range(n):
                if rank not in statuses and rank not in stalled:
                    state = _kill_stuck(folder, rank)
                    if state:
                        stalled[rank] = (f"still {state} {limit:g} s after rank {ended[1]} ended "
                                         "(--attempt-timeout)")
            killed_all = now
        if killed_all is not None and now - killed_all > limit:
            proc.kill()
        time.sleep(POLL)
    return stalled


# ---- inside the script ------------------------------------------------------------------------
@dataclass(frozen=True)
class Restart:
    """What ``minipar run --elastic`` told this run (``restart_info``)."""

    count: int  # 0: the first run
    max_restarts: int
    world_size: int | None  # None when not started by minipar run
    lost: tuple[int, ...]  # the previous run's lost ranks


def restart_info(env: Mapping[str, str] | None = None) -> Restart:
    """This run's place in the elastic loop, from the environment (a plain run: count 0)."""
    env = os.environ if env is None else env
    lost = tuple(int(r) for r in env.get("MINIPAR_LOST_RANKS", "").split(",") if r)
    size = env.get("MINIPAR_WORLD_SIZE")
    return Restart(int(env.get("MINIPAR_RESTART_COUNT", "0")), int(env.get("MINIPAR_MAX_RESTARTS", "0")),
                   int(size) if size else None, lost)


def accumulation(global_batch: int, world: int, micro_batch: int) -> int:
    """Micro-batches per rank that keep ``global_batch`` on ``world`` ranks; ``ValueError`` naming the
    world sizes that would work when it does not divide (call it before any message)."""
    if min(global_batch, world, micro_batch) < 1:
        raise ValueError(f"global batch, world size and micro-batch must be >= 1, got {global_batch}, {world}, "
                         f"{micro_batch}")
    per_step = world * micro_batch
    if global_batch % per_step:
        fits = [w for w in range(1, global_batch // micro_batch + 1) if global_batch % (w * micro_batch) == 0]
        raise ValueError(f"the global batch of {global_batch} cannot be kept on {world} ranks with micro-batches of "
                         f"{micro_batch}: {global_batch} / ({world} x {micro_batch}) is not an integer; world sizes "
                         f"that keep it: {fits}")
    return global_batch // per_step


def checkpoint_exists(directory: str | os.PathLike[str], comm: Any = None) -> bool:
    """True when ``directory`` holds a complete checkpoint (or a crash between the commit's two renames
    left one beside it, which ``checkpoint.load`` reads).

    With ``comm`` (every rank calls it, at the start of a run) rank 0 first tidies up after the saves
    that crashed: it finishes an interrupted commit and deletes their leftover ``ckpt.tmp-X`` and
    ``ckpt.old-X`` siblings (``checkpoint._recover``: never the complete checkpoint), and every rank
    gets rank 0's answer."""
    from minipar.parallel.zero import checkpoint

    path = Path(directory).absolute()

    def complete() -> bool:
        try:
            return (checkpoint._resolve(path) / checkpoint.META).is_file()
        except ValueError:
            return False

    if comm is None:
        return complete()
    found, errors = None, []
    if comm.rank == 0:
        _, errors = checkpoint._local_problem(checkpoint._recover, path)
        found = complete()
    found, errors = comm.broadcast_object((found, errors))
    checkpoint._raise_if(f"tidy {path}", errors)
    return bool(found)


def _ddp_layout(ddp: Any, optimizer: Any, world: int) -> tuple[Any, list[int]]:
    """The flat layout of the replica's parameters over ``world`` ranks, and each one's index in the
    optimizer's list."""
    from minipar.parallel.zero.flat import FlatLayout

    params = ddp.parameters()
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    where = {id(p): i for i, p in enumerate(optimizer.params)}
    missing = [names[id(p)] for p in params if id(p) not in where]
    if missing or len(where) != len(params):
        raise ValueError(f"save_ddp/load_ddp: the optimizer must hold exactly the DDP parameters (missing {missing})")
    layout = FlatLayout(tuple(names[id(p)] for p in params), tuple(p.data.shape for p in params), world)
    return layout, [where[id(p)] for p in params]


def save_ddp(directory: str | os.PathLike[str], ddp: Any, optimizer: Any, meta: dict[str, Any] | None = None) -> None:
    """Checkpoint a DDP replica and its AdamW state (every rank calls): the flat parameters and both
    moments cut into N shards, rank r writing shard r only (the replicas are equal: each rank saves
    1/N of the bytes), atomically (``checkpoint.save``). ``meta``: the caller's (the step, ...)."""
    from minipar.parallel.zero import checkpoint

    comm = ddp.comm
    layout, index = _ddp_layout(ddp, optimizer, comm.size)
    states = [optimizer.state[i] for i in index]
    lo, hi = layout.shard_range(comm.rank)
    arrays = {"model/param": layout.flatten([p.data for p in ddp.parameters()])[lo:hi]}
    for key in ("exp_avg", "exp_avg_sq"):
        arrays[f"model/{key}"] = layout.flatten([s.get(key) for s in states])[lo:hi]
    steps = {s.get("step", 0) for s in states}
    if len(steps) != 1:
        raise ValueError(f"save_ddp: the parameters took different numbers of AdamW steps {sorted(steps)}")
    full = {**(meta or {}), "adam_step": steps.pop(), "params": {"model": layout.described()}}
    checkpoint.save(directory, comm, arrays, dict.fromkeys(arrays, layout.numel), full)


def load_ddp(directory: str | os.PathLike[str], ddp: Any, optimizer: Any) -> dict[str, Any]:
    """Put a ``save_ddp`` checkpoint (of any world size) back into the replica and AdamW; returns its
    meta. Each rank loads its re-cut shard and one all-gather per array rebuilds the replica."""
    from minipar.parallel.zero import checkpoint

    comm = ddp.comm
    layout, index = _ddp_layout(ddp, optimizer, comm.size)
    names = ("model/param", "model/exp_avg", "model/exp_avg_sq")
    shards, meta = checkpoint.load(directory, comm, dict.fromkeys(names, layout.numel))
    full = {n: comm.allgather(shards[n]) for n in names}
    if meta["params"]["model"] != layout.described():
        raise ValueError(f"load_ddp: {directory} holds parameters {meta['params']['model']}, this model "
                         f"{layout.described()}")
    params = ddp.parameters()
    moments = [layout.views(full[f"model/{k}"]) for k in ("exp_avg", "exp_avg_sq")]
    for j, (p, value) in enumerate(zip(params, layout.views(full["model/param"]), strict=True)):
        p.data[...] = value
        optimizer.state[index[j]] = {} if not meta["adam_step"] else {
            "step": meta["adam_step"], "exp_avg": np.array(moments[0][j]), "exp_avg_sq": np.array(moments[1][j])}
    return meta
