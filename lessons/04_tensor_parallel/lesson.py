"""Lesson 4: tensor parallelism (Megatron-LM) and sequence parallelism, byte by byte.

    mpiexec -n 4 python lessons/04_tensor_parallel/lesson.py [--steps 4] [--verbose]
    python lessons/04_tensor_parallel/lesson.py [--ranks 4]      # same, ranks as threads in one process

1. The matrix-multiplication picture (Shoeybi et al. 2019, Sec. 3): Y = X W with X 4x5 and W 5x8.
   Split W by COLUMNS and every rank computes whole output columns, Y_r = X W_r: putting Y together
   takes an all-gather. Split W by ROWS (and X by columns to match) and every rank computes a
   full-size partial sum X_r W_r: Y = sum_r X_r W_r takes an all-reduce. Megatron puts a column
   split first and a row split second so the pair needs no communication in between.
2. The tiny GPT split over t ranks (heads, MLP columns and the vocabulary): trained without and
   with sequence parallelism (Korthikanti et al. 2022), from the single-process initialisation, on
   the same batches: every step's loss equals the single-process model's.
3. From the trace of the last step: collectives per transformer block (2 all-reduces forward, 2
   backward; with sequence parallelism all-gathers and reduce-scatters of the same bytes, plus 2
   all-gathers in backward that gather the kept sequence shards again for the weight gradients)
   and the bytes each rank sent, next to the formulas; activation bytes held per rank, measured
   from the autograd graph: one layer keeps Korthikanti et al.'s sbh (34/t + 5as/(ht)) without the
   dropout terms, and the layer-norm region shrinks by exactly t under sequence parallelism; with
   recomputation (Sec. 5), selective drops the softmax term, full keeps each block's input and sends
   its forward collectives again in backward (``minipar.recompute``).
By default it prints the split's conclusion, one line on the losses, the bytes per rank per step and
the activation bytes against the formulas, and the timeline of the traced step (two bands, no traffic
table); ``--verbose`` adds the picture's table, the losses step by step, the collectives per block
and the full timeline. Writes runs/04_tensor_parallel/{tp,tp_sp}.json and report.html.
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
from minipar.cost import ring_bytes
from minipar.cost import tensor as formulas
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.tensor import TensorParallelGPT
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH = 64, 32, 64, 8, 2, 256, 8
OUT = Path("runs/04_tensor_parallel")
LABELS = ("activations/ln", "activations/tp", "activations/logits")


def matmul_picture(comm: Any) -> dict[str, Any]:
    """Y = X W (4x5 @ 5x8) split by columns (all-gather) and by rows (all-reduce) over ``comm``."""
    t, r = comm.size, comm.rank
    x = np.arange(20.0).reshape(4, 5) % 7 - 3
    w = np.arange(40.0).reshape(5, 8) % 5 - 2
    col = np.array_split(np.arange(8), t)[r]
    row = np.array_split(np.arange(5), t)[r]
    with mtrace.recording(comm.world_rank) as rec:
        y_col_local = x @ w[:, col]  # whole columns of Y
        y_col = comm.allgather(np.ascontiguousarray(y_col_local.T)).T
        y_row_partial = x[:, row] @ w[row]  # a full-size partial sum
        y_row = comm.allreduce(y_row_partial)
    mine = [e for e in rec.events if e.kind == "comm" and e.src == comm.world_rank]
    sent = {op: sum(e.nbytes for e in mine if e.op == op) for op in ("allgather", "allreduce")}
    return {"rank": r, "cols": col.tolist(), "rows": row.tolist(), "col_local": y_col_local,
            "row_partial": y_row_partial, "y_col": y_col, "y_row": y_row, "y": x @ w, "sent": sent}


def picture_table(results: list[dict[str, Any]]) -> Table:
    t = len(results)
    table = Table(title=f"Y = X W with X 4x5 and W 5x8 on {t} ranks", title_justify="left")
    for col in ("rank", "W cols", "computes", "all-gather sent", "W rows", "computes", "all-reduce sent"):
        table.add_column(col, justify="right")
    for res in results:
        table.add_row(str(res["rank"]), str(res["cols"]), f"Y[:, cols] {res['col_local'].shape}",
                      f"{res['sent']['allgather']} B", str(res["rows"]),
                      f"partial {res['row_partial'].shape}", f"{res['sent']['allreduce']} B")
    return table


def picture_summary(results: list[dict[str, Any]]) -> str:
    """Which split needs which collective, the bytes against the ring formulas, and the check."""
    t, res = len(results), results[0]
    n = res["y"].nbytes
    return (f"column split: every rank owns whole output columns; Y needs an ALL-GATHER, ring formula "
            f"(t-1)/t x {n} B = {ring_bytes('allgather', n, t):.0f} B per rank.\n"
            f"row split: every rank owns a full-size partial sum; Y needs an ALL-REDUCE, ring formula "
            f"2(t-1)/t x {n} B = {ring_bytes('allreduce', n, t):.0f} B per rank.\n"
            f"both equal X W: {np.array_equal(res['y_col'], res['y'])}, "
            f"{np.allclose(res['y_row'], res['y'])}. Megatron: column split first, row split second, "
            "so the pair needs one all-reduce and nothing in between.")


def train(comm: Any, sequence_parallel: bool, steps: int = 4,
          trace_path: str | os.PathLike[str] | None = None, layers: int = LAYERS,
          batch: int = BATCH) -> dict[str, Any]:
    """Train the TP GPT ``steps`` steps (AdamW); the last one is recorded into ``trace_path``."""
    model = TensorParallelGPT(VOCAB, SEQ, D_MODEL, HEADS, layers, comm, D_FF,
                              sequence_parallel=sequence_parallel, seed=0)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    t = comm.size
    config = {"t": t, "sequence_parallel": sequence_parallel, "vocab": VOCAB, "seq": SEQ, "d_model": D_MODEL,
              "heads": HEADS, "layers": layers, "d_ff": D_FF, "batch": batch}
    expected = formulas.expected_bytes(t, batch, SEQ, D_MODEL, layers, 8, sequence_parallel, SEQ)
    losses = []
    for step, (x, y) in enumerate(common.lm_batches(steps, VOCAB, batch, SEQ)):
        last = step == steps - 1
        meta = {"paradigm": "tensor" + (" + sequence" if sequence_parallel else ""), "config": config,
                "expected_bytes": expected, "time_unit": "s"}
        with mtrace.record(trace_path if last else None, comm, **meta):
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            with mtrace.span("opt"):
                model.sync_grads()
                opt.step()
        losses.append(loss.item())
    return {"losses": losses, "peak": dict(model.meter.peak), "params_per_rank": model.num_parameters()}


def single_process_losses(steps: int, layers: int = LAYERS, batch: int = BATCH) -> list[float]:
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, layers, D_FF, seed=0)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    return common.one_process(model, opt, common.lm_batches(steps, VOCAB, batch, SEQ))


def block_traffic(trace: mtrace.Trace, rank: int = 0) -> dict[tuple[int, str], dict[str, list[int]]]:
    """Per (block, "F"/"B"): {op: [calls, bytes sent]} by ``rank``, from the messages inside the
    block's span (a call is counted at its first message, step 0)."""
    sends = [e for e in trace.events if e.kind == "comm" and e.rank == rank and e.src == rank]
    out: dict[tuple[int, str], dict[str, list[int]]] = {}
    for span in trace.events:
        if span.kind == "compute" and span.rank == rank and isinstance(span.args.get("layer"), int):
            ops: dict[str, list[int]] = {}
            for e in sends:
                if span.t0 <= e.t0 <= span.t1:
                    cell = ops.setdefault(e.op, [0, 0])
                    cell[0] += e.step == 0
                    cell[1] += e.nbytes
            out[(span.args["layer"], span.name)] = ops
    return out


