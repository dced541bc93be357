"""Lesson 11: number formats for training, fp32 to FP8: what each holds, why fp16 needs a loss
scale and bf16 does not, FP8's scales at work, and the bytes per parameter of each recipe.

    mpiexec -n 2 python lessons/11_precision/lesson.py [--steps 12] [--verbose]
    python lessons/11_precision/lesson.py [--ranks 2]      # same, ranks as threads in one process

A format is a sign, ``e`` exponent bits and ``m`` mantissa bits: the exponent sets the range (from
the smallest subnormal to the largest value), the mantissa the precision (the step above 1 is
2^-m). fp16 (e5 m10) has precision but little range; bf16 (e8 m7) has float32's range with less
precision; FP8 (Micikevicius et al. 2022) is e4m3 for activations and weights, e5m2 for gradients.
Code: ``minipar/fp8.py`` (casts, scales, the FP8 GEMM), ``minipar/parallel/tensor/fp8.py`` (the
same in Megatron's linears), ``minipar/cost/precision.py`` (bytes per parameter).

Printed: 1. the five formats (ml_dtypes' numbers). 2. The gradients of one real backward of the
tiny GPT (the weights' and the logits') against each format's range: how many flush to zero or
lose bits as subnormals in fp16, with a loss scale, in bf16 and in e5m2 with and without a scale.
3. FP8 training (``fp8.enable``) of the GPT split over the ranks by tensor parallelism, delayed
scaling (Transformer Engine: per-tensor scales from an amax history) and block scaling
(DeepSeek-V3: a scale per 1 x 8 tile and 8 x 8 block here; 128 in the report), against fp32 and
the single-process FP8 run; the scales one layer used step by step; per-tensor against block
scales on an activation with an outlier channel. 4. Bytes per parameter and gradient all-reduce
bytes per step for fp32, fp16 + loss scale, bf16, bf16 reduced in fp32 and FP8
(``minipar.cost.precision``). Then the FP8 step's timeline (tensor-parallel collectives and the
amax all-reduces) and the conclusion. ``--verbose`` adds the losses step by step and every step's
scales. The HTML report adds the gradient histogram against the formats' ranges and the loss
curves. Writes runs/11_precision/*.json, report.html.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import plotly.graph_objects as go

from lessons import common
from lessons.common import console as make_console
from minipar import fp8
from minipar import functional as F
from minipar import trace as mtrace
from minipar.cost import precision
from minipar.nn import GPT
from minipar.optim import AdamW
from minipar.parallel.tensor import TensorParallelGPT
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, BATCH, LR = 32, 16, 32, 4, 2, 128, 8, 3e-3
BLOCK = 8  # DeepSeek-V3's 128 divides no weight of this GPT: 32 wide, 8 a rank on 4 ranks
LOSS_SCALE = 2**10
FORMATS = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": fp8.E4M3, "e5m2": fp8.E5M2}
RECIPES = {"delayed": fp8.DelayedScaling(history=4), "block": fp8.BlockScaling(BLOCK)}
LAYER = "blocks.0.mlp.fc"  # whose scales are shown
OUTLIER = 10_000  # an outlier channel this many times the others
OUT = Path("runs/11_precision")


def info(name: str) -> Any:
    return ml_dtypes.finfo(FORMATS[name])


def formats_table() -> Table:
    rows = []
    for name in FORMATS:
        fi = info(name)
        rows.append((name, f"{fi.bits}", f"{fi.nexp}/{fi.nmant}", f"{float(fi.max):.3g}", f"{float(fi.tiny):.3g}",
                     f"{float(fi.smallest_subnormal):.3g}", f"2^{int(np.log2(float(fi.eps)))}"))
    return Table.of("", ("", "bits", "exp/man", "largest", "smallest normal", "subnormal", "step at 1"), rows)


def backward_gradients() -> dict[str, np.ndarray]:
    """Magnitudes of the nonzero gradients of one backward of the float32 GPT: its weights' (but the
    keys' biases', zero but for rounding: softmax ignores a shift shared by every key) and its logits'."""
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, seed=0, dtype=np.float32)
    x, y = common.lm_batch(0, VOCAB, BATCH, SEQ)
    logits = model(x).retain_grad()
    F.cross_entropy(logits, y).backward()
    weights = [p.grad.ravel() for n, p in model.named_parameters() if not n.endswith("attn.k.bias")]
    out = {"weights": np.concatenate(weights), "logits": logits.grad.ravel()}
    return {k: np.abs(v[v != 0]).astype(np.float64) for k, v in out.items()}


def lost(g: np.ndarray, name: str, scale: float = 1.0) -> tuple[float, float, float]:
    """Fractions of ``g * scale`` that ``name`` flushes to zero, keeps as subnormals (fewer bits), overflows."""
    fi, v = info(name), g * scale
    zero = float(np.mean(v.astype(FORMATS[name]) == 0))
    return zero, float(np.mean(v < float(fi.tiny))) - zero, float(np.mean(v > float(fi.max)))


