"""Lesson 9: tensors that know how they are split (GSPMD, Xu et al. 2021; OneFlow's SBP, Yuan et al.
2021), Megatron written as four annotations, and tensor parallelism beyond one dimension: 2.5-D (Wang et
al. 2021, Tesseract) and 3-D (Bian et al. 2021).

    mpiexec -n 8 python lessons/09_sharding/lesson.py
    python lessons/09_sharding/lesson.py            # the same, 8 ranks as threads in one process

1. The seed's 4x5 @ 5x8 matmul on 2 ranks under every pair of placements S(0), S(1), B, P: what the
   chooser (``minipar.sharding.propagate``) moves A and B to, C's placement, the bytes one rank sends
   (``minipar.cost.sharding`` vs the trace), C vs numpy: all 16 run, uneven cuts as PyTorch DTensor makes
   them (k = 5 columns of A cut 3 + 2), by default as a 4 x 4 grid. Then one op
   ahead against the whole chain (``minipar.sharding.chain``): X[S(1)] @ W[B] then gelu, both run.
2. Megatron in annotations: ``minipar.sharding.nn.Block`` with only its weights placed (fc, q, k, v
   by columns, the second linears by rows) beside the hand-written ``parallel.tensor.ParallelBlock``:
   outputs, gradients and bytes equal; where propagation put the collectives.
3. One block on 8 ranks: 1-D (Megatron, t = 8), 2.5-D (d = 2 stacked 2 x 2 grids: 8 is no square) and
   3-D (a 2 x 2 x 2 cube): bytes sent, parameters and activations per rank against ``minipar.cost``.
By default a line each for parts 1 and 2, part 3's table, the 3-D block's timeline and the conclusion;
``--verbose`` adds part 1's table and part 2's bytes and collectives. Writes runs/09_sharding/
{1d,2p5d,3d}.json and report.html (the three timelines, the traffic, parts 1 and 3 as bar charts).
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go

from lessons.common import REPLAY, Clock, finish, lesson_parser, parse_lesson_args, print_note, reading_path, run_ranks
from lessons.common import console as make_console
from minipar import nn, trace
from minipar.autograd import Tensor
from minipar.cost import tensor as cost1d
from minipar.cost import tensor2p5d as cost2p5d
from minipar.cost import tensor3d as cost3d
from minipar.cost.sharding import collective
from minipar.functional import _gelu
from minipar.memory import activation_bytes, seq_mark
from minipar.mesh import DeviceMesh
from minipar.parallel.tensor.model import ParallelBlock
from minipar.parallel.tensor.tp2p5d import Block2p5D, block_2p5d, grid_2p5d
from minipar.parallel.tensor.tp3d import Block3D, cube_3d, input_piece
from minipar.sharding import GlobalTensor, Partial, Replicate, Shard, chain, ops
from minipar.sharding import nn as snn
from minipar.sharding.placement import describe
from minipar.sharding.plan import cheapest, plan_bytes
from minipar.sharding.propagate import matmul_strategies
from minipar.sharding.redistribute import plan_text
from viz.analysis import sent_by_op
from viz.figures import measured_bars
from viz.width import Table

BATCH, SEQ, D, HEADS, D_FF, SEED, RANKS = 8, 4, 16, 8, 32, 3, 8
M, K, N = 4, 5, 8  # the seed's matmul
OUT = Path("runs/09_sharding")
B = Replicate()
ONE = [Shard(0), Shard(1), B, Partial()]
NAMES = {"1d": "1-D (t=8)", "2p5d": "2.5-D (d=2, q=2)", "3d": "3-D (q=2)"}


# ---- 1. the seed's matmul under every pair of placements ---------------------------------------------------
def seed_operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(-3, 4, (M, K)).astype(np.float64), rng.integers(-3, 4, (K, N)).astype(np.float64)


def seed_run(mesh: DeviceMesh) -> list[dict[str, Any]]:
    """Every pair on the mesh's ``tp`` axis (2 ranks; other axes compute the same): one row each, the
    bytes per ``tp`` rank measured (trace) and predicted (the cheapest plans' bytes, ``plan_bytes``)."""
    x, y = seed_operands()
    rows, tp = [], mesh["tp"]
    for pa, pb in itertools.product(ONE, repeat=2):
        a = GlobalTensor.from_global(x, mesh, ("tp",), [pa])
        b = GlobalTensor.from_global(y, mesh, ("tp",), [pb])
        na, nb, pc, _ = matmul_strategies(a, b)[0]
        predicted = [sum(per_rank) for per_rank in zip(*[
            plan_bytes(t.shape, 8, t.degrees, t.placements, cheapest(t.shape, 8, t.degrees, t.placements, n)[0])
            for t, n in ((a, na), (b, nb))], strict=True)]
        with trace.recording(mesh.rank) as rec:
            c = ops.matmul(a, b)
        sent = tp.allgather_object(int(sum(sent_by_op(rec.events, mesh.rank).values())))  # untraced
        rows.append({"A": str(pa), "B": str(pb), "needs": f"{na[0]} x {nb[0]}", "C": describe(pc)[1:-1],
                     "how": ", ".join(plan_text((pa,), na, "A") + plan_text((pb,), nb, "B")) or "none (local)",
                     "predicted": predicted, "sent": sent, "equal": bool(np.array_equal(c.to_global(), x @ y))})
    return rows


def per_rank(n: list[int]) -> str:
    return str(n[0]) if len(set(n)) == 1 else "/".join(map(str, n))


def seed_table(rows: list[dict[str, Any]]) -> Table:
    return Table.of(f"C = A @ B, A {M}x{K}, B {K}x{N} float64, on 2 ranks: bytes each rank sends",
                    ("A x B", "needs", "C", "moves", "predicted", "measured"), [
        (f"{r['A']} x {r['B']}", r["needs"], r["C"] if r["equal"] else f"[red]{r['C']} wrong[/red]", r["how"],
         per_rank(r["predicted"]), per_rank(r["sent"])) for r in rows], text=4)


def seed_grid(rows: list[dict[str, Any]]) -> Table:
    """The 16 pairs as a 4 x 4 grid: C's placement and the bytes each rank sends (rank 0/rank 1)."""
    cell = {(r["A"], r["B"]): f"{r['C']} {per_rank(r['sent'])}" for r in rows}
    names = [str(p) for p in ONE]
    return Table.of(f"A {M}x{K} @ B {K}x{N}, 2 ranks: C, bytes rank 0/1 send", ("A \\ B", *names),
                    [(a, *(cell[(a, b)] for b in names)) for a in names], text=5)


def seed_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Bytes the busier rank sends per pair, measured, labelled with the prediction."""
    return measured_bars([f"{r['A']} x {r['B']} -> {r['C']}" for r in rows],
                         [("bytes sent (trace)", [max(r["sent"]) for r in rows], [max(r["predicted"]) for r in rows])],
                         f"the seed's {M}x{K} @ {K}x{N} matmul on 2 ranks: bytes one rank sends to make each pair of "
                         "placements legal (label: cost.sharding's prediction)", "bytes sent per rank",
                         "A's placement x B's placement -> C's")


CHAIN_X, CHAIN_W = (32, 16), (16, 128)  # X[S(1)] @ W[B] then gelu


def chain_run(mesh: DeviceMesh) -> dict[str, tuple[int, int, bool]]:
    """X[S(1)] @ W[B] then gelu on the ``tp`` axis, planned one op ahead (the ops' chooser) and over the
    whole chain (dynamic programming): (predicted, measured bytes one rank sends, output equals numpy)."""
    rng = np.random.default_rng(1)
    x, w = rng.normal(size=CHAIN_X), rng.normal(size=CHAIN_W)
    gx = GlobalTensor.from_global(x, mesh, ("tp",), [Shard(1)])
    links = [chain.Link("matmul", (GlobalTensor.from_global(w, mesh, ("tp",), [B]),)), chain.Link("gelu")]
    out = {}
    for how, plan in (("greedy", chain.greedy(gx, links)), ("chain", chain.plan(gx, links))):
        with trace.recording(mesh.rank) as rec:
            y = chain.run(gx, links, plan)
        out[how] = (plan.total, int(sum(sent_by_op(rec.events, mesh.rank).values())),
                    bool(np.allclose(y.to_global(), _gelu(x @ w), rtol=1e-12, atol=1e-12)))
    return out


# ---- 2. Megatron in annotations ----------------------------------------------------------------------------
def inputs() -> tuple[np.ndarray, np.ndarray]:
    """The block's input and the fixed tensor the loss ``sum(y * r)`` weighs its output with."""
    rng = np.random.default_rng(SEED)
    return rng.normal(size=(BATCH, SEQ, D)), rng.normal(size=(BATCH, SEQ, D))


def annotated(comm: Any) -> dict[str, Any]:
    """The annotated block and the hand-written one on ``comm``'s ranks, same input, same loss."""
    x, r = inputs()
    mesh = DeviceMesh(comm, tp=comm.size)
    layer = snn.Block(D, HEADS, mesh, ("tp",), snn.prefixed("attn.", snn.MEGATRON) | snn.prefixed(
        "mlp.", snn.MEGATRON), d_ff=D_FF).init_parameters(SEED, "b.")
    gx = GlobalTensor.from_global(x, mesh, ("tp",), [B]).requires_grad_()
    with trace.recording(comm.world_rank) as rec:
        y = ops.redistribute(layer(gx), [B], "output")
        mark = len(rec.events)
        ops.sum(ops.mul(y, GlobalTensor.from_global(r, mesh, ("tp",), [B]))).backward()
    hand = ParallelBlock(D, HEADS, comm, d_ff=D_FF).init_parameters(SEED, "b.")
    tx = Tensor(x.transpose(1, 0, 2).copy(), requires_grad=True)  # Megatron's [seq, batch, d]
    with trace.recording(comm.world_rank) as rec2:
        ty = hand(tx)
        mark2 = len(rec2.events)
        (ty * r.transpose(1, 0, 2)).sum().backward()
    worst = max(float(np.abs(p.grad.local - q.grad).max()) for (_, p), (_, q) in
                zip(layer.named_parameters(), hand.named_parameters(), strict=True))
    moves = [(i < mark, e.args) for i, e in enumerate(rec.events) if e.kind == "mark" and e.name == "redistribute"]
    return {"y": float(np.abs(y.local - ty.data.transpose(1, 0, 2)).max()), "grads": worst,
            "dx": float(np.abs(gx.grad.local - tx.grad.transpose(1, 0, 2)).max()),
            "bytes": [sent_by_op(part, comm.world_rank) for part in (rec.events[:mark], rec.events[mark:],
                                                                      rec2.events[:mark2], rec2.events[mark2:])],
            "moves": moves, "placements": {n: str(p.placements[0]) for n, p in layer.named_parameters()}}


def annotated_formula(t: int) -> int:
    """Bytes one rank sends per phase: two ring all-reduces of the activation (attention's, the MLP's)."""
    return int(2 * cost1d.ring_bytes("allreduce", BATCH * SEQ * D * 8, t))


def print_annotated(res: dict[str, Any], t: int, out: Any) -> bool:
    """Part 2's placements, bytes per phase and collectives; whether the bytes equal the formula."""
    formula = annotated_formula(t)
    named = {n: p for n, p in res["placements"].items() if p != "B"}
    out.print(f"The user places {len(named)} of the block's {len(res['placements'])} parameters (the rest stay "
              f"whole, B): " + ", ".join(f"{n} {p}" for n, p in named.items()), highlight=False)
    fa, ba, fh, bh = res["bytes"]
    t_ = Table.of(f"bytes one rank sends, t = {t}, activation {BATCH}x{SEQ}x{D} float64 = {BATCH * SEQ * D * 8} bytes",
                  ("phase", "annotated (sharding.nn)", "hand-written (parallel.tensor)", "formula: 2 all-reduces"),
                  [(phase, str(dict(x)), str(dict(y)), str(formula)) for phase, x, y in
                   (("forward", fa, fh), ("backward", ba, bh))])
    out.print(t_)
    out.print("Where propagation put them (the trace's redistribute marks on rank 0: the op that needed the "
              "change, or the engine bringing a complete gradient to its tensor's placement):", highlight=False)
    for forward, m in res["moves"]:
        how = collective(m["src"][1:-1], m["dst"][1:-1])
        out.print(f"  {'forward ' if forward else 'backward'} {m['op']:<11} {str(m['shape']):<11} {m['src']} -> "
                  f"{m['dst']}  {how + (' (free)' if how in ('zero', 'slice') else '')}", highlight=False)
    out.print(f"Largest differences from the hand-written block: output {res['y']:.1e}, input gradient "
              f"{res['dx']:.1e}, parameter gradients {res['grads']:.1e}.", highlight=False)
    return all(sum(x.values()) == formula for x in res["bytes"])


# ---- 3. 1-D vs 2.5-D vs 3-D ----------------------------------------------------------------------------------
def three_ways(comm: Any, out_dir: Path) -> dict[str, Any]:
    """One forward and backward of each block; bytes, parameters, activations, output vs one process."""
    x, r = inputs()
    ref = nn.Block(D, HEADS, D_FF).init_parameters(SEED, "b.")
    start = seq_mark()
    whole_y = ref(Tensor(x))
    res: dict[str, Any] = {"whole_params": sum(p.data.size for p in ref.parameters()),
                           "whole_act": activation_bytes(whole_y, start)}
    for kind in NAMES:
        unpiece = None
        if kind == "1d":
            block: Any = ParallelBlock(D, HEADS, comm, d_ff=D_FF)
            piece = lambda a: a.transpose(1, 0, 2).copy()  # noqa: E731 - [seq, batch, d]
            unpiece = lambda a: a.transpose(1, 0, 2)  # noqa: E731
        elif kind == "2p5d":
            grid = grid_2p5d(comm, 2)
            block, piece = Block2p5D(D, HEADS, grid, d_ff=D_FF), (lambda a, g=grid: block_2p5d(a, g))
        else:
            cube = cube_3d(comm)
            block, piece = Block3D(D, HEADS, cube, d_ff=D_FF), (lambda a, c=cube: input_piece(a, c))
        block.init_parameters(SEED, "b.")
        xt = Tensor(piece(x), requires_grad=True)
        with trace.record(out_dir / f"{kind}.json", comm, paradigm=f"tensor {NAMES[kind]}") as rec:
            start = seq_mark()
            with trace.span("F", args={"layer": 0}):
                y = block(xt)
            act = activation_bytes(y, start)
            with trace.span("B", args={"layer": 0}):
                (y * piece(r)).sum().backward()
        want = unpiece(piece(whole_y.data)) if unpiece else piece(whole_y.data)
        me = comm.world_rank
        res[kind] = {"bytes": sum(sent_by_op(rec.events, me).values()),
                     "params": sum(p.data.size for p in block.parameters()), "act": act,
                     "diff": float(np.abs((unpiece(y.data) if unpiece else y.data) - want).max())}
    return res


def formulas(rank: int, whole_act: int) -> dict[str, dict[str, int]]:
    """Part 3's predictions for ``rank`` of 8, from minipar.cost: bytes sent, parameters, activation bytes."""
    t, rows, q = 8, BATCH * SEQ, 2
    k, i, j = rank // 4, rank // 2 % 2, rank % 2  # 2.5-D (depth, grid row, grid column); 3-D: its k is i here
    b25 = cost2p5d.block2p5d_bytes(rows, D, D_FF, q, 2, i, j, k)
    b3 = cost3d.block3d_bytes(rows, D, D_FF, q, i)
    return {
        "1d": {"bytes": int(sum(cost1d.block_bytes(t, BATCH, SEQ, D).values())),
               "params": cost1d.block_parameters(t, D, D_FF),
               "act": sum(cost1d.layer_terms(t, BATCH, SEQ, D, HEADS, D_FF).values())},
        "2p5d": {"bytes": sum(sum(c.values()) for c in b25.values()),
                 "params": cost2p5d.block2p5d_parameters(D, D_FF, q),
                 "act": cost2p5d.activation_bytes(whole_act, q, 2, 2, D)},
        "3d": {"bytes": sum(sum(c.values()) for c in b3.values()), "params": cost3d.block3d_parameters(D, D_FF, q),
               "act": sum(cost3d.block3d_activation_bytes(BATCH, SEQ, D, HEADS, D_FF, q).values())}}


def compare_table(res: dict[str, Any], rank: int) -> tuple[Table, bool]:
    """Part 3's table (measured / formula per cell) and whether every measurement equals its formula."""
    want = formulas(rank, res["whole_act"])
    t = Table.of(f"rank {rank}: one block forward + backward ({BATCH}x{SEQ}x{D}, {HEADS} heads, d_ff {D_FF}, float64), "
                 "measured / formula", ("layout", "bytes sent", "params", "activations", "max |y - y1|"), [],
                 caption=f"params: numbers held (one process: {res['whole_params']}); activations: bytes kept for "
                 f"backward (one process: {res['whole_act']}); y1: one process's output", caption_justify="left")
    ok = True
    for kind, name in NAMES.items():
        got, w = res[kind], want[kind]
        ok &= all(got[k] == w[k] for k in ("bytes", "params", "act"))
        t.add_row(name, *(f"{got[k]} / {w[k]}" for k in ("bytes", "params", "act")), f"{got['diff']:.1e}")
    return t, ok


def compare_figure(res: dict[str, Any], rank: int) -> go.Figure:
    """Part 3 as bars: bytes sent, parameter bytes and activation bytes per layout, the formula as label."""
    want, kinds = formulas(rank, res["whole_act"]), list(NAMES)
    series = [(label, [res[k][what] * scale for k in kinds], [want[k][what] * scale for k in kinds])
              for what, label, scale in (("bytes", "bytes sent", 1), ("params", "parameter bytes", 8),
                                         ("act", "activation bytes kept", 1))]
    return measured_bars([NAMES[k] for k in kinds], series, f"one transformer block on 8 ranks, rank {rank}, one "
                         "forward + backward: measured (bars), the formula (label)", "bytes per rank")


# ---- the lesson ---------------------------------------------------------------------------------------------
def run(comm: Any, clock: Clock = REPLAY, verbose: bool = False) -> None:
    out = make_console()
    OUT.mkdir(parents=True, exist_ok=True)
    rows = seed_run(DeviceMesh(comm, dp=comm.size // 2, tp=2))
    ahead = chain_run(DeviceMesh(comm, dp=comm.size // 2, tp=2))
    res2 = annotated(comm)
    res3 = three_ways(comm, OUT)
    if comm.rank != 0:
        return
    good = all(r["equal"] and r["sent"] == r["predicted"] for r in rows)
    out.rule("[bold]1. the seed's 4x5 @ 5x8 under every pair of placements (one axis, 2 ranks)")
    out.print(seed_table(rows) if verbose else seed_grid(rows))
    out.print(f"All {len(rows)} pairs run; a split of k = {K} over 2 ranks is uneven, 3 + 2 columns of A and rows of "
              "B as PyTorch DTensor cuts them, so S(1) x S(0) (row-parallel) is free and the ranks of an uneven "
              "move send unequal bytes. "
              + ("Every product equals numpy's and every rank's measured bytes the prediction." if good else
                 "[red]a product or a byte count differs (run with --verbose)[/red]"), highlight=False)
    (g, g_sent, g_ok), (c, c_sent, c_ok) = ahead["greedy"], ahead["chain"]
    out.print(f"One op ahead or the whole chain: X[S(1)] @ W[B] then gelu, X {CHAIN_X[0]}x{CHAIN_X[1]}, W "
              f"{CHAIN_W[0]}x{CHAIN_W[1]}. The ops' chooser leaves C partial and reduce-scatters it for gelu: {g:,} "
              f"bytes per rank; dynamic programming over the chain moves X to rows first: {c:,}. "
              + ("Both sent as predicted, both equal numpy's." if (g, c) == (g_sent, c_sent) and g_ok and c_ok
                 else "[red]a byte count or an output differs[/red]"), highlight=False)
    out.rule(f"[bold]2. Megatron as annotations, t = {comm.size}")
    ok2 = print_annotated(res2, comm.size, out) if verbose else all(
        sum(x.values()) == annotated_formula(comm.size) for x in res2["bytes"])
    out.print(f"With only the weights placed (q, k, v, fc by columns, both projections by rows), propagation finds "
              f"Megatron's 2 all-reduces a phase: {annotated_formula(comm.size):,} bytes per rank in forward, as in "
              "backward. "
              + ("Annotated and hand-written send the same bytes, the formula's." if ok2 else
                 "[red]bytes differ (run with --verbose)[/red]"), highlight=False)
    out.rule("[bold]3. one block on 8 ranks: 1-D vs 2.5-D vs 3-D")
    t3, ok3 = compare_table(res3, 0)
    out.print(t3)
    out.print("Measured equals the formula for every layout." if ok3 else "[red]measured and formula differ[/red]",
              highlight=False)
    print_note(out, clock.caveat(comm.size))
    figures = [("one block, three layouts: measured vs formula", compare_figure(res3, 0)),
               ("the seed's matmul: bytes per pair of placements", seed_figure(rows))]
    finish([OUT / "3d.json", OUT / "2p5d.json", OUT / "1d.json"], OUT / "report.html", out,
           titles=[NAMES["3d"], NAMES["2p5d"], NAMES["1d"]], extra_figures=figures, clock=clock, brief=not verbose)
    out.print("1-D keeps whole what a replicated layer needs (layer norms, residual sums) and moves activations "
              "only. 2.5-D and 3-D split everything and also move weight blocks (SUMMA's broadcasts, the cube's "
              "gathers), so their bytes grow with the weights; 2.5-D all-reduces every gradient over its d = 2 "
              "grids, and 3-D keeps its gathered inputs and weights for backward.", highlight=False)
    out.print(reading_path("09_sharding"), highlight=False)


def check_ranks(p: int) -> str | None:
    return None if p == RANKS else f"this lesson runs on {RANKS} ranks (a 2 x 2 x 2 cube); got {p}: mpiexec -n 8"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    return parse_lesson_args(lesson_parser(__doc__, 1, RANKS), argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_ranks(run, args.ranks, check_ranks, clock=Clock.of_args(args), verbose=args.verbose)


if __name__ == "__main__":
    main()
