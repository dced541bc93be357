"""Whole-chain propagation: the placements of a chain of ops that send the fewest bytes over the whole
chain, by dynamic programming (``plan``), beside the one-op-ahead chooser every op uses (``greedy``).

The chooser of ``propagate.py`` decides each op alone, from its inputs' placements, and so can save
a little now for a lot later. ``X[S(1)] @ W[B]`` then gelu, X ``(32, 16)`` and W ``(16, 128)`` float64
on 2 ranks: the matmul's cheapest strategy slices W to rows (free) and leaves C partial (``S(1) x S(0)
-> P``); gelu needs C split or whole, so C (32,768 B, whole on each rank) is reduce-scattered: 16,384 B
per rank. Moving X to rows first (an all-to-all: each rank sends half of its 2,048 B piece, 1,024 B)
makes C rows with no message and gelu free.

A chain: a tensor ``x`` and ops ``f_1 .. f_n`` (``Link``), op ``i`` taking the previous op's output and
its own other inputs (a weight, a bias: their placements are given and may be moved too). A strategy
``r`` of op ``i`` (one rule per mesh axis, ``propagate.strategies``) fixes the placements every input
needs and the output's; ``c_i(s, r)`` is the bytes the busiest rank sends to move the inputs there,
the running tensor from the placements ``s`` (each input by ``plan.cheapest``, costed as the chooser
does). The chain costs ``sum_i c_i``: ops run one after another, each ending with its slowest rank
(plan.py's measure for the moves of one redistribution). ``c_i`` depends on the chain's past only
through ``s``, so with ``best_i(s)`` the least cost of the first ``i`` ops leaving the running tensor
placed ``s``::

    best_0(x.placements) = 0
    best_i(s') = min over s, and r of op i with output s', of  best_{i-1}(s) + c_i(s, r)
    cost = min over s of best_n(s)

is exact (Bellman's principle: an optimal chain's first ``i`` ops are an optimal way to reach their
output's placements). With ``final`` (the placements the next op needs, say a residual's whole
activation) the last line minimises ``best_n(s)`` plus the bytes of bringing the output from ``s``
there. Work: ``n`` ops x states x strategies, states at most ``(ndim + 2) ^ axes``.
Ties: the sum over the ops of the chosen strategy's index in the chooser's list (0: the greedy's
choice) is a second key, so the greedy's plan comes back whenever it is among the cheapest. Every rank
computes the same plan from the same layouts, with no message.

A tensor used by two ops (the residual ``x + f(x)``, attention's q, k and v of one input) makes the
problem a graph's: Alpa's intra-operator pass (Zheng et al. 2022, "Alpa: Automating Inter- and
Intra-Operator Parallelism for Distributed Deep Learning", Sec. 4) picks one strategy per op by an
integer linear program whose objective adds every edge's resharding cost, which is what this
dynamic program solves exactly when the graph is a path. The tiny GPT's MLP (``x @ W1 + b1``, gelu,
``@ W2 + b2``) is a chain; its whole forward, with residuals and three projections of one input, is not.

``run(x, links, chosen)`` executes a plan: each op's inputs are redistributed to the planned placements
(``ops.redistribute``: traced, differentiable), then the op runs and its own chooser finds them already
in place. Strategies needing the same inputs' placements are one to the op (it keeps the first in
rule order), so the plan keeps only that one of them. ``sent`` gives the bytes each rank sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minipar.mesh import MeshShape
from minipar.sharding import ops, propagate
from minipar.sharding.placement import Partial, Placement, describe
from minipar.sharding.plan import cheapest, plan_bytes
from minipar.sharding.tensor import GlobalTensor, check_layout

ARITY = {"matmul": 1, "add": 1, "sub": 1, "mul": 1, "gelu": 0, "exp": 0, "scale": 0, "softmax": 0}


@dataclass(frozen=True)
class Abstract:
    """A mesh known by its degrees alone: enough to plan, nothing to run."""

    shape: MeshShape


@dataclass(frozen=True, eq=False)
class Spec:
    """A tensor's layout without its values, what the chooser reads of a tensor (a planned intermediate
    is one; a ``GlobalTensor`` serves as well). ``mesh``: anything with a ``MeshShape`` as ``.shape``."""

    shape: tuple[int, ...]
    mesh: Any
    axes: tuple[str, ...]
    placements: tuple[Placement, ...]
    local: np.ndarray = field(default_factory=lambda: np.empty(0))  # its dtype's itemsize is read

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape.degrees()[a] for a in self.axes)

    def placed(self, shape: Sequence[int], placements: Sequence[Placement]) -> Spec:
        """A tensor of ``shape`` placed ``placements`` on this one's mesh, axes and dtype."""
        return Spec(tuple(shape), self.mesh, self.axes, tuple(placements), self.local)

    @classmethod
    def of(cls, t: Any) -> Spec:
        return cls(tuple(t.shape), t.mesh, tuple(t.axes), tuple(t.placements), np.empty(0, t.local.dtype))


