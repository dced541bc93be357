"""Tensor parallelism: Megatron-LM (Shoeybi et al. 2019) with sequence parallelism (Korthikanti et
al. 2022) and the vocabulary-parallel embedding and cross-entropy.

- ``comm_ops.py``: the exit operators ``g`` and ``sp_reduce_scatter`` (Korthikanti et al.'s
  ``g-bar``) as autograd ``Function``s; the activation meter.
- ``layers.py``: ``ColumnParallelMatmul`` (``f`` or the sequence all-gather fused with the
  column-parallel linear, re-gathering in backward), ``RowParallelMatmul`` (row-parallel linear,
  ``g`` or the reduce-scatter, bias and residual add); ``ColumnParallelLinear``,
  ``RowParallelLinear``, ``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``;
  ``gather_state_dict`` / ``gather_grads``.
- ``model.py``: ``ParallelMLP``, ``ParallelAttention``, ``ParallelBlock``, ``TensorParallelGPT``.

What a step should cost (collectives, bytes per rank, activation bytes) is in ``minipar.cost.tensor``.

The rest of the family, one subpackage per layout of the ranks (each splits every weight and
activation further than Megatron's 1-D, whose activations are whole on every rank):

- ``tp2d/``: 2-D (Optimus, on SUMMA): a ``q x q`` grid (``minipar.cost.tensor2d``);
- ``tp2p5d/``: 2.5-D (Tesseract): ``d`` stacked ``q x q`` grids (``minipar.cost.tensor2p5d``);
- ``tp3d/``: 3-D: a ``q x q x q`` cube (``minipar.cost.tensor3d``).
"""

from minipar.parallel.tensor.comm_ops import (
    ActivationMeter,
    exit_region,
    f,
    g,
    gather_last,
    sp_reduce_scatter,
)
from minipar.parallel.tensor.layers import (
    ColumnParallelLinear,
    ColumnParallelMatmul,
    RowParallelLinear,
    RowParallelMatmul,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    gather_array,
    gather_grads,
    gather_state_dict,
    vocab_parallel_cross_entropy,
)
from minipar.parallel.tensor.model import (
    ParallelAttention,
    ParallelBlock,
    ParallelMLP,
    TensorParallelGPT,
    check_tp_config,
    gather_logits,
    sync_sequence_parallel_grads,
)

__all__ = [
    "ActivationMeter", "ColumnParallelLinear", "ColumnParallelMatmul", "ParallelAttention", "ParallelBlock",
    "ParallelMLP", "RowParallelLinear", "RowParallelMatmul", "TensorParallelGPT", "VocabParallelCrossEntropy",
    "VocabParallelEmbedding", "check_tp_config", "exit_region", "f", "g", "gather_array", "gather_grads",
    "gather_logits", "gather_state_dict", "gather_last", "sp_reduce_scatter",
    "sync_sequence_parallel_grads", "vocab_parallel_cross_entropy",
]