def traffic_table(trace: mtrace.Trace, t: int, sp: bool, batch: int = BATCH) -> Table:
    a = SEQ * batch * D_MODEL * 8
    table = Table(title=f"rank 0, per block ({'with' if sp else 'without'} sequence parallelism): "
                        f"activation A = seq x batch x d x 8 B = {a:,} B", title_justify="left")
    for col in ("block", "pass", "collectives (measured)", "bytes sent", "formula"):
        table.add_column(col, justify="right")
    per_call = formulas.collectives_per_block(sp)
    rows = sorted(block_traffic(trace).items(), key=lambda kv: (kv[0][0], kv[0][1] == "B"))  # F before B
    for (layer, name), ops in rows:
        phase = "forward" if name == "F" else "backward"
        calls = ", ".join(f"{n} {op}" for op, (n, _) in ops.items()) or "-"
        sent = sum(b for _, b in ops.values())
        want = sum(n * ring_bytes(op, a, t) for op, n in per_call[phase].items())
        table.add_row(str(layer), phase, calls, f"{sent:,}", f"{want:,.0f}")
    return table


def totals_table(traces: dict[str, mtrace.Trace]) -> Table:
    from viz import analysis

    table = Table(title="bytes sent per rank in one training step (embedding, blocks, head, loss, grads)",
                  title_justify="left")
    for col in ("run", "op", "measured per rank", "formula"):
        table.add_column(col, justify="right")
    for title, trace in traces.items():
        for key, per_rank, want in analysis.measured_vs_formula(trace):
            table.add_row(title, key, " ".join(f"{b:,}" for b in per_rank), f"{want:,.0f}")
    return table


