"""Lesson 5: sequence parallelism. Megatron-SP, DeepSpeed-Ulysses, Ring Attention (contiguous and
zigzag) and their 2 x 2 hybrid on one tiny GPT and one sequence, side by side.

    mpiexec -n 4 python lessons/05_sequence_parallel/lesson.py [--steps 2] [--verbose]
    python lessons/05_sequence_parallel/lesson.py [--ranks 4]      # same, ranks as threads in one process

Every rank holds S/P of the sequence's positions; the methods differ in how attention, the one
layer that mixes positions, gets the rest (``minipar/parallel/sequence``, formulas in
``minipar/cost/sequence.py``):

- Megatron-SP (Korthikanti et al. 2022, Sec. 4.2.2): tensor parallelism with the layer norms on a
  sequence shard; all-gather before the tensor-parallel region, reduce-scatter after it.
- Ulysses (Jacobs et al. 2023, Sec. 3.1): an all-to-all turns "S/P positions, all heads" into "all
  positions, H/P heads", ordinary attention, an all-to-all back: 4 (P-1)/P x (b S/P h) per layer.
- Ring Attention (Liu et al. 2023, Sec. 3): queries stay; K/V blocks travel around the ring, one hop
  per step, while the rank computes on the block it holds; scores one (S/P) x (S/P) block at a time.
  Zigzag (Brandon et al. 2023): rank i holds chunks i and 2P-1-i, so the causal mask leaves every
  rank the same work.
- Hybrid (Fang & Zhao 2024, USP): Ulysses inside pairs of ranks, the ring across the pairs.

Printed: 1. every method's losses equal the single-process loss; 2. bytes sent per rank per layer,
forward and backward, measured from the trace next to the formula; 3. activation bytes one layer
keeps and the largest score buffer, measured (the autograd graph; the ring's ``score_bytes`` span
fields) next to the formula; 4. the zigzag ring's last step: the longest wait for a K/V block against
the formula's max(0, alpha + n beta - compute), then the terminal timeline. ``--verbose`` adds the
losses step by step, the memory caption, the longest sequence each method fits into a fixed per-rank
budget (from the formulas), the score blocks per rank under the causal mask counted from the spans
(contiguous vs zigzag), the ring's layer 0 step by step (compute on each K/V block and the wait left
after it) and the full timeline. The HTML report draws the ring on top (``viz.ring``). Times are
replayed (``lessons.common.Clock``: CPU time per span, a core per rank, ``--cluster``'s links;
``--clock wall``: as recorded). Writes runs/05_sequence_parallel/*.json and report.html.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from lessons import common
from lessons.common import console as make_console
from minipar import trace as mtrace
from minipar.cost import sequence as formulas
from minipar.cost import tensor as tensor_cost
from minipar.nn import GPT, Module
from minipar.optim import AdamW
from minipar.parallel.sequence import SequenceParallelGPT
from minipar.parallel.sequence.measure import measure_blocks
from minipar.parallel.tensor import TensorParallelGPT
from viz.layers import layer_table, per_rank
from viz.ring import overlap_summary, score_spans, step_table
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH = 32, 256, 32, 4, 2, 64, 2
ITEM = 8  # float64
HYBRID_U = 2  # the hybrid's Ulysses degree P_u (P_r = P / P_u)
BUDGET = 64 * 2**20  # bytes of activations per rank, for the budget table
OUT = Path("runs/05_sequence_parallel")
RUNS = {"megatron_sp": ("megatron", False, "Megatron-SP"), "ulysses": ("ulysses", False, "Ulysses"),
        "ring": ("ring", False, "Ring, contiguous"), "ring_zigzag": ("ring", True, "Ring, zigzag"),
        "hybrid": ("hybrid", True, "Hybrid 2 x P/2 (zigzag)")}  # run name: (method, zigzag, title)
ATTENTION_OPS = ("all_to_all", "ring_kv", "ring_dkv", "allgather", "reduce_scatter")


def build(comm: Any, name: str) -> Module:
    """The GPT of run ``name`` on ``comm``, every block wrapped in ``sequence.measure.Measured``."""
    method, zigzag, _ = RUNS[name]
    if method == "megatron":
        model = TensorParallelGPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, comm, D_FF, sequence_parallel=True, seed=0)
    else:
        model = SequenceParallelGPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, comm, method=method, zigzag=zigzag,
                                    ulysses=HYBRID_U if method == "hybrid" else None, d_ff=D_FF, seed=0)
    measure_blocks(model, spans=method != "megatron")
    return model


def train(comm: Any, name: str, steps: int = 2, trace_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Train run ``name`` ``steps`` steps (AdamW) from the single-process initialisation; the last
    step is traced into ``trace_path``. Returns the losses (mean over ranks) and this rank's
    activation bytes per layer and largest buffer."""
    method, zigzag, title = RUNS[name]
    model = build(comm, name)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    p = comm.size
    meta = {"paradigm": f"sequence: {title}", "time_unit": "s", "expected_bytes": step_bytes(method, p),
            "config": {"method": method, "zigzag": zigzag, "P": p, "ulysses": HYBRID_U if method == "hybrid" else None,
                       "vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL, "heads": HEADS, "layers": LAYERS,
                       "d_ff": D_FF, "batch": BATCH}}
    losses = []
    for step, (x, y) in enumerate(common.lm_batches(steps, VOCAB, BATCH, SEQ)):
        if method != "megatron":
            x, y = model.shard(x), model.shard(y)
        with mtrace.record(trace_path if step == steps - 1 else None, comm, **meta):
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            with mtrace.span("opt"):
                model.sync_grads()
                opt.step()
        mine = loss.item() if method == "megatron" else comm.allreduce(np.array([loss.item()]))[0] / p
        losses.append(float(mine))  # Megatron's loss is already global; the others' is this rank's mean
    layers = list(model.blocks)
    return {"losses": losses, "held": [m.held for m in layers], "largest": [m.largest for m in layers]}


