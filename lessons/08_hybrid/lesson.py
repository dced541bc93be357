"""Lesson 8: hybrid parallelism. The tiny GPT on a pp x dp x tp device mesh (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3, PTD-P):
a pipeline of tensor-parallel stages, replicated by data parallelism.

    mpiexec -n 8 python lessons/08_hybrid/lesson.py [--steps 5] [--cluster local|FILE] [--clock wall] [--verbose]
    python lessons/08_hybrid/lesson.py [--ranks 8]      # same, ranks as threads in one process
    mpiexec -n 8 python lessons/08_hybrid/lesson.py --pp 2 --dp 2 --sp 2 --tp 1   # another mesh

The world's ranks form a grid ``arange(world).reshape(pp, dp, sp, tp)``, tp innermost
(``minipar/mesh.py``): rank = ((pp_i dp + dp_i) sp + sp_i) tp + tp_i. Each rank gets one
sub-communicator per axis, and each axis carries one kind of traffic: tp Megatron's f / g
all-reduces inside every layer (Shoeybi et al. 2019), pp the activations between stages, point to
point, dp the gradients once per step (one ring all-reduce of the rank's slice). The model is
``minipar.parallel.hybrid.HybridGPT``; its bytes per axis per rank are ``minipar.cost.hybrid``,
its step time on a cluster ``minipar.cost.perf.predict``, the layout search ``minipar.cost.planner``.
Zero-bubble schedules run on any mesh: W is local but for Megatron-SP's re-gather (``cost.hybrid``).

Printed: 1. the mesh's sub-communicators (``--verbose``: every rank's coordinates and what it holds:
its stage's layers, its tp slice of the weights, its replica's rows, its parameters vs
``cost.hybrid.parameters_per_rank``). 2. the losses of a few AdamW steps and every parameter after
them equal one process's ``nn.GPT`` + ``AdamW`` on the whole batch (``--verbose``: step by step). 3.
bytes each rank sent in one step per mesh axis (the axis its two ranks differ in) next to
``cost.hybrid.traffic_by_axis``, and each rank's model states and activation peak (1F1B keeps more
micro-batches on the first stage) against ``cost.hybrid`` (``--verbose``: the memory table). 4.
``perf.predict`` against the traced step replayed (``minipar.replay``), both on one cluster: the links
of ``--cluster`` (``local``: this machine's network, measured; or a ``minipar calibrate`` file) and
this machine's compute in CPU time, every rank at once, on the shapes one rank computes
(``rates.replay_cluster``: FLOP/s, gamma, the per-op overhead, which tensor parallelism does not
divide, the optimizer's, the CPU a message costs; ``--clock wall``: the measured step instead). Then
the traced step's timeline. ``--verbose`` adds the planner on GPT-3 175B with 3072 A100s (Selene): the
fastest predicted layouts, why each beats the next, and the 6 x 8 x 64 (d x t x p) grid. The HTML
report draws the grid (one colour per sub-communicator), the bytes per rank stacked by mesh axis with
the formula, and where each layout's predicted step goes. Writes runs/08_hybrid/hybrid.json (the last
step; hybrid-step<k>.json the ones between; messages.json the message-overhead runs) and report.html.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from lessons import common
from lessons.common import console as make_console
from minipar import trace as mtrace
from minipar.calibrate import FIT_FROM
from minipar.cli_args import int_in
from minipar.cost import hybrid as formulas
from minipar.cost import perf, planner, presets
from minipar.mesh import DeviceMesh, MeshShape
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.hybrid import HybridGPT
from minipar.rates import replay_cluster
from minipar.replay import replay
from viz import mesh as vmesh
from viz.prediction import parts, parts_figure, plan_table, prediction_table, replayed_parts, small_messages

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, MICRO, LR, WD = 32, 16, 32, 4, 4, 64, 8, 2, 3e-3, 0.01
MESH = {"pp": 2, "dp": 2, "sp": 1, "tp": 2}  # change with --pp/--dp/--sp/--tp (product = ranks; tp or sp, not both)
SCHEDULE, STEPS = "1f1b", 5  # step 0 warms up, the last is traced, the others are timed
OUT = Path("runs/08_hybrid")
GPT3, GPUS, GPT3_BATCH, CLUSTER = "gpt3-175b", 3072, 1536, "a100-selene"  # the planner's example at scale
GRID = {"dp": 6, "tp": 8, "pp": 64}  # the d x t x p grid attributed to GPT-3 (Narayanan et al.'s 1T layout)


def tiny_layout(mesh: dict[str, int]) -> formulas.TinyLayout:
    return formulas.TinyLayout(vocab=VOCAB, seq=SEQ, d=D_MODEL, heads=HEADS, layers=LAYERS, d_ff=D_FF, batch=BATCH,
                               microbatches=MICRO, **mesh)


def train(comm: Any, mesh: dict[str, int] | None = None, steps: int = STEPS,
          trace_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``steps`` AdamW steps of the tiny GPT on ``mesh`` (every rank, the same global batches); the
    last step traced into ``trace_path`` with the formula's bytes per axis in its metadata, the steps
    between the first (a warm-up) and the last into ``<trace_path stem>-step<k>.json`` beside it
    (``"earlier"``: the prediction replays them all). Each step starts after a barrier; its time is the
    slowest rank's. Returns (on every rank) the losses, the step times, the whole model's parameters
    after the steps and what each rank holds."""
    mesh = mesh or MESH
    dm = DeviceMesh(comm, **mesh)
    model = HybridGPT(dm, VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, schedule=SCHEDULE, microbatches=MICRO, lr=LR,
                      weight_decay=WD, seed=0)
    held = comm.allgather_object(model.holdings(BATCH))
    c = tiny_layout(mesh)
    expected = {a: [formulas.traffic_by_axis(c, r).get(a, 0) for r in range(comm.size)]
                for a in dict.fromkeys(a for r in range(comm.size) for a in formulas.traffic_by_axis(c, r))}
    meta = {**model.trace_meta(), "time_unit": "s", "expected_bytes_by_axis": expected,
            "config": {"vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL, "heads": HEADS, "layers": LAYERS,
                       "d_ff": D_FF, "batch": BATCH, "microbatches": MICRO, **mesh}}
    losses, seconds = [], []
    earlier = [Path(trace_path).with_name(f"{Path(trace_path).stem}-step{k}.json") for k in range(1, steps - 1)
               ] if trace_path is not None else []
    for step, (x, y) in enumerate(common.lm_batches(steps, VOCAB, BATCH, SEQ)):
        comm.barrier()
        t0 = time.perf_counter()
        path = trace_path if step == steps - 1 else (earlier[step - 1] if 0 < step <= len(earlier) else None)
        last = {"earlier_steps": [e.name for e in earlier]} if step == steps - 1 else {}  # pooled by the replay
        with mtrace.record(path, comm, **meta, **last):
            mtrace.memory_states(model.state_bytes())  # held through the step (the report's peak adds activations)
            losses.append(model.forward_backward(x, y))  # samples them again when the optimizer step begins
            model.optimizer_step()
        seconds.append(max(comm.allgather_object(time.perf_counter() - t0)))
    return {"losses": losses, "seconds": seconds, "state": model.full_state_dict(), "held": held,
            "trace": trace_path, "earlier": earlier, "mesh": mesh}


