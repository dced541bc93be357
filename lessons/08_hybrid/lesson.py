"""Lesson 8: hybrid parallelism. The tiny GPT on a pp x dp x tp device mesh (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3, PTD-P):
a pipeline of tensor-parallel stages, replicated by data parallelism.

    mpiexec -n 8 python lessons/08_hybrid/lesson.py [--steps 5] [--cluster local|FILE] [--clock wall]
    python lessons/08_hybrid/lesson.py [--ranks 8]      # same, ranks as threads in one process
    mpiexec -n 8 python lessons/08_hybrid/lesson.py --pp 2 --dp 2 --sp 2 --tp 1   # another mesh

The world's ranks form a grid ``arange(world).reshape(pp, dp, sp, tp)``, tp innermost
(``minipar/mesh.py``): rank = ((pp_i dp + dp_i) sp + sp_i) tp + tp_i. Each rank gets one
sub-communicator per axis, and each axis carries one kind of traffic: tp Megatron's f / g
all-reduces inside every layer (Shoeybi et al. 2019), pp the activations between stages, point to
point, dp the gradients once per step (one ring all-reduce of the rank's slice). The model is
``minipar.parallel.hybrid.HybridGPT``; its bytes per axis per rank are ``minipar.cost.hybrid``,
its step time on a cluster ``minipar.cost.perf.predict``, the layout search ``minipar.cost.planner``.

Printed: 1. the mesh: every rank's coordinates and what it holds (its stage's layers, its tp slice
of the weights: heads, MLP columns, vocabulary rows; its replica's rows of the batch; parameters
held, measured vs ``cost.hybrid.parameters_per_rank``). 2. the losses of a few AdamW steps next to
one process's ``nn.GPT`` + ``AdamW`` on the whole batch, and the largest parameter difference after
them: the mesh computes the same model. 3. bytes each rank sent in one step per mesh axis, summed
from the trace by the axis its two ranks differ in (``MeshShape.axis_of``), next to
``cost.hybrid.traffic_by_axis``. 4. each rank's model states when its optimizer step begins and its
activation peak (1F1B keeps more micro-batches on the first stage), measured vs ``cost.hybrid``. 5.
``perf.predict`` against the traced step replayed (``minipar.replay``), both on one cluster: the links
of ``--cluster`` (default ``local``: this machine's network, measured; or a ``minipar calibrate`` file)
and this machine's compute measured in CPU time, every rank at once, on the shapes one rank computes,
the terms in which the replay charges a span: FLOP/s, gamma, the per-op overhead (which tensor
parallelism does not divide), the optimizer's, and the CPU a message costs (``--clock wall``: the
measured step instead). 6. the planner on GPT-3 175B
with 3072 A100s (Selene): the fastest predicted layouts and why each beats the next, and the 6 x 8 x
64 (d x t x p) grid for comparison. Then the terminal timeline; the HTML report draws the grid (one
colour per sub-communicator), the bytes per rank stacked by mesh axis with the formula, and where
each layout's predicted step goes.
Writes runs/08_hybrid/hybrid.json (the last step; hybrid-step<k>.json the ones between; messages.json the
message-overhead runs of section 5) and report.html.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from lessons.common import MAX_RANKS, REPLAY, Clock, finish, lesson_parser, one_process, parse_lesson_args, run_ranks
from lessons.common import console as make_console
from minipar import datasets
from minipar import trace as mtrace
from minipar.cli_args import int_in
from minipar.cost import hybrid as formulas
from minipar.cost import perf, planner, presets
from minipar.mesh import DeviceMesh, MeshShape
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.hybrid import HybridGPT
from minipar.replay import replay
from viz.memory_stack import before_step
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, MICRO, LR, WD = 32, 16, 32, 4, 4, 64, 8, 2, 3e-3, 0.01
MESH = {"pp": 2, "dp": 2, "sp": 1, "tp": 2}  # change with --pp/--dp/--sp/--tp (product = ranks; tp or sp, not both)
SCHEDULE, STEPS = "1f1b", 5  # step 0 warms up, the last is traced, the others are timed
OUT = Path("runs/08_hybrid")
scale = importlib.import_module("lessons.08_hybrid.predict")  # sections 5 and 6: perf.predict and the planner


def tiny_layout(mesh: dict[str, int]) -> formulas.TinyLayout:
    return formulas.TinyLayout(vocab=VOCAB, seq=SEQ, d=D_MODEL, heads=HEADS, layers=LAYERS, d_ff=D_FF, batch=BATCH,
                               microbatches=MICRO, **mesh)


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    stream = datasets.token_stream(20_000, VOCAB, seed=0)
    return [datasets.lm_batch(stream, BATCH, SEQ, step=s) for s in range(steps)]


# ---- 1. the mesh ------------------------------------------------------------------------------------
def _span(names: list[str]) -> str:
    """``["embed", "blocks.0", "blocks.1"]`` -> ``"embed, blocks 0-1"``."""
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    parts = [n for n in names if not n.startswith("blocks.")]
    if blocks:
        parts.insert(1 if names[0] == "embed" else 0,
                     f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
    return ", ".join(parts)


def holdings(model: HybridGPT) -> dict[str, Any]:
    """What this rank holds: its stage's layers, its tensor slice (read from the parameters' declared
    ``shard``: heads, MLP columns, vocabulary rows or head columns), its replica's rows of the batch (and
    positions under sequence parallelism, contiguous), and how many parameters."""
    params = dict(model.pipe.named_parameters())
    layers = [n for s in sorted(model.pipe.stages) for n in model.pipe.stages[s].layer_names]

    def shard(suffix: str, axis: int) -> slice | None:
        name = next((n for n in params if n.endswith(suffix)), None)
        return None if name is None or params[name].shard is None else params[name].shard[axis]

    slices, head_dim = [], D_MODEL // HEADS
    q, fc, vocab, head = shard("attn.q.weight", 1), shard("mlp.fc.weight", 1), shard("tok_emb.weight", 0), \
        shard("head.weight", 1)
    if q is not None:
        slices.append(f"heads {q.start // head_dim}-{q.stop // head_dim - 1}")
    if fc is not None:
        slices.append(f"fc {fc.start}:{fc.stop}")
    for what, sl in (("vocab", vocab), ("vocab", head)):
        if sl is not None:
            slices.append(f"{what} {sl.start}:{sl.stop}")
    coords, degree = model.mesh.coords, model.mesh.degree
    rows, positions = BATCH // degree("dp"), SEQ // degree("sp")
    data = f"rows {coords['dp'] * rows}:{(coords['dp'] + 1) * rows}"
    if degree("sp") > 1:
        data += f", positions {coords['sp'] * positions}:{(coords['sp'] + 1) * positions}"
    return {"layers": _span(layers), "slices": ", ".join(slices) or "whole weights", "data": data,
            "params": sum(p.data.size for p in params.values())}


def mesh_table(shape: MeshShape, held: list[dict[str, Any]]) -> Table:
    c = tiny_layout(shape.degrees())
    same = all(h["params"] == formulas.parameters_per_rank(c, shape.coords(r)["pp"]) for r, h in enumerate(held))
    table = Table(title=f"the mesh {shape}: rank = ((pp_i x {shape.dp} + dp_i) x {shape.sp} + sp_i) x {shape.tp} "
                        "+ tp_i", title_justify="left",
                  caption="tp varies fastest (Megatron-LM's order). pp: the rank's pipeline stage and its "
                          "layers; tp: its slice of every weight matrix (Megatron: q, k, v and the MLP's fc by "
                          "columns, the projections by rows, the vocabulary split); dp: its replica's rows of the "
                          "global batch; parameters: float64 numbers held, "
                          + ("equal on every rank to" if same else "[red]NOT equal[/red] to")
                          + " cost.hybrid.parameters_per_rank.", caption_justify="left")
    for col in ("rank", "pp: stage", "tp: tensor slice", "dp: batch", "parameters"):
        table.add_column(col, justify="left" if ":" in col else "right")
    for r, h in enumerate(held):
        co = shape.coords(r)
        table.add_row(str(r), f"{co['pp']}: {h['layers']}", f"{co['tp']}: {h['slices']}",
                      f"{co['dp']}: {h['data']}" if shape.sp == 1 else f"{co['dp']}, sp {co['sp']}: {h['data']}",
                      f"{h['params']:,}")
    return table


def groups_text(shape: MeshShape) -> str:
    """Every sub-communicator of every axis of degree > 1, as rank sets."""
    lines = []
    for axis, degree in shape.degrees().items():
        if degree > 1:
            groups = sorted({tuple(shape.group(r, axis)) for r in range(shape.size)})
            lines.append(f"{axis}: " + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups))
    return "sub-communicators (one per group, mesh[axis] on each member): " + "; ".join(lines)


# ---- 2. training ------------------------------------------------------------------------------------
def sample(model: HybridGPT) -> None:
    """The rank's model states (parameters, gradients, optimizer state) as memory samples of the trace."""
    for label, nbytes in model.state_bytes().items():
        mtrace.memory(label, nbytes)


