"""Where a ring all-reduce's time goes when ranks outnumber cores (issue 26).

    .venv/bin/python benchmarks/oversubscribed.py --ranks 2 4 8 --sizes 1048576 16777216

The driver starts one ``mpiexec -n p`` per rank count (and per ``--env`` setting of MPICH's),
each running this file with ``--worker``: on float64 buffers every repeat runs, alternating, MPICH's
blocking ``MPI_Allreduce`` (through mpi4py) and the hand ring all-reduce of ``minipar.comm.ring``
under each way a rank can wait for its step:

- ``sleep``: what ``watchdog.poll`` does by default (spin ``comm.spin``, 0 when oversubscribed,
  then sleeps of ``comm.pace`` = 1/32 of the time waited, 20 us to 1 ms);
- ``spin``: test in a loop (watchdog kept), never giving the core away;
- ``yield``: test, then ``os.sched_yield()`` (the rank stays runnable);
- ``bell``: test, then sleep on a doorbell (a local datagram socket; ``watchdog.Doorbell``) with the
  same paced timeout: a sender rings the receiver when it posts, a receiver rings the sender when
  its copy is done, so the waiter wakes when its data is there, not at the next timeout;
- ``block``: MPI's blocking ``Waitall`` (MPICH busy-polls; no watchdog: reference only);
- ``lazy``: the same ring where a step waits for its receive only (its send is waited for once per
  phase: reduce-scatter, all-gather), with doorbell pauses.

Per rank and call it reads: wall time (``perf_counter``), the main thread's CPU time
(``RUSAGE_THREAD``) and the process's (``RUSAGE_SELF``: the heartbeat thread too), voluntary and
involuntary context switches (main thread), the time the main thread was runnable but waited for a
core (``/proc/thread-self/schedstat`` run delay, wall), and for the ring how late a waiter noticed:
``recv late`` = start of the test that completed a receive minus the moment both the sender had
posted and the receiver was waiting (wall, one machine's monotonic clock), ``send late`` = the
moment a sender saw its send done minus the end of the receiver's copy. The table prints, per
variant, the median over repeats of the slowest rank's wall time and the mean over ranks of the
rest. ``idle`` = wall - thread CPU - run delay: asleep or blocked.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("blocking", "sleep", "spin", "yield", "bell", "block", "lazy")


def run_delay() -> float:
    """Seconds this thread was runnable but waited for a core (wall clock; schedstat field 2)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except OSError:
        return float("nan")


def counters() -> tuple[float, ...]:
    th = resource.getrusage(resource.RUSAGE_THREAD)
    pr = resource.getrusage(resource.RUSAGE_SELF)
    return (time.perf_counter(), th.ru_utime + th.ru_stime, pr.ru_utime + pr.ru_stime,
            float(th.ru_nvcsw), float(th.ru_nivcsw), run_delay())


class Bell:
    """A doorbell per rank: an abstract-namespace datagram socket (one machine's ranks only; a ring
    to a rank on another machine fails silently and its waits fall back to their timeouts)."""

    def __init__(self, world_rank: int) -> None:
        import socket

        self.tag = f"minipar-bell-{os.getppid()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.name(world_rank))
        self.sock.setblocking(False)

    def name(self, rank: int) -> str:
        return f"\0{self.tag}-{rank}"

    def ring(self, rank: int) -> None:
        try:
            self.sock.sendto(b"\1", self.name(rank))
        except OSError:
            pass

    def wait(self, timeout: float) -> None:
        import select

        select.select([self.sock], [], [], timeout)
        try:
            while True:
                self.sock.recv(64)
        except BlockingIOError:
            pass


def wait_reqs(comm: Any, variant: str, bell: Bell | None, stats: dict[str, int], reqs: list[Any],
              srcs: dict[int, int], what: str) -> tuple[float, float, float]:
    """Wait for ``reqs`` the ``variant`` way; returns the start and end of the test that completed
    the receive (``srcs``: id of a receive -> its sender's world rank) and when the last send was
    seen done (NaN where none)."""
    from mpi4py import MPI

    rs = rst = sd = float("nan")
    if variant == "block":
        MPI.Request.Waitall([q for r in reqs for q in r._pending.reqs])
        rs = rst = sd = time.perf_counter()
        return rs, rst, sd
    todo = {id(r): r for r in reqs}
    start = time.perf_counter()
    while todo:
        t0 = time.perf_counter()
        for key, r in list(todo.items()):
            if r._pending.done():
                del todo[key]
                t1 = time.perf_counter()
                if key in srcs:
                    rs, rst = t0, t1
                    if bell is not None:
                        bell.ring(srcs[key])
                else:
                    sd = t1
        stats["tests"] += 1
        if not todo:
            break
        waited = time.perf_counter() - start
        if waited > comm.timeout:
            raise RuntimeError(f"{what} timed out")
        if variant == "spin" or waited < comm.spin:
            continue
        if variant == "yield":
            os.sched_yield()
        elif variant in ("bell", "lazy"):
            assert bell is not None
            bell.wait(min(1e-3, max(2e-5, waited * comm.pace)))
        else:
            time.sleep(min(1e-3, max(2e-5, waited * comm.pace)))
        stats["pauses"] += 1
    return rs, rst, sd


