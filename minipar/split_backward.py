"""Backward split in two: input gradients now, weight gradients later (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism", Sec. 2: the backward pass of a layer is two computations, the gradient with
respect to its input, which the previous stage is waiting for, and the gradient with respect to its
weights, which nobody waits for and can fill a bubble).

::

    later = WeightGradients(stage.parameters())
    out.backward(grad, weights=later)    # the paper's B (PyTorch's I): every gradient but the weights'
    ...                                  # send the input's gradient upstream, run other work
    later.run()                          # the paper's W: the weights' gradients, accumulated into .grad

During the first sweep, an op with a weight among its inputs computes only the gradients of its other
inputs (a ``Function`` is told through ``ctx.needs_input_grad``, as in PyTorch: ``F.linear`` then
skips the ``x^T g`` GEMM; an op whose only inputs are weights, like an embedding lookup, is not run
at all) and the sweep keeps the gradient flowing into it. ``run`` calls the same ops again for the
weights alone. Every weight gradient is the same sum of the same products as in one backward, so B
then W equals the ordinary backward exactly. Between the two, the graph nodes of those ops stay
alive (their saved inputs) and so do the kept output gradients: ``nbytes`` measures that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from minipar.autograd import Tensor


class WeightGradients:
    """The deferred weight-gradient work of one backward sweep (see the module docstring)."""

    def __init__(self, weights: Iterable[Tensor]) -> None:
        self.weights = {id(w): w for w in weights}
        self._work: list[tuple[Tensor, np.ndarray]] = []  # (node, the gradient of its output)
        self.done = False

    def defers(self, leaf: Tensor) -> bool:
        return id(leaf) in self.weights

    def split(self, node: Tensor, g: np.ndarray) -> Sequence[np.ndarray | None]:
        """``node``'s parent gradients for the first sweep: the deferred weights' left out (None)."""
        slots = [self.defers(p) for p in node._parents]
        if not any(slots):
            return node._backward(g)
        self._work.append((node, g))
        if all(slots):
            return [None] * len(slots)
        return self._call(node, g, [not s for s in slots])

    @staticmethod
    def _call(node: Tensor, g: np.ndarray, want: list[bool]) -> Sequence[np.ndarray | None]:
        """``node._backward(g)`` with only the parents in ``want`` asked for (a Function skips the rest)."""
        ctx = node._ctx
        if ctx is None:  # a primitive op computes every parent's gradient; keep the wanted ones
            return [pg if w else None for pg, w in zip(node._backward(g), want, strict=True)]
        before = ctx.needs_input_grad
        tensors = iter(want)  # needs_input_grad has a slot per forward argument, parents are the Tensors
        ctx.needs_input_grad = tuple(need and next(tensors) for need in before)
        try:
            return node._backward(g)
        finally:
            ctx.needs_input_grad = before

    def run(self) -> None:
        """W: every deferred weight's gradient, summed over the ops that used it, accumulated into its
        ``.grad`` (and its hooks fired) once. Frees the kept nodes and gradients."""
        if self.done:
            raise RuntimeError("WeightGradients.run() was already called for this backward")
        sums: dict[int, np.ndarray] = {}
        for node, g in self._work:
            want = [self.defers(p) for p in node._parents]
            for p, pg, w in zip(node._parents, self._call(node, g, want), want, strict=True):
                if w and pg is not None:
                    sums[id(p)] = pg if id(p) not in sums else sums[id(p)] + pg
        self._work, self.done = [], True
        for key, total in sums.items():
            self.weights[key]._accumulate(total, owned=False)

    def nbytes(self) -> int:
        """Bytes held until ``run``: the kept output gradients, the kept ops' outputs and what they
        saved (``memory.held_buffers``' rule: each buffer once, a view counts its base; the weights
        themselves excluded)."""
        weights = {id(_base(w.data)) for w in self.weights.values()}
        bufs: dict[int, int] = {}
        for node, g in self._work:
            ctx = node._ctx
            saved = (*ctx.saved, *vars(ctx).values()) if ctx is not None else ()
            for a in (g, node.data, *saved):
                if isinstance(a, np.ndarray) and id(_base(a)) not in weights:
                    bufs[id(_base(a))] = _base(a).nbytes
        return sum(bufs.values())


def _base(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a