def layer_caption(t: int, batch: int = BATCH) -> str:
    """One layer's bytes against Korthikanti et al. 2022 (Sec. 4.1), dropout terms removed."""
    terms = formulas.layer_terms(t, batch, SEQ, D_MODEL, HEADS, D_FF, 8, sequence_parallel=True)
    listed = ", ".join(f"{name} {n:,}" for name, n in terms.items())
    return (f"one layer with TP+SP keeps (Korthikanti et al. sbh(34/t + 5as/(ht)) without dropout's terms, "
            f"8-byte numbers): {listed}; total {sum(terms.values()):,} B. The column-parallel linears keep "
            "only the sequence shard and all-gather it again in backward.")


def memory_table(peaks: dict[str, dict[str, int]], t: int, layers: int = LAYERS, batch: int = BATCH,
                 verbose: bool = True) -> Table:
    table = Table(title="activation bytes held per rank at the end of the forward pass (measured: every "
                        "buffer the autograd graph keeps, once)", title_justify="left",
                  caption=layer_caption(t) if verbose else None, caption_justify="left")
    for col in ("region", "no TP (formula)", "TP measured", "TP formula", "TP+SP measured", "TP+SP formula",
                "ratio TP / TP+SP"):
        table.add_column(col, justify="right")
    args = (batch, SEQ, D_MODEL, HEADS, D_FF, layers, VOCAB, 8)
    one = formulas.activation_bytes(1, *args)
    tp, sp = formulas.activation_bytes(t, *args), formulas.activation_bytes(t, *args, sequence_parallel=True)
    for label in LABELS:
        table.add_row(label.split("/")[1], f"{one[label]:,}", f"{peaks['tp'][label]:,}", f"{tp[label]:,}",
                      f"{peaks['tp_sp'][label]:,}", f"{sp[label]:,}",
                      f"{peaks['tp'][label] / peaks['tp_sp'][label]:.2f}")
    return table


def recompute_run(comm: Any, mode: str) -> dict[str, float]:
    """One TP+SP step under recomputation ``mode`` (Korthikanti et al. 2022 Sec. 5), traced in memory: this
    rank's activation bytes kept after the forward, bytes sent, CPU seconds of the forwards (F) and of the
    forwards run again in backward (R)."""
    model = TensorParallelGPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, comm, D_FF, sequence_parallel=True, seed=0,
                              recompute=mode)
    x, y = common.lm_batches(1, VOCAB, BATCH, SEQ)[0]
    with mtrace.recording(comm.world_rank) as rec:
        loss = model.loss(x, y)
        kept = sum(model.meter.held.values())
        loss.backward()
        model.sync_grads()
    cpu = {n: sum(e.c1 - e.c0 for e in rec.events if e.kind == "compute" and e.name == n) for n in ("F", "R")}
    sent = sum(e.nbytes for e in rec.events if e.kind == "comm" and e.src == comm.world_rank)
    return {"kept": kept, "sent": sent, "F": cpu["F"], "R": cpu["R"]}


def recompute_table(rows: dict[str, dict[str, float]], t: int) -> Table:
    """Rank 0's activations and bytes per mode beside ``cost.tensor``'s, and the extra forward's CPU time."""
    work = formulas.recompute_working_bytes(t, BATCH, SEQ, D_MODEL, HEADS, D_FF, 8, True)
    table = Table(title=f"recomputation, TP+SP on {t} ranks, rank 0, one step: activations kept after the "
                        "forward, bytes sent, the forward run again in backward (R) over the forward (F), CPU time",
                  caption=f"full also holds one layer's working set, {work:,} B, while that layer's backward runs",
                  title_justify="left", caption_justify="left")
    for col in ("mode", "kept", "formula", "sent", "formula", "R / F"):
        table.add_column(col, justify="right")
    for mode, r in rows.items():
        kept = formulas.activation_bytes(t, BATCH, SEQ, D_MODEL, HEADS, D_FF, LAYERS, VOCAB, 8, True, recompute=mode)
        sent = formulas.expected_bytes(t, BATCH, SEQ, D_MODEL, LAYERS, 8, True, SEQ, recompute=mode)
        table.add_row(mode, f"{r['kept']:,}", f"{sum(kept.values()):,}", f"{r['sent']:,}", f"{sum(sent.values()):,.0f}",
                      f"{r['R'] / r['F']:.2f}")
    return table


