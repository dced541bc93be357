"""Lesson 3: data parallelism, two ways: DDP's bucketed all-reduce and the parameter server.

    mpiexec -n 4 python lessons/03_data_parallel/lesson.py [--steps 10] [--verbose]
    python lessons/03_data_parallel/lesson.py --ranks 4      # same, ranks as threads in one process

1. DDP (Li et al., VLDB 2020): every rank trains a full replica of the tiny GPT on its quarter of each
   global batch; gradients travel in size-capped buckets, each all-reduced (non-blocking) as soon as
   backward has finished it. With every all-reduce algorithm (ring, recursive doubling, naive, native)
   the loss equals one process's, step by step, and each rank's bytes per step (from the trace) the
   algorithm's formula. The overlap is held against its formula (docs/formulas.md, section 11): bucket
   k's all-reduce (``collective_time`` on the cluster) starts when the last rank launched it and bucket
   k - 1 ended, so every bucket but the last hides under the backward.
2. The parameter server (Li et al., OSDI 2014): rank 0 holds the parameters, ranks 1-3 pull, compute,
   push gradients. Synchronous: one process's losses; asynchronous with staleness bound k = 0, 2, 4:
   the fast workers run up to k steps ahead of a straggler (rank 1, slowed on purpose), each applied
   gradient's staleness (in the trace) <= k. An always-slow straggler still does every step, so SSP
   cannot shorten the run: it hides transient delays, at the price of stale gradients.
3. Bytes per link per step: the server's links carry everything (a hub), the ring's an even share.

By default: DDP's table, each part's conclusion and the DDP ring's timeline (its last 2 steps, traced);
``--verbose`` adds the loss tables, the staleness counts, the bytes per link and the parameter server's
timeline (every step traced). Times are replayed (``--clock``, ``--cluster``: ``lessons.common.Clock``):
each span at its rank's CPU time, a core per rank, messages on the cluster's links; ``--clock wall``
shows them as recorded. Writes runs/03_data_parallel/*.json and report.html (``--out``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from lessons import common
from lessons.common import REPLAY, Clock, by_rank, console, finish, lesson_parser, one_process
from minipar import trace
from minipar.cost import ALLREDUCE_ALGORITHMS
from minipar.cost.cluster import Cluster
from minipar.cost.collectives import collective_time
from minipar.nn import GPT, Module
from minipar.optim import SGD
from minipar.parallel import param_server as ps
from minipar.parallel.ddp import DistributedDataParallel, train_step
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, BATCH, LR = 16, 16, 32, 4, 2, 12, 1.0
CAP = 16 * 1024  # bucket cap (bytes): the tiny GPT's 250 KB of gradients make several buckets
STRAGGLER, DELAY = 1, 0.03  # the parameter server's slow worker and its extra seconds per step
OUT = Path("runs/03_data_parallel")
TRACED_STEPS = 2  # DDP traces its last 2 steps (a readable timeline); the parameter server its whole run


def model() -> GPT:
    return GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, seed=0)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (the same on every rank)."""
    return common.lm_batch(step, VOCAB, BATCH, SEQ)


def loss_fn(m: Module, x: np.ndarray, y: np.ndarray) -> Any:
    return m.loss(x, y)


def single_process(steps: int) -> list[float]:
    """The reference: one process, the whole global batch, plain SGD."""
    m = model()
    opt = SGD(m.parameters(), lr=LR)
    return one_process(m, opt, (batch(step) for step in range(steps)))


def sent_matrix(t: trace.Trace) -> np.ndarray:
    """Bytes sent from rank i to rank j (payloads, from the senders' records)."""
    p = t.world_size
    m = np.zeros((p, p), dtype=np.int64)
    for e in t.events:
        if e.kind == "comm" and e.src is not None and e.src == e.rank and e.dst is not None:
            m[e.src, e.dst] += e.nbytes or 0
    return m