def single_process_losses(steps: int) -> list[float]:
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    return common.one_process(model, opt, common.lm_batches(steps, VOCAB, BATCH, SEQ))


def layer_bytes(method: str, p: int, backward: bool) -> float:
    """Bytes one rank sends for one layer's attention (Megatron-SP: the whole block), by the formulas."""
    if method == "megatron":
        return formulas.megatron_sp_bytes(BATCH, SEQ, D_MODEL, p, ITEM, backward=backward)
    return formulas.attention_bytes(method, BATCH, SEQ, D_MODEL, p, ulysses=HYBRID_U if method == "hybrid" else None,
                                    itemsize=ITEM, backward=backward)


def step_bytes(method: str, p: int) -> dict[str, float]:
    """The formulas' bytes per rank for the traced step by op (``meta["expected_bytes"]``)."""
    if method == "megatron":
        return tensor_cost.expected_bytes(p, BATCH, SEQ, D_MODEL, LAYERS, ITEM, True, SEQ)
    n_params = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF).num_parameters()
    return formulas.step_bytes_by_op(method, BATCH, SEQ, D_MODEL, LAYERS, p, n_params, ulysses_degree(method, p), ITEM)


def held_formula(method: str, p: int, s: int = SEQ) -> int:
    """Bytes one block's graph keeps on one rank (Megatron-SP: Korthikanti et al.'s terms)."""
    if method == "megatron":
        return sum(tensor_cost.layer_terms(p, BATCH, s, D_MODEL, HEADS, D_FF, ITEM, sequence_parallel=True).values())
    return formulas.activation_bytes(method, BATCH, s, D_MODEL, HEADS, D_FF, p, ulysses_degree(method, p), ITEM)


def score_formula(method: str, zigzag: bool, p: int, s: int = SEQ) -> int:
    """The largest score buffer a rank holds at once (Megatron-SP: its softmax, b H/t s^2 e)."""
    if method == "megatron":
        return tensor_cost.layer_terms(p, BATCH, s, D_MODEL, HEADS, D_FF, ITEM, sequence_parallel=True)["softmax"]
    return formulas.score_bytes(method, BATCH, s, HEADS, p, ulysses_degree(method, p), zigzag, ITEM)


def ulysses_degree(method: str, p: int) -> int | None:  # P_u, for the formulas
    return HYBRID_U if method == "hybrid" else p if method == "ulysses" else None


