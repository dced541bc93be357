"""3-D tensor parallelism (Bian et al. 2021): bytes each rank sends, parameters and activations it holds.

Derivation, on a ``q x q x q`` cube, rank ``(b, k, n)``, for ``Linear3D`` on an input of ``B`` rows
(the product of its leading axes), ``K = in_features``, ``N = out_features``
(``minipar.parallel.tensor.tp3d``). Every collective is a ring on ``q`` ranks, and a ring all-gather or
reduce-scatter of a whole array of ``m`` bytes sends ``(q-1)/q m`` per rank
(``collectives.ring_bytes``), i.e. ``q - 1`` pieces of ``m/q``:

- forward: all-gather of ``X_bk`` (``B K/q^2`` numbers) along ``n``: ``(q-1) B K/q^3``; all-gather
  of ``W_kn`` (``K N/q^2``) along ``b``: ``(q-1) K N/q^3``; reduce-scatter of the partial ``Y_bn``
  (``B N/q^2``) along ``k``: ``(q-1) B N/q^3``.
- backward (both gradients): all-gather of ``dY_bn`` along ``k``: ``(q-1) B N/q^3``; reduce-scatter
  of the partial ``dX_bk`` along ``n``: ``(q-1) B K/q^3``; of the partial ``dW_kn`` along ``b``:
  ``(q-1) K N/q^3``.

So forward and backward each send **``(q-1)(B K + K N + B N)/q^3`` numbers per rank**, the same on
every rank, against a 2-D (SUMMA) linear's ``(q'-1)(B K + K N)/q'^2`` forward on ``q'^2`` ranks: with
``p`` ranks 3-D moves ``~(BK + KN + BN)/p^(2/3)`` and 2-D ``~(BK + KN)/p^(1/2)`` (the paper's Table 1
scaling). Without the input's gradient (a first layer), backward drops the ``dX`` reduce-scatter.

With a bias (``N/q^3`` entries per rank): forward all-gathers the piece along ``k`` (a whole of
``N/q^2``: ``(q-1) N/q^3``) and that along ``b`` (a whole of ``N/q``: ``(q-1) N/q^2``); backward
reduce-scatters the same two wholes in the opposite order, the same bytes (``plane_bytes``).

A transformer block (``Block3D``: ``B`` = batch x sequence rows, width ``d``, MLP width ``d_ff``):

- six ``Linear3D`` with biases and input gradients (``q, k, v, proj`` of ``d x d``, ``fc`` of
  ``d x d_ff``, ``proj`` of ``d_ff x d``; a layer on a swapped view moves the same bytes, on the
  other two axes). Per linear and phase three collectives, each moving ``(q-1)/q^3`` of one of the
  three whole matrices (the paper's count; Colossal-AI's documentation tabulates it as
  ``6(q-1)/q^3``, forward and backward together), except that ``q``, ``k`` and ``v`` share one
  gathered input and one reduce-scatter of its summed gradient (``GatherInput``, as a fused ``qkv``
  layer): per phase ``(q-1)/q^3 (8 B d + 2 B d_ff + 4 d^2 + 2 d d_ff)`` numbers for the products,
  ``16 B d + 12 d^2`` with ``d_ff = 4d``, plus ``(q-1)(5d + d_ff)(1/q^3 + 1/q^2)`` for the biases.
- two ``LayerNorm3D``: forward two ring all-reduces of ``B/q^2`` numbers (row sums for the mean,
  then the variance) along ``k``, ``2 (q-1)/q B/q^2`` each (``collectives.allreduce_bytes`` gives
  each rank's exact count when ``q`` does not divide ``B/q^2``), and the plane all-gathers of gain
  and shift (a bias's bytes, ``N = d``); backward the two statistics again, one all-reduce of
  ``2 B/q^2`` (the row sums of ``gain dY`` and ``gain dY xhat``) and the two plane reduce-scatters
  (``layernorm3d_bytes``).
- attention, GELU and the residual adds: no message (``Attention3D``: whole sequences, ``H/q`` heads
  per rank).

So the block sends ``~(q-1)/q^3 (16 B d + 12 d^2)`` numbers per phase per rank (``block3d_bytes``),
against Megatron's ``4 (t-1)/t B d`` per phase (two all-reduces): with ``p`` ranks the 3-D block moves
``~p^(-2/3)`` of the activations and the weights, Megatron ``~1`` of the activations and no weight.

Memory per rank (``block3d_parameters``, ``block3d_activation_bytes``): every parameter exactly
``1/q^3`` (weights ``K/q^2 x N/q``, biases and gains ``N/q^3``). Activations: the paper's ``1/q^3``
of every array the single-process block's graph holds (as ``memory.held_buffers`` counts them):
``10 B d + 2 B d_ff`` numbers (ln1's output, ``q``, ``k``, ``v``, the heads' output, attention's
``proj`` output, the first residual sum, ln2's output, ``fc``'s output and GELU's, the MLP's ``proj``
output, the block's output) and the softmax, ``b H s^2`` (``cost.tensor.layer_terms`` with ``t = 1``
plus the two ``proj`` outputs, which the residual adds' nodes hold). Each is a piece on the cube
(rows ``/q^2``, features or heads ``/q``). On top come the gathered buffers kept for backward,
counted exactly: each ``Matmul3D`` keeps its gathered ``X_bk`` (``B K/q^2``, ``q`` times its input
piece; ``q``, ``k`` and ``v`` share one) and ``W_kn`` (``K N/q^2``, ``q`` times the weight's piece),
each layer norm its gathered gain (``d/q``). These are ``(3 B d + B d_ff)/q^2`` input numbers,
``(4 d^2 + 2 d d_ff)/q^2`` weight numbers and ``2 d/q`` gain numbers per block: the gathered inputs
are ``q`` times the pieces the paper's ``1/q^3`` counts, the price of not gathering them again in
backward (Colossal-AI's ``linear_3d`` saves its gathered input too).
"""