# ---- 1. DDP with every all-reduce algorithm --------------------------------------------------------
def ddp_run(comm: Any, algorithm: str, steps: int, out: Path) -> dict[str, Any]:
    m = model()
    ddp = DistributedDataParallel(m, comm, bucket_cap_bytes=CAP, algorithm=algorithm)
    opt = SGD(m.parameters(), lr=LR)
    path = out / f"ddp_{algorithm}.json"
    traced = min(TRACED_STEPS, steps)  # the last steps: a readable timeline
    local = [train_step(ddp, opt, loss_fn, *batch(step)) for step in range(steps - traced)]
    with trace.record(path, comm, lesson="03_data_parallel", **ddp.trace_meta(traced)) as rec:
        local += [train_step(ddp, opt, loss_fn, *batch(step)) for step in range(steps - traced, steps)]
    sent = sum(e.nbytes for e in rec.events
               if e.kind == "comm" and e.src == comm.world_rank and e.op == "allreduce")
    rows = comm.gather_object((local, sent))
    if comm.rank != 0:
        return {}
    return {"losses": np.mean([r[0] for r in rows], axis=0).tolist(), "sent": [r[1] for r in rows],
            "formula": ddp.trace_meta(traced)["expected_bytes_by_rank"][f"allreduce/{algorithm}"],
            "buckets": [b.nbytes for b in ddp.buckets], "path": path, "algorithm": algorithm, "traced": traced}


def overlap(t: trace.Trace, cluster: Cluster, algorithm: str) -> dict[str, float]:
    """DDP's overlap in ``t`` (medians over its steps): the step (first F to last optimizer end over the
    ranks), the all-reduce time exposed after rank 0's backward (its end to rank 0's optimizer), and that
    exposure by the formula: bucket k's all-reduce lasts ``collective_time`` on ``cluster`` (native: the
    ring) and starts at max(its last rank's launch, bucket k - 1's end)."""
    p = t.world_size
    link = cluster.intra if p <= cluster.gpus_per_node else cluster.inter
    alg = "ring" if algorithm == "native" else algorithm
    own = sorted((e for e in t.events if e.thread is None), key=lambda e: e.t0)  # not the all-reduce worker's
    by = {(r, n): [e for e in own if e.rank == r and e.name == n] for r in range(p)
          for n in ("F", "B", "opt", "async posted", "bucket")}
    rows = []
    for s, b0 in enumerate(by[(0, "B")]):
        marks = {(r, n): [e for e in by[(r, n)] if by[(r, "B")][s].t0 <= e.t0 <= by[(r, "opt")][s].t0]
                 for r in range(p) for n in ("async posted", "bucket")}  # step s's launches on each rank
        launches = [max(ts) for ts in zip(*([e.t0 for e in marks[(r, "async posted")]] for r in range(p)),
                                          strict=True)]
        end = 0.0
        for at, mark in zip(launches, marks[(0, "bucket")], strict=True):
            end = max(at, end) + collective_time("allreduce", alg, mark.args["nbytes"], p, link.alpha, link.beta,
                                                 cluster.gamma)
        rows.append((max(by[(r, "opt")][s].t1 for r in range(p)) - min(by[(r, "F")][s].t0 for r in range(p)),
                     by[(0, "opt")][s].t0 - b0.t1, max(0.0, end - b0.t1)))
    return dict(zip(("step", "exposed", "formula"), (float(np.median(c)) for c in zip(*rows, strict=True)),
                    strict=True))


# ---- 2. the parameter server ------------------------------------------------------------------------
def ps_run(comm: Any, mode: str, k: int, steps: int, out: Path) -> dict[str, Any]:
    name = "ps_sync" if mode == "sync" else f"ps_async_k{k}"
    path = out / f"{name}.json"
    meta = ps.run_meta(model(), comm.size, 1, steps, mode, k)
    with trace.record(path, comm, lesson="03_data_parallel", straggler=STRAGGLER, **meta) as rec:
        result = ps.train(comm, model(), loss_fn, batch, steps, n_servers=1, mode=mode, staleness=k,
                          optimizer=lambda params: SGD(params, lr=LR), slow={STRAGGLER: DELAY})
    marks = [e.args for e in rec.events if e.kind == "mark" and e.name == "apply"]
    rows = comm.gather_object((result, marks))
    if comm.rank != 0:
        return {}
    _, losses = ps.merge([r[0] for r in rows])
    staleness = [m["staleness"] for r in rows for m in r[1]]
    return {"name": name, "losses": losses, "staleness": staleness, "path": path}


def run_seconds(t: trace.Trace) -> float:
    """First to last compute or message event: a whole traced run."""
    spans = [e for e in t.events if e.kind in ("compute", "comm")]
    return max(e.t1 for e in spans) - min(e.t0 for e in spans)


