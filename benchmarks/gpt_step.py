"""One training step (forward, backward, AdamW) of minipar's tiny GPT against the same maths in PyTorch eager.

    python benchmarks/gpt_step.py [--size small|large|both] [--repeats 20]

The matmul-bound MLP of ``benchmarks/autograd.py`` hides the engine's own cost; a small transformer
does not: dozens of small ops per layer, so temporaries, copies and graph bookkeeping show. Both
sides run float32 on one thread (OPENBLAS_NUM_THREADS=1, ``torch.set_num_threads(1)``), interleaved
step by step in one process; the script prints the median step time of each and the ratio
minipar/torch (target: <= 1.0x).

Sizes (4 layers, d_ff = 4 d_model, vocabulary 256 (bytes), d_head 32 at both sizes):

    small   d_model  64, 2 heads, seq  32, batch  8
    large   d_model 256, 8 heads, seq 128, batch 16

The PyTorch side is written op for op like ``minipar.nn`` (separate q, k, v projections, attention
as matmul / causal mask / softmax / matmul rather than the fused ``scaled_dot_product_attention``,
tanh-GELU, ``torch.optim.AdamW`` with its defaults) and starts from a copy of minipar's parameters:
the first step's losses must agree to 1e-4. PyTorch is an optional, benchmark-only dependency
(``pip install -e .[bench]``); without it the script says so and exits.

Measured on the shared 2-core machine (torch 2.14.1 from PyPI on the CPU, numpy 2.4, nice -5, other jobs:
re-measure on a quiet one), ratio minipar/torch of the median CPU time per step:

    before (the engine at d0d7128)  small 1.16x   large 1.40x
    after (two runs)                small 0.88x   large 0.96-0.97x   (wall time 0.89-0.91x, 0.90-0.96x)

Re-measured on the quiet machine (nothing else running, --repeats 20): small 14.7 vs 17.3 ms, 0.85x;
large 747 vs 819 ms, 0.91x (wall and CPU time agree).

Where the time went (cProfile of minipar's step before the changes): GELU's ``a**3`` (a third of
the large step), the causal mask written by boolean indexing, 3-D @ 2-D products run as
a batch of GEMMs plus a sum for the weight gradient, numpy's slow ``.sum(axis=-1)`` on short rows,
fresh temporaries in layer norm / GELU / cross-entropy / AdamW, head-merge copies, and ~12 us of
``contextlib`` per ``Function.apply``. At the large size ~70% of the step is now GEMM time, the same
calls on both sides; the rest is memory-bound numpy passes, which suffer most when other jobs share
the memory bus.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from minipar.nn import GPT  # noqa: E402
from minipar.optim import AdamW  # noqa: E402

SIZES = {  # name: (d_model, n_heads, seq, batch)
    "small": (64, 2, 32, 8),
    "large": (256, 8, 128, 16),
}
LAYERS, VOCAB, LR = 4, 256, 1e-3


def torch_gpt(model: GPT, torch: Any) -> tuple[dict[str, Any], Any]:
    """minipar's parameters copied into torch leaves, and a step function computing the same GPT."""
    params = {name: torch.tensor(p.data, requires_grad=True) for name, p in model.named_parameters()}
    fn = torch.nn.functional
    n_layers, n_heads = len(model.blocks), model.blocks[0].attn.n_heads

    def linear(x: Any, name: str) -> Any:
        y = x @ params[name + ".weight"]
        bias = params.get(name + ".bias")
        return y + bias if bias is not None else y

    def layer_norm(x: Any, name: str) -> Any:
        return fn.layer_norm(x, x.shape[-1:], params[name + ".weight"], params[name + ".bias"], eps=1e-5)

    def attention(x: Any, name: str) -> Any:
        b, t, d = x.shape
        q, k, v = (linear(x, f"{name}.{n}").view(b, t, n_heads, d // n_heads).transpose(1, 2) for n in "qkv")
        s = (q @ k.transpose(-2, -1)) * (1.0 / (d // n_heads) ** 0.5)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        return linear(y.transpose(1, 2).reshape(b, t, d), f"{name}.proj")

    def loss(idx: Any, targets: Any) -> Any:
        x = fn.embedding(idx, params["tok_emb.weight"]) + params["pos_emb.weight"][: idx.shape[1]]
        for i in range(n_layers):
            x = x + attention(layer_norm(x, f"blocks.{i}.ln1"), f"blocks.{i}.attn")
            h = fn.gelu(linear(layer_norm(x, f"blocks.{i}.ln2"), f"blocks.{i}.mlp.fc"), approximate="tanh")
            x = x + linear(h, f"blocks.{i}.mlp.proj")
        logits = linear(layer_norm(x, "ln_f"), "head")
        return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return params, loss


def compare(size: str, repeats: int, torch: Any) -> float:
    d, heads, seq, batch = SIZES[size]
    model = GPT(VOCAB, seq, d, heads, LAYERS, seed=0, dtype=np.float32)
    opt = AdamW(model.parameters(), lr=LR)
    params, torch_loss = torch_gpt(model, torch)
    topt = torch.optim.AdamW(params.values(), lr=LR)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, VOCAB, size=(2, batch, seq))
    tidx, ttargets = torch.from_numpy(idx), torch.from_numpy(targets)

    def minipar_step() -> float:
        loss = model.loss(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def torch_step() -> float:
        loss = torch_loss(tidx, ttargets)
        topt.zero_grad()
        loss.backward()
        topt.step()
        return loss.item()

    first_mp, first_pt = minipar_step(), torch_step()  # also the warm-up
    if abs(first_mp - first_pt) > 1e-4:
        raise AssertionError(f"first-step losses differ: minipar {first_mp:.6f}, torch {first_pt:.6f}")
    t_mp, t_pt, cpu_mp, cpu_pt = [], [], [], []
    for i in range(repeats):  # alternate which side goes first, so neither always follows the other
        for step, times, cpu in ((minipar_step, t_mp, cpu_mp), (torch_step, t_pt, cpu_pt))[:: 1 if i % 2 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    last_mp, last_pt = minipar_step(), torch_step()
    a, b = float(np.median(t_mp)), float(np.median(t_pt))
    ca, cb = float(np.median(cpu_mp)), float(np.median(cpu_pt))
    print(f"GPT {size}: d_model {d}, {heads} heads, {LAYERS} layers, seq {seq}, batch {batch}, vocab {VOCAB}, "
          f"{model.num_parameters():,} parameters, float32, median of {repeats} steps")
    print(f"  minipar            : {a * 1e3:8.2f} ms/step (fastest {min(t_mp) * 1e3:.2f})")
    print(f"  PyTorch eager      : {b * 1e3:8.2f} ms/step (fastest {min(t_pt) * 1e3:.2f})")
    print(f"  ratio minipar/torch: {a / b:8.3f}x   (target <= 1.0x)")
    print(f"  CPU time per step  : minipar {ca * 1e3:.2f} ms, torch {cb * 1e3:.2f} ms, ratio {ca / cb:.3f}x "
          "(steadier than wall time on a busy machine)")
    print(f"  loss: first step {first_mp:.6f} vs {first_pt:.6f}; after {repeats + 2} steps "
          f"{last_mp:.6f} vs {last_pt:.6f}")
    return a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=[*SIZES, "both"], default="both")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: nothing to compare against (pip install -e .[bench]); skipping.")
        return
    torch.set_num_threads(1)
    for size in SIZES if args.size == "both" else [args.size]:
        compare(size, args.repeats, torch)


if __name__ == "__main__":
    main()
