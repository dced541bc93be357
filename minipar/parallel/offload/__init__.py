"""Training with model states moved off the (modelled, budgeted) device: ZeRO-Offload (Ren et al. 2021,
"ZeRO-Offload: Democratizing Billion-Scale Model Training"). The tiers themselves are ``minipar.tiers``;
the bytes each method moves per step are in ``minipar.cost.offload``.
"""

from minipar.parallel.offload.zero_offload import ZeroOffload, offload_device_need

__all__ = ["ZeroOffload", "offload_device_need"]
from minipar.parallel.offload.chunks import ChunkManager as ChunkManager  # noqa: E402  PatrickStar (Fang et al. 2021)
from minipar.parallel.offload.infinity import ZeroInfinity as ZeroInfinity  # noqa: E402  (Rajbhandari et al. 2021)