def check_ranks(t: int) -> str | None:
    """What is wrong with ``t`` tensor-parallel ranks, or None: t must divide the heads, d_ff, the
    vocabulary and (for sequence parallelism) the sequence."""
    bad = [f"{name}={n}" for name, n in (("heads", HEADS), ("d_ff", D_FF), ("vocab", VOCAB), ("seq", SEQ)) if n % t]
    if t < 2 or bad:
        return (f"lesson 4 splits {HEADS} heads, d_ff={D_FF}, vocab={VOCAB} and seq={SEQ} over the ranks: "
                f"run it on 2, 4 or 8 ranks (got {t}{': ' + ', '.join(bad) + ' not divisible' if bad else ''})")
    return None


def run(comm: Any, steps: int, clock: common.Clock = common.REPLAY, verbose: bool = False) -> None:
    """The three parts on ``comm``; rank 0 prints (``verbose``: every table)."""
    console = make_console()
    t, lead = comm.size, comm.rank == 0
    picture = comm.gather_object(matmul_picture(comm))
    if lead:
        OUT.mkdir(parents=True, exist_ok=True)
        console.rule("[bold]1. the matrix-multiplication picture")
        if verbose:
            console.print(picture_table(picture))
        console.print(picture_summary(picture), highlight=False)
    runs = {"tp": False, "tp_sp": True}
    results = {name: train(comm, sp, steps, OUT / f"{name}.json") for name, sp in runs.items()}
    recomputed = {mode: recompute_run(comm, mode) for mode in ("none", "selective", "full")}
    if not lead:
        return
    console.rule(f"[bold]2. tiny GPT on {t} tensor-parallel ranks, {steps} AdamW steps")
    ref = single_process_losses(steps)
    if verbose:
        console.print(common.loss_table(ref, {"TP": results["tp"]["losses"], "TP + SP": results["tp_sp"]["losses"]},
                                        reference_name="single process", digits=10))
        full = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF).num_parameters()
        console.print(f"parameters: {full:,} in the whole model, {results['tp']['params_per_rank']:,} on each "
                      "rank (layer norms, position embedding and proj biases are replicated)", highlight=False)
    diff = max(abs(a - b) for r in results.values() for a, b in zip(r["losses"], ref, strict=True))
    console.print(f"TP and TP + SP give the single-process loss at every step: largest difference {diff:.1e}.",
                  highlight=False)
    console.rule("[bold]3. communication and memory vs the formulas")
    traces = {name: mtrace.load(OUT / f"{name}.json") for name in runs}
    if verbose:
        for name, sp in runs.items():
            console.print(traffic_table(traces[name], t, sp))
    console.print(totals_table(traces))
    console.print(memory_table({k: v["peak"] for k, v in results.items()}, t, verbose=verbose))
    console.print(recompute_table(recomputed, t))
    console.rule(f"[bold]the last step with sequence parallelism ({clock.short}; F/B per block, opt)")
    common.finish([OUT / "tp.json", OUT / "tp_sp.json"], OUT / "report.html", console, timeline=traces["tp_sp"],
                  titles=["tensor parallel", "tensor + sequence parallel"], clock=clock, brief=not verbose)
    console.print("Megatron's f / g pair costs 2 all-reduces of the activation per block forward and 2 backward; "
                  "sequence parallelism swaps each for an all-gather and a reduce-scatter of the same bytes and "
                  f"keeps 1/{t} of the layer-norm activations.", highlight=False)
    if verbose:
        console.print(f"traces: {OUT / 'tp.json'}, {OUT / 'tp_sp.json'}", highlight=False)
    console.print(common.reading_path("04_tensor_parallel"), highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=4, ranks=4)
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    common.run_lesson(run, parse_args(argv), check_ranks)


if __name__ == "__main__":
    main()
