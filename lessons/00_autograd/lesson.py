"""Lesson 0: the autograd engine and the tiny GPT every later lesson splits across ranks.

    python lessons/00_autograd/lesson.py [--steps 300] [--out runs/00_autograd] [--verbose]

1. Build the tiny GPT (token + position embeddings, pre-norm blocks, vocabulary head).
2. Check one weight's gradient from backward() against central differences.
3. Train it on a synthetic Markov-chain token stream with AdamW; the loss falls from log(V)
   (uniform guessing) towards the entropy of the chain.
4. Trace the last few steps (forward, backward, optimizer spans; parameter, gradient and optimizer
   state bytes) and show them: the one-rank picture every later lesson splits across ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from lessons.common import MAX_STEPS, Clock, clock_arguments, finish, parse_lesson_args, reading_path
from lessons.common import console as make_console
from minipar import datasets, trace
from minipar.cli_args import int_in
from minipar.comm import world
from minipar.nn import GPT
from minipar.optim import AdamW
from viz.width import Table

VOCAB, SEQ, D_MODEL, HEADS, LAYERS = 16, 16, 32, 4, 2


def gradient_check(model: GPT, x: np.ndarray, y: np.ndarray, eps: float = 1e-6) -> tuple[float, float]:
    """(autograd, central-difference) derivative of the loss by one entry of the first query weight."""
    w = model.blocks[0].attn.q.weight
    model.zero_grad()
    model.loss(x, y).backward()
    analytic = float(w.grad[1, 2])
    old = w.data[1, 2]
    w.data[1, 2] = old + eps
    hi = model.loss(x, y).item()
    w.data[1, 2] = old - eps
    lo = model.loss(x, y).item()
    w.data[1, 2] = old
    return analytic, (hi - lo) / (2 * eps)


def entropy_rate(vocab: int, seed: int = 0) -> float:
    """Best achievable loss on the stream: the chain's conditional entropy under its visit frequencies."""
    probs = datasets.markov_chain(vocab, seed)
    stationary = np.full(vocab, 1.0 / vocab)
    for _ in range(500):
        stationary = stationary @ probs
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.nansum(probs * np.log(probs), axis=1)
    return float(stationary @ h)


def train_step(model: GPT, opt: AdamW, x: np.ndarray, y: np.ndarray) -> float:
    """One traced step: forward, backward, optimizer; memory samples of what the rank holds."""
    params = sum(p.data.nbytes for p in model.parameters())
    trace.memory("parameters", params)
    with trace.span("F", microbatch=0):
        loss = model.loss(x, y)
    opt.zero_grad()
    with trace.span("B", microbatch=0):
        loss.backward()
    trace.memory("gradients", sum(p.grad.nbytes for p in model.parameters()))
    with trace.span("opt"):
        opt.step()
    trace.memory("optimizer state", opt.state_bytes())
    return loss.item()


def train(steps: int = 300, batch: int = 16, lr: float = 3e-3, console: Console | None = None,
          trace_path: str | Path | None = None, traced_steps: int = 3) -> list[float]:
    """Train the tiny GPT; the last ``traced_steps`` steps are recorded to ``trace_path`` (if given)."""
    console = console or Console()
    stream = datasets.token_stream(20_000, VOCAB, seed=0)
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, seed=0)
    console.print(f"tiny GPT: {model.num_parameters():,} parameters, vocab {VOCAB}, seq {SEQ}, "
                  f"d_model {D_MODEL}, {HEADS} heads, {LAYERS} layers")
    x, y = datasets.lm_batch(stream, batch, SEQ, step=0)
    analytic, numeric = gradient_check(model, x, y)
    console.print(f"gradient check  d loss / d q.weight[1,2]: autograd {analytic:.9f}   "
                  f"central difference {numeric:.9f}   |diff| {abs(analytic - numeric):.1e}")
    opt = AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    columns = [TextColumn("training"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"))
        for step in range(steps - traced_steps):
            losses.append(train_step(model, opt, *datasets.lm_batch(stream, batch, SEQ, step=step)))
            progress.update(task, advance=1, loss=np.mean(losses[-20:]))
        with trace.record(trace_path, world(), paradigm="single process", lesson="00_autograd", time_unit="s",
                          steps=traced_steps):
            for step in range(steps - traced_steps, steps):
                losses.append(train_step(model, opt, *datasets.lm_batch(stream, batch, SEQ, step=step)))
                progress.update(task, advance=1, loss=np.mean(losses[-20:]))
    table = Table(title="loss")
    for col in ("steps", "mean loss"):
        table.add_column(col, justify="right")
    for lo in range(0, steps, max(steps // 6, 1)):
        table.add_row(f"{lo}-{min(lo + steps // 6, steps) - 1}", f"{np.mean(losses[lo : lo + steps // 6]):.3f}")
    console.print(table)
    console.print(f"uniform guessing: log V = {np.log(VOCAB):.3f}; best possible (chain entropy) = "
                  f"{entropy_rate(VOCAB):.3f}")
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The lesson's arguments, every value checked before any work (``lessons.common.parse_lesson_args``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int_in(1, MAX_STEPS), default=300, help="training steps (default 300)")
    parser.add_argument("--out", default="runs/00_autograd", help="folder for trace.json and report.html")
    parser.add_argument("--verbose", action="store_true", help="the whole timeline (default: at most 2 bands)")
    return parse_lesson_args(clock_arguments(parser), argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = make_console()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "trace.json"
    train(args.steps, console=out, trace_path=path)
    finish([path], Path(args.out) / "report.html", out, titles=["tiny GPT, one process, the last 3 steps"],
           clock=Clock.of_args(args), brief=not args.verbose)
    out.print(reading_path("00_autograd"), highlight=False)


if __name__ == "__main__":
    main()