def instrumented_step(comm: Any, variant: str, log: list[tuple[float, float, float, float]],
                      bell: Bell | None, stats: dict[str, int]) -> Callable[..., list[np.ndarray]]:
    """``comm._step`` waiting the ``variant`` way, logging per step (posted, start and end of the
    test that completed the receive, time the send was seen done)."""
    from minipar.comm.base import COLL

    gr = comm.group_ranks

    def step(sends: Any, recvs: Any, op: str, algorithm: str | None, stepno: int | None,
             header: bool = False) -> list[np.ndarray]:
        rreqs, srcs = [], {}
        for src, spec in recvs:
            out = spec if isinstance(spec, np.ndarray) else None
            like = None if header else ((out.shape, out.dtype) if out is not None else spec)
            rreqs.append(comm._irecv(COLL, src, 0, like, out, op, algorithm, stepno))
            srcs[id(rreqs[-1])] = gr[src]
        sreqs = [comm._isend(COLL, arr, dst, 0, header, op, algorithm, stepno) for dst, arr in sends]
        posted = time.perf_counter()
        if bell is not None:
            for dst, _ in sends:
                bell.ring(gr[dst])
        rs, rst, sd = wait_reqs(comm, variant, bell, stats, rreqs + sreqs, srcs, f"step {stepno}")
        for r in rreqs + sreqs:
            r._finish()
        log.append((posted, rs, rst, sd))
        return [r._value for r in rreqs]

    return step


