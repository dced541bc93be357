"""Lesson 10's printed sections: the numbers of each run, measured from its trace (the kill, each
survivor's "peer declared dead", the server's "worker dropped") and held against what should be; each
section appends what did not hold to ``problems`` (the lesson then exits non-zero)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from minipar import trace as mtrace
from minipar.parallel.zero import checkpoint
from viz.terminal import print_timeline
from viz.width import Table

P = importlib.import_module("lessons.10_faults.parts")


def period(deadline: float) -> float:
    """The detector's heartbeat period (``detector.Detector.period``)."""
    return min(1.0, max(0.01, deadline / 5))


def kill_time(t: mtrace.Trace) -> float:
    return t.select("mark", name="killed")[0].t0


def after_kill(t: mtrace.Trace, name: str) -> dict[int, tuple[float, dict[str, Any]]]:
    """Per rank: seconds from the kill to its first mark ``name``, and the mark's args."""
    k, out = kill_time(t), {}
    for e in sorted(t.select("mark", name=name), key=lambda e: e.t0):
        out.setdefault(e.rank, (e.t0 - k, e.args))
    return out


def updates(applied: list[tuple[int, int, int, int]]) -> dict[int, list[int]]:
    """The steps of each worker's updates the server applied, in order of application."""
    out: dict[int, list[int]] = {}
    for w, c, _, _ in applied:
        out.setdefault(w, []).append(c)
    return out


def stall(t: mtrace.Trace, worker: int) -> tuple[float, int]:
    """A worker's longest wait between two forward passes, and the step it then started."""
    fs = sorted(t.select("compute", name="F", rank=worker), key=lambda e: e.t0)
    gaps = [(b.t0 - a.t1, b.step) for a, b in zip(fs, fs[1:])]
    return max(gaps) if gaps else (0.0, 0)


def parameter_server(console: Console, res: dict[str, Any], problems: list[str]) -> list[str]:
    t = mtrace.load(res["trace"])
    console.rule(f"[bold]1. asynchronous parameter server (k = {P.STALENESS}): worker {P.PS_VICTIM} killed before "
                 f"its push of step {P.PS_KILL}")
    (declared, args), = after_kill(t, "peer declared dead").values()
    dropped, _ = after_kill(t, "worker dropped")[0]
    d = args["deadline"]
    console.print(f"killed at {kill_time(t):.3f} s; the server declared it dead {declared:.3f} s later (no heartbeat "
                  f"for {args['silence']:.2f} s; deadline {d} s, heartbeats every {period(d):.2f} s: expected "
                  f"{d - period(d):.2f}..{d + period(d):.2f} s) and dropped it {dropped:.3f} s after the kill.",
                  highlight=False)
    got = updates(res["applied"])
    table = Table(title="updates per worker: each (worker, step) applied once, in step order", title_justify="left")
    for col in ("worker", "pushed (its own count)", "applied by the server", "expected", "steps applied"):
        table.add_column(col, justify="right")
    ok = True
    workers = sorted({*res["pushed"], P.PS_VICTIM})
    for w in workers:
        want = P.PS_KILL if w == P.PS_VICTIM else P.PS_STEPS
        steps = got.get(w, [])
        ok &= steps == list(range(want))
        pushed = "killed" if w == P.PS_VICTIM else str(res["pushed"].get(w))
        table.add_row(str(w), pushed, str(len(steps)), str(want), f"{steps[0]}..{steps[-1]}" if steps else "-")
    console.print(table)
    console.print("No lost and no doubled update: every worker's steps were applied exactly once, in order; the "
                  f"killed worker's step {P.PS_KILL} was never pushed, so never applied."
                  if ok else "[red]updates missing or doubled[/red] (see the table)", highlight=False)
    waited, at = max(stall(t, w) for w in workers if w != P.PS_VICTIM)
    console.print(f"The survivors ran up to k = {P.STALENESS} steps ahead of the dead worker's clock ({P.PS_KILL}), "
                  f"then waited {waited:.2f} s before step {at}: until the server dropped it (the slowest live clock "
                  "moved on).", highlight=False)
    losses = res["losses"]
    console.print("loss per step (mean over the workers that ran it): " + " ".join(f"{x:.3f}" for x in losses),
                  highlight=False)
    console.print(f"The loss still falls: {losses[0]:.3f} at step 0, {losses[-1]:.3f} at step {len(losses) - 1}.",
                  highlight=False)
    problems += [] if ok else ["parameter server: updates lost or doubled"]
    problems += [] if losses[-1] < losses[0] else ["parameter server: the loss did not fall"]
    print_timeline(t, console=console, title="async parameter server: rank 0 serves, worker 2 killed (X), "
                                              "the server's detector declares it dead (!)")
    return [res["trace"]]


