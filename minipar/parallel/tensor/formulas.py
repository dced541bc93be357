"""What a tensor-parallel training step should cost: collectives, bytes per rank, activation bytes.

The measurements in the tests and in lesson 04 are held against these numbers. ``t`` ranks,
tokens ``(batch b, seq s)``, width ``d``, ``H`` heads, MLP width ``d_ff``, ``L`` blocks, vocabulary
``V``, ``w`` bytes per number. ``A = s b d w`` is one activation of the residual stream.

Collectives (Shoeybi et al. 2019 Sec. 3; Korthikanti et al. 2022 Sec. 4.2.2), ring algorithms:
- per block without sequence parallelism: 2 all-reduces of ``A`` forward (``g`` after attention and
  after the MLP) and 2 backward (``f`` before them); each sends ``2 (t-1)/t A`` per rank.
- with it: 2 all-gathers + 2 reduce-scatters forward and the same backward; each sends
  ``(t-1)/t A``: the same total bytes as the all-reduces they replace.
- around the blocks: the embedding (``g`` / reduce-scatter forward), the head's input (``f`` /
  all-gather), the loss (3 all-reduces of ``s b`` numbers: max, sum of exponentials, target logit)
  and, with sequence parallelism, one all-reduce of the replicated parameters' gradients.

Activation bytes kept for backward (Korthikanti et al. Sec. 4.1's accounting, no dropout): per block
``ln`` = the two layer-norm inputs, ``2 A`` (``2 A / t`` with sequence parallelism) and ``tp`` =
q/k/v input ``A``, q, k, v ``3 A/t``, softmax ``b (H/t) s^2 w``, proj input ``A/t``, fc input ``A``,
gelu in and out ``2 s b d_ff w / t``. The whole-sequence inputs of the column-parallel linears are
kept as gathered (Megatron instead keeps the shard and gathers again in backward). Around the
blocks: ``ln`` + the final layer norm's input, ``tp`` + the head's input ``A``, ``logits``
= logits and softmax ``2 s b V w / t``.
"""

from __future__ import annotations


def ring(op: str, nbytes: float, t: int) -> float:
    """Bytes one rank sends in a ring ``op`` on ``t`` ranks; ``nbytes`` = the (full) array's size."""
    if op == "allreduce":
        return 2 * (t - 1) / t * nbytes
    if op in ("allgather", "reduce_scatter"):
        return (t - 1) / t * nbytes
    raise ValueError(f"no ring formula for {op!r}")


def collectives_per_block(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """Calls per transformer block by phase: ``{"forward": {op: n}, "backward": {op: n}}``."""
    if sequence_parallel:
        both = {"allgather": 2, "reduce_scatter": 2}
        return {"forward": dict(both), "backward": dict(both)}
    return {"forward": {"allreduce": 2}, "backward": {"allreduce": 2}}


def sequence_parallel_params(seq_len: int, d: int, n_layers: int) -> int:
    """Numbers in the gradients ``sync_grads`` all-reduces: 2 layer norms and 2 proj biases per
    block (6 d), the final layer norm (2 d), the position embedding (seq_len d)."""
    return n_layers * 6 * d + 2 * d + seq_len * d


def expected_bytes(t: int, batch: int, seq: int, d: int, n_layers: int, itemsize: int = 8,
                   sequence_parallel: bool = False, seq_len: int | None = None) -> dict[str, float]:
    """Bytes each rank sends in one training step (forward, backward, ``sync_grads``), by op."""
    a = seq * batch * d * itemsize
    loss = 3 * ring("allreduce", seq * batch * itemsize, t)
    calls = 4 * n_layers + 2  # blocks (2 forward, 2 backward), embedding, head input
    if not sequence_parallel:
        return {"allreduce": calls * ring("allreduce", a, t) + loss}
    grads = sequence_parallel_params(seq_len or seq, d, n_layers) * itemsize
    return {"allgather": calls * ring("allgather", a, t),
            "reduce_scatter": calls * ring("reduce_scatter", a, t),
            "allreduce": loss + ring("allreduce", grads, t)}


def block_bytes(t: int, batch: int, seq: int, d: int, itemsize: int = 8,
                sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes each rank sends for one block, forward plus backward, by op."""
    a = seq * batch * d * itemsize
    if sequence_parallel:
        return {"allgather": 4 * ring("allgather", a, t), "reduce_scatter": 4 * ring("reduce_scatter", a, t)}
    return {"allreduce": 4 * ring("allreduce", a, t)}


def activation_bytes(t: int, batch: int, seq: int, d: int, n_heads: int, d_ff: int, n_layers: int,
                     vocab: int, itemsize: int = 8, sequence_parallel: bool = False) -> dict[str, int]:
    """Peak activation bytes held per rank after the forward pass, by memory-sample label."""
    a = seq * batch * d * itemsize
    shard = a // t if sequence_parallel else a
    per_ln = 2 * shard
    per_tp = a + 3 * a // t + batch * (n_heads // t) * seq * seq * itemsize + a // t \
        + a + 2 * seq * batch * (d_ff // t) * itemsize
    return {"activations/ln": n_layers * per_ln + shard,
            "activations/tp": n_layers * per_tp + a,
            "activations/logits": 2 * seq * batch * (vocab // t) * itemsize}
