"""Lesson 1: all-reduce four ways, message by message.

    mpiexec -n 4 python lessons/01_collectives/lesson.py [--n 1048576] [--reps 5] [--out DIR] [--verbose]
    python lessons/01_collectives/lesson.py --ranks 4      # same, ranks as threads in one process

Every rank holds the same-sized buffer of float64; all four all-reduce algorithms reduce it:
- ring (reduce-scatter, then all-gather): 2(p-1) steps, 2(p-1)/p n bytes out per rank;
- recursive doubling: lg p steps of the whole buffer, n lg p bytes;
- naive (everyone to rank 0, rank 0 back to everyone): rank 0 sends (p-1) n bytes;
- native: the MPI library's own (its messages are hidden from us).
The table holds the bytes each rank sent, read from the trace, next to the formula's prediction,
and the time (median of ``--reps`` untraced runs, slowest rank). The trace lands in ``--out``, with
the formula's bytes per rank in its metadata (``expected_bytes_by_rank``, drawn over each rank's
measured bar in the report and as a formula column in the terminal table) and memory samples of
the input and of the results the lesson keeps. By default it prints the table, the busiest rank's
bytes per algorithm and a timeline of at most two bands; ``--verbose`` the whole timeline, the bytes
per rank and collective, and the trace files.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from lessons.common import (
    MAX_RANKS,
    REPLAY,
    Clock,
    by_rank,
    clock_arguments,
    console,
    finish,
    parse_lesson_args,
    print_note,
    reading_path,
    run_ranks,
)
from minipar import trace
from minipar.chrome import to_chrome
from minipar.cli_args import int_in
from minipar.comm import Communicator
from minipar.cost import ALLREDUCE_ALGORITHMS, allreduce_bytes
from minipar.cost.collectives import collective_time
from viz.width import Table

OUT = Path("runs/01_collectives")
MODEL = {"ring": "2(p-1)/p n", "recursive_doubling": "n lg p", "naive": "root (p-1) n, others n",
         "native": ""}


def formula_bytes(algorithm: str, n: int, itemsize: int, p: int, rank: int) -> int | None:
    """Bytes ``rank`` sends in one all-reduce of ``n`` elements, by the algorithm's formula
    (``minipar.cost.allreduce_bytes``); None for native, whose messages live inside MPI."""
    return None if algorithm == "native" else allreduce_bytes(n, itemsize, p, rank, algorithm)


def expected_bytes(n: int, itemsize: int, p: int) -> dict[str, dict[str, Any]]:
    """The trace metadata the viewer draws next to the measured bytes:
    ``expected_bytes_by_rank`` = ``{"allreduce/<alg>": [bytes rank 0 sends, rank 1, ...]}`` for every
    algorithm with a formula (the naive root's (p-1) n stands out against the others' n), and the
    scalar ``expected_bytes`` = ``{"allreduce/<alg>": bytes}`` for those whose formula gives every
    rank the same count (ring when p divides n, recursive doubling when p is a power of two)."""
    scalar, ranks = {}, {}
    for alg in ALLREDUCE_ALGORITHMS:
        per_rank = [formula_bytes(alg, n, itemsize, p, r) for r in range(p)]
        if None in per_rank:
            continue
        ranks[f"allreduce/{alg}"] = per_rank
        if len(set(per_rank)) == 1:
            scalar[f"allreduce/{alg}"] = float(per_rank[0])
    return {"expected_bytes": scalar, "expected_bytes_by_rank": ranks}


def formula_steps(algorithm: str, p: int) -> str:
    pp = 1 << (p.bit_length() - 1)
    return {"ring": str(2 * (p - 1)), "naive": "2",
            "recursive_doubling": str(pp.bit_length() - 1 + (2 if pp != p else 0))}.get(algorithm, "?")


def measure(comm: Communicator, n: int = 1 << 20, reps: int = 5, out: str | os.PathLike[str] | None = OUT
            ) -> list[dict[str, Any]]:
    """Run every algorithm once under the trace, then ``reps`` times untimed by it; returns the rows
    of the table (on every rank)."""
    x = np.random.default_rng(comm.rank).standard_normal(n)
    path = None
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / "trace.json"
    results: dict[str, np.ndarray] = {}
    meta = {"paradigm": "collectives", "lesson": "01_collectives", "elements": n,
            **expected_bytes(n, x.itemsize, comm.size)}
    with trace.record(path, comm, **meta) as rec:
        trace.memory("input", x.nbytes)
        for alg in ALLREDUCE_ALGORITHMS:
            trace.mark(f"allreduce {alg}")
            comm.barrier()
            results[alg] = comm.allreduce(x, algorithm=alg)
            trace.memory("results kept", sum(r.nbytes for r in results.values()))
    mine = [e for e in rec.events if e.kind == "comm" and e.op == "allreduce"]
    sent = {alg: sum(e.nbytes for e in mine if e.algorithm == alg and e.src == comm.world_rank)
            for alg in ALLREDUCE_ALGORITHMS}
    steps = {alg: len({e.step for e in mine if e.algorithm == alg and e.step is not None})
             for alg in ALLREDUCE_ALGORITHMS}
    times = {alg: [] for alg in ALLREDUCE_ALGORITHMS}
    for _ in range(reps):
        for alg in ALLREDUCE_ALGORITHMS:
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce(x, algorithm=alg)
            times[alg].append(time.perf_counter() - t0)
    agree = {alg: bool(np.allclose(results[alg], results["native"])) for alg in ALLREDUCE_ALGORITHMS}
    table = comm.allgather_object((sent, steps, times, agree))
    rows = []
    for alg in ALLREDUCE_ALGORITHMS:
        rows.append({
            "algorithm": alg,
            "steps": max(t[1][alg] for t in table),
            "formula_steps": formula_steps(alg, comm.size),
            "sent": [t[0][alg] for t in table],
            "formula": [formula_bytes(alg, n, 8, comm.size, r) for r in range(comm.size)],
            "seconds": (statistics.median(max(t[2][alg][i] for t in table) for i in range(reps))
                        if reps else 0.0),
            "agrees": all(t[3][alg] for t in table),
        })
    return rows


def replayed_seconds(t: trace.Trace) -> dict[str, float]:
    """Each algorithm's traced all-reduce (one call each, between barriers) from its first message to its last."""
    calls = [e for e in t.events if e.kind == "comm" and e.op == "allreduce"]
    return {alg: max(e.t1 for e in mine) - min(e.t0 for e in mine)
            for alg in ALLREDUCE_ALGORITHMS if (mine := [e for e in calls if e.algorithm == alg])}