def traffic_table(traces: dict[str, mtrace.Trace], p: int, verbose: bool = True) -> Table:
    a = BATCH * SEQ // p * D_MODEL * ITEM
    return layer_table({RUNS[n][2]: t for n, t in traces.items()},
                       {RUNS[n][2]: (layer_bytes(RUNS[n][0], p, False), layer_bytes(RUNS[n][0], p, True))
                        for n in traces},
                       f"bytes sent per rank per layer (P = {p}; one shard b (S/P) h x 8 B = {a:,} B); measured: "
                       "the messages inside each layer's F / B span, every layer alike", ATTENTION_OPS, verbose)


def memory_table(results: dict[str, list[dict[str, Any]]], traces: dict[str, mtrace.Trace], p: int,
                 verbose: bool = True) -> Table:
    rows = []
    for name, ranks in results.items():
        method, zigzag, title = RUNS[name]
        held = [r["held"][0] for r in ranks]
        if method in ("ring", "hybrid"):
            score = max(e.args["score_bytes"] for e in score_spans(traces[name]))
        else:
            score = max(r["largest"][0] for r in ranks)
        rows.append((title, per_rank(held), f"{held_formula(method, p):,}", f"{score:,}",
                     f"{score_formula(method, zigzag, p):,}"))
    return Table.of("activation bytes one layer keeps for backward, and the largest score buffer, per rank",
                    ("method", "held measured", "held formula", "largest score measured", "score formula"), rows,
                    text=0, caption_justify="left",
                    caption="held: every buffer the layer's autograd graph keeps (memory.held_buffers), measured "
                            "on each rank. Largest score buffer: Megatron-SP and Ulysses keep their softmax "
                            "(b x H/P x S x S), the largest buffer the layer holds; Ring Attention keeps none and "
                            "computes one block at a time: the largest score_bytes of its 'attention F' spans."
                            if verbose else None)


