"""Lesson 9: tensors that know how they are split (GSPMD, Xu et al. 2021; OneFlow's SBP, Yuan et al.
2021), Megatron written as four annotations, and tensor parallelism beyond one dimension: 2-D / 2.5-D
(Xu et al. 2021, Optimus; Wang et al. 2021, Tesseract) and 3-D (Bian et al. 2021).

    mpiexec -n 8 python lessons/09_sharding/lesson.py
    python lessons/09_sharding/lesson.py            # the same, 8 ranks as threads in one process

1. The seed's 4x5 @ 5x8 matmul on one mesh axis of 2 ranks under every pair of placements S(0), S(1),
   B, P: the placements the chooser moves A and B to, C's placement, the collective, the bytes one rank
   sends (predicted by ``minipar.cost.sharding``, measured from the trace) and C checked against numpy.
2. Megatron in annotations: ``minipar.sharding.nn.Block`` with only its weights placed
   (``nn.MEGATRON``: fc, q, k, v by columns, the second linears by rows) on all the world's ranks,
   next to the hand-written ``minipar.parallel.tensor.ParallelBlock``: outputs, gradients and bytes
   per rank equal; where propagation put the collectives (the trace's ``redistribute`` marks).
3. One transformer block on the same 8 ranks three ways: 1-D (Megatron, t = 8), 2.5-D (two stacked
   2 x 2 grids: d = 2, q = 2; with 8 ranks no square grid exists, and 2.5-D with d = 1 is 2-D) and
   3-D (a 2 x 2 x 2 cube): bytes each rank sends, parameters and activations it holds, measured
   against ``minipar.cost.tensor``, ``tensor2p5d`` and ``tensor3d``; outputs equal one process.
Then the terminal timeline of the 3-D block; the report draws all three blocks' timelines, the
traffic between ranks, the seed table's bytes and section 3's comparison.
Writes runs/09_sharding/{1d,2p5d,3d}.json and report.html.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go

from lessons.common import REPLAY, Clock, finish, lesson_parser, parse_lesson_args, run_ranks
from lessons.common import console as make_console
from minipar import nn, trace
from minipar.autograd import Tensor
from minipar.cost import tensor as cost1d
from minipar.cost import tensor2p5d as cost2p5d
from minipar.cost import tensor3d as cost3d
from minipar.cost.sharding import collective
from minipar.memory import activation_bytes, seq_mark
from minipar.mesh import DeviceMesh
from minipar.parallel.tensor.model import ParallelBlock
from minipar.parallel.tensor2p5d import Block2p5D, block_2p5d, grid_2p5d
from minipar.parallel.tensor3d import Block3D, cube_3d, input_piece
from minipar.sharding import GlobalTensor, Replicate, ops
from minipar.sharding import nn as snn
from viz.analysis import sent_by_op
from viz.width import Table

table = importlib.import_module("lessons.09_sharding.table")  # section 1
BATCH, SEQ, D, HEADS, D_FF, SEED, RANKS = 8, 4, 16, 8, 32, 3, 8
OUT = Path("runs/09_sharding")
B = Replicate()


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """The block's input and the fixed tensor the loss ``sum(y * r)`` weighs its output with."""
    rng = np.random.default_rng(SEED)
    return rng.normal(size=(BATCH, SEQ, D)), rng.normal(size=(BATCH, SEQ, D))


# ---- 2. Megatron in annotations ----------------------------------------------------------------------------
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