def single_process(steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process: ``nn.GPT`` and ``AdamW`` on the whole batch, the same initialisation."""
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return common.one_process(model, opt, common.lm_batches(steps, VOCAB, BATCH, SEQ)), model.state_dict()


TRAFFIC = ("tp: per micro-batch and block 2 all-reduces of the b x S x d activation forward and 2 backward, the "
           "embedding's g and the head's f, the loss's 3 small all-reduces; pp: one activation per micro-batch "
           "forward and its gradient back, and the loss broadcast; dp: the ring all-reduce of this rank's gradients, "
           "2 (N-1)/N x 8 bytes x its parameters (with sp > 1 the ring runs over the dp x sp replicas; a rank's hop "
           "to its successor lands on sp or dp+sp; sp itself carries Ulysses' all-to-alls). Formula: "
           "cost.hybrid.traffic_by_axis.")
MEMORY = ("float64 AdamW: 8 bytes per parameter, 8 per gradient, 16 of state (m, v). Activations: 1F1B keeps p - s "
          "micro-batches in flight on stage s (here all of them on stage 0, one on stage 1), each the Korthikanti et "
          "al. terms of its tensor-parallel blocks. Formula: cost.hybrid.model_state_bytes, activation_peak_bytes.")


def tiny_spec() -> perf.ModelSpec:
    return perf.ModelSpec(layers=LAYERS, hidden=D_MODEL, heads=HEADS, seq=SEQ, vocab=VOCAB, ffn=D_FF,
                          bytes_per_number=8, name="the tiny GPT (float64)")


def tiny_perf_layout(mesh: dict[str, int]) -> perf.Layout:
    return perf.Layout(dp=mesh["dp"], tp=mesh["tp"], pp=mesh["pp"], sp=mesh["sp"],
                       micro_batch=BATCH // (mesh["dp"] * MICRO), global_batch=BATCH, schedule=SCHEDULE)


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


def grid_prediction() -> perf.Prediction:
    """The 6 x 8 x 64 grid on GPT-3: 96 layers on 64 stages do not split evenly (``Layout.check``
    refuses it), so predicted with ``uneven_stages`` (the slowest stage: 2 blocks), full recomputation
    as Narayanan et al.'s Table 1 runs."""
    layout = perf.Layout(**GRID, micro_batch=1, global_batch=GPT3_BATCH, recompute="full")
    return perf.predict(presets.MODELS[GPT3], layout, presets.CLUSTERS[CLUSTER], uneven_stages=True)


def step_seconds(trace: mtrace.Trace) -> float:
    """First to last compute or message event."""
    spans = [e for e in trace.events if e.kind in ("compute", "comm")]
    return max(e.t1 for e in spans) - min(e.t0 for e in spans)


def run(comm: Any, steps: int, mesh: dict[str, int], clock: common.Clock = common.REPLAY,
        verbose: bool = False) -> None:
    """Train on ``mesh``, measure this machine for the replay and the prediction (every rank); rank 0
    prints (``verbose``: every table)."""
    console = make_console()
    common.shared_folder(comm, OUT)
    res = train(comm, mesh, steps, OUT / "hybrid.json")
    cluster = replay_cluster(comm, clock.cluster, shard_gpt(mesh), OUT / "messages.json")  # every rank
    if comm.rank != 0:
        return
    shape, section = MeshShape(**mesh), common.sections(console)
    section(f"the mesh {shape}: who holds what")
    if verbose:
        expected = [formulas.parameters_per_rank(tiny_layout(mesh), shape.coords(r)["pp"]) for r in range(shape.size)]
        console.print(vmesh.holdings_table(shape.degrees(), res["held"], expected))
    console.print(vmesh.groups_text(shape.degrees()), highlight=False, markup=False)
    section(f"{steps} AdamW steps, global batch {BATCH} ({MICRO} micro-batches per replica)")
    ref, ref_state = single_process(steps)
    if verbose:
        console.print(common.loss_table(ref, {f"mesh {shape}": res["losses"]}, reference_name="one process"))
    loss_diff = max(abs(a - b) for a, b in zip(ref, res["losses"], strict=True))
    param_diff = common.max_difference(res["state"], ref_state)
    console.print(f"The mesh computes one process's model: losses equal to {loss_diff:.1e}, every parameter after "
                  f"{steps} steps to {param_diff:.1e} (float64 rounding: sums in another order).", highlight=False)
    trace = mtrace.load(res["trace"])
    section("bytes per mesh axis and memory per rank (the last step)")
    c = tiny_layout(mesh)
    table, equal = vmesh.axis_table(trace, [formulas.traffic_by_axis(c, r) for r in range(shape.size)], verbose,
                                    TRAFFIC if verbose else None)
    console.print(table)
    console.print("Every rank's bytes on every axis equal the formula." if equal else
                  "[red]measured and formula differ[/red] (see the table)", highlight=False)
    if shape.sp == 1:
        table, equal = vmesh.states_table(trace, [formulas.model_state_bytes(c, r) for r in range(shape.size)],
                                          [formulas.activation_peak_bytes(c, r, SCHEDULE) for r in range(shape.size)],
                                          MEMORY)
        if verbose:
            console.print(table)
        console.print("Every rank holds what the formulas say (model states and activation peak, bytes)." if equal
                      else "[red]memory: measured and formula differ[/red] (--verbose: the table)", highlight=False)
    else:
        console.print("(cost.hybrid.activation_peak_bytes models tensor-parallel stages; sp > 1 here.)")
    section(f"predicted vs {clock.short} step time")
    common.print_note(console, clock.caveat(comm.size), "; the prediction has one core per rank.")
    pred = perf.predict(tiny_spec(), tiny_perf_layout(mesh), cluster)
    if clock.kind == "replay":
        traced = [*(mtrace.load(p) for p in res["earlier"]), trace]  # each replayed with the others' spans pooled
        replays = [replay(t, cluster, samples=[o for o in traced if o is not t]) for t in traced]
        each, replayed = [step_seconds(r) for r in replays], replays[-1]
        got = float(np.median(each))
        console.print(prediction_table(pred, got, cluster, clock.short, verbose))
        console.print(f"Replayed steps {', '.join(f'{t * 1e3:.1f}' for t in each)} ms (every step after the "
                      f"warm-up): the table holds their median.", highlight=False)
        if verbose:
            console.print(replayed_parts(replayed, pred), highlight=False)
    else:  # the timed steps, on the wall clock
        got = float(np.median(res["seconds"][1:-1] or res["seconds"]))
        console.print(prediction_table(pred, got, cluster, clock.short, verbose))
        if verbose:
            console.print(small_messages(trace, shape, FIT_FROM), highlight=False)
    model, gpu_cluster = presets.MODELS[GPT3], presets.CLUSTERS[CLUSTER]
    ranked, grid = planner.plan(model, GPUS, gpu_cluster, GPT3_BATCH), grid_prediction()
    if verbose:
        section(f"the planner on GPT-3 175B, {GPUS} A100s")
        console.print(plan_table(ranked, grid, model, GPUS, gpu_cluster, GPT3_BATCH))
        for i, c in enumerate(ranked):
            console.print(f"{i + 1}. {c.why()}", highlight=False)
        console.print(f"\nplanner's first: {ranked[0].prediction.explain()}\n\n6 x 8 x 64 grid (96 layers on 64 "
                      "stages: Layout.check refuses the uneven split, predicted with uneven_stages=True and full "
                      f"recomputation, as Narayanan et al.'s Table 1 runs): {grid.explain()}", highlight=False)
    console.rule(f"[bold]the traced step, {clock.short} (F / B per stage and micro-batch, sync, opt)")
    figures = [(f"predicted vs {clock.short}: the tiny GPT's step on this machine",
                parts_figure({"predicted (perf.predict)": parts(pred), clock.short: {clock.short: got}},
                             f"one step of the tiny GPT on {shape}: predicted (perf.predict) vs {clock.short}, "
                             f"seconds on {cluster.name}")),
               ("the planner on GPT-3 175B: where each layout's predicted step goes",
                parts_figure({**{c.label(): parts(c.prediction) for c in ranked[:3]},
                              "6 x 8 x 64 grid (dp6 tp8 pp64, full recompute)": parts(grid)},
                             f"GPT-3 175B on {GPUS} A100s of {gpu_cluster.name}: predicted seconds per step "
                             "(perf.predict)"))]
    common.finish([trace], OUT / "report.html", console, titles=[f"hybrid {shape}, {SCHEDULE}, m = {MICRO}"],
                  extra_figures=figures, clock=clock, brief=not verbose)
    console.print("Each axis carries one kind of traffic: tp Megatron's all-reduces inside every layer, pp the "
                  "activations between stages, dp one all-reduce of the gradients per step.", highlight=False)
    console.print(common.reading_path("08_hybrid"), highlight=False)


def _mesh_problem(args: argparse.Namespace) -> str | None:
    mesh = {a: getattr(args, a) for a in MESH}
    size = MeshShape(**mesh).size
    if (args.ranks or size) > common.MAX_RANKS:
        return f"the mesh {MeshShape(**mesh)} needs {size} ranks; at most {common.MAX_RANKS} run as threads here"
    return check_ranks(args.ranks or size, mesh)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=STEPS, ranks=0)  # --ranks 0: the mesh's size
    for axis, degree in MESH.items():
        parser.add_argument(f"--{axis}", type=int_in(1, common.MAX_RANKS), default=degree,
                            help=f"{axis} degree (default {degree})")
    return common.parse_lesson_args(parser, argv, _mesh_problem)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mesh = {a: getattr(args, a) for a in MESH}
    common.run_lesson(run, args, lambda p: check_ranks(p, mesh), args.ranks or MeshShape(**mesh).size, mesh=mesh)


if __name__ == "__main__":
    main()
