"""Hybrid parallelism: the tiny GPT on a named device mesh (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3, PTD-P), pipeline x
tensor (or sequence) x data parallelism, DDP or ZeRO-1, 2 or 3 across data-parallel ranks.

- ``stages.py``: the GPT as pipeline layers whose insides are tensor-parallel (Megatron, with or
  without Megatron-SP) or sequence-parallel (Ulysses, Ring Attention, their hybrid).
- ``model.py``: ``HybridGPT`` (one entry point for every combination), ``check_hybrid_config``.
- ``zero_pp.py``: ZeRO-2 and ZeRO-3 / FSDP under pipelining (gradients reduce-scattered once per
  step; ZeRO-3 stages gathered per action or kept, ``reshard_after_forward``).

The mesh is ``minipar.mesh.DeviceMesh``; what a step should cost per axis is in ``minipar.cost.hybrid``.
"""

from minipar.parallel.hybrid.model import HybridGPT, check_hybrid_config
from minipar.parallel.hybrid.stages import sequence_parallel_layers, tensor_parallel_layers

__all__ = ["HybridGPT", "check_hybrid_config", "sequence_parallel_layers", "tensor_parallel_layers"]
