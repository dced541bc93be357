"""Lesson 6: ZeRO stages 1, 2, 3 and FSDP: the optimizer state, the gradients and the parameters
partitioned over the data-parallel ranks, byte by byte.

    mpiexec -n 4 python lessons/06_zero/lesson.py [--steps 3] [--verbose]
    python lessons/06_zero/lesson.py [--ranks 4]      # same, ranks as threads in one process

DDP ("stage 0") keeps parameters, gradients and AdamW's two moments whole on every rank. ZeRO
(Rajbhandari et al. 2020, Sec. 5, Fig. 1) partitions one more of them over the N ranks at each stage:
1 (P_os) the optimizer state, 2 (P_os+g) the gradients, 3 (P_os+g+p) the parameters, which PyTorch's
FSDP (Zhao et al. 2023) gathers unit by unit (a transformer block, the embeddings, the final norm and
head) just before the unit computes and frees after, prefetching the next unit's all-gather. Code:
``minipar/parallel/zero``, ``minipar/parallel/ddp.py``; formulas: ``minipar/cost/zero.py``.

Printed: 1. every stage's losses equal one process's on the global batch. 2. The paper's memory
table MEASURED: model states per rank (bytes) when the optimizer step begins at N = 1, 2, 4 (the
first N ranks, ``comm.split``), next to ``zero_state_bytes`` (this layout, exact) and the paper's
``zero_model_states`` (8 + 8 + 16 bytes per parameter: float64, AdamW's m and v). 3. Bytes each rank
sent in one step vs ``zero_traffic_bytes`` and DDP's all-reduce: stages 1, 2 move DDP's 2 (N-1)/N Psi,
FSDP 1.5 times that (Sec. 7.2.1); FSDP1 (flat padded units) beside FSDP2 (``fully_shard``: a ``Shard(0)``
piece per parameter, ``minipar/parallel/zero/fsdp2.py``) for one step of this GPT and of one whose first
dimensions 3 ranks do not divide: padding, bytes per rank, a checkpoint's arrays. Then the FSDP step's
terminal timeline and the conclusion.
``--verbose`` adds the losses step by step, the states by component with each run's peak, the paper's
Table 1 for 7.5B (K = 12; at N = 64 its Fig. 1), the ops per stage, 4. FSDP's forward on rank 0 unit
by unit (gathered bytes: this unit + the prefetched next, then resharded; the next all-gather in
flight while this unit computes), 5. mixed precision (fp16 working copy, fp32 master and moments: K =
12 bytes per parameter, measured) and the full timeline. The HTML report stacks the model states per
rank (Fig. 1) and draws the FSDP step over its gathered units. Writes runs/06_zero/*.json, report.html.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from lessons import common
from lessons.common import console as make_console
from minipar import nn
from minipar import trace as mtrace
from minipar.autograd import Tensor
from minipar.cost import zero as formulas
from minipar.mesh import DeviceMesh
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.ddp import DistributedDataParallel, local_batch
from minipar.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from minipar.parallel.zero.fsdp2 import fully_shard
from viz.analysis import sent_by_op
from viz.memory_stack import at_peak, before_step, fsdp_forward_table, totals_table
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, LR = 32, 16, 32, 4, 2, 64, 8, 3e-3
CAP = 32 * 1024  # bytes per ZeRO bucket: the GPT's 158 KB of gradients make several (stage 2 drops each early)
ITEM = 8  # float64
DEGREES = (1, 2, 4)  # N for the memory table
MIXED_SCALE = 2.0**10  # fp16 loss x S must stay under fp16's 65,504: 2^16 would overflow (and skip) twice
PAPER_PSI, PAPER_N, PAPER_FIG1 = 7.5e9, 64, (120, 31.4, 16.6, 1.88)  # Rajbhandari et al. Fig. 1 / Table 1, GB
OUT = Path("runs/06_zero")
ODD = (5, 3, 4, 2, 2, 16)  # vocab, seq, d, heads, layers, d_ff: first dimensions 3 ranks do not divide
TITLES = {0: "DDP (stage 0)", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "FSDP (ZeRO-3, P_os+g+p)"}


class DDPStage0:
    """Stage 0 with ZeRO's surface: DDP's all-reduce (ring) and a whole AdamW on every rank."""

    def __init__(self, model: GPT, comm: Any) -> None:
        self.module, self.ddp = model, DistributedDataParallel(model, comm, algorithm="ring")
        self.optimizer = AdamW(model.parameters(), lr=LR)

    def backward(self, loss: Tensor) -> None:
        self.ddp.backward(loss)

    def step(self) -> bool:
        with mtrace.span("opt"):
            self.optimizer.step()
        self.optimizer.zero_grad()
        return True

    def state_bytes(self) -> dict[str, int]:
        return {"parameters": self.ddp.param_bytes,
                "gradients": sum(p.grad.nbytes for p in self.module.parameters() if p.grad is not None),
                "optimizer state": self.optimizer.state_bytes()}


def build(comm: Any, stage: int, precision: str = "fp64") -> Any:
    """The tiny GPT at ``stage`` on ``comm`` (FSDP's built under ``nn.deferred()``: no rank holds it
    whole). Mixed precision starts from loss scale ``MIXED_SCALE``."""
    dtype = np.float16 if precision == "mixed" else np.float64
    if stage == 3:
        with nn.deferred():
            model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0, dtype=dtype)
        return FullyShardedDataParallel(model, comm, lr=LR, precision=precision, loss_scale=MIXED_SCALE)
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0, dtype=dtype)
    if stage == 0:
        return DDPStage0(model, comm)
    return ZeroDataParallel(model, comm, stage=stage, lr=LR, bucket_cap_bytes=CAP, precision=precision,
                            loss_scale=MIXED_SCALE)


def groups(wrapper: Any) -> list[int]:
    """Elements of each bucket (DDP, stages 1-2) or unit (stage 3), unpadded: the formulas' ``numels``."""
    if isinstance(wrapper, DDPStage0):
        return [b.numel for b in wrapper.ddp.buckets]
    return [g.layout.numel for g in getattr(wrapper, "units", None) or wrapper.buckets]