def gradients_table(grads: dict[str, np.ndarray]) -> tuple[Table, dict[str, tuple[float, ...]]]:
    e5m2 = {k: float(fp8.pow2_scale(g.max(), fp8.E5M2)) for k, g in grads.items()}  # a per-tensor FP8 scale
    cases = {"fp16": ("fp16", {}), f"fp16 x 2^{int(np.log2(LOSS_SCALE))}": ("fp16", {k: LOSS_SCALE for k in grads}),
             "bf16": ("bf16", {}), "e5m2": ("e5m2", {}), "e5m2 x amax scale": ("e5m2", e5m2)}
    rows, got = [], {}
    for label, (name, scales) in cases.items():
        got[label] = tuple(f for k, g in grads.items() for f in lost(g, name, scales.get(k, 1.0))[:2])
        rows.append((label, *(f"{100 * f:.2f}" for f in got[label])))
    table = Table.of("", ("% flushed to 0 / subnormal", "weights: 0", "subnormal", "logits: 0", "subnormal"), rows)
    return table, got


def histogram_figure(grads: dict[str, np.ndarray]) -> go.Figure:
    fig = go.Figure()
    for name, g in grads.items():
        fig.add_trace(go.Histogram(x=np.log2(g), name=f"{name}' gradients", opacity=0.6, xbins={"size": 1}))
    lines = {"fp16 smallest subnormal": info("fp16").smallest_subnormal, "e5m2 smallest subnormal":
             info("e5m2").smallest_subnormal, "fp16 and e5m2 smallest normal": info("fp16").tiny,
             "e4m3 smallest normal": info("e4m3").tiny}
    for (what, value), colour in zip(lines.items(), ("red", "purple", "black", "green"), strict=True):
        fig.add_vline(x=float(np.log2(float(value))), line_color=colour, annotation_textangle=-90,
                      line_dash="dot" if what.endswith("subnormal") else "solid", annotation_text=what)
    fig.update_layout(barmode="overlay", xaxis_title="log2 |gradient| (bf16's smallest subnormal: 2^-133)",
                      yaxis_title="count", xaxis_range=[-45, 2])
    return fig


def train(comm: Any, recipe: str | None, steps: int, parallel: bool = True,
          trace_path: Path | None = None) -> dict[str, Any]:
    """The float32 GPT trained ``steps`` AdamW steps on the same batches, FP8 by ``recipe`` (None:
    fp32), split over ``comm`` by tensor parallelism (sequence parallel) or in one process; the last
    step traced into ``trace_path``. Returns the losses and ``LAYER``'s scales and amaxes per step."""
    kw = {"seed": 0, "dtype": np.float32}
    model = (TensorParallelGPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, comm, D_FF, sequence_parallel=True, **kw)
             if parallel else GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF, **kw))
    if recipe is not None:
        fp8.enable(model, RECIPES[recipe])
    layer = model.blocks[0].mlp.fc  # LAYER
    opt, losses, scales = AdamW(model.parameters(), lr=LR), [], []
    meta = {"paradigm": f"tensor parallel, FP8 {recipe}", "time_unit": "s",
            "config": {"recipe": recipe, "t": comm.size, "d_model": D_MODEL, "d_ff": D_FF, "block": BLOCK}}
    for step, (x, y) in enumerate(common.lm_batches(steps, VOCAB, BATCH, SEQ)):
        traced = mtrace.record(trace_path if step == steps - 1 else None, comm, **meta) if parallel else nullcontext()
        with traced:
            opt.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            if parallel:
                model.sync_grads()
            with mtrace.span("opt"):
                opt.step()
        losses.append(float(loss.data))
        if recipe == "delayed":
            h = layer.fp8.history
            scales.append({role: (h[role][-1], float(layer.fp8.scales[role])) for role in ("x", "w", "dy")})
    return {"losses": losses, "scales": scales, "saturated": dict(layer.fp8.saturated) if recipe else {}}


def outlier_rows() -> list[tuple[str, ...]]:
    """An activation whose channel 0 is OUTLIER times the others (LLM.int8's outlier features,
    Dettmers et al. 2022) cast to e4m3 with one scale and with a scale per 1 x BLOCK tile: of the
    other channels, the % flushed to zero, the % left subnormal (fewer bits), the median relative error."""
    a = np.random.default_rng(0).normal(size=(64, 128))
    a[:, 0] *= OUTLIER
    rows = []
    for name, recipe in (("per tensor", fp8.DelayedScaling()), (f"1 x {BLOCK} tiles", fp8.BlockScaling(BLOCK))):
        q, s = fp8.Fp8Meta(recipe).quantise("x", a)
        back, rest = fp8.dequantise(q, s)[:, 1:], a[:, 1:]
        subnormal = np.abs(q[:, 1:].astype(np.float64)) < float(ml_dtypes.finfo(fp8.E4M3).tiny)
        rows.append((name, f"{100 * np.mean(back == 0):.1f}", f"{100 * np.mean(subnormal & (back != 0)):.1f}",
                     f"{np.median(np.abs(back - rest) / np.abs(rest)):.3f}"))
    return rows