@dataclass(frozen=True)
class Link:
    """One op of a chain (``ARITY`` names them): ``name`` of the running tensor and ``others`` (a
    ``GlobalTensor`` or ``Spec`` each: ``x @ W``, ``x + b``), ``arg`` the scale's number or softmax's axis."""

    name: str
    others: tuple[Any, ...] = ()
    arg: float = -1

    def __post_init__(self) -> None:
        if self.name not in ARITY:
            raise ValueError(f"chain: unknown op {self.name!r}; the ops are {sorted(ARITY)}")
        if len(self.others) != ARITY[self.name]:
            raise ValueError(f"chain: {self.name} takes the running tensor and {ARITY[self.name]} other "
                             f"input(s), got {len(self.others)}")

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output's shape for a running tensor of ``shape``; ``ValueError`` if they do not fit."""
        if self.name == "matmul":
            w = tuple(self.others[0].shape)
            if len(shape) < 2 or len(w) != 2 or shape[-1] != w[0]:
                raise ValueError(f"chain: matmul takes (..., m, k) @ (k, n), got {shape} @ {w}")
            return (*shape[:-1], w[1])
        if self.others:
            try:
                return tuple(int(n) for n in np.broadcast_shapes(shape, tuple(self.others[0].shape)))
            except ValueError:
                raise ValueError(f"chain: {self.name} of shapes {shape} and {tuple(self.others[0].shape)}: "
                                 "they do not broadcast") from None
        return shape

    def rules(self, x: Spec, out: tuple[int, ...]) -> list[tuple[tuple[Placement, ...], Placement]]:
        """The op's rules per mesh axis, as ``ops`` gives them for these shapes."""
        if self.name == "matmul":
            return propagate.matmul_rules(len(x.shape), 2)
        if self.others:
            return propagate.elementwise_rules(self.name, [x.shape, self.others[0].shape], out)
        if self.name == "softmax":
            return ops._along(x, int(self.arg) % len(x.shape), True)  # type: ignore[arg-type]
        return ops._per_dim(len(x.shape), [((Partial(),), Partial())] if self.name == "scale" else [])

    def apply(self, x: GlobalTensor, *others: GlobalTensor) -> GlobalTensor:
        """The op itself, on tensors already placed as planned."""
        if self.name == "matmul":
            return ops.matmul(x, others[0])
        if others:
            return ops.elementwise(self.name, x, others[0])
        if self.name == "scale":
            return ops.scale(x, self.arg)
        return ops.softmax(x, int(self.arg)) if self.name == "softmax" else ops.unary(self.name, x)


@dataclass(frozen=True)
class Choice:
    """One op's strategy: the placements of each input (the running tensor first), the output's, and
    the bytes the busiest rank sends to move the inputs there."""

    needed: tuple[tuple[Placement, ...], ...]
    placed: tuple[Placement, ...]
    cost: int

    def __str__(self) -> str:
        return f"{' x '.join(describe(p) for p in self.needed)} -> {describe(self.placed)} ({self.cost} B)"


@dataclass(frozen=True)
class ChainPlan:
    """A strategy per op, the placements the output is then brought to (``final``, if asked: what the
    next op needs) and that move's bytes; the chain's cost is the sum."""

    choices: tuple[Choice, ...]
    final: tuple[Placement, ...] | None = None
    final_cost: int = 0

    @property
    def total(self) -> int:
        return sum(c.cost for c in self.choices) + self.final_cost


def _shapes(x: Any, links: Sequence[Link], final: Sequence[Placement] | None = None) -> list[tuple[int, ...]]:
    """The running tensor's shape before each op and after the last; ``ValueError`` on a misfit or a
    ``final`` layout the output cannot have."""
    out = [tuple(x.shape)]
    for link in links:
        out.append(link.out_shape(out[-1]))
    if final is not None:
        check_layout(out[-1], x.axes, final)
    return out


def _moved(t: Any, dst: Sequence[Placement]) -> np.ndarray:
    """The bytes each rank sends to bring ``t`` to ``dst`` (the cheapest plan, the one ``redistribute`` runs)."""
    src, shape = tuple(t.placements), tuple(t.shape)
    moves = cheapest(shape, t.local.itemsize, t.degrees, src, tuple(dst))[0]
    return np.array(plan_bytes(shape, t.local.itemsize, t.degrees, src, moves), dtype=np.int64)