def run_all(comm: Any, steps: int, out: Path = OUT) -> dict[str, Any]:
    """Every run of the lesson on ``comm`` (4 ranks); the results on rank 0, {} elsewhere."""
    common.shared_folder(comm, out)
    ddp = {alg: ddp_run(comm, alg, steps, out) for alg in ALLREDUCE_ALGORITHMS}
    runs = [ps_run(comm, "sync", 0, steps, out)] + [ps_run(comm, "async", k, steps, out) for k in (0, 2, 4)]
    return {"ddp": ddp, "ps": runs, "p": comm.size, "backend": comm.backend} if comm.rank == 0 else {}


# ---- tables ------------------------------------------------------------------------------------------
def ddp_tables(res: dict[str, Any], ref: list[float], clock: Clock = REPLAY) -> tuple[Table, Table]:
    ddp = res["ddp"]
    losses = Table(title="DDP loss per step (mean of the ranks' shard losses) vs one process",
                   title_justify="left")
    losses.add_column("step", justify="right")
    losses.add_column("single process", justify="right")
    for alg in ALLREDUCE_ALGORITHMS:
        losses.add_column(alg, justify="right")
    for s, r in enumerate(ref):
        losses.add_row(str(s), f"{r:.10f}", *[f"{ddp[a]['losses'][s]:.10f}" for a in ALLREDUCE_ALGORITHMS])
    b, traced = ddp[ALLREDUCE_ALGORITHMS[0]]["buckets"], ddp[ALLREDUCE_ALGORITHMS[0]]["traced"]
    traffic = Table(title=f"DDP per step (of {traced} traced; times: medians, {clock.label})", title_justify="left",
                    caption=f"bytes: all-reduce bytes each rank sent, {len(b)} buckets of <= {CAP:,} B ({sum(b):,} B "
                            "of gradients); after B: the all-reduce left after rank 0's backward; formula: bucket "
                            f"k's collective_time on {clock.cluster.name} from max(launch, bucket k-1's end), native "
                            "as the ring", caption_justify="left")
    for col in ("algorithm", "trace, by rank", "formula, by rank", "match", "step", "after B", "formula"):
        traffic.add_column(col, justify="right", no_wrap=col == "algorithm")
    for alg in ALLREDUCE_ALGORITHMS:
        d, hidden = ddp[alg], alg == "native"
        o = overlap(clock.of(d["path"]), clock.cluster, alg)
        traffic.add_row(alg, "(inside MPI)" if hidden else by_rank([v // traced for v in d["sent"]]),
                        "" if hidden else by_rank([v // traced for v in d["formula"]]),
                        "-" if hidden else ("yes" if d["sent"] == d["formula"] else "NO"),
                        *(f"{o[k] * 1e3:.2f} ms" for k in ("step", "exposed", "formula")))
    return losses, traffic


def ps_tables(res: dict[str, Any], ref: list[float], clock: Clock = REPLAY) -> tuple[Table, Table]:
    runs = res["ps"]
    losses = Table(title=f"parameter server loss per step (worker {STRAGGLER} sleeps "
                         f"{DELAY * 1e3:.0f} ms a step)", title_justify="left")
    losses.add_column("step", justify="right")
    losses.add_column("single process", justify="right")
    for r in runs:
        losses.add_column(r["name"], justify="right")
    for s, v in enumerate(ref):
        cells = [f"{r['losses'][s]:.6f}" if s < len(r["losses"]) else "" for r in runs]
        losses.add_row(str(s), f"{v:.6f}", *cells)
    losses.add_row(f"{len(ref)} steps, {clock.short}", "",
                   *[f"{run_seconds(clock.of(r['path'])):.2f} s" for r in runs], style="bold")
    stale = Table(title="staleness of each applied gradient (from the trace marks): count by value",
                  title_justify="left")
    stale.add_column("run")
    top = max(max(r["staleness"]) for r in runs)
    for v in range(top + 1):
        stale.add_column(str(v), justify="right")
    stale.add_column("bound k", justify="right")
    for r in runs:
        k = 0 if r["name"] == "ps_sync" else int(r["name"].rsplit("k", 1)[1])
        counts = np.bincount(r["staleness"], minlength=top + 1)
        stale.add_row(r["name"], *[str(c) for c in counts], str(k))
    return losses, stale


def links_table(ring: np.ndarray, hub: np.ndarray) -> Table:
    p = ring.shape[0]
    table = Table(title="bytes per link per step, src -> dst: ring all-reduce (DDP) | parameter server "
                        "(rank 0 = server)", title_justify="left")
    table.add_column("src")
    for j in range(p):
        table.add_column(f"ring ->{j}", justify="right")
    for j in range(p):
        table.add_column(f"PS ->{j}", justify="right")
    for i in range(p):
        cells = [f"{v:,}" if v else "." for v in [*ring[i], *hub[i]]]
        table.add_row(str(i), *cells)
    return table


def check_ranks(p: int) -> str | None:
    return None if p == 4 else f"lesson 3 runs on 4 ranks (1 server and 3 workers, a straggler): got {p}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = lesson_parser(__doc__, steps=10, ranks=4)
    parser.add_argument("--out", default=str(OUT), help="folder for the traces and report.html")
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folder, clock = Path(args.out), Clock.of_args(args)
    res = common.run_ranks(run_all, args.ranks, check_ranks, steps=args.steps, out=folder)
    if res is None:  # not rank 0
        return
    out, verbose = console(), args.verbose
    p, ref, runs, ddp = res["p"], single_process(args.steps), res["ps"], res["ddp"]
    traced = ddp["ring"]["traced"]
    out.rule(f"[bold]1. DDP: the tiny GPT on {p} ranks ({res['backend']}), every all-reduce algorithm")
    losses, traffic = ddp_tables(res, ref, clock)
    out.print(*(losses, traffic) if verbose else (traffic,))
    spread = max(abs(a - b) for d in ddp.values() for a, b in zip(d["losses"], ref, strict=True))
    out.print(f"Every algorithm gives one process's losses (largest difference {spread:.1e} over {len(ref)} steps).",
              highlight=False)
    common.print_note(out, clock.caveat(p), " (the wall times).")
    out.rule(f"[bold]2. the parameter server: rank 0 serves, ranks 1-{p - 1} work, rank {STRAGGLER} straggles")
    if verbose:
        out.print(*ps_tables(res, ref, clock))
    sync = max(abs(a - b) for a, b in zip(runs[0]["losses"], ref, strict=True))
    times = ", ".join(f"{run_seconds(clock.of(r['path'])):.2f}" for r in runs)
    out.print(f"Synchronous: one process's losses (largest difference {sync:.1e}). Asynchronous, staleness bound "
              f"k = {', '.join(r['name'].rsplit('k', 1)[1] for r in runs[1:])}: the stalest applied gradient "
              f"{', '.join(str(max(r['staleness'])) for r in runs[1:])} steps old, never more than k; "
              f"{len(ref)} steps take {times} s "
              f"(sync, then each k; {clock.short}).", highlight=False)
    out.rule("[bold]3. who sends to whom, per step")
    ring, hub = sent_matrix(trace.load(ddp["ring"]["path"])) // traced, sent_matrix(trace.load(runs[0]["path"]))
    hub //= args.steps
    if verbose:
        out.print(links_table(ring, hub))
    out.print(f"The server sends {hub[0].sum():,} B and receives as much, over its {p - 1} links; a ring rank "
              f"sends {ring[0].sum():,} B (2(p-1)/p n), all over one link.", highlight=False)
    paths = [ddp[a]["path"] for a in ALLREDUCE_ALGORITHMS] + [r["path"] for r in runs]
    titles = ([f"DDP {a} ({traced} steps traced)" for a in ALLREDUCE_ALGORITHMS]
              + [f"{r['name']} (all {args.steps} steps traced)" for r in runs])
    if verbose:
        from viz.terminal import print_timeline

        out.rule("[bold]timeline: parameter server, asynchronous, k = 2 (the straggler is rank 1)")
        print_timeline(clock.of(runs[2]["path"]), console=out)
    out.rule(f"[bold]timeline: DDP, ring, {traced} steps (all-reduces while backward runs)")
    finish(paths, folder / "report.html", out, timeline=ddp["ring"]["path"], titles=titles, clock=clock,
           brief=not verbose)
    if verbose:
        out.print(f"traces: {', '.join(str(path) for path in paths)}", highlight=False)
    out.print(common.reading_path("03_data_parallel"), highlight=False)


if __name__ == "__main__":
    main()
