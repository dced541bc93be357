"""2.5-D tensor parallelism (Wang et al. 2021, Tesseract): bytes each rank sends, memory it holds.

Derivation, on ``d`` stacked ``q x q`` grids, rank ``(k, i, j)`` (``minipar.parallel.tensor.tp2p5d``),
for a linear layer ``Y = X W`` with ``X`` of ``b`` rows (the product of its leading axes) and
``h_in`` features, ``W`` of ``h_in x h_out``, ``s`` bytes per number:

- In-layer (forward and backward). Layer ``k`` is a 2-D grid on ``b/d`` rows, so its traffic is
  ``tensor2d``'s (``minipar.cost.tensor2d``) with ``b/d`` for ``b``: SUMMA's ``q`` steps of binomial
  tree broadcasts (and, backward, reduces), every rank the root of one step, send ``(q-1)`` blocks of
  each matrix per rank: **forward ``(q-1)(|X_kij| + |W_ij|)``, backward ``2(q-1)(|X_kij| + |W_ij|)``**
  with ``|X_kij| = b h_in/(d q^2) s`` and ``|W_ij| = h_in h_out/q^2 s``; a bias all-gathers (forward)
  and reduce-scatters (backward) its ``h_out/q^2`` piece down the column, ``(q-1) h_out/q^2 s`` each;
  a layer norm all-reduces ``b/(d q)`` numbers per statistic along the row (``layernorm2d_bytes``).
  No activation crosses the depth.
- Depth (backward, once per step). Every parameter piece (``|W_ij|``, the bias piece, a layer norm's
  gain and shift pieces) is summed over the ``d`` ranks of its depth by a ring all-reduce: ``2(d-1)/d``
  of the piece per rank when ``d`` divides it (``collectives.allreduce_bytes`` counts the chunks
  exactly otherwise). ``depth_bytes`` adds them up parameter by parameter, as they are sent.

So a square linear (``h_in = h_out = h``, no bias) sends per rank, in numbers,
``3(q-1)(b h/(d q^2) + h^2/q^2)`` inside the layer plus ``2(d-1)/d h^2/q^2`` over the depth
(``linear_closed_form``). With ``b = h`` and the whole matrix as the unit the in-layer term is
``3(q-1)(d+1)/(d q^2)``. The paper's summary (as Colossal-AI's documentation of its 2.5-D mode, the
authors' implementation, tabulates it) gives bandwidth ``O(3(q-1)(d+1)/(d q))`` and latency
``O(6(q-1))``: the same ``3(q-1)(d+1)/d``, but over ``q`` where we have ``q^2``, and no depth term.
Where they differ, and why (our reading; the factors are exact): (1) the table's term is ``q`` times
ours because it is a time, not a per-rank byte count: SUMMA's ``q`` steps run one after another,
each bounded by its root sending its block to the other ``q - 1`` ranks of its row (or column),
``q(q-1)`` blocks on the critical path; we count the bytes one rank sends, and a rank is the root of
one step in ``q`` (``q - 1`` blocks per matrix, whatever the broadcast tree), the convention of
``minipar.cost.tensor2d``, so the 2-D and 2.5-D counts compare. (2) The table leaves out the depth
all-reduce of the weight gradients, once per step and, like data parallelism's, started from
backward's hooks (so it can overlap with backward); we count it (``phase="depth"``) because it is on
the wire. The latency ``6(q-1)`` matches six collectives per SUMMA step (two broadcasts forward; two
broadcasts and two reduces backward); a trace counts messages, not latencies.

Memory per rank: parameters ``1/q^2`` of the whole (``block2p5d_parameters``; every rank of a depth
holds the same piece, so the ``p = d q^2`` ranks hold ``d`` copies), activations kept for backward
``1/(d q^2)`` of the single process's (each kept array is a block: rows ``/(d q)``, features or
heads ``/q``), plus, per layer norm, its gathered gain (``d_model/q`` numbers; ``activation_bytes``).
"""

from __future__ import annotations

from collections import Counter

from minipar.checks import counts, index, whole, wholes
from minipar.cost.collectives import allreduce_bytes
from minipar.cost.tensor2d import block2d_bytes, layernorm2d_bytes, linear2d_bytes


def _rows(who: str, batch_rows: int, d: int, depth: int) -> int:
    """The rows of one layer of the ``d`` stacked grids (``depth`` one of them)."""
    wholes(who, batch_rows=batch_rows, d=d)
    index(who, "depth", depth, d, "layers of the depth d")
    if batch_rows % d:
        raise ValueError(f"{who}: batch_rows={batch_rows} is not a multiple of the depth d={d}")
    return batch_rows // d


def depth_bytes(pieces: list[int], d: int, k: int, itemsize: int = 8) -> int:
    """Bytes depth rank ``k`` sends summing parameter pieces of ``pieces`` numbers each over ``d``
    ranks, one ring all-reduce per piece (``DepthAllReduce``)."""
    counts("depth_bytes", "pieces", pieces)
    index("depth_bytes", "k", k, whole("depth_bytes", "d", d), "ranks along the depth")
    return sum(allreduce_bytes(n, itemsize, d, k, "ring") for n in pieces)


def _depth(pieces: list[int], d: int, k: int, itemsize: int) -> Counter:
    sums = depth_bytes(pieces, d, k, itemsize)
    return Counter({"allreduce": sums} if sums else {})


