"""2-D tensor parallelism (Xu et al. 2021, Optimus; SUMMA): bytes each rank sends, parameters it holds.

Derivation, on a ``q x q`` grid, rank ``(i, j)`` (``minipar.parallel.tensor.tp2d``):

- SUMMA ``C = A B`` runs ``q`` steps; at step ``t`` rank ``(i, t)`` broadcasts ``A_it`` along row
  ``i`` and rank ``(t, j)`` broadcasts ``B_tj`` down column ``j``. In a binomial-tree broadcast on
  ``q`` ranks (``collectives.tree_broadcast_bytes``) rank ``v`` (relative to the root) sends one
  message per child; the ``q - 1`` non-roots each have one parent, so one broadcast sends ``q - 1``
  messages in all. Over the ``q`` steps the root runs through every member of the row, so rank
  ``(i, j)`` plays every relative position once and sends ``(q-1)|A_ij|`` along its row and
  ``(q-1)|B_ij|`` down its column: **forward ``(q-1)(|A_ij| + |B_ij|)``**, the same on every rank.
- Backward, ``dA = dC B^T``: ``q`` column broadcasts of ``B`` blocks and ``q`` row reduces of
  ``A``-sized partial sums; ``dB = A^T dC``: ``q`` row broadcasts of ``A`` blocks and ``q`` column
  reduces of ``B``-sized partial sums. In a binomial-tree reduce every rank but the root sends its
  partial result once (``tree_reduce_bytes``), so over the ``q`` roots a rank sends ``q - 1``
  blocks: **backward ``2(q-1)(|A_ij| + |B_ij|)``** (half broadcast, half reduce).
- The bias of ``Linear2D`` (``out/q^2`` entries per rank) is all-gathered down the column forward
  and its gradient reduce-scattered backward, both rings of ``q`` pieces: ``(q-1) out/q^2`` entries
  each.

So a ``Linear2D`` on a ``b x in`` activation with ``q x q`` ranks sends per rank, with ``s`` bytes per
number, ``3(q-1)(b in + in out)/q^2 s`` for the products, about ``3/q`` of the whole input and
weight (a Megatron linear moves no weight but all-reduces ``2(t-1)/t`` of a whole activation), plus
``2(q-1) out/q^2 s`` for the bias. ``linear2d_bytes`` gives each rank's bytes by collective
from the per-root definitions above, ``summa_bytes`` the closed forms.

A layer norm on the grid (``LayerNorm2D``) all-reduces along the grid row one number per local row
for the mean and one for the variance (ring, ``collectives.allreduce_bytes``); backward recomputes
both and all-reduces two more; its gain and shift move like a bias. ``block2d_bytes`` adds up a
transformer block: two layer norms and six ``Linear2D`` (q, k, v, proj, fc, proj); attention, GELU
and the residual adds are local.

Memory per rank: ``1/q^2`` of every parameter (``linear2d_parameters``) and of every activation the
single-process layer keeps for backward (each kept array is a block: batch rows ``/q``, features or
heads ``/q``), plus, per layer norm, its gathered gain (``d/q`` numbers) for the backward.
"""

from __future__ import annotations

from collections import Counter

from minipar.checks import index, wholes
from minipar.cost.collectives import allreduce_bytes, tree_broadcast_bytes


def _grid(who: str, q: int, row: int, col: int) -> None:
    """``(row, col)`` is a rank of the ``q x q`` grid."""
    index(who, "row", row, q, "rows of the q x q grid")
    index(who, "col", col, q, "columns of the q x q grid")


def tree_reduce_bytes(nbytes: int, p: int, rank: int, root: int = 0) -> int:
    """Bytes ``rank`` sends in a binomial-tree reduce of ``nbytes`` to ``root`` on ``p`` ranks: every
    rank but the root sends its partial result once, to its parent."""
    wholes("tree_reduce_bytes", 0, nbytes=nbytes)
    wholes("tree_reduce_bytes", p=p)
    index("tree_reduce_bytes", "rank", rank, p, "ranks")
    index("tree_reduce_bytes", "root", root, p, "ranks")
    return 0 if p == 1 or (rank - root) % p == 0 else nbytes


