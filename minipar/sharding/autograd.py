"""Reverse-mode autograd on global tensors: every op's backward is itself made of global ops.

A ``GlobalTensor`` made by an op of ``minipar.sharding.ops`` from inputs that require gradients
remembers them and a closure mapping its gradient to theirs (micrograd's shape, as
``minipar.autograd``). A gradient is a global tensor of the same global shape, with placements of
its own: each backward closure calls the same propagated ops as the forward (``ops.matmul``,
``ops.sum``, ...), so the backward's placements and collectives are chosen by the same rules and
the same cost, and no backward is written twice (once per placement).

The placements that come out are OneFlow's duals (Yuan et al. 2021): for a matmul ``y = x W`` with
``x`` replicated (``B``) and ``W`` split by columns (``S(1)``), ``dx = dy W^T`` is ``S(1) x S(0)``, a
partial sum (``P``), with no message; the gradient of a ``P`` tensor must reach every piece whole
(``B``); a split stays split. The engine adds one rule, after DTensor's ``Redistribute.backward``
(which turns a partial gradient into the forward's placement at each redistribution): once a
tensor's gradient is complete (every consumer's part added), on every mesh axis where it is still a
partial sum it is reduced to the tensor's own placement there (``B`` for a replicated or partial
tensor: an all-reduce; ``S(i)`` for a split one: a reduce-scatter), before the tensor's own backward
runs; other axes keep the gradient's placement (a split gradient of a replicated tensor is not
gathered: the ops behind it work on any placement). So a replicated activation's partial gradient
is all-reduced where it is complete, once (Megatron's ``f`` in backward, and the layer norm before
it then sees a whole gradient, so its own gradients are whole), and a split tensor's partial
gradient is reduce-scattered (sequence parallelism's backward). A leaf's ``.grad`` takes the leaf's
own placements on every axis (``grad_placements``: ``Partial`` read as ``Replicate``, each piece's
derivative being the whole gradient), as DTensor gives a parameter's gradient the parameter's
placements: a replicated parameter's gradient is whole (DDP's all-reduce under data parallelism).
Redistributions are the exception: one is the identity on the global value, so its backward hands
the gradient on as it arrives and the tensor it came from applies the rule (a ``P`` gradient meeting
a split source is reduce-scattered, not all-reduced and then sliced).

Gradients reaching a tensor from several consumers are added with ``ops.add`` (propagated too).
Grad mode is per thread (ranks of the threads backend are threads): ``no_grad()``. This module holds
what the ops need to build the graph (``record``) and the placement rules; the pass itself, which
runs the ops, is ``engine.backward`` (``GlobalTensor.backward``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from minipar.sharding.placement import Partial, Replicate

if TYPE_CHECKING:
    from minipar.sharding.tensor import GlobalTensor

Backward = Callable[["GlobalTensor"], Sequence["GlobalTensor | None"]]
_mode = threading.local()


def grad_enabled() -> bool:
    return getattr(_mode, "enabled", True)


class no_grad:  # noqa: N801 - PyTorch's name
    """Ops inside build no graph (the backward closures run inside one)."""

    def __enter__(self) -> None:
        self.prev = grad_enabled()
        _mode.enabled = False

    def __exit__(self, *exc: object) -> None:
        _mode.enabled = self.prev


def record(out: GlobalTensor, parents: Sequence[GlobalTensor], backward: Backward) -> GlobalTensor:
    """Make ``out`` a node of the graph when grad mode is on and some parent requires a gradient;
    ``backward(grad_of_out)`` returns one gradient (or None) per parent."""
    if grad_enabled() and any(p.requires_grad for p in parents):
        out.requires_grad, out.parents, out.backward_fn = True, tuple(parents), backward
    return out


def grad_placements(t: GlobalTensor) -> tuple:
    """A leaf's gradient's placements: ``t``'s own, ``Partial`` replaced by ``Replicate``."""
    return whole_sums(t.placements)


def whole_sums(placements: Sequence) -> tuple:
    """``placements`` with every ``Partial`` made ``Replicate`` (the sum, whole on every rank)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def reduced(t: GlobalTensor, g: GlobalTensor) -> tuple:
    """``g``'s placements with each partial axis reduced to ``t``'s own placement there (module docstring)."""
    return tuple(want if isinstance(have, Partial) else have
                 for want, have in zip(whole_sums(t.placements), g.placements, strict=True))