def options(link: Link, x: Spec, out: tuple[int, ...]) -> list[Choice]:
    """Op ``link``'s strategies from the running tensor ``x`` (its others as given), the chooser's
    order (cheapest first), one per distinct placements of the inputs (the first: the op's own pick)."""
    found = propagate.strategies([x, *link.others], out, link.rules(x, out))
    if not found:
        raise ValueError(f"chain: {link.name}: no placement of the output {out} is legal on this mesh")
    seen: set[tuple[tuple[Placement, ...], ...]] = set()
    kept = []
    for needed, placed, n in found:
        if needed not in seen:
            seen.add(needed)
            kept.append(Choice(needed, placed, int(n)))
    return kept


def greedy(x: Any, links: Sequence[Link], final: Sequence[Placement] | None = None) -> ChainPlan:
    """The ops' own choices, one op ahead: each the cheapest from where the previous left the tensor;
    then the output brought to ``final`` (if given)."""
    shapes, cur, chosen = _shapes(x, links, final), Spec.of(x), []
    for link, out in zip(links, shapes[1:], strict=True):
        chosen.append(options(link, cur, out)[0])
        cur = cur.placed(out, chosen[-1].placed)
    if final is None:
        return ChainPlan(tuple(chosen))
    return ChainPlan(tuple(chosen), tuple(final), int(_moved(cur, final).max()))


def plan(x: Any, links: Sequence[Link], final: Sequence[Placement] | None = None) -> ChainPlan:
    """The strategies of least total bytes over the whole chain, the output then brought to ``final``
    if given (module docstring's recurrence, with that move's bytes added at the end)."""
    shapes, start = _shapes(x, links, final), Spec.of(x)
    # best[s] = ((bytes, sum of indices), the choices so far) for the running tensor placed s
    best: dict[tuple[Placement, ...], tuple[tuple[int, int], tuple[Choice, ...]]] = {start.placements: ((0, 0), ())}
    for link, before, out in zip(links, shapes[:-1], shapes[1:], strict=True):
        nxt: dict[tuple[Placement, ...], tuple[tuple[int, int], tuple[Choice, ...]]] = {}
        for s, ((spent, rank), so_far) in best.items():
            for i, c in enumerate(options(link, start.placed(before, s), out)):
                key = (spent + c.cost, rank + i)
                if c.placed not in nxt or key < nxt[c.placed][0]:
                    nxt[c.placed] = (key, (*so_far, c))
        best = nxt
    if final is None:
        return ChainPlan(min(best.values(), key=lambda v: v[0])[1])
    last = {s: int(_moved(start.placed(shapes[-1], s), final).max()) for s in best}
    s = min(best, key=lambda s: (best[s][0][0] + last[s], best[s][0][1]))
    return ChainPlan(best[s][1], tuple(final), last[s])


def sent(x: Any, links: Sequence[Link], chosen: ChainPlan) -> tuple[int, ...]:
    """The bytes each rank sends running ``chosen``, one entry per combination of coordinates on the
    tensor's axes (``itertools.product`` order)."""
    shapes, cur = _shapes(x, links, chosen.final), Spec.of(x)
    total = np.zeros(int(np.prod(cur.degrees)), dtype=np.int64)
    for link, out, c in zip(links, shapes[1:], chosen.choices, strict=True):
        for t, pl in zip([cur, *link.others], c.needed, strict=True):
            total += _moved(t, pl)
        cur = cur.placed(out, c.placed)
    if chosen.final is not None:
        total += _moved(cur, chosen.final)
    return tuple(int(n) for n in total)


def run(x: GlobalTensor, links: Sequence[Link], chosen: ChainPlan) -> GlobalTensor:
    """The chain on ``x`` with ``chosen``'s strategies: inputs redistributed as planned, then each op;
    the output then brought to ``chosen.final`` (if the plan has one)."""
    if len(chosen.choices) != len(links):
        raise ValueError(f"chain: a plan of {len(chosen.choices)} ops for a chain of {len(links)}")
    for link, c in zip(links, chosen.choices, strict=True):
        moved = [ops.redistribute(t, pl, link.name) for t, pl in zip([x, *link.others], c.needed, strict=True)]
        x = link.apply(*moved)
        if x.placements != c.placed:
            raise AssertionError(f"chain: {link.name} gave {describe(x.placements)}, the plan {describe(c.placed)}")
    return x if chosen.final is None else ops.redistribute(x, chosen.final, "chain output")