def render(rows: list[dict[str, Any]], p: int, n: int, backend: str, clock: Clock = REPLAY,
           replayed: dict[str, float] | None = None) -> Table:
    """The rows; the time column on ``clock``: the traced call ``replayed`` (seconds by algorithm) beside
    ``collective_time`` on the cluster (native: the ring), or the median of the untraced runs on the wall clock."""
    link, gamma = clock.cluster.intra, clock.cluster.gamma

    def formula(alg: str) -> float:
        return collective_time("allreduce", "ring" if alg == "native" else alg, 8 * n, p, link.alpha, link.beta, gamma)

    table = Table(title=f"all-reduce of {n:,} float64 ({n * 8 / 1e6:.1f} MB) on {p} ranks ({backend}); time "
                        f"{clock.label}")
    hidden = "(inside MPI)" if backend == "mpi" else "(shared memory)"
    for col in ("algorithm", "steps (formula)", "bytes sent per rank (trace)", "formula", "match",
                "ms" if replayed is None else "ms / formula"):
        table.add_column(col, justify="left" if col == "algorithm" else "right", no_wrap=col == "algorithm")
    for row in rows:
        native = row["formula"][0] is None
        match = "-" if native else ("yes" if row["sent"] == row["formula"] else "NO")
        steps = "?" if native else str(row["steps"])
        table.add_row(row["algorithm"], f"{steps} ({row['formula_steps']})",
                      hidden if native else by_rank(row["sent"]),
                      hidden if native else by_rank(row["formula"]),
                      match, f"{row['seconds'] * 1e3:.1f}" if replayed is None else
                      f"{replayed[row['algorithm']] * 1e3:.2f} / {formula(row['algorithm']) * 1e3:.2f}")
    table.caption = "formulas: " + "; ".join(f"{k} {v}" for k, v in MODEL.items() if v)
    return table


def check_ranks(p: int) -> str | None:
    return None if p >= 2 else f"lesson 1 compares collectives between ranks: run it on 2 or more (got {p})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int_in(1, 1 << 26), default=1 << 20, help="elements per rank (float64)")
    parser.add_argument("--reps", type=int_in(0, 1000), default=5,
                        help="untraced timing runs per algorithm (0: none)")
    parser.add_argument("--out", default=str(OUT), help="folder for trace.json and trace.chrome.json")
    parser.add_argument("--ranks", type=int_in(1, MAX_RANKS), default=4, help="ranks when not under mpiexec (threads)")
    parser.add_argument("--verbose", action="store_true",
                        help="the whole timeline, the bytes per rank and collective, the trace files (default: the "
                             "table, a short timeline, the conclusion)")
    return parse_lesson_args(clock_arguments(parser), argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    clock = Clock.of_args(args)

    def body(comm: Communicator) -> tuple[list[dict[str, Any]], int, str]:
        return measure(comm, args.n, args.reps, args.out), comm.size, comm.backend

    result = run_ranks(body, args.ranks, check_ranks)
    if result is None:  # not rank 0
        return
    rows, p, backend = result
    out = console()
    path = Path(args.out) / "trace.json"
    out.print(render(rows, p, args.n, backend, clock, replayed_seconds(clock.of(path)) if clock.kind == "replay"
                     else None))
    print_note(out, clock.caveat(p), " (the time column).")
    if not all(r["agrees"] for r in rows):
        raise SystemExit("the algorithms disagree with each other")
    busiest = {r["algorithm"]: f"{max(r['sent']):,}" for r in rows}
    out.print(f"Every rank's bytes equal its algorithm's formula. The busiest rank sends {busiest['ring']} B with the "
              f"ring (2(p-1)/p n, in 2(p-1) = {2 * (p - 1)} steps), {busiest['recursive_doubling']} B with recursive "
              f"doubling (n lg p) and {busiest['naive']} B as the naive root ((p-1) n)."
              if all(r["sent"] == r["formula"] for r in rows if r["formula"][0] is not None) else
              "[red]Some rank's bytes differ from the formula (match column).[/red]", highlight=False)
    to_chrome(trace.load(path), Path(args.out) / "trace.chrome.json")
    finish([path], Path(args.out) / "report.html", out, titles=[f"all-reduce algorithms on {p} ranks"], clock=clock,
           brief=not args.verbose)
    if args.verbose:
        out.print(f"trace: {path} (or open {Path(args.out) / 'trace.chrome.json'} in https://ui.perfetto.dev)")
    out.print(reading_path("01_collectives"), highlight=False)


if __name__ == "__main__":
    main()
