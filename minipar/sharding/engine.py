"""The backward pass on global tensors (``GlobalTensor.backward``): the graph ``autograd.record``
built, walked consumers first, each node's gradient reduced by ``autograd``'s rules and handed to its
backward closure, which is made of the same propagated ops as the forward (``ops``)."""

from __future__ import annotations

import numpy as np

from minipar.sharding import ops
from minipar.sharding.autograd import grad_placements, no_grad, reduced
from minipar.sharding.tensor import GlobalTensor


def _order(out: GlobalTensor) -> list[GlobalTensor]:
    """Every node behind ``out`` that requires a gradient, consumers before producers."""
    seen, post = set(), []
    stack: list[tuple[GlobalTensor, bool]] = [(out, False)]
    while stack:
        t, done = stack.pop()
        if done:
            post.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        stack.extend((p, False) for p in t.parents if p.requires_grad and id(p) not in seen)
    return post[::-1]


def backward(out: GlobalTensor, grad: GlobalTensor | None = None) -> None:
    """Accumulate ``d out / d leaf`` into every leaf's ``.grad``; ``grad`` defaults to ones (for a
    scalar loss), in ``out``'s placements with ``Partial`` read as ``Replicate``."""
    if not out.requires_grad:
        raise RuntimeError("backward: the tensor does not require a gradient (no input of its graph does)")
    if grad is None:
        seed = grad_placements(out)
        like = GlobalTensor.empty_like(out, seed)
        grad = GlobalTensor(np.ones_like(like.local), out.shape, out.mesh, out.axes, seed, check=False)
    if grad.shape != out.shape:
        raise ValueError(f"backward: gradient of shape {grad.shape} for a tensor of shape {out.shape}")
    grads: dict[int, GlobalTensor] = {id(out): grad}
    with no_grad():
        for t in _order(out):
            g = grads.pop(id(t), None)
            if g is None:
                continue
            if t.backward_fn is None:  # a leaf: its own placements; a copy (g may be another's, or the caller's)
                g = ops.redistribute(g if t.grad is None else ops.add(t.grad, g), grad_placements(t), "gradient")
                t.grad = GlobalTensor(g.local.copy(), g.shape, g.mesh, g.axes, g.placements, check=False)
                continue
            if not t.passes_gradient:
                g = ops.redistribute(g, reduced(t, g), "gradient")
            for p, gp in zip(t.parents, t.backward_fn(g), strict=True):
                if gp is None or not p.requires_grad:
                    continue
                if gp.shape != p.shape:
                    raise AssertionError(f"gradient of shape {gp.shape} for a parent of shape {p.shape}")
                grads[id(p)] = gp if id(p) not in grads else ops.add(grads[id(p)], gp)
