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

Activation bytes kept for backward, as measured (``memory.held_buffers``: every distinct buffer
the graph holds, views free; ``P = b (H/t) s^2 w`` one set of local attention scores, ``M = s b
d_ff w / t`` one local MLP hidden, ``S = A/t`` with sequence parallelism and ``A`` without). This
engine keeps every op's output until backward, so there are more terms than in Korthikanti et al.
Sec. 4.1 (which counts what PyTorch saves), and the same split: per block ``ln = 8 S`` (two
layer-norm outputs, two reduced row-parallel outputs, two bias sums, two residual sums: all on
the sequence shard) and ``tp = 2A + 8A/t + 4P + 3M`` (two row-parallel partial sums ``A``; q, k, v
before and after the bias ``6A/t``; scores, scaled, masked, softmax ``4P``; attention output
``A/t`` and its heads merged ``A/t``, a copy unless one local head or one position; fc before and
after the bias and gelu ``3M``), plus under sequence parallelism ``2A``: the gathered whole-sequence
inputs of the column-parallel linears. Without it ``f`` hands over the layer-norm output itself
(counted in ``ln``); with it the engine keeps the shard AND the gathered copy (Megatron keeps only
the shard and gathers again in backward). So sequence parallelism divides ``ln`` by exactly t and
adds exactly the gathered inputs to ``tp``. Around the blocks: ``ln`` + ``3 S`` (the embedding's
reduced output and position sum, the final layer norm's output), ``tp`` + ``2A`` (the embedding
rows and their masked copy, every position) + the head's gathered input ``A`` under sequence
parallelism; ``logits`` = logits and the loss's saved softmax ``2 s b V w / t``, its saved target
indices and mask ``s b (8 + 1)`` and the loss ``w``.
"""

from __future__ import annotations

from minipar.cost.collectives import ring_bytes as ring  # noqa: F401 - the lesson and notebook use formulas.ring


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
                     vocab: int, itemsize: int = 8, sequence_parallel: bool = False,
                     index_itemsize: int = 8) -> dict[str, int]:
    """Activation bytes held per rank after the forward pass, by memory-sample label (module
    docstring); ``index_itemsize`` = bytes of the targets' integer type (int64: 8)."""
    w, n = itemsize, seq * batch
    a, a_t = n * d * w, n * (d // t) * w
    s_ = a_t if sequence_parallel else a
    gathered = a if sequence_parallel else 0
    scores = batch * (n_heads // t) * seq * seq * w
    merged = a_t if n_heads // t > 1 and seq > 1 else 0  # numpy merges the heads by a view otherwise
    per_tp = 2 * gathered + 2 * a + 6 * a_t + 4 * scores + a_t + merged + 3 * n * (d_ff // t) * w
    return {"activations/ln": (8 * n_layers + 3) * s_,
            "activations/tp": n_layers * per_tp + 2 * a + gathered,
            "activations/logits": 2 * n * (vocab // t) * w + n * (index_itemsize + 1) + w}
