"""3-D tensor parallelism (Bian et al. 2021): bytes each rank sends, parameters it holds.

Derivation, on a ``q x q x q`` cube, rank ``(b, k, n)``, for ``Linear3D`` on an input of ``B`` rows
(the product of its leading axes), ``K = in_features``, ``N = out_features``
(``minipar.parallel.tensor3d``). Every collective is a ring on ``q`` ranks, and a ring all-gather or
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
reduce-scatters the same two wholes in the opposite order, the same bytes.

Memory per rank: ``K N/q^3`` parameters, ``+ N/q^3`` with a bias (``linear3d_parameters``), and the
kept gathered ``X_bk`` and ``W_kn`` (``B K/q^2`` and ``K N/q^2``) for backward.
"""

from __future__ import annotations

from minipar.cost.collectives import ring_bytes


def linear3d_bytes(batch_rows: int, in_features: int, out_features: int, q: int, itemsize: int = 8,
                   input_grad: bool = True, bias: bool = False) -> dict[str, dict[str, int]]:
    """Bytes every rank sends in one ``Linear3D`` forward and backward, by phase and collective, from
    the ring formulas on the whole blocks gathered or scattered (module docstring)."""
    for name, n, by in (("batch_rows", batch_rows, q * q), ("in_features", in_features, q * q),
                        ("out_features", out_features, q ** 3 if bias else q)):
        if n % by:
            raise ValueError(f"{name}={n} is not a multiple of {by} (q={q})")
    x_block = batch_rows // q * in_features // q * itemsize  # X_bk, gathered along n
    w_block = in_features // q * out_features // q * itemsize  # W_kn, gathered along b
    y_block = batch_rows // q * out_features // q * itemsize  # Y_bn, reduce-scattered along k
    fwd = {"allgather": ring_bytes("allgather", x_block, q) + ring_bytes("allgather", w_block, q),
           "reduce_scatter": ring_bytes("reduce_scatter", y_block, q)}
    bwd = {"allgather": ring_bytes("allgather", y_block, q),
           "reduce_scatter": ring_bytes("reduce_scatter", w_block, q)
           + (ring_bytes("reduce_scatter", x_block, q) if input_grad else 0)}
    if bias:
        pair = ring_bytes("allgather", out_features // q ** 2 * itemsize, q) + ring_bytes(
            "allgather", out_features // q * itemsize, q)
        fwd["allgather"] += pair
        bwd["reduce_scatter"] += pair
    return {phase: {op: int(v) for op, v in d.items()} for phase, d in (("forward", fwd), ("backward", bwd))}


def linear3d_total_bytes(batch_rows: int, in_features: int, out_features: int, q: int, itemsize: int = 8) -> int:
    """The closed form per phase (forward, or backward with both gradients): ``(q-1)(BK + KN + BN)/q^3``
    numbers times ``itemsize``."""
    return (q - 1) * (batch_rows * in_features + in_features * out_features
                      + batch_rows * out_features) // q ** 3 * itemsize


def linear3d_parameters(in_features: int, out_features: int, q: int, bias: bool = False) -> int:
    """Numbers of a ``Linear3D`` held per rank: ``(in out + out) / q^3`` (``in out / q^3`` without bias)."""
    return (in_features * out_features + (out_features if bias else 0)) // q ** 3
