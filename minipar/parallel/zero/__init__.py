"""ZeRO (Rajbhandari et al. 2020) and FSDP (Zhao et al. 2023): data parallelism with the optimizer
state, gradients and parameters partitioned over the ranks.

- ``flat.py``: the flat padded layout every stage shares (rank r owns slice r of each group), and
  the shard-only initialisation.
- ``stages.py``: ``ZeroDataParallel``, stages 1 (optimizer state) and 2 (+ gradients, reduce-scattered
  bucket by bucket during backward).
- ``fsdp.py``: ``FullyShardedDataParallel``, stage 3 (+ parameters), unit by unit with prefetching.
- ``fsdp2.py``: ``fully_shard`` (FSDP2): the same units, each parameter a ``Shard(0)`` global tensor on
  the mesh's dp axis (``minipar.sharding``), uneven where N does not divide its first dimension.
- ``checkpoint.py``: sharded checkpoints, written atomically, loadable at another world size.

What each stage costs (bytes of model states per rank, bytes sent per step) is in ``minipar.cost.zero``.
"""

from minipar.parallel.zero.flat import FlatLayout, init_shard, layout_of
from minipar.parallel.zero.fsdp import FullyShardedDataParallel, Unit, check_fsdp_config, transformer_units
from minipar.parallel.zero.stages import STAGES, ZeroBucket, ZeroDataParallel, check_zero_config

__all__ = [
    "STAGES", "FlatLayout", "FullyShardedDataParallel", "Unit", "ZeroBucket", "ZeroDataParallel",
    "check_fsdp_config", "check_zero_config", "init_shard", "layout_of", "transformer_units",
]
