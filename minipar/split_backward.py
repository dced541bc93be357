"""Backward split in two: input gradients now, weight gradients later (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism", Sec. 2: the backward pass of a layer is two computations, the gradient with
respect to its input, which the previous stage is waiting for, and the gradient with respect to its
weights, which nobody waits for and can fill a bubble).

::

    later = WeightGradients(stage.parameters())
    out.backward(grad, weights=later)    # the paper's B (PyTorch's I): every gradient but the weights'
    ...                                  # send the input's gradient upstream, run other work
    later.run()                          # the paper's W: the weights' gradients, accumulated into .grad

During the first sweep, a ``Function`` with a weight among its inputs computes only the gradients of
its other inputs (it is told through ``ctx.needs_input_grad``, as in PyTorch: ``F.linear`` then
skips the ``x^T g`` GEMM; one whose other inputs need no gradient, like an embedding lookup, is not
run at all) and the sweep keeps it and the gradient flowing into it. A primitive op (``x * w``,
``x @ w`` written with operators) computes all its gradients at once: its weights' are kept from the
first sweep, so only ``Function``s move work into W. Frozen parameters (``requires_grad=False``)
are not deferred and get no gradient. ``run`` calls the same ops again for the
weights alone. Every weight gradient is the same sum of the same products as in one backward, so B
then W equals the ordinary backward exactly. Between the two only what those ops saved (their
inputs: ``x`` for ``x^T g``) and the kept output gradients stay alive, not the graph around them:
``nbytes`` measures that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from minipar.autograd import Context, Tensor
from minipar.memory import base_buffer, saved_arrays


class WeightGradients:
    """The deferred weight-gradient work of one backward sweep (see the module docstring)."""

    def __init__(self, weights: Iterable[Tensor]) -> None:
        weights = list(weights)
        inner = [w for w in weights if not w.is_leaf]
        if inner:
            raise ValueError(f"WeightGradients takes leaf tensors (parameters); got {len(inner)} computed tensors")
        self.weights = {id(w): w for w in weights if w.requires_grad}  # a frozen parameter gets no gradient
        # per kept op: its backward, its saved state, the weight at each parent slot (None: not a
        # weight) and the gradient of its output. Not the node itself: its parents would keep the
        # whole graph alive until W, where zero bubble frees all but what W needs.
        self._work: list[tuple[Callable, Context, list[Tensor | None], np.ndarray]] = []
        self._order: list[int | list[tuple[Tensor, np.ndarray | None]]] = []  # an index into _work, or the
        self.done = False  # weight gradients a primitive op computed in the first sweep, in the sweep's order

    def defers(self, leaf: Tensor) -> bool:
        return id(leaf) in self.weights

    def split(self, node: Tensor, g: np.ndarray) -> Sequence[np.ndarray | None]:
        """``node``'s parent gradients for the first sweep: the deferred weights' left out (None)."""
        slots = [p if self.defers(p) else None for p in node._parents]
        if all(w is None for w in slots):
            return node._backward(g)
        if node._ctx is None:  # a primitive op computes all its gradients at once, and its closure holds
            grads = node._backward(g)  # its inputs' graph: keep the weights' gradients, not the op
            self._order.append([(w, pg) for w, pg in zip(slots, grads, strict=True) if w is not None])
            return [None if w is not None else pg for w, pg in zip(slots, grads, strict=True)]
        self._order.append(len(self._work))
        self._work.append((node._backward, node._ctx, slots, g))
        if all(w is not None or not p.requires_grad for p, w in zip(node._parents, slots, strict=True)):
            return [None] * len(slots)  # nothing but weights needs a gradient: the op waits for W
        return _call(node._backward, node._ctx, g, [w is None for w in slots])

    def run(self) -> None:
        """W: every deferred weight's gradient, summed over the ops that used it, accumulated into its
        ``.grad`` (and its hooks fired) once. Frees the kept ops and gradients."""
        if self.done:
            raise RuntimeError("WeightGradients.run() was already called for this backward")
        sums: dict[int, np.ndarray | None] = {}
        for item in self._order:  # in the first sweep's order: the same sums as one backward, bit for bit
            if isinstance(item, int):
                backward, ctx, slots, g = self._work[item]
                want = [w is not None for w in slots]
                item = [(w, pg) for w, pg in zip(slots, _call(backward, ctx, g, want), strict=True) if w is not None]
            for w, pg in item:
                prev = sums.get(id(w))
                sums[id(w)] = pg if prev is None else prev if pg is None else prev + pg
        self._work, self._order, self.done = [], [], True
        for key, total in sums.items():  # an op that gave a weight no gradient gives it zeros, as backward does
            w = self.weights[key]
            w._accumulate(np.zeros_like(w.data) if total is None else total, owned=False)

    def nbytes(self) -> int:
        """Bytes held until ``run``: the kept output gradients and what the kept ops saved
        (``memory.held_buffers``' rule: each buffer once, a view counts its base; the weights
        themselves excluded)."""
        weights = {id(base_buffer(w.data)) for w in self.weights.values()}
        kept = [pg for item in self._order if not isinstance(item, int) for _, pg in item]
        kept += [a for _, ctx, _, g in self._work for a in (g, *saved_arrays(ctx))]
        bufs = {id(b): b.nbytes for b in (base_buffer(a) for a in kept if isinstance(a, np.ndarray))}
        return sum(n for key, n in bufs.items() if key not in weights)


def _call(backward: Callable, ctx: Context, g: np.ndarray, want: list[bool]) -> Sequence[np.ndarray | None]:
    """``backward(g)`` with only the parents in ``want`` asked for (a ``Function`` skips the rest)."""
    before = ctx.needs_input_grad
    mask = list(before)  # a slot per forward argument; parent k is argument ctx.tensor_slots[k]
    for k, arg in enumerate(ctx.tensor_slots):
        mask[arg] = before[arg] and want[k]
    ctx.needs_input_grad = tuple(mask)
    try:
        return backward(g)
    finally:
        ctx.needs_input_grad = before