def lazy_ring(comm: Any, x: np.ndarray, bell: Bell, log: list[tuple[float, float, float, float]],
              stats: dict[str, int]) -> np.ndarray:
    """The ring all-reduce where a step waits for its receive only: the sends of the reduce-scatter
    are waited for before the all-gather (which overwrites their chunks), the all-gather's at the end
    (2 waits on the right neighbour instead of 2(p - 1)); doorbell pauses."""
    from minipar.comm.base import COLL
    from minipar.comm.ring import chunk_bounds, combine

    p, r = comm.size, comm.rank
    flat = x.reshape(-1).copy()
    bounds = chunk_bounds(flat.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    gl, gright = comm.group_ranks[left], comm.group_ranks[right]
    for phase in (0, 1):
        sends = []
        for s in range(p - 1):
            a, b = bounds[(r - s - 1 + phase) % p]
            c, d = bounds[(r - s - 2 + phase) % p]
            if phase == 0:
                rq = comm._irecv(COLL, left, 0, ((d - c,), flat.dtype), None, "allreduce", "ring", s)
            else:
                rq = comm._irecv(COLL, left, 0, None, flat[c:d], "allreduce", "ring", p - 1 + s)
            sends.append(comm._isend(COLL, flat[a:b], right, 0, False, "allreduce", "ring", s + phase * (p - 1)))
            posted = time.perf_counter()
            bell.ring(gright)
            rs, rst, _ = wait_reqs(comm, "lazy", bell, stats, [rq], {id(rq): gl}, f"lazy step {s}")
            rq._finish()
            if phase == 0:
                combine(flat[c:d], rq._value, "sum")
            log.append((posted, rs, rst, float("nan")))
        wait_reqs(comm, "lazy", bell, stats, sends, {}, "lazy sends")
        for q in sends:
            q._finish()
    return flat.reshape(x.shape)


def worker(sizes: list[int], reps: int, variants: list[str]) -> None:
    from mpi4py import MPI

    from minipar.comm import world
    from minipar.comm.ring import allreduce_ring

    comm = world()
    p, r = comm.size, comm.rank
    bell = Bell(comm.world_rank) if "bell" in variants or "lazy" in variants else None
    comm.barrier()
    results: dict[str, Any] = {"p": p, "cores": os.cpu_count(), "spin": comm.spin, "sizes": {}}
    for n in sizes:
        x = np.random.default_rng(r).standard_normal(n)
        ref = np.empty_like(x)
        comm.mpicomm.Allreduce(x, ref, op=MPI.SUM)
        per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rep in range(reps + 1):  # the first repeat warms up and is dropped
            for v in variants:
                log: list[tuple[float, float, float, float]] = []
                stats = {"tests": 0, "pauses": 0}
                if v not in ("blocking", "lazy"):
                    comm._step = instrumented_step(comm, v, log, bell if v == "bell" else None, stats)
                comm.barrier()
                c0 = counters()
                if v == "blocking":
                    out = np.empty_like(x)
                    comm.mpicomm.Allreduce(x, out, op=MPI.SUM)
                elif v == "lazy":
                    assert bell is not None
                    out = lazy_ring(comm, x, bell, log, stats)
                else:
                    out = allreduce_ring(comm, x, "sum")
                c1 = counters()
                if v not in ("blocking", "lazy"):
                    del comm._step
                assert np.allclose(out, ref), v
                mine = {"d": [b - a for a, b in zip(c0, c1, strict=True)], "log": log, **stats}
                table = comm.allgather_object(mine)
                if rep:
                    per[v].append(summarise(table, p))
        results["sizes"][str(n)] = per
    if r == 0:
        print("JSON " + json.dumps(results), flush=True)


def summarise(table: list[dict[str, Any]], p: int) -> dict[str, Any]:
    """One call: slowest wall, mean over ranks of the rest, ring lateness from the step logs."""
    d = np.array([t["d"] for t in table])
    row = {"wall": float(d[:, 0].max()), "cpu": float(d[:, 1].mean()), "cpu_proc": float(d[:, 2].mean()),
           "vcsw": float(d[:, 3].mean()), "ivcsw": float(d[:, 4].mean()), "delay": float(d[:, 5].mean()),
           "tests": float(np.mean([t["tests"] for t in table])),
           "pauses": float(np.mean([t["pauses"] for t in table]))}
    logs = [t["log"] for t in table]
    if logs[0]:
        rl, sl = [], []
        for q in range(p):
            left, right = (q - 1) % p, (q + 1) % p
            for s, (posted, rs, _rst, sd) in enumerate(logs[q]):
                rl.append(max(0.0, rs - max(posted, logs[left][s][0])))
                sl.append(max(0.0, sd - logs[right][s][2]))
        row["recv_late"] = float(np.nansum(rl)) / p
        row["send_late"] = float(np.nansum(sl)) / p
    return row


def worker_json(cmd: list[str], env: dict[str, str], what: str) -> dict[str, Any] | None:
    """Run an mpiexec job whose rank 0 prints one line ``JSON {...}``; its dict, or None after printing
    the job's output when no such line came."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("JSON ")), None)
    if line is None:
        print(f"{what}: failed\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return None
    return json.loads(line[5:])


def driver(args: argparse.Namespace) -> None:
    py = str(ROOT / ".venv/bin/python")
    mpiexec = str(ROOT / ".venv/bin/mpiexec")
    envs = [None, *args.env]
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start; median of {args.reps} "
          "repeats after a warm-up; times in ms; wall = slowest rank's wall clock, the rest mean per rank")
    for p in args.ranks:
        for extra in envs:
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", MINIPAR_PEER_DEADLINE="10")
            label = "default"
            if extra:
                for kv in extra.split(","):
                    k, v = kv.split("=", 1)
                    env[k] = v
                label = extra
            cmd = [mpiexec, "-n", str(p), py, __file__, "--worker", "--reps", str(args.reps),
                   "--variants", *args.variants, "--sizes", *map(str, args.sizes)]
            res = worker_json(cmd, env, f"p={p} {label}")
            if res is not None:
                print_table(res, label)


def print_table(res: dict[str, Any], label: str) -> None:
    p = res["p"]
    print(f"\np = {p} ranks on {res['cores']} cores, MPICH env: {label} (comm.spin {res['spin'] * 1e3:g} ms)")
    head = ("elements", "variant", "wall ms", "/blocking", "CPU ms thr", "CPU ms proc", "run-delay ms",
            "idle ms", "vol cs", "invol cs", "recv late ms", "send late ms", "tests", "pauses")
    print("  ".join(f"{h:>11}" for h in head))
    for n, per in res["sizes"].items():
        med = {v: {k: statistics.median(c[k] for c in calls) for k in calls[0]} for v, calls in per.items() if calls}
        base = med.get("blocking", {}).get("wall", float("nan"))
        for v, m in med.items():
            idle = m["wall"] - m["cpu"] - m["delay"]
            cells = [f"{int(n):,}", v, f"{m['wall'] * 1e3:.1f}", f"{m['wall'] / base:.2f}x", f"{m['cpu'] * 1e3:.1f}",
                     f"{m['cpu_proc'] * 1e3:.1f}", f"{m['delay'] * 1e3:.1f}", f"{idle * 1e3:.1f}",
                     f"{m['vcsw']:.0f}", f"{m['ivcsw']:.0f}",
                     f"{m['recv_late'] * 1e3:.1f}" if "recv_late" in m else "-",
                     f"{m['send_late'] * 1e3:.1f}" if "send_late" in m else "-",
                     f"{m['tests']:.0f}", f"{m['pauses']:.0f}"]
            print("  ".join(f"{c:>11}" for c in cells))
    print("clocks: wall, run-delay, idle, recv/send late = wall (monotonic); CPU = getrusage CPU time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--env", nargs="*", default=[],
                    help="extra MPICH settings, one run each: NAME=VALUE[,NAME=VALUE...], "
                         "e.g. MPIR_CVAR_POLLS_BEFORE_YIELD=1,MPIR_CVAR_POSIX_POLL_FREQUENCY=1")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.sizes, args.reps, args.variants)
    else:
        driver(args)


if __name__ == "__main__":
    main()
