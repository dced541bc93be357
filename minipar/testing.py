"""Equivalence harness: run one function on N ranks, on either backend, and get every rank's result.

    results = minipar.testing.run(fn, 4, backend="mpi", n=16, seed=3)   # [fn(comm, n=16, seed=3) by rank]
    by_config = minipar.testing.run_each(fn, 4, [{"n": 16}, {"n": 5}])  # one job, [[by rank] by config]

backend="threads" calls ``launch`` in this process. backend="mpi" starts
``mpiexec -n N python -m minipar.testing <module:qualname> <argsfile> <outdir>`` in a subprocess
(``OPENBLAS_NUM_THREADS=1``, a wall-clock ``timeout``); every rank pickles its result into
``outdir``. So hypothesis can draw the configuration here, in the pytest process, while the
property itself runs under real MPI; ``run_each`` runs a list of drawn configurations in one job,
so the start-up cost is paid once per job, not per configuration. ``fn`` must be importable (a
module-level function of an importable module; the module's folder is put on the ranks'
``sys.path``), its keyword arguments and results picklable. A rank that fails, a job that exits
non-zero or overruns raises ``HarnessError`` whose message holds the ranks' stdout and stderr.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class HarnessError(RuntimeError):
    """An ``mpiexec`` run that failed or timed out; ``.returncode``, ``.stdout``, ``.stderr``."""

    def __init__(self, message: str, returncode: int | None, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def mpiexec_path() -> Path:
    """The ``mpiexec`` installed next to this Python (the ``mpich`` wheel puts it in the venv)."""
    return Path(sys.executable).parent / "mpiexec"


def run(fn: Callable[..., Any], world_size: int, backend: str = "threads", timeout: float = 120,
        comm_timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """``[fn(comm, **kwargs) for every rank]`` on ``backend`` ("threads" | "mpi").

    ``timeout``: seconds the whole mpiexec job may take. ``comm_timeout``: the ranks' watchdog
    (``MINIPAR_TIMEOUT``) in seconds; default: the environment's, else 60.
    """
    if backend == "threads":
        from minipar.comm import launch

        return launch(fn, world_size, "threads", timeout=comm_timeout, **kwargs)
    if backend != "mpi":
        raise ValueError(f"run: backend must be 'threads' or 'mpi', got {backend!r}")
    return _mpiexec(fn, fn, world_size, timeout, comm_timeout, kwargs)


def run_each(fn: Callable[..., Any], world_size: int, configs: list[dict[str, Any]], backend: str = "mpi",
             timeout: float = 120, comm_timeout: float | None = None) -> list[list[Any]]:
    """``[[fn(comm, **c) for every rank] for c in configs]``, all in ONE job (one ``mpiexec``).

    The ranks run the configurations in order; a failure in any of them fails the job.
    """
    if backend == "threads":
        from minipar.comm import launch

        per_rank = launch(_each, world_size, "threads", fn, configs, timeout=comm_timeout)
    elif backend == "mpi":
        per_rank = _mpiexec(_each, fn, world_size, timeout, comm_timeout, {"fn": fn, "configs": configs})
    else:
        raise ValueError(f"run_each: backend must be 'threads' or 'mpi', got {backend!r}")
    return [[res[i] for res in per_rank] for i in range(len(configs))]


def _each(comm: Any, fn: Callable[..., Any], configs: list[dict[str, Any]]) -> list[Any]:
    """One rank of ``run_each``: every configuration in order."""
    return [fn(comm, **c) for c in configs]


def _mpiexec(target: Callable[..., Any], fn: Callable[..., Any], world_size: int, timeout: float,
             comm_timeout: float | None, kwargs: dict[str, Any]) -> list[Any]:
    """``target(comm, **kwargs)`` on every rank of one ``mpiexec`` job; ``fn``'s folder is on the ranks'
    path (``fn`` is ``target`` itself, or the function ``target`` calls)."""
    module, qualname = target.__module__, target.__qualname__
    if fn.__module__ == "__main__" or "<" in fn.__qualname__:
        raise ValueError(f"run(backend='mpi'): {fn.__qualname__} from {fn.__module__} cannot be imported by "
                         "the ranks; define it at module level in an importable module")
    paths = [str(ROOT)]
    try:
        paths.insert(0, str(Path(inspect.getfile(fn)).resolve().parent))
    except TypeError:
        pass
    with tempfile.TemporaryDirectory(prefix="minipar-run-") as tmp:
        argsfile, outdir = Path(tmp) / "args.pkl", Path(tmp) / "out"
        outdir.mkdir()
        argsfile.write_bytes(pickle.dumps({"kwargs": pickle.dumps(kwargs), "path": paths}))
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        if comm_timeout is not None:
            env["MINIPAR_TIMEOUT"] = str(comm_timeout)
        cmd = [str(mpiexec_path()), "-n", str(world_size), sys.executable, "-m", "minipar.testing",
               f"{module}:{qualname}", str(argsfile), str(outdir)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise HarnessError(f"{' '.join(cmd[:3])} ... {fn.__qualname__}: no result after {timeout} s; killed.\n"
                               f"--- stdout ---\n{out}\n--- stderr ---\n{err}", None, out, err) from None
        files = [outdir / f"rank{r}.pkl" for r in range(world_size)]
        if proc.returncode != 0 or not all(f.exists() for f in files):
            missing = [r for r, f in enumerate(files) if not f.exists()]
            raise HarnessError(f"mpiexec -n {world_size} ... {fn.__qualname__} exited with code {proc.returncode}"
                               f" (no result from ranks {missing}).\n--- stdout ---\n{out}\n"
                               f"--- stderr ---\n{err}",
                               proc.returncode, out, err)
        return [pickle.loads(f.read_bytes()) for f in files]


def _main(argv: list[str]) -> None:
    target, argsfile, outdir = argv
    from minipar.comm import world

    comm = world()  # installs the abort-on-exception hook before anything can fail
    spec = pickle.loads(Path(argsfile).read_bytes())
    sys.path[:0] = [p for p in spec["path"] if p not in sys.path]
    module, qualname = target.split(":")
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    result = fn(comm, **pickle.loads(spec["kwargs"]))  # after sys.path: kwargs may name test classes
    out = Path(outdir) / f"rank{comm.rank}.pkl"
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    os.replace(tmp, out)


if __name__ == "__main__":
    _main(sys.argv[1:])