def linear_pieces(in_features: int, out_features: int, q: int, bias: bool = True) -> list[int]:
    """Numbers per rank of a 2.5-D linear's parameters: ``W_ij`` (``in out/q^2``) and the bias piece
    (``out/q^2``)."""
    wholes("linear_pieces", in_features=in_features, out_features=out_features, q=q)
    return [in_features * out_features // (q * q)] + ([out_features // (q * q)] if bias else [])


def block_pieces(d_model: int, d_ff: int, q: int) -> list[int]:
    """Numbers per rank of each parameter of a 2.5-D transformer block, in ``nn.Block``'s order."""
    wholes("block_pieces", d_model=d_model, d_ff=d_ff, q=q)
    norm = [d_model // (q * q)] * 2
    return (norm + linear_pieces(d_model, d_model, q) * 4 + norm + linear_pieces(d_model, d_ff, q)
            + linear_pieces(d_ff, d_model, q))


def linear2p5d_bytes(batch_rows: int, in_features: int, out_features: int, q: int, d: int, row: int, col: int,
                     depth: int, itemsize: int = 8, bias: bool = True) -> dict[str, Counter]:
    """Bytes rank ``(depth, row, col)`` sends in one ``Linear2p5D`` forward and backward: ``forward``
    and ``backward`` inside its layer (``tensor2d.linear2d_bytes`` on ``batch_rows / d`` rows) and
    ``depth``, the gradient all-reduces (module docstring). ``batch_rows``: the whole activation's."""
    rows = _rows("linear2p5d_bytes", batch_rows, d, depth)
    inner = linear2d_bytes(rows, in_features, out_features, q, row, col, itemsize, bias)
    return {"forward": Counter(inner["forward"]), "backward": Counter(inner["backward"]),
            "depth": _depth(linear_pieces(in_features, out_features, q, bias), d, depth, itemsize)}


def layernorm2p5d_bytes(batch_rows: int, d_model: int, q: int, d: int, row: int, col: int, depth: int,
                        itemsize: int = 8) -> dict[str, Counter]:
    """Bytes rank ``(depth, row, col)`` sends in one ``LayerNorm2p5D`` forward and backward, by phase
    (``tensor2d.layernorm2d_bytes`` on ``batch_rows / d`` rows; ``depth``: gain and shift pieces)."""
    inner = layernorm2d_bytes(_rows("layernorm2p5d_bytes", batch_rows, d, depth), d_model, q, row, col, itemsize)
    return {**inner, "depth": _depth([d_model // (q * q)] * 2, d, depth, itemsize)}


def block2p5d_bytes(batch_rows: int, d_model: int, d_ff: int, q: int, d: int, row: int, col: int, depth: int,
                    itemsize: int = 8) -> dict[str, Counter]:
    """Bytes rank ``(depth, row, col)`` sends in one ``Block2p5D`` forward and backward, by phase
    (``forward``, ``backward`` in the layer; ``depth``) and collective."""
    inner = block2d_bytes(_rows("block2p5d_bytes", batch_rows, d, depth), d_model, d_ff, q, row, col, itemsize)
    return {**inner, "depth": _depth(block_pieces(d_model, d_ff, q), d, depth, itemsize)}


def linear_closed_form(b: int, h: int, q: int, d: int) -> dict[str, float]:
    """Numbers each rank sends for a square linear without bias, ``b`` rows, ``h x h`` weight, when
    every division is exact: ``layer`` ``3(q-1)(b h/(d q^2) + h^2/q^2)`` (forward + backward),
    ``depth`` ``2(d-1)/d h^2/q^2`` (module docstring)."""
    wholes("linear_closed_form", b=b, h=h, q=q, d=d)
    return {"layer": 3 * (q - 1) * (b * h / (d * q * q) + h * h / (q * q)),
            "depth": 2 * (d - 1) / d * h * h / (q * q)}


def paper_bandwidth(q: int, d: int) -> float:
    """The paper's per-layer bandwidth term ``3(q-1)(d+1)/(d q)`` (whole matrices as the unit, ``b = h``),
    as Colossal-AI's 2.5-D documentation gives it; ``q`` times ``linear_closed_form``'s ``layer`` term
    in those units (module docstring: why)."""
    wholes("paper_bandwidth", q=q, d=d)
    return 3 * (q - 1) * (d + 1) / (d * q)


def block2p5d_parameters(d_model: int, d_ff: int, q: int) -> int:
    """Numbers of a ``Block2p5D`` held per rank: ``1/q^2`` of ``nn.Block``'s, whatever the depth."""
    return sum(block_pieces(d_model, d_ff, q))


def activation_bytes(whole: int, q: int, d: int, layer_norms: int = 0, d_model: int = 0, itemsize: int = 8) -> int:
    """Activation bytes a rank keeps for backward: ``1/(d q^2)`` of the single process's ``whole``,
    plus each of ``layer_norms`` layer norms' gathered gain (``d_model/q`` numbers)."""
    wholes("activation_bytes", 0, whole=whole, layer_norms=layer_norms, d_model=d_model)
    wholes("activation_bytes", q=q, d=d, itemsize=itemsize)
    if whole % (d * q * q):
        raise ValueError(f"activation_bytes: whole={whole} activation bytes do not split d q^2 = {d * q * q} ways")
    return whole // (d * q * q) + layer_norms * d_model // q * itemsize
