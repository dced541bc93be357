"""Sequence parallelism that splits attention itself along the sequence: DeepSpeed-Ulysses (Jacobs
et al. 2023), Ring Attention (Liu et al. 2023; Li et al. 2021) and their unified grid (Fang & Zhao
2024). Megatron-SP (Korthikanti et al. 2022), which splits only the layer-norm regions, is in
``minipar.parallel.tensor``.

- ``layout.py``: which positions each rank holds (contiguous or zigzag), the P_u x P_r grid, the
  checks that run before any message.
- ``comm_ops.py``: Ulysses' two all-to-alls as autograd ``Function``s; Ring Attention's hand-off.
- ``blockwise.py``: attention one score block at a time (online softmax forward, backward from the
  log-sum-exp).
- ``ulysses.py``, ``ring.py``, ``hybrid.py``: the three attentions.
- ``model.py``: ``SequenceGroup`` and ``SequenceParallelGPT``.

What they should cost (bytes per rank per layer, score and activation memory, causal work per
rank) is in ``minipar.cost.sequence``.
"""

from minipar.parallel.sequence.blockwise import OnlineSoftmax, block_backward, scores, visibility
from minipar.parallel.sequence.comm_ops import heads_to_seq, pass_on, seq_to_heads
from minipar.parallel.sequence.hybrid import hybrid_attention
from minipar.parallel.sequence.layout import METHODS, SequenceLayout, check_sequence_config, sequence_problems
from minipar.parallel.sequence.model import SequenceGroup, SequenceParallelAttention, SequenceParallelGPT
from minipar.parallel.sequence.ring import RingAttention, block_pairs, ring_attention
from minipar.parallel.sequence.ulysses import ulysses_attention

__all__ = [
    "METHODS", "OnlineSoftmax", "RingAttention", "SequenceGroup", "SequenceLayout", "SequenceParallelAttention",
    "SequenceParallelGPT", "block_backward", "block_pairs", "check_sequence_config", "heads_to_seq",
    "hybrid_attention", "pass_on", "ring_attention", "scores", "seq_to_heads", "sequence_problems",
    "ulysses_attention", "visibility",
]
