"""Activation recomputation: keep less for backward, compute it again there.

Full (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", Sec. 3; Megatron-LM's
``--recompute-granularity full``, Korthikanti et al. 2022 Sec. 5): ``checkpoint(fn, *inputs)``
runs a block's forward without building a graph and keeps only its inputs. Its backward runs the
forward again with a graph (the ``R`` span of the trace), sends the incoming gradient through it
(parameter gradients accumulate into ``.grad`` as in any backward) and returns the inputs'
gradients. A layer then keeps its input, ``sbh`` numbers (``sbh/t`` on a sequence shard), and one
layer's working set lives only while its backward runs. Tensor parallelism's collectives inside
the block run again in backward, as in Megatron: every rank recomputes the same blocks, so the
message order is the same on all of them.

Selective (Korthikanti et al. 2022 Sec. 5): keep everything but the attention core, recompute
softmax(QK^T) and its product with V in backward: ``functional.attention(..., keep_softmax=False)``;
the ``5as/(ht)`` term of a layer's activation memory goes.

The bytes each mode keeps are ``minipar.cost.tensor.layer_terms(..., recompute=)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minipar.autograd import Context, Function, Tensor, enable_grad
from minipar.checks import RECOMPUTE, one_of

__all__ = ["RECOMPUTE", "check_recompute", "checkpoint"]


def check_recompute(who: str, recompute: Any) -> str:
    """``recompute`` when it is one of ``RECOMPUTE``, else one line (raised before any message)."""
    one_of(who, "recompute", recompute, RECOMPUTE)
    return recompute


class _Checkpoint(Function):
    """``fn(*inputs)``, keeping only the inputs; backward recomputes ``fn`` with a graph (module docstring)."""

    @staticmethod
    def forward(ctx: Context, fn: Callable[..., Tensor], on_recompute: Callable[[Tensor], None] | None,
                args: dict | None, *arrays: np.ndarray) -> np.ndarray:
        ctx.save_for_backward(*arrays)
        ctx.fn, ctx.on_recompute, ctx.args = fn, on_recompute, args
        return fn(*(Tensor(a) for a in arrays)).data  # no graph: Function.apply runs forward in no_grad

    @staticmethod
    def backward(ctx: Context, g: np.ndarray) -> tuple[np.ndarray | None, ...]:
        from minipar import trace  # here: "import minipar" loads the engine alone (tests/test_layering.py)

        needs = ctx.needs_input_grad[3:]
        with enable_grad(), trace.span("R", args=ctx.args or {}):  # the extra forward
            inputs = [Tensor(a, requires_grad=need) for a, need in zip(ctx.saved, needs, strict=True)]
            out = ctx.fn(*inputs)
        if ctx.on_recompute is not None:
            ctx.on_recompute(out)
        if out.requires_grad:
            out.backward(g)
        return (None, None, None, *(x.grad if need else None for x, need in zip(inputs, needs, strict=True)))


def checkpoint(fn: Callable[..., Tensor], *inputs: Tensor, on_recompute: Callable[[Tensor], None] | None = None,
               args: dict | None = None) -> Tensor:
    """``fn(*inputs)`` under full recomputation: the graph keeps ``inputs`` and the output only.

    ``on_recompute(out)`` is called in backward with the recomputed output (its graph built), before
    the gradient goes through it (tensor parallelism measures the working set there); ``args`` go
    on the ``R`` span. ``fn`` must compute the same numbers each call (minipar has no dropout)."""
    return _Checkpoint.apply(fn, on_recompute, args, *inputs)