from __future__ import annotations

from collections import Counter

from minipar.checks import index, wholes
from minipar.cost.collectives import allreduce_bytes, ring_bytes


def linear3d_bytes(batch_rows: int, in_features: int, out_features: int, q: int, itemsize: int = 8,
                   input_grad: bool = True, bias: bool = False,
                   shared_input: bool = False) -> dict[str, dict[str, int]]:
    """Bytes every rank sends in one ``Linear3D`` forward and backward, by phase and collective, from
    the ring formulas on the whole blocks gathered or scattered (module docstring). ``shared_input``:
    the input was gathered by another layer (``Linear3D.gathered``), which also reduce-scatters the
    summed gradient: neither is counted here."""
    wholes("linear3d_bytes", batch_rows=batch_rows, in_features=in_features, out_features=out_features, q=q,
           itemsize=itemsize)
    for name, n, by in (("batch_rows", batch_rows, q * q), ("in_features", in_features, q * q),
                        ("out_features", out_features, q ** 3 if bias else q)):
        if n % by:
            raise ValueError(f"linear3d_bytes: {name}={n} is not a multiple of {by} (q={q})")
    x_block = batch_rows // q * in_features // q * itemsize  # X_bk, gathered along n
    w_block = in_features // q * out_features // q * itemsize  # W_kn, gathered along b
    y_block = batch_rows // q * out_features // q * itemsize  # Y_bn, reduce-scattered along k
    x_bytes = 0 if shared_input else ring_bytes("allgather", x_block, q)  # the same either way
    fwd = {"allgather": x_bytes + ring_bytes("allgather", w_block, q),
           "reduce_scatter": ring_bytes("reduce_scatter", y_block, q)}
    bwd = {"allgather": ring_bytes("allgather", y_block, q),
           "reduce_scatter": ring_bytes("reduce_scatter", w_block, q) + (x_bytes if input_grad else 0)}
    if bias:
        fwd["allgather"] += plane_bytes(out_features, q, itemsize)
        bwd["reduce_scatter"] += plane_bytes(out_features, q, itemsize)
    return {phase: {op: int(v) for op, v in d.items()} for phase, d in (("forward", fwd), ("backward", bwd))}


def linear3d_total_bytes(batch_rows: int, in_features: int, out_features: int, q: int, itemsize: int = 8) -> int:
    """The closed form per phase (forward, or backward with both gradients): ``(q-1)(BK + KN + BN)/q^3``
    numbers times ``itemsize``."""
    wholes("linear3d_total_bytes", batch_rows=batch_rows, in_features=in_features, out_features=out_features, q=q,
           itemsize=itemsize)
    return (q - 1) * (batch_rows * in_features + in_features * out_features
                      + batch_rows * out_features) // q ** 3 * itemsize


def linear3d_parameters(in_features: int, out_features: int, q: int, bias: bool = False) -> int:
    """Numbers of a ``Linear3D`` held per rank: ``(in out + out) / q^3`` (``in out / q^3`` without bias)."""
    wholes("linear3d_parameters", in_features=in_features, out_features=out_features, q=q)
    return (in_features * out_features + (out_features if bias else 0)) // q ** 3