def longest(method: str, zigzag: bool, p: int, budget: int = BUDGET) -> int:
    """The longest S (a multiple of 2P) whose LAYERS layers' activations plus one layer's backward
    buffers fit ``budget`` bytes per rank, by the formulas. Backward of a softmax kept whole makes a
    score gradient as large (Megatron-SP, Ulysses); Ring Attention's backward holds a block of
    probabilities and one of their gradients, and 12 blocks of (b, S/P, h): the K/V pair held and
    the one arriving, its own dK/dV and three accumulators."""

    def need(s: int) -> int:
        if method in ("ring", "hybrid"):
            transient = 2 * score_formula(method, zigzag, p, s) + 12 * BATCH * (s // p) * D_MODEL * ITEM
        else:
            transient = score_formula(method, zigzag, p, s)
        return LAYERS * held_formula(method, p, s) + transient

    return formulas.longest_sequence(need, budget, 2 * p)


def budget_table(p: int) -> Table:
    base, longests = longest("megatron", False, p), {title: longest(m, z, p) for m, z, title in RUNS.values()}
    return Table.of(f"the longest sequence whose activations and backward buffers fit {BUDGET / 2**20:.0f} MiB per "
                    f"rank (this model: b={BATCH}, h={D_MODEL}, H={HEADS}, d_ff={D_FF}, {LAYERS} layers; from the "
                    "formulas, not measured)", ("method", "longest S", "vs Megatron-SP"),
                    [(title, f"{s:,}", f"{s / base:.1f}x") for title, s in longests.items()], text=0)


def causal_table(traces: dict[str, mtrace.Trace], p: int) -> Table:
    rows = []
    for name in ("ring", "ring_zigzag", "hybrid"):
        method, zigzag, title = RUNS[name]
        ring = p // (HYBRID_U if method == "hybrid" else 1)
        blocks, elements = [], []
        for r in range(p):
            spans = score_spans(traces[name], r)
            blocks.append(len(spans) // LAYERS)
            per_head = BATCH * HEADS // (HYBRID_U if method == "hybrid" else 1) * ITEM
            elements.append(sum(e.args["score_bytes"] for e in spans) // per_head // LAYERS)
        ranks = [r // (HYBRID_U if method == "hybrid" else 1) for r in range(p)]  # ring index of each rank
        want_b = [formulas.causal_blocks(ring, zigzag)[i] for i in ranks]
        want_e = formulas.causal_score_elements(SEQ, ring, zigzag)
        want_e = [want_e[i] for i in ranks] if isinstance(want_e, list) else want_e
        rows.append((title, str(ring), str(blocks), str(want_b), str(elements), str(want_e),
                     f"{max(elements) / np.mean(elements):.2f}"))
    return Table.of("causal mask: score blocks each rank computes in one layer's forward (counted from the 'attention "
                    "F' spans) vs causal_blocks; hidden blocks are skipped", ("method", "ring ranks",
                    "blocks per rank (measured)", "formula", "score elements per rank", "formula", "max / mean"),
                    rows, text=0)


def check_ranks(p: int) -> str | None:
    """What is wrong with ``p`` ranks, or None: Ulysses needs P | heads, the hybrid P_u = 2 | P."""
    if p not in (2, 4):
        return (f"lesson 5 splits {HEADS} heads (Ulysses) and a {HYBRID_U} x P/{HYBRID_U} hybrid grid over the "
                f"ranks: run it on 4 ranks, or 2 (got {p})")
    return None


def run(comm: Any, steps: int, clock: common.Clock = common.REPLAY, verbose: bool = False) -> None:
    """Every method on ``comm``; rank 0 prints (times on ``clock``; ``verbose``: every table)."""
    console = make_console()
    p, lead = comm.size, comm.rank == 0
    if lead:
        OUT.mkdir(parents=True, exist_ok=True)
    results = {name: comm.gather_object(train(comm, name, steps, OUT / f"{name}.json")) for name in RUNS}
    if not lead:
        return
    section = common.sections(console)
    section(f"one tiny GPT, S = {SEQ} positions over P = {p} ranks, {steps} AdamW steps")
    ref = single_process_losses(steps)
    if verbose:
        console.print(common.loss_table(ref, {RUNS[n][2]: results[n][0]["losses"] for n in RUNS},
                                        "loss per step (the mean over ranks of each rank's mean over its positions)",
                                        "single process"))
    diff = max(abs(a - b) for n in RUNS for a, b in zip(results[n][0]["losses"], ref, strict=True))
    console.print(f"Every method gives the single-process loss: largest difference {diff:.1e} (float64 "
                  "rounding: the methods add the same numbers in other orders).", highlight=False)
    traces = {name: mtrace.load(OUT / f"{name}.json") for name in RUNS}
    section("communication per layer")
    console.print(traffic_table(traces, p, verbose))
    console.print("Megatron-SP moves the whole (b, S, h) activation; Ulysses 4 (P-1)/P of a shard, fixed while S "
                  "and P grow together; the ring P-1 K/V blocks (backward: again, and dK/dV going home).",
                  highlight=False)
    section("memory per layer")
    console.print(memory_table(results, traces, p, verbose))
    if verbose:
        section("how long a sequence fits")
        console.print(budget_table(p))
        console.print("Megatron-SP and Ulysses keep an S x S softmax of H/P heads: their memory grows as S^2/P. The "
                      "ring keeps no scores; the two score blocks its backward holds, (S/P)^2 (zigzag: (S/2P)^2), "
                      "are what cap it here (FlashAttention-style tiles inside a block would shrink them too).",
                      highlight=False)
        section("causal load balance")
        console.print(causal_table(traces, p))
    section(f"the zigzag ring's last step, {clock.short} (F/B per layer, opt)")
    common.print_note(console, clock.caveat(p), ". That concerns the times below, not the bytes, memory or blocks "
                      "above.")
    ring = clock.of(OUT / "ring_zigzag.json")
    if verbose:
        console.print(step_table(ring))
    console.print(overlap_summary(ring, clock.cluster.intra.seconds, clock.cluster.name, clock.short),
                  highlight=False)
    order = ["megatron_sp", "ulysses", "ring_zigzag", "ring", "hybrid"]  # the report draws the first ring on top
    common.finish([OUT / f"{name}.json" for name in order], OUT / "report.html", console, timeline=ring,
                  titles=[RUNS[n][2] for n in order], clock=clock, brief=not verbose)
    console.print(common.reading_path("05_sequence_parallel"), highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=2, ranks=4)
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    common.run_lesson(run, parse_args(argv), check_ranks)


if __name__ == "__main__":
    main()