def memory_table(n: int, psi: int) -> Table:
    rows = []
    for r in precision.RECIPES:
        b = precision.state_bytes(r)
        rows.append((r, *(str(b.get(k, "-")) for k in ("parameters", "gradients", "master parameters",
                                                       "optimizer state", "fp8 weights")),
                     str(sum(b.values())), f"{precision.allreduce_bytes_per_step(r, psi, n):,}"))
    return Table.of("",
                    ("", "work", "grad", "master", "m+v", "fp8", "total", "all-reduce"), rows)


def check_ranks(p: int) -> str | None:
    if p not in (1, 2, 4):
        return f"lesson 11 splits the GPT's 4 heads and {D_FF}-wide MLP over 1, 2 or 4 ranks (got {p})"
    return None


def run(comm: Any, steps: int, clock: common.Clock = common.REPLAY, verbose: bool = False) -> None:
    console = make_console()
    common.shared_folder(comm, OUT)
    runs = {r: train(comm, r, steps, trace_path=OUT / f"fp8_{r}.json") for r in RECIPES}
    if comm.rank != 0:
        return
    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    console.rule("[bold]1. five formats (ml_dtypes.finfo)")
    console.print(formats_table())
    grads = backward_gradients()
    console.rule(f"[bold]2. one backward's {len(grads['weights']):,} weight and {len(grads['logits']):,} logit "
                 "gradients")
    table, got = gradients_table(grads)
    console.print(table)
    scaled = sum(got[f"fp16 x 2^{int(np.log2(LOSS_SCALE))}"])
    say(f"fp16 keeps {100 * got['fp16'][1]:.1f} % of the weight gradients as subnormals (fewer bits), "
        f"{100 * scaled:.0f} % times the loss scale {LOSS_SCALE}; bf16 has fp32's exponent: no scale. e5m2 needs one.")
    console.rule(f"[bold]3. FP8 training, tensor parallel on {comm.size} ranks")
    ref = train(comm, None, steps, parallel=False)["losses"]
    one = train(comm, "delayed", steps, parallel=False)["losses"]
    if verbose:
        console.print(common.loss_table(ref, {f"FP8 {r}": v["losses"] for r, v in runs.items()},
                                        "loss per step", "fp32", digits=5))
    gaps = {r: max(abs(a - b) for a, b in zip(v["losses"], ref, strict=True)) for r, v in runs.items()}
    drift = max(abs(a - b) for a, b in zip(runs["delayed"]["losses"], one, strict=True))
    say(f"{steps} steps, loss {ref[0]:.2f} -> {ref[-1]:.2f} (fp32); |FP8 - fp32| <= {gaps['delayed']:.4f} "
        f"(delayed), {gaps['block']:.4f} (block); vs FP8 in one process: {drift:.1e} (fp32 head, norms).")
    last = runs["delayed"]["scales"][-1]
    say(f"{LAYER} cast x, w, dy with scales " + ", ".join(f"2^{int(np.log2(last[r][1]))}" for r in ("x", "w", "dy"))
        + " (the largest of the last 4 amaxes times the scale just fits 448 or 57344).")
    if verbose:
        console.print(Table.of(f"{LAYER}'s delayed scales: this step's amax, the scale it cast with (from the "
                               "last 4 amaxes; step 0: its own)",
                               ("step", "x amax", "scale", "w amax", "scale", "dy amax", "scale"),
                               [(str(i), *(f"{v:.3g}" for role in ("x", "w", "dy") for v in s[role]))
                                for i, s in enumerate(runs["delayed"]["scales"])]))
    console.print(Table.of(f"e4m3 cast, one channel {OUTLIER:,}x: the others' %",
                           ("scale", "to 0", "subnormal", "median rel. error"), outlier_rows()))
    psi, n = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, D_FF).num_parameters(), max(comm.size, 2)
    console.rule(f"[bold]4. bytes per parameter, all-reduce of Psi = {psi:,} gradients on N = {n}")
    console.print(memory_table(n, psi))
    console.rule(f"[bold]the FP8 step, delayed scaling ({clock.short})")
    curves = go.Figure([go.Scatter(y=np.subtract(v["losses"], ref), name=f"FP8 {r}, tensor parallel")
                        for r, v in runs.items()])
    curves.update_layout(xaxis_title="step", yaxis_title="loss minus fp32's loss")
    common.finish([OUT / f"fp8_{r}.json" for r in RECIPES], OUT / "report.html", console,
                  titles=[f"FP8 {r}, tensor parallel" for r in RECIPES], clock=clock, brief=not verbose,
                  extra_figures=[("one backward's gradients against the formats' ranges", histogram_figure(grads)),
                                 (f"FP8 loss minus fp32 loss (fp32: {ref[0]:.2f} -> {ref[-1]:.2f})", curves)])
    say("bf16 needs no loss scale; scaled FP8 tracks fp32. The bytes per parameter barely move: FP8 "
        "buys GEMM speed and 1-byte activations.")
    say(common.reading_path("11_precision"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = common.lesson_parser(__doc__, steps=12, ranks=2)
    return common.parse_lesson_args(parser, argv, lambda a: check_ranks(a.ranks))


def main(argv: list[str] | None = None) -> None:
    common.run_lesson(run, parse_args(argv), check_ranks)


if __name__ == "__main__":
    main()