def train(comm: Any, stage: int, steps: int = 3, trace_path: str | os.PathLike[str] | None = None,
          precision: str = "fp64") -> dict[str, Any]:
    """Train the tiny GPT ``steps`` AdamW steps at ``stage`` on ``comm``, each rank on its part of
    the global batch; the last step is traced into ``trace_path``. Returns the global-batch losses
    (the mean over ranks of each rank's mean), the groups' sizes and the steps skipped (mixed)."""
    wrapper = build(comm, stage, precision)
    n, numels = comm.size, groups(wrapper)
    if stage in (1, 2):  # the lesson's sample as each gradient arrives (after ZeRO's own hook): stage 2's transient
        for p in wrapper.module.parameters():
            p.register_hook(lambda _p: mtrace.memory_states(wrapper.state_bytes()))
    meta = {"paradigm": f"ZeRO stage {stage}" + (" (FSDP)" if stage == 3 else " (DDP)" if stage == 0 else ""),
            "time_unit": "s",
            "expected_bytes": formulas.zero_traffic_by_op(numels, stage, n, 2 if precision == "mixed" else ITEM),
            "config": {"stage": stage, "N": n, "precision": precision, "groups": numels, "vocab": VOCAB, "seq": SEQ,
                       "d_model": D_MODEL, "heads": HEADS, "layers": LAYERS, "d_ff": D_FF, "batch": BATCH}}
    losses, skipped = [], 0
    for step, (x, y) in enumerate(common.lm_batches(steps, VOCAB, BATCH, SEQ)):
        xs, ys = local_batch(comm, x, y)
        with mtrace.record(trace_path if step == steps - 1 else None, comm, **meta):
            mtrace.memory_states(wrapper.state_bytes())
            with mtrace.span("F") if stage != 3 else nullcontext():  # FSDP records one "F" span per unit
                loss = wrapper.module.loss(xs, ys)
            wrapper.backward(loss)
            skipped += not wrapper.step()
            mtrace.memory_states(wrapper.state_bytes())
        losses.append(float(comm.allreduce(np.array([loss.item()]))[0]) / n)
    return {"losses": losses, "numels": numels, "skipped": skipped, "trace": trace_path,
            "loss_scale": getattr(wrapper.optimizer, "loss_scale", 1.0)}


def single_process_losses(steps: int) -> list[float]:
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0)
    opt = AdamW(model.parameters(), lr=LR)
    return common.one_process(model, opt, common.lm_batches(steps, VOCAB, BATCH, SEQ))


def run_all(comm: Any, steps: int, out: Path = OUT) -> dict[tuple[int, int], dict[str, Any]]:
    """Every stage at every N of ``DEGREES`` that fits: the first N ranks (a sub-communicator) train,
    the others wait; traces ``out/stage{s}_n{N}.json``. Returns rank 0's results by (stage, N)."""
    results = {}
    for n in (d for d in DEGREES if d <= comm.size):
        sub = comm if n == comm.size else comm.split(0 if comm.rank < n else 1)
        for stage in TITLES:
            if comm.rank < n:
                results[(stage, n)] = train(sub, stage, steps, out / f"stage{stage}_n{n}.json")
        comm.barrier()
    return results