def print_annotated(res: dict[str, Any], t: int, out: Any) -> bool:
    a = BATCH * SEQ * D * 8
    formula = 2 * cost1d.ring_bytes("allreduce", a, t)  # per phase: one all-reduce each for attention and MLP
    named = {n: p for n, p in res["placements"].items() if p != "B"}
    out.print(f"The user places {len(named)} of the block's {len(res['placements'])} parameters (the rest stay "
              f"whole, B): " + ", ".join(f"{n} {p}" for n, p in named.items()), highlight=False)
    t_ = Table(title=f"bytes one rank sends, t = {t}, activation {BATCH}x{SEQ}x{D} float64 = {a} bytes",
               title_justify="left")
    for col in ("phase", "annotated (sharding.nn)", "hand-written (parallel.tensor)", "formula: 2 all-reduces"):
        t_.add_column(col, justify="right")
    fa, ba, fh, bh = res["bytes"]
    for phase, x, y in (("forward", fa, fh), ("backward", ba, bh)):
        t_.add_row(phase, str(dict(x)), str(dict(y)), str(int(formula)))
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
def megatron_parameters(t: int) -> int:
    """Numbers per rank of a Megatron block on t ranks: q, k, v, fc by columns and both projections by
    rows are split; the layer norms and the projections' biases are whole."""
    return (2 * 2 * D + 3 * (D * D // t + D // t) + (D * D // t + D) + (D * D_FF // t + D_FF // t)
            + (D_FF // t * D + D))


def three_ways(comm: Any, out_dir: Path) -> dict[str, Any]:
    """One forward and backward of each block; bytes, parameters, activations, output vs one process."""
    x, r = inputs()
    ref = nn.Block(D, HEADS, D_FF).init_parameters(SEED, "b.")
    start = seq_mark()
    whole_y = ref(Tensor(x))
    whole_act = activation_bytes(whole_y, start)
    res: dict[str, Any] = {"whole_params": sum(p.data.size for p in ref.parameters()), "whole_act": whole_act}
    for kind in ("1d", "2p5d", "3d"):
        if kind == "1d":
            block: Any = ParallelBlock(D, HEADS, comm, d_ff=D_FF)
            piece = lambda a: a.transpose(1, 0, 2).copy()  # noqa: E731 - [seq, batch, d]
            unpiece = lambda a: a.transpose(1, 0, 2)  # noqa: E731
        elif kind == "2p5d":
            grid = grid_2p5d(comm, 2)
            block, piece, unpiece = Block2p5D(D, HEADS, grid, d_ff=D_FF), (lambda a, g=grid: block_2p5d(a, g)), None
        else:
            cube = cube_3d(comm)
            block, piece, unpiece = Block3D(D, HEADS, cube, d_ff=D_FF), (lambda a, c=cube: input_piece(a, c)), None
        block.init_parameters(SEED, "b.")
        xt = Tensor(piece(x), requires_grad=True)
        with trace.record(out_dir / f"{kind}.json", comm, paradigm=f"tensor {NAMES[kind]}") as rec:
            start = seq_mark()
            with trace.span("F", args={"layer": 0}):
                y = block(xt)
            mark, act = len(rec.events), activation_bytes(y, start)
            with trace.span("B", args={"layer": 0}):
                (y * piece(r)).sum().backward()
        want = unpiece(piece(whole_y.data)) if unpiece else piece(whole_y.data)
        me = comm.world_rank
        res[kind] = {"fwd": sent_by_op(rec.events[:mark], me), "bwd": sent_by_op(rec.events[mark:], me),
                     "params": sum(p.data.size for p in block.parameters()), "act": act,
                     "diff": float(np.abs((unpiece(y.data) if unpiece else y.data) - want).max())}
    return res


def formulas(rank: int, whole_act: int) -> dict[str, dict[str, Any]]:
    """Section 3's predictions for ``rank`` of 8, from minipar.cost."""
    t, rows, q = 8, BATCH * SEQ, 2
    k, i, j = rank // 4, rank // 2 % 2, rank % 2  # 2.5-D (depth, grid row, grid column); 3-D: its k is i here
    b25 = cost2p5d.block2p5d_bytes(rows, D, D_FF, q, 2, i, j, k)
    b3 = cost3d.block3d_bytes(rows, D, D_FF, q, i)
    return {
        "1d": {"bytes": int(sum(cost1d.block_bytes(t, BATCH, SEQ, D).values())), "params": megatron_parameters(t),
               "act": sum(cost1d.layer_terms(t, BATCH, SEQ, D, HEADS, D_FF).values())},
        "2p5d": {"bytes": sum(sum(c.values()) for c in b25.values()),
                 "params": cost2p5d.block2p5d_parameters(D, D_FF, q),
                 "act": cost2p5d.activation_bytes(whole_act, q, 2, 2, D)},
        "3d": {"bytes": sum(sum(c.values()) for c in b3.values()), "params": cost3d.block3d_parameters(D, D_FF, q),
               "act": sum(cost3d.block3d_activation_bytes(BATCH, SEQ, D, HEADS, D_FF, q).values())}}


NAMES = {"1d": "1-D (t=8)", "2p5d": "2.5-D (d=2, q=2)", "3d": "3-D (q=2)"}


def compare_table(res: dict[str, Any], rank: int) -> tuple[Table, bool]:
    want = formulas(rank, res["whole_act"])
    t = Table(title=f"rank {rank}: one block forward + backward ({BATCH}x{SEQ}x{D}, {HEADS} heads, d_ff {D_FF}, "
              "float64)", title_justify="left")
    for col in ("layout", "bytes sent", "formula", "params", "formula", "of all", "activations", "formula",
                "of all", "max |y - y1|"):
        t.add_column(col, justify="right")
    ok = True
    for kind, name in NAMES.items():
        got, w = res[kind], want[kind]
        nbytes = sum(got["fwd"].values()) + sum(got["bwd"].values())
        ok &= (nbytes, got["params"], got["act"]) == (w["bytes"], w["params"], w["act"])
        t.add_row(name, str(nbytes), str(w["bytes"]), str(got["params"]), str(w["params"]),
                  f"1/{res['whole_params'] / got['params']:.2f}", str(got["act"]), str(w["act"]),
                  f"1/{res['whole_act'] / got['act']:.2f}", f"{got['diff']:.1e}")
    return t, ok


def compare_figure(res: dict[str, Any], rank: int) -> go.Figure:
    want = formulas(rank, res["whole_act"])
    kinds = list(NAMES)
    fig = go.Figure()
    for what, label, colour in (("bytes", "bytes sent", "#4c78a8"), ("params", "parameter bytes", "#f58518"),
                                ("act", "activation bytes kept", "#54a24b")):
        got = [(sum(res[k]["fwd"].values()) + sum(res[k]["bwd"].values())) if what == "bytes" else
               res[k][what] * (8 if what == "params" else 1) for k in kinds]
        fig.add_bar(name=label, x=[NAMES[k] for k in kinds], y=got, marker_color=colour,
                    text=[f"formula {want[k][what] * (8 if what == 'params' else 1)}" for k in kinds])
    fig.update_layout(barmode="group", height=420, yaxis_title="bytes per rank",
                      title=f"one transformer block on 8 ranks, rank {rank}: measured (bars) and the formula (label)")
    return fig


# ---- the lesson ---------------------------------------------------------------------------------------------
def run(comm: Any, clock: Clock = REPLAY) -> None:
    out = make_console()
    OUT.mkdir(parents=True, exist_ok=True)
    mesh = DeviceMesh(comm, dp=comm.size // 2, tp=2)
    rows = table.run(mesh)
    res2 = annotated(comm)
    res3 = three_ways(comm, OUT)
    if comm.rank != 0:
        return
    out.rule("[bold]1. the seed's 4x5 @ 5x8 under every pair of placements (one axis, 2 ranks)")
    out.print(table.table(rows))
    good = all(r.get("equal", True) and r.get("sent") == r.get("predicted") for r in rows)
    out.print("Every product equals numpy's and every measured byte count the prediction." if good else
              "[red]a product or a byte count differs (see the table)[/red]", highlight=False)
    out.rule(f"[bold]2. Megatron as annotations, t = {comm.size}")
    ok2 = print_annotated(res2, comm.size, out)
    out.print("Annotated and hand-written send the same bytes, the formula's." if ok2 else
              "[red]bytes differ (see the table)[/red]", highlight=False)
    out.rule("[bold]3. one block on 8 ranks: 1-D vs 2.5-D vs 3-D")
    t3, ok3 = compare_table(res3, 0)
    out.print(t3)
    out.print("Measured equals the formula for every layout." if ok3 else "[red]measured and formula differ[/red]",
              highlight=False)
    out.print("Bytes are per rank for one forward and backward; params are numbers held, activations the bytes "
              "kept for backward; y1 is one process's output. 1-D keeps whole what a replicated layer needs (layer "
              "norms, residual sums) and moves activations only. 2.5-D and 3-D split everything and move weight "
              "blocks as well as activation blocks (SUMMA's broadcasts, the cube's gathers), so their bytes grow "
              "with the weights too; 2.5-D also all-reduces every gradient over its d = 2 grids, and 3-D keeps "
              "its gathered inputs and weights for backward.", highlight=False)
    note = clock.caveat(comm.size)
    if note:
        out.print(f"[yellow]note:[/yellow] {note}.", highlight=False)
    figures = [("the seed's matmul: bytes per pair of placements", table.figure(rows)),
               ("one block, three layouts: measured vs formula", compare_figure(res3, 0))]
    finish([OUT / "3d.json", OUT / "2p5d.json", OUT / "1d.json"], OUT / "report.html", out,
           titles=[NAMES["3d"], NAMES["2p5d"], NAMES["1d"]], extra_figures=figures, clock=clock)


def check_ranks(p: int) -> str | None:
    return None if p == RANKS else f"this lesson runs on {RANKS} ranks (a 2 x 2 x 2 cube); got {p}: mpiexec -n 8"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    return parse_lesson_args(lesson_parser(__doc__, 1, RANKS), argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_ranks(run, args.ranks, check_ranks, clock=Clock.of_args(args))


if __name__ == "__main__":
    main()
