"""Activation memory, measured from the autograd graph.

What a stashed micro-batch (pipeline) or a transformer block's forward (tensor and sequence
parallelism) costs is the set of arrays its graph keeps alive for backward. These functions walk
that graph and count each underlying buffer once, so the memory the traces report is measured from
the arrays themselves, not from a formula.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minipar import autograd
from minipar.autograd import Tensor


def seq_mark() -> int:
    """A number above the ``_seq`` of every tensor made so far, below every later one's."""
    return next(autograd._seq)


def base_buffer(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (``a`` itself, or the base of the view it is)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def saved_arrays(ctx: Any) -> tuple[Any, ...]:
    """What a ``Function``'s context keeps for backward: ``save_for_backward``'s values and its
    attributes (None: a primitive op's node, whose closure is not counted)."""
    return (*ctx.saved, *vars(ctx).values()) if ctx is not None else ()


def held_buffers(root: Tensor, since: int = 0) -> dict[int, tuple[int, int]]:
    """Memory the graph behind ``root`` keeps for backward, measured: ``{id(buffer): (seq, nbytes)}``.

    Counts the arrays of non-leaf tensors made at or after ``since`` (a ``seq_mark``) and what a
    ``Function`` keeps (``ctx.save_for_backward`` and arrays set as ``ctx`` attributes), each buffer
    once, ``seq`` = its first tensor (a reshape or transpose is a view of its input, free; a view
    keeps its whole base alive). Skips buffers of leaves (parameters, inputs, constants) and of
    tensors made before ``since``, and arrays a primitive op's backward closure captures without a
    tensor holding them (``relu``'s mask, ``embedding``'s indices): the ops whose memory the tests hold
    against formulas (layer norm, GELU, attention, the parallel linears) are ``Function``s.
    Cost: one walk over the nodes made since ``since``.
    """
    own: dict[int, tuple[int, int]] = {}
    elsewhere, seen, stack = set(), {id(root)}, [root]
    while stack:
        node = stack.pop()
        if node.is_leaf or node._seq < since:
            elsewhere.add(id(base_buffer(node.data)))
            continue
        for buf in (base_buffer(a) for a in (node.data, *saved_arrays(node._ctx)) if isinstance(a, np.ndarray)):
            if id(buf) not in own or node._seq < own[id(buf)][0]:
                own[id(buf)] = (node._seq, buf.nbytes)
        for p in node._parents:
            if id(p) not in seen:
                seen.add(id(p))
                stack.append(p)
    return {k: v for k, v in own.items() if k not in elsewhere}


def activation_bytes(root: Tensor, since: int = 0) -> int:
    """Total bytes of ``held_buffers(root, since)``: the activation memory behind ``root``."""
    return sum(nbytes for _, nbytes in held_buffers(root, since).values())