def ddp(console: Console, res: dict[str, Any], problems: list[str]) -> list[str]:
    t = mtrace.load(res["trace"])
    console.rule(f"[bold]2. DDP: rank {P.DDP_VICTIM} killed before step {P.DDP_KILL}; every survivor stops")
    declared, stopped = after_kill(t, "peer declared dead"), after_kill(t, "PeerLost")
    table = Table(title="each survivor: where it waited, which rank it names, how long after the kill",
                  title_justify="left", caption="declared: its failure detector's mark; stopped: PeerLost caught. "
                  "Expected: deadline +- one heartbeat period.", caption_justify="left")
    for col in ("survivor", "waiting in", "dead rank named", "declared (s)", "stopped (s)", "expected (s)"):
        table.add_column(col, justify="right")
    ok = True
    for row in sorted(res["stopped"], key=lambda r: r["rank"]):
        r = row["rank"]
        (dt, args), (st, _) = declared[r], stopped[r]
        d = args["deadline"]
        ok &= row["dead"] == P.DDP_VICTIM and dt <= st <= d + 2 * period(d)
        table.add_row(str(r), row["operation"], str(row["dead"]), f"{dt:.3f}", f"{st:.3f}",
                      f"{d - period(d):.2f}..{d + period(d):.2f}")
    console.print(table)
    console.print(f"All {len(res['stopped'])} survivors stopped within the deadline, naming rank {P.DDP_VICTIM}."
                  if ok and len(res["stopped"]) == 3 else "[red]a survivor did not stop in time[/red]",
                  highlight=False)
    problems += [] if ok and len(res["stopped"]) == 3 else ["DDP: a survivor did not stop in time"]
    full, meta = checkpoint.consolidate(res["ckpt"])  # checks every shard file's sha256
    ckpt = Path(res["ckpt"])
    left = sorted(p.name for p in ckpt.parent.glob(f"{ckpt.name}.*"))
    console.print(f"The checkpoint on disk is step {meta['step']}'s (the last complete one; every shard's checksum "
                  f"verified, {sum(a.size for a in full.values()):,} numbers); temporary or old copies left: "
                  f"{left or 'none'}.", highlight=False)
    problems += [] if meta["step"] == P.DDP_KILL and not left else ["DDP: not the last complete checkpoint"]
    print_timeline(t, console=console, title="DDP: rank 2 killed (X); the survivors' detectors declare it dead (!)")
    return [res["trace"]]


def elastic_restart(console: Console, runs: list[dict[str, Any]], reference: dict[str, Any],
                    problems: list[str]) -> list[str]:
    console.rule(f"[bold]3. elastic restart: {P.EL_RANKS} ranks lose rank {P.EL_VICTIM} before step {P.EL_KILL}, "
                 "the job restarts smaller")
    table = Table(title=f"runs of the elastic loop: global batch {P.BATCH} every step", title_justify="left")
    for col in ("run", "ranks", "resumed at step", "micro-batches per rank", "rows per step", "steps run", "end"):
        table.add_column(col, justify="right")
    for r in runs:
        end = "rank killed: PeerLost" if r["status"] else "done"
        table.add_row(str(r["run"]), str(r["ranks"]), str(r["start"]), f"{r['accumulation']} x {P.MICRO}",
                      f"{r['ranks']} x {r['accumulation']} x {P.MICRO} = {r['ranks'] * r['accumulation'] * P.MICRO}",
                      str(len(r["losses"])), end)
    console.print(table)
    final = runs[-1]["params"]
    diff = max(float(np.max(np.abs(final[k] - reference["params"][k]))) for k in reference["params"])
    console.print(f"Final parameters after {P.EL_STEPS} steps vs the uninterrupted run on {P.EL_RANKS} ranks: max "
                  f"|difference| {diff:.1e} (float64 rounding: the same sums in another order).", highlight=False)
    shape = [(r["ranks"], r["start"]) for r in runs]
    problems += [] if diff < 1e-10 and shape == [(P.EL_RANKS, 0), (P.EL_RANKS - 1, P.EL_KILL)] else [
        f"elastic: runs {shape}, max difference {diff:.1e}"]
    traces = [r["trace"] for r in runs if r["trace"]]
    print_timeline(traces[0], console=console, title=f"elastic run 0: {P.EL_RANKS} ranks, rank {P.EL_VICTIM} "
                                                     "killed (X), the survivors stop (!)")
    return traces
