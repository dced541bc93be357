"""Lesson 0: the autograd engine and the tiny GPT every later lesson splits across ranks.

    python lessons/00_autograd/lesson.py [--steps 300]

1. Build the tiny GPT (token + position embeddings, pre-norm blocks, vocabulary head).
2. Check one weight's gradient from backward() against central differences.
3. Train it on a synthetic Markov-chain token stream with AdamW; the loss falls from log(V)
   (uniform guessing) towards the entropy of the chain.
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from minipar import data
from minipar.nn import GPT
from minipar.optim import AdamW

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
    probs = data.markov_chain(vocab, seed)
    stationary = np.full(vocab, 1.0 / vocab)
    for _ in range(500):
        stationary = stationary @ probs
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.nansum(probs * np.log(probs), axis=1)
    return float(stationary @ h)


def train(steps: int = 300, batch: int = 16, lr: float = 3e-3, console: Console | None = None) -> list[float]:
    console = console or Console()
    stream = data.token_stream(20_000, VOCAB, seed=0)
    model = GPT(VOCAB, SEQ, D_MODEL, HEADS, LAYERS, seed=0)
    console.print(f"tiny GPT: {model.num_parameters():,} parameters, vocab {VOCAB}, seq {SEQ}, "
                  f"d_model {D_MODEL}, {HEADS} heads, {LAYERS} layers")
    x, y = data.lm_batch(stream, batch, SEQ, step=0)
    analytic, numeric = gradient_check(model, x, y)
    console.print(f"gradient check  d loss / d q.weight[1,2]: autograd {analytic:.9f}   "
                  f"central difference {numeric:.9f}   |diff| {abs(analytic - numeric):.1e}")
    opt = AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    columns = [TextColumn("training"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"))
        for step in range(steps):
            x, y = data.lm_batch(stream, batch, SEQ, step=step)
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    train(args.steps)


if __name__ == "__main__":
    main()