def summa_bytes(a_bytes: int, b_bytes: int, q: int) -> dict[str, int]:
    """Closed forms per rank for one SUMMA ``C = A B`` with blocks of ``a_bytes`` and ``b_bytes``:
    ``forward`` ``(q-1)(a + b)`` (broadcasts), ``backward`` ``2(q-1)(a + b)`` (broadcasts and reduces)."""
    wholes("summa_bytes", 0, a_bytes=a_bytes, b_bytes=b_bytes)
    wholes("summa_bytes", q=q)
    return {"forward": (q - 1) * (a_bytes + b_bytes), "backward": 2 * (q - 1) * (a_bytes + b_bytes)}


def linear2d_bytes(batch_rows: int, in_features: int, out_features: int, q: int, row: int, col: int,
                   itemsize: int = 8, bias: bool = True) -> dict[str, dict[str, int]]:
    """Bytes rank ``(row, col)`` sends in one ``Linear2D`` forward and backward (input and weight
    gradients both computed), by phase and collective, summed over SUMMA's ``q`` steps root by root.
    ``batch_rows``: rows of the whole activation (the product of its leading axes)."""
    wholes("linear2d_bytes", batch_rows=batch_rows, in_features=in_features, out_features=out_features, q=q,
           itemsize=itemsize)
    _grid("linear2d_bytes", q, row, col)
    for name, n in (("batch_rows", batch_rows), ("in_features", in_features), ("out_features", out_features)):
        if n % q:
            raise ValueError(f"linear2d_bytes: {name}={n} is not a multiple of q={q}")
    a = batch_rows // q * in_features // q * itemsize  # this rank's input block A_ij
    w = in_features // q * out_features // q * itemsize  # its weight block W_ij
    roots = range(q)
    fwd = {"broadcast": sum(tree_broadcast_bytes(a, q, col, t) + tree_broadcast_bytes(w, q, row, t) for t in roots)}
    bwd = {"broadcast": sum(tree_broadcast_bytes(w, q, row, t) + tree_broadcast_bytes(a, q, col, t) for t in roots),
           "reduce": sum(tree_reduce_bytes(a, q, col, t) + tree_reduce_bytes(w, q, row, t) for t in roots)}
    if bias:
        piece = out_features // (q * q) * itemsize
        fwd["allgather"] = (q - 1) * piece  # ring: each rank forwards q-1 pieces
        bwd["reduce_scatter"] = (q - 1) * piece
    return {"forward": fwd, "backward": bwd}


def linear2d_parameters(in_features: int, out_features: int, q: int, bias: bool = True) -> int:
    """Numbers of a ``Linear2D`` held per rank: ``(in out + out) / q^2`` (``in out / q^2`` without bias)."""
    wholes("linear2d_parameters", in_features=in_features, out_features=out_features, q=q)
    return (in_features * out_features + (out_features if bias else 0)) // (q * q)


def layernorm2d_bytes(batch_rows: int, d: int, q: int, row: int, col: int, itemsize: int = 8) -> dict[str, Counter]:
    """Bytes rank ``(row, col)`` sends in one ``LayerNorm2D`` forward and backward, by collective."""
    wholes("layernorm2d_bytes", batch_rows=batch_rows, d=d, q=q, itemsize=itemsize)
    _grid("layernorm2d_bytes", q, row, col)
    local = batch_rows // q
    stat = allreduce_bytes(local, itemsize, q, col, "ring")
    piece = (q - 1) * (d // (q * q)) * itemsize
    return {"forward": Counter({"allreduce": 2 * stat, "allgather": 2 * piece}),
            "backward": Counter({"allreduce": 2 * stat + allreduce_bytes(2 * local, itemsize, q, col, "ring"),
                                 "reduce_scatter": 2 * piece})}


def block2d_bytes(batch_rows: int, d: int, d_ff: int, q: int, row: int, col: int,
                  itemsize: int = 8) -> dict[str, Counter]:
    """Bytes rank ``(row, col)`` sends in one ``Block2D`` forward and backward, by collective."""
    parts = [layernorm2d_bytes(batch_rows, d, q, row, col, itemsize)] * 2
    parts += [linear2d_bytes(batch_rows, fin, fout, q, row, col, itemsize)
              for fin, fout in [(d, d)] * 4 + [(d, d_ff), (d_ff, d)]]
    return {phase: sum((Counter(p[phase]) for p in parts), Counter()) for phase in ("forward", "backward")}