def plane_bytes(size: int, q: int, itemsize: int = 8) -> int:
    """Bytes a rank sends all-gathering (or reduce-scattering) the ``1/q^3`` pieces of a length-``size``
    vector over a plane of ``q^2`` ranks (a bias, a layer norm's gain): a ring along one axis on the
    whole of ``size/q^2``, then one along another on ``size/q``: ``(q-1)(size/q^3 + size/q^2)``."""
    wholes("plane_bytes", size=size, q=q, itemsize=itemsize)
    return int(ring_bytes("allgather", size // q ** 2 * itemsize, q) + ring_bytes("allgather", size // q * itemsize, q))


def layernorm3d_bytes(batch_rows: int, d: int, q: int, k: int, itemsize: int = 8) -> dict[str, Counter]:
    """Bytes rank ``(b, k, n)`` sends in one ``LayerNorm3D`` forward and backward, by collective: ring
    all-reduces of one number per local row along ``k`` (its rank there is ``k``), the gain's and the
    shift's plane gathers (module docstring)."""
    wholes("layernorm3d_bytes", batch_rows=batch_rows, d=d, q=q, itemsize=itemsize)
    index("layernorm3d_bytes", "k", k, q, "ranks along k")
    local = batch_rows // q ** 2
    stat = allreduce_bytes(local, itemsize, q, k, "ring")
    pair = 2 * plane_bytes(d, q, itemsize)
    return {"forward": Counter({"allreduce": 2 * stat, "allgather": pair}),
            "backward": Counter({"allreduce": 2 * stat + allreduce_bytes(2 * local, itemsize, q, k, "ring"),
                                 "reduce_scatter": pair})}


def block3d_linears(d: int, d_ff: int) -> list[tuple[int, int, bool]]:
    """``(in, out, shared_input)`` of the block's six linears: attention's ``q, k, v, proj`` (``k`` and
    ``v`` use ``q``'s gathered input), the MLP's ``fc, proj``."""
    wholes("block3d_linears", d=d, d_ff=d_ff)
    return [(d, d, False), (d, d, True), (d, d, True), (d, d, False), (d, d_ff, False), (d_ff, d, False)]


def block3d_bytes(batch_rows: int, d: int, d_ff: int, q: int, k: int, itemsize: int = 8) -> dict[str, Counter]:
    """Bytes rank ``(b, k, n)`` sends in one ``Block3D`` forward and backward, by collective: two layer
    norms and six linears with biases (module docstring)."""
    parts = [layernorm3d_bytes(batch_rows, d, q, k, itemsize)] * 2
    parts += [linear3d_bytes(batch_rows, fin, fout, q, itemsize, bias=True, shared_input=shared)
              for fin, fout, shared in block3d_linears(d, d_ff)]
    return {phase: sum((Counter(p[phase]) for p in parts), Counter()) for phase in ("forward", "backward")}


def block3d_parameters(d: int, d_ff: int, q: int) -> int:
    """Numbers of a ``Block3D`` held per rank: ``1/q^3`` of ``nn.Block``'s (two layer norms of ``2d``,
    six linears with biases)."""
    wholes("block3d_parameters", d=d, d_ff=d_ff, q=q)
    whole = 2 * 2 * d + sum(fin * fout + fout for fin, fout, _ in block3d_linears(d, d_ff))
    return whole // q ** 3


def block3d_activation_bytes(batch: int, seq: int, d: int, n_heads: int, d_ff: int, q: int,
                             itemsize: int = 8) -> dict[str, int]:
    """Activation bytes one ``Block3D`` keeps for backward per rank, by kind (module docstring):
    ``pieces`` (``1/q^3`` of the single-process block's), the gathered ``inputs`` and ``weights`` of the
    six ``Matmul3D`` and the layer norms' gathered ``gains``."""
    wholes("block3d_activation_bytes", batch=batch, seq=seq, d=d, n_heads=n_heads, d_ff=d_ff, q=q, itemsize=itemsize)
    rows, linears = batch * seq, block3d_linears(d, d_ff)
    whole = (10 * rows * d + 2 * rows * d_ff + batch * n_heads * seq * seq) * itemsize  # block_activations
    inputs = sum(rows * fin for fin, _, shared in linears if not shared)  # 3 B d + B d_ff
    return {"pieces": whole // q ** 3, "inputs": inputs // q ** 2 * itemsize,
            "weights": sum(fin * fout for fin, fout, _ in linears) // q ** 2 * itemsize,
            "gains": 2 * d // q * itemsize}
