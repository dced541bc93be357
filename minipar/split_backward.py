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
then W equals the ordinary backward exactly. Between the two only what those ops saved (their
inputs: ``x`` for ``x^T g``) and the kept output gradients stay alive, not the graph around them:
``nbytes`` measures that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from minipar.autograd import Context, Tensor


class WeightGradients:
    """The deferred weight-gradient work of one backward sweep (see the module docstring)."""

    def __init__(self, weights: Iterable[Tensor]) -> None:
        self.weights = {id(w): w for w in weights}
        # per kept op: its backward, its saved state, the weight at each parent slot (None: not a
        # weight) and the gradient of its output. Not the node itself: its parents would keep the
        # whole graph alive until W, where zero bubble frees all but what W needs.
        self._work: list[tuple[Callable, Context | None, list[Tensor | None], np.ndarray]] = []
        self.done = False

    def defers(self, leaf: Tensor) -> bool:
        return id(leaf) in self.weights

    def split(self, node: Tensor, g: np.ndarray) -> Sequence[np.ndarray | None]:
        """``node``'s parent gradients for the first sweep: the deferred weights' left out (None)."""
        slots = [p if self.defers(p) else None for p in node._parents]
        if all(w is None for w in slots):
            return node._backward(g)
        self._work.append((node._backward, node._ctx, slots, g))
        if all(w is not None for w in slots):
            return [None] * len(slots)
        return _call(node._backward, node._ctx, g, [w is None for w in slots])

    def run(self) -> None:
        """W: every deferred weight's gradient, summed over the ops that used it, accumulated into its
        ``.grad`` (and its hooks fired) once. Frees the kept ops and gradients."""
        if self.done:
            raise RuntimeError("WeightGradients.run() was already called for this backward")
        sums: dict[int, np.ndarray] = {}
        for backward, ctx, slots, g in self._work:
            for w, pg in zip(slots, _call(backward, ctx, g, [w is not None for w in slots]), strict=True):
                if w is not None and pg is not None:
                    sums[id(w)] = pg if id(w) not in sums else sums[id(w)] + pg
        self._work, self.done = [], True
        for key, total in sums.items():
            self.weights[key]._accumulate(total, owned=False)

    def nbytes(self) -> int:
        """Bytes held until ``run``: the kept output gradients and what the kept ops saved
        (``memory.held_buffers``' rule: each buffer once, a view counts its base; the weights
        themselves excluded)."""
        weights = {id(_base(w.data)) for w in self.weights.values()}
        bufs: dict[int, int] = {}
        for _, ctx, _, g in self._work:
            saved = (*ctx.saved, *vars(ctx).values()) if ctx is not None else ()
            for a in (g, *saved):
                if isinstance(a, np.ndarray) and id(_base(a)) not in weights:
                    bufs[id(_base(a))] = _base(a).nbytes
        return sum(bufs.values())


def _call(backward: Callable, ctx: Context | None, g: np.ndarray, want: list[bool]) -> Sequence[np.ndarray | None]:
    """``backward(g)`` with only the parents in ``want`` asked for (a ``Function`` skips the rest)."""
    if ctx is None:  # a primitive op computes every parent's gradient; keep the wanted ones
        return [pg if w else None for pg, w in zip(backward(g), want, strict=True)]
    before = ctx.needs_input_grad
    mask = list(before)  # a slot per forward argument; parent k is argument ctx.tensor_slots[k]
    for k, arg in enumerate(ctx.tensor_slots):
        mask[arg] = before[arg] and want[k]
    ctx.needs_input_grad = tuple(mask)
    try:
        return backward(g)
    finally:
        ctx.needs_input_grad = before


def _base(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a