def train(comm: Any, mesh: dict[str, int] | None = None, steps: int = STEPS,
          trace_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``steps`` AdamW steps of the tiny GPT on ``mesh`` (every rank, the same global batches); the
    last step traced into ``trace_path`` with the formula's bytes per axis in its metadata, the steps
    between the first (a warm-up) and the last into ``<trace_path stem>-step<k>.json`` beside it
    (``"earlier"``: section 5 replays them all). Each step starts after a barrier; its time is the
    slowest rank's. Returns (on every rank) the losses, the step times, the whole model's parameters
    after the steps and what each rank holds."""
    mesh = mesh or MESH
    dm = DeviceMesh(comm, **mesh)
    model = HybridGPT(dm, VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, schedule=SCHEDULE, microbatches=MICRO, lr=LR,
                      weight_decay=WD, seed=0)
    held = comm.allgather_object(holdings(model))
    c = tiny_layout(mesh)
    expected = {a: [formulas.traffic_by_axis(c, r).get(a, 0) for r in range(comm.size)]
                for a in dict.fromkeys(a for r in range(comm.size) for a in formulas.traffic_by_axis(c, r))}
    meta = {**model.trace_meta(), "time_unit": "s", "expected_bytes_by_axis": expected,
            "config": {"vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL, "heads": HEADS, "layers": LAYERS,
                       "d_ff": D_FF, "batch": BATCH, "microbatches": MICRO, **mesh}}
    losses, seconds = [], []
    earlier = [Path(trace_path).with_name(f"{Path(trace_path).stem}-step{k}.json") for k in range(1, steps - 1)
               ] if trace_path is not None else []
    for step, (x, y) in enumerate(batches(steps)):
        comm.barrier()
        t0 = time.perf_counter()
        path = trace_path if step == steps - 1 else (earlier[step - 1] if 0 < step <= len(earlier) else None)
        with mtrace.record(path, comm, **meta):
            sample(model)  # held through the step (the report's peak adds the activations to it)
            losses.append(model.forward_backward(x, y))  # samples them again when the optimizer step begins
            model.optimizer_step()
        seconds.append(max(comm.allgather_object(time.perf_counter() - t0)))
    return {"losses": losses, "seconds": seconds, "state": model.full_state_dict(), "held": held,
            "trace": trace_path, "earlier": earlier, "mesh": mesh}


def single_process(steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process: ``nn.GPT`` and ``AdamW`` on the whole batch, the same initialisation."""
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return one_process(model, opt, batches(steps)), model.state_dict()


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


# ---- 3. traffic per axis ------------------------------------------------------------------------------
def bytes_by_axis(trace: mtrace.Trace, shape: MeshShape) -> dict[int, dict[str, int]]:
    """Bytes each rank sent, per mesh axis: every message counted once, on its sender, on the axes in
    which its two ranks differ (the sub-communicator that carried it)."""
    out: dict[int, dict[str, int]] = {r: {} for r in range(shape.size)}
    for e in trace.events:
        if e.kind == "comm" and e.rank == e.src and e.dst is not None:
            axis = shape.axis_of(e.src, e.dst)
            out[e.src][axis] = out[e.src].get(axis, 0) + (e.nbytes or 0)
    return out


def traffic_table(trace: mtrace.Trace, shape: MeshShape) -> tuple[Table, bool]:
    got, c = bytes_by_axis(trace, shape), tiny_layout(shape.degrees())
    axes = list(dict.fromkeys(a for r in range(shape.size) for a in [*got[r], *formulas.traffic_by_axis(c, r)]))
    table = Table(title="bytes each rank sent in one step, by mesh axis: measured (the trace) / formula "
                        "(cost.hybrid.traffic_by_axis)", title_justify="left",
                  caption="tp: per micro-batch and block 2 all-reduces of the b x S x d activation forward and 2 "
                          "backward, the embedding's g and the head's f, the loss's 3 small all-reduces; pp: one "
                          "activation per micro-batch forward and its gradient back, and the loss broadcast; dp: "
                          "the ring all-reduce of this rank's gradients, 2 (N-1)/N x 8 bytes x its parameters (with "
                          "sp > 1 the ring runs over the dp x sp replicas; a rank's hop to its successor lands on "
                          "sp or dp+sp; sp itself carries Ulysses' all-to-alls).",
                  caption_justify="left")
    for col in ("rank", "coords", *axes, "total"):
        table.add_column(col, justify="right")
    equal = True
    for r in range(shape.size):
        want = formulas.traffic_by_axis(c, r)
        equal &= got[r] == want
        table.add_row(str(r), " ".join(f"{a}{i}" for a, i in shape.coords(r).items() if shape.degrees()[a] > 1),
                      *(f"{got[r].get(a, 0):,} / {want.get(a, 0):,}" for a in axes),
                      f"{sum(got[r].values()):,} / {sum(want.values()):,}")
    return table, equal


# ---- 4. memory per rank ----------------------------------------------------------------------------------
def memory_table(trace: mtrace.Trace, shape: MeshShape) -> tuple[Table, bool]:
    """Model states when the optimizer step begins and the activation peak, per rank, measured (the
    trace's memory samples) / formula (``cost.hybrid.model_state_bytes``, ``activation_peak_bytes``)."""
    c = tiny_layout(shape.degrees())
    table = Table(title="bytes each rank holds: model states when the optimizer step begins, and the most activations "
                        "kept at once; measured (the trace) / formula (cost.hybrid)", title_justify="left",
                  caption="float64 AdamW: 8 bytes per parameter, 8 per gradient, 16 of state (m, v). Activations: "
                          "1F1B keeps p - s micro-batches in flight on stage s (here all of them on stage 0, one "
                          "on stage 1), each the Korthikanti et al. terms of its tensor-parallel blocks.",
                  caption_justify="left")
    for col in ("rank", "parameters", "gradients", "optimizer state", "activation peak"):
        table.add_column(col, justify="right")
    equal = True
    for r in range(shape.size):
        got, want = before_step(trace, r), formulas.model_state_bytes(c, r)
        peak = max((e.nbytes or 0 for e in trace.select("memory", rank=r, name="activations")), default=0)
        want_peak = formulas.activation_peak_bytes(c, r, SCHEDULE)
        equal &= all(got.get(k) == v for k, v in want.items()) and peak == want_peak
        table.add_row(str(r), *(f"{got.get(k, 0):,} / {v:,}" for k, v in want.items()), f"{peak:,} / {want_peak:,}")
    return table, equal


# ---- 5. predicted vs measured ---------------------------------------------------------------------------
def tiny_spec() -> perf.ModelSpec:
    return perf.ModelSpec(layers=LAYERS, hidden=D_MODEL, heads=HEADS, seq=SEQ, vocab=VOCAB, ffn=D_FF,
                          bytes_per_number=8, name="the tiny GPT (float64)")


def tiny_perf_layout(mesh: dict[str, int]) -> perf.Layout:
    return perf.Layout(dp=mesh["dp"], tp=mesh["tp"], pp=mesh["pp"], sp=mesh["sp"],
                       micro_batch=BATCH // (mesh["dp"] * MICRO), global_batch=BATCH, schedule=SCHEDULE)


# ---- the lesson ------------------------------------------------------------------------------------------
def check_ranks(p: int, mesh: dict[str, int] | None = None) -> str | None:
    """What is wrong with running ``mesh`` on ``p`` ranks (None when nothing): the world size, then the
    layout's own problems (``perf.Layout.check``: degrees dividing heads, layers, the batch)."""
    mesh = mesh or MESH
    shape = MeshShape(**mesh)
    if p != shape.size:
        return (f"lesson 8 runs the mesh {shape} on {shape.size} ranks: run it on {shape.size}, or change the "
                f"degrees with --pp/--dp/--sp/--tp (got {p})")
    if BATCH % (mesh["dp"] * MICRO):
        return (f"the mesh {shape}: the global batch of {BATCH} does not split into dp x micro-batches = "
                f"{mesh['dp']} x {MICRO}: choose dp dividing {BATCH // MICRO}")
    problems = tiny_perf_layout(mesh).check(tiny_spec())
    if mesh["tp"] > 1 and mesh["sp"] > 1:
        problems.insert(0, "a stage is tensor- or sequence-parallel: set --tp 1 or --sp 1")
    return f"the mesh {shape}: " + "; ".join(problems) if problems else None


def shard_gpt(mesh: dict[str, int]) -> dict[str, int]:
    """The GPT shapes one rank computes: a micro-batch of its replica's rows, its sequence shard, its
    tensor-parallel slice of the width, heads, MLP and vocabulary (``rates.compute_rates``' ``gpt``)."""
    t = mesh["tp"]
    return {"batch": BATCH // (mesh["dp"] * MICRO), "seq": SEQ // mesh["sp"], "d_model": D_MODEL // t,
            "heads": HEADS // t, "layers": LAYERS, "vocab": VOCAB // t, "d_ff": D_FF // t}


def step_seconds(trace: mtrace.Trace) -> float:
    """First to last compute or message event."""
    spans = [e for e in trace.events if e.kind in ("compute", "comm")]
    return max(e.t1 for e in spans) - min(e.t0 for e in spans)


def run(comm: Any, steps: int, mesh: dict[str, int], clock: Clock = REPLAY) -> None:
    console = make_console()
    lead = comm.rank == 0
    if lead:
        OUT.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    res = train(comm, mesh, steps, OUT / "hybrid.json")
    cluster = scale.lesson_cluster(comm, clock.cluster, shard_gpt(mesh), OUT / "messages.json")  # every rank
    if not lead:
        return
    shape = MeshShape(**mesh)
    console.rule(f"[bold]1. the mesh {shape}: who holds what")
    console.print(mesh_table(shape, res["held"]))
    console.print(groups_text(shape), highlight=False, markup=False)
    console.print("Change the mesh with --pp, --dp, --sp and --tp (their product is the number of ranks; a stage is "
                  "tensor- or sequence-parallel, so tp or sp).", highlight=False)
    console.rule(f"[bold]2. {steps} AdamW steps, global batch {BATCH} ({MICRO} micro-batches per replica)")
    ref, ref_state = single_process(steps)
    table = Table(title="loss per step", title_justify="left")
    for col in ("step", "one process (nn.GPT + AdamW)", f"mesh {shape}"):
        table.add_column(col, justify="right")
    for s in range(steps):
        table.add_row(str(s), f"{ref[s]:.12f}", f"{res['losses'][s]:.12f}")
    console.print(table)
    loss_diff = max(abs(a - b) for a, b in zip(ref, res["losses"], strict=True))
    param_diff = max_difference(res["state"], ref_state)
    console.print(f"The mesh computes one process's model: losses equal to {loss_diff:.1e}, every parameter after "
                  f"{steps} steps to {param_diff:.1e} (float64 rounding: sums in another order).", highlight=False)
    trace = mtrace.load(res["trace"])
    console.rule("[bold]3. bytes per mesh axis (the last step)")
    table, equal = traffic_table(trace, shape)
    console.print(table)
    console.print("Every rank's bytes on every axis equal the formula." if equal else
                  "[red]measured and formula differ[/red] (see the table)", highlight=False)
    console.rule("[bold]4. memory per rank (the last step)")
    if shape.sp == 1:
        table, equal = memory_table(trace, shape)
        console.print(table)
        console.print("Every rank holds what the formulas say." if equal else
                      "[red]measured and formula differ[/red] (see the table)", highlight=False)
    else:
        console.print("(cost.hybrid.activation_peak_bytes models tensor-parallel stages; sp > 1 here.)")
    console.rule(f"[bold]5. predicted vs {clock.short} step time")
    if note := clock.caveat(comm.size):
        console.print(f"[yellow]note:[/yellow] {note}; the prediction has one core per rank.", highlight=False)
    pred = perf.predict(tiny_spec(), tiny_perf_layout(mesh), cluster)
    if clock.kind == "replay":
        replayed = replay(trace, cluster)
        each = [step_seconds(replay(mtrace.load(p), cluster)) for p in res["earlier"]] + [step_seconds(replayed)]
        got = float(np.median(each))
        console.print(scale.prediction_table(pred, got, cluster, clock.short))
        console.print(f"Replayed steps {', '.join(f'{t * 1e3:.1f}' for t in each)} ms (every step after the "
                      f"warm-up): the table holds their median.", highlight=False)
        console.print(scale.replayed_parts(replayed, pred), highlight=False)
    else:  # the timed steps, on the wall clock
        got = float(np.median(res["seconds"][1:-1] or res["seconds"]))
        console.print(scale.prediction_table(pred, got, cluster, clock.short))
        console.print(scale.small_messages(trace, shape), highlight=False)
    console.rule(f"[bold]6. the planner on GPT-3 175B, {scale.GPUS} A100s")
    ranked = planner.plan(presets.MODELS[scale.GPT3], scale.GPUS, presets.CLUSTERS[scale.CLUSTER], scale.GPT3_BATCH)
    grid = scale.grid_prediction()
    console.print(scale.plan_table(ranked, grid))
    for i, c in enumerate(ranked):
        console.print(f"{i + 1}. {c.why()}", highlight=False)
    console.print(f"\nplanner's first: {ranked[0].prediction.explain()}\n\n6 x 8 x 64 grid (96 layers on 64 stages: "
                  f"Layout.check refuses the uneven split, predicted with uneven_stages=True and full recomputation, "
                  f"as Narayanan et al.'s Table 1 runs): {grid.explain()}", highlight=False)
    console.rule("[bold]the traced step's timeline (F / B per stage and micro-batch, sync, opt)")
    figures = [(f"predicted vs {clock.short}: the tiny GPT's step on this machine",
                scale.parts_figure({"predicted (perf.predict)": scale.parts(pred), clock.short: {clock.short: got}},
                                   f"one step of the tiny GPT on {shape}: predicted vs {clock.short}, "
                                   f"on {cluster.name}")),
               ("the planner on GPT-3 175B: where each layout's predicted step goes",
                scale.parts_figure({**{c.label(): scale.parts(c.prediction) for c in ranked[:3]},
                                    "6 x 8 x 64 grid (dp6 tp8 pp64, full recompute)": scale.parts(grid)},
                                   f"GPT-3 175B on {scale.GPUS} A100s: predicted seconds per step"))]
    finish([trace], OUT / "report.html", console, titles=[f"hybrid {shape}, {SCHEDULE}, m = {MICRO}"],
           extra_figures=figures, clock=clock)


def _mesh_problem(args: argparse.Namespace) -> str | None:
    mesh = {a: getattr(args, a) for a in MESH}
    size = MeshShape(**mesh).size
    if (args.ranks or size) > MAX_RANKS:
        return f"the mesh {MeshShape(**mesh)} needs {size} ranks; at most {MAX_RANKS} run as threads here"
    return check_ranks(args.ranks or size, mesh)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = lesson_parser(__doc__, steps=STEPS, ranks=0)  # --ranks 0: the mesh's size
    for axis, degree in MESH.items():
        parser.add_argument(f"--{axis}", type=int_in(1, MAX_RANKS), default=degree,
                            help=f"{axis} degree (default {degree})")
    return parse_lesson_args(parser, argv, _mesh_problem)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mesh = {a: getattr(args, a) for a in MESH}
    ranks = args.ranks or MeshShape(**mesh).size
    run_ranks(run, ranks, lambda p: check_ranks(p, mesh), steps=args.steps, mesh=mesh, clock=Clock.of_args(args))


if __name__ == "__main__":
    main()