def fsdp_versions(comm: Any, n: int, dims: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """One step of FSDP1 (flat padded units) and FSDP2 (``fully_shard``: a ``Shard(0)`` piece per
    parameter) on the first ``n`` ranks for ``GPT(*dims)``: the bytes each rank sent (trace), the
    elements FSDP1 pads, the arrays a rank's checkpoint holds, and whether the bytes equal
    ``cost.zero``'s formulas. Rank 0's view; the other ranks return {}."""
    sub = comm if n == comm.size else comm.split(0 if comm.rank < n else 1)
    out: dict[int, dict[str, Any]] = {}
    if comm.rank < n:
        ((x, y),) = common.lm_batches(1, dims[0], 2 * n, dims[1])
        xs, ys = local_batch(sub, x, y)
        for version in (1, 2):
            with nn.deferred():
                model = GPT(*dims, seed=0)
            par = (FullyShardedDataParallel(model, sub, lr=LR) if version == 1 else
                   fully_shard(model, DeviceMesh(sub, dp=n), lr=LR))
            with mtrace.recording(comm.rank) as rec:
                par.backward(model.loss(xs, ys))
                par.step()
            sent = sub.allgather_object(sum(e.nbytes for e in rec.events if e.kind == "comm" and e.name == "send"
                                            and e.src == comm.rank))
            want = [formulas.zero_traffic_bytes([u.layout.numel for u in par.units], 3, n, ITEM, r) if version == 1
                    else formulas.fsdp2_traffic_bytes([u.shapes for u in par.units], n, ITEM, r) for r in range(n)]
            out[version] = {"sent": sent, "formula": sent == want,
                            "padding": sum(u.layout.padded - u.layout.numel for u in par.units) if version == 1 else 0,
                            "arrays": len(par.units) if version == 1 else len(par.checkpoint_shapes())}
    comm.barrier()
    return out


def versions_text(same: dict[int, dict[str, Any]], odd: dict[int, dict[str, Any]], p: int, n: int) -> str:
    """FSDP1 beside FSDP2, one step: this GPT, and the odd one (``ODD``) on ``n`` ranks."""
    def per_rank(sent: list[int]) -> str:
        return f"{sent[0]:,}" if len(set(sent)) == 1 else " / ".join(f"{b:,}" for b in sent)

    ok = all(v["formula"] for d in (same, odd) for v in d.values())
    return (f"FSDP2 (fully_shard: each parameter Shard(0), rows cut as DTensor does) beside FSDP1 (flat padded "
            f"units), one step: this GPT on {p} ranks, padding {same[1]['padding']}, {per_rank(same[1]['sent'])} / "
            f"{per_rank(same[2]['sent'])} B per rank; vocab 5, d 4 on {n} ranks: FSDP1 pads {odd[1]['padding']}, sends "
            f"{per_rank(odd[1]['sent'])}; FSDP2 pads none, sends {per_rank(odd[2]['sent'])}. Checkpoint per rank: "
            f"{odd[1]['arrays']} flat shards / {odd[2]['arrays']} arrays of rows. "
            + ("All as cost.zero's formulas." if ok else "[red]bytes and formulas differ[/red]"))


def memory_table(results: dict[tuple[int, int], dict[str, Any]], psi: int) -> Table:
    """Model states per rank when the step begins, by component, measured vs the formulas, and each run's peak."""
    table = Table(title=f"model states per rank (bytes) when the optimizer step begins, float64, Psi = {psi:,}; "
                        "measured: the trace's memory samples on rank 0", title_justify="left",
                  caption="exact: zero_state_bytes (this layout, padded shards); paper: zero_model_states, "
                          "(2+2+K) Psi with 8-byte parameters and gradients and K = 16 (AdamW's m, v). Peak: the "
                          "most at any sample of the step (stage 2: gradients of a bucket not yet reduced; FSDP: a "
                          "unit's full gradients before their reduce-scatter, and the gathered units: the one "
                          "computing plus the prefetched one, next to fsdp_gathered_peak).",
                  caption_justify="left", key=2)  # split to fit: each part keeps the stage and N
    for col in ("stage", "N", "params", "grads", "opt state", "total", "exact", "paper", "peak",
                "FSDP gathered peak (formula)"):
        table.add_column(col, justify="right")
    for (stage, n), res in sorted(results.items()):
        trace = mtrace.load(res["trace"])
        got, exact = before_step(trace, 0), formulas.zero_state_bytes(res["numels"], stage, n)
        paper = formulas.zero_model_states(psi, stage, n, optimizer_bytes=16, param_bytes=8, grad_bytes=8)
        gathered = "-"
        if stage == 3:
            most = max(e.nbytes for e in trace.select("memory", rank=0, name="gathered units"))
            gathered = f"{most:,} ({formulas.fsdp_gathered_peak(res['numels'], n):,})"
        table.add_row(f"{stage} {formulas.STAGE_NAMES[stage]}", str(n), *(f"{got.get(k, 0):,}" for k in exact),
                      f"{sum(got.get(k, 0) for k in exact):,}", f"{sum(exact.values()):,}", f"{paper:,.0f}",
                      f"{sum(at_peak(trace, 0).values()):,}", gathered)
    return table


def paper_rows() -> Table:
    table = Table(title=f"the paper's Table 1 from zero_model_states: Psi = {PAPER_PSI / 1e9:g}B parameters, K = 12 "
                        "(fp16 parameters and gradients, fp32 master + m + v), GB per rank", title_justify="left")
    for col in ("N", *formulas.STAGE_NAMES.values()):
        table.add_column(col, justify="right")
    for row in formulas.paper_table(int(PAPER_PSI), [1, 4, 16, PAPER_N, 256, 1024]):
        table.add_row(str(row["dp"]), *(formulas.paper_gb(row[s]) for s in formulas.STAGE_NAMES.values()))
    table.add_row(f"paper's Fig. 1, N = {PAPER_N}", *(f"{v:g}" for v in PAPER_FIG1), style="bold")
    return table


def traffic_table(results: dict[tuple[int, int], dict[str, Any]], n: int, verbose: bool = True) -> Table:
    ddp, rows = formulas.zero_traffic_bytes(results[(0, n)]["numels"], 0, n), []
    for stage in TITLES:
        trace = mtrace.load(results[(stage, n)]["trace"])
        per_op = sent_by_op(trace.events, 0)
        sent = [trace.bytes_sent(r) for r in range(n)]
        want = formulas.zero_traffic_bytes(results[(stage, n)]["numels"], stage, n)
        rows.append((f"{stage} {formulas.STAGE_NAMES[stage]}",
                     *((", ".join(f"{op} {b:,}" for op, b in per_op.items()),) if verbose else ()),
                     f"{sent[0]:,}" if len(set(sent)) == 1 else " / ".join(f"{b:,}" for b in sent),
                     f"{want:,}", f"{ddp:,}", f"{sent[0] / ddp:.2f}x"))
    return Table.of(f"bytes each rank sent in one training step, N = {n} (ring collectives; measured: the trace)",
                    ("stage", *(("ops measured (rank 0)",) if verbose else ()), "measured per rank",
                     "zero_traffic_bytes", "DDP all-reduce", "vs DDP"), rows, text=0)


def check_ranks(p: int) -> str | None:
    if p not in (2, 4):
        return f"lesson 6 measures ZeRO at N = 1, 2 and 4 ranks: run it on 4 ranks, or 2 (got {p})"
    return None


def run(comm: Any, steps: int, clock: common.Clock = common.REPLAY, verbose: bool = False) -> None:
    """Every stage at every N, then mixed precision; rank 0 prints (``verbose``: every table)."""
    console = make_console()
    p, lead = comm.size, comm.rank == 0
    common.shared_folder(comm, OUT)
    results = run_all(comm, steps)
    mixed = train(comm, 3, steps, OUT / "fsdp_mixed.json", precision="mixed")
    n_odd = min(3, p)
    versions = (fsdp_versions(comm, p, (VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF)), fsdp_versions(comm, n_odd, ODD))
    if not lead:
        return
    console.rule(f"[bold]1. one tiny GPT, global batch {BATCH} over N = {p} ranks, {steps} AdamW steps")
    ref = single_process_losses(steps)
    if verbose:
        console.print(common.loss_table(ref, {t: results[(k, p)]["losses"] for k, t in TITLES.items()},
                                        "loss per step (global batch: the mean over ranks of each rank's mean)"))
    diff = max(abs(a - b) for k in TITLES for a, b in zip(results[(k, p)]["losses"], ref, strict=True))
    console.print(f"DDP, ZeRO-1, ZeRO-2 and FSDP give one process's losses: largest difference {diff:.1e} (float64 "
                  "rounding: the ranks add the same gradients in another order).", highlight=False)
    psi = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF).num_parameters()
    console.rule("[bold]2. memory per rank: the paper's table, measured")
    exact = {(TITLES[k], n): sum(formulas.zero_state_bytes(r["numels"], k, n).values())
             for (k, n), r in results.items()}
    paper = all(exact[(TITLES[k], n)] == formulas.zero_model_states(psi, k, n, 16, param_bytes=8, grad_bytes=8)
                for k, n in results)
    table, equal = totals_table({(TITLES[k], n): mtrace.load(r["trace"]) for (k, n), r in sorted(results.items())},
                                exact, f"model states per rank (bytes) when the optimizer step begins, measured on "
                                f"rank 0 (float64, AdamW, Psi = {psi:,}; N ranks)")
    console.print(table)
    console.print("Every total equals zero_state_bytes (this layout) and the paper's zero_model_states, (2 + 2 + K) "
                  "Psi with K = 16 (8-byte numbers, AdamW's m and v) partitioned as the stage says."
                  if equal and paper else "[red]measured and formula differ[/red] (--verbose: the table by component)",
                  highlight=False)
    if verbose:
        console.print(f"N = {', '.join(str(n) for n in DEGREES if n <= p)}: the first N of the {p} ranks train on "
                      f"a sub-communicator (comm.split; N = {p} is the run above), the others wait.", highlight=False)
        console.print(memory_table(results, psi))
        console.print(paper_rows())
    console.rule("[bold]3. communication per step")
    console.print(traffic_table(results, p, verbose))
    console.print(versions_text(*versions, p, n_odd), highlight=False)
    fsdp = clock.of(results[(3, p)]["trace"])
    if verbose:
        console.rule(f"[bold]4. FSDP unit by unit ({clock.label})")
        common.print_note(console, clock.caveat(p), ". That concerns the times below, not the bytes.")
        console.print(fsdp_forward_table(fsdp, results[(3, p)]["numels"], p))
        console.rule("[bold]5. mixed precision (FSDP, fp16 working copy, fp32 master and moments)")
        console.print(mixed_summary(mixed, results[(3, p)]["losses"], p), highlight=False)
    console.rule(f"[bold]the FSDP step ({clock.short}; F per unit, B, opt; all-gathers, reduce-scatters)")
    order = [results[(k, p)]["trace"] for k in TITLES] + [mixed["trace"]]
    common.finish(order, OUT / "report.html", console, timeline=fsdp,
                  titles=[*TITLES.values(), "FSDP, mixed precision"], clock=clock, brief=not verbose)
    console.print("Each stage partitions one more model state over the N ranks: stage 1 the optimizer state, stage 2 "
                  "the gradients, FSDP the parameters (1/N of everything). A reduce-scatter plus an all-gather move "
                  "what one all-reduce moves (Sec. 7.2.1): stages 1 and 2 cost DDP's bytes; FSDP gathers every unit "
                  "twice (forward, and again for backward) and reduce-scatters once: 1.5x.", highlight=False)
    console.print(common.reading_path("06_zero"), highlight=False)


def mixed_summary(mixed: dict[str, Any], fp64: list[float], n: int) -> str:
    """Bytes per parameter of rank 0's shard when the step begins (mixed precision), the losses."""
    shard = sum(-(-k // n) for k in mixed["numels"])  # elements of this rank's shards
    got = before_step(mtrace.load(mixed["trace"]), 0)
    exact = formulas.zero_state_bytes(mixed["numels"], 3, n, precision="mixed")
    return (f"bytes per parameter of rank 0's shards ({shard:,} elements) when the step begins, measured: "
            + ", ".join(f"{k} {v / shard:g}" for k, v in got.items() if k != "gathered units")
            + f"; K = {(got['optimizer state'] + got['master parameters']) / shard:g} = fp32 m 4 + v 4 + master 4 "
            "(zero_state_bytes: "
            + ", ".join(f"{k} {v / shard:g}" for k, v in exact.items()) + ").\n"
            + "losses " + ", ".join(f"{v:.4f}" for v in mixed["losses"]) + " vs float64 "
            + ", ".join(f"{v:.4f}" for v in fp64) + f" (fp16 rounding); loss scale {mixed['loss_scale']:g}, "
            f"steps skipped on overflow: {mixed['skipped']}.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=3, ranks=4)
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    common.run_lesson(run, parse_args(argv), check_ranks)


if __name__ == "__main__":
    main()
