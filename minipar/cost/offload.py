"""Offload: the time of a move between memory tiers, and ZeRO-Offload's bytes per step.

**Moves between tiers** (``transfer_seconds``). minipar has no accelerator; the device is a byte
budget (``minipar.tiers``) and a move between tiers is modelled as ``nbytes / bandwidth`` of the
link it crosses: host <-> device over PCIe (``pcie``, both directions), host -> NVMe at
``nvme_write``, NVMe -> host at ``nvme_read``. A move between the device and NVMe is staged through
host memory (as in ZeRO-Infinity, Rajbhandari et al. 2021, Sec. 6): the two links one after the other.
No latency term: the tensors moved are large.

**ZeRO-Offload** (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training").
Forward and backward run on the device with fp16 parameters; the fp16 gradients go down to the CPU,
which keeps the fp32 master parameters and Adam's moments and runs the update; the updated fp16
parameters come back up. Sec. 3 shows this placement moves the least possible, ``4 Psi`` bytes per
step for ``Psi`` parameters (``2 Psi`` of fp16 gradients down, ``2 Psi`` of fp16 parameters up), and
Sec. 4.2 combines it with ZeRO stage 2: each of the ``N`` data-parallel ranks offloads only its
``1/N`` partition of gradients and optimizer state, so each rank moves ``4 Psi / N``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

TIERS = ("cpu", "device", "nvme")


class Rates(Protocol):
    pcie: float
    nvme_read: float
    nvme_write: float


def transfer_seconds(nbytes: int, src: str, dst: str, bandwidth: Rates) -> float:
    """Modelled seconds to move ``nbytes`` from tier ``src`` to tier ``dst`` (``"cpu"``, ``"device"``,
    ``"nvme"``) at ``bandwidth``'s rates in bytes/s; 0 within one tier."""
    for tier in (src, dst):
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}")
    if src == dst:
        return 0.0
    if "nvme" in (src, dst) and "device" in (src, dst):  # staged through host memory
        return transfer_seconds(nbytes, src, "cpu", bandwidth) + transfer_seconds(nbytes, "cpu", dst, bandwidth)
    if "device" in (src, dst):
        return nbytes / bandwidth.pcie
    return nbytes / (bandwidth.nvme_write if dst == "nvme" else bandwidth.nvme_read)


def zero_offload_bytes(params: int | Sequence[int], param_bytes: int = 2, grad_bytes: int = 2,
                       dp: int = 1) -> dict[str, int]:
    """Bytes one rank moves between device and CPU per ZeRO-Offload step (Ren et al. 2021, Sec. 3-4).

    ``{"device->cpu": grad_bytes * P, "cpu->device": param_bytes * P}`` with ``P`` the parameters
    this rank offloads: all of them on one rank (``4 Psi`` bytes in fp16), its partition under ZeRO
    stage 2 on ``dp`` ranks. ``params`` is ``Psi``, or a list of flat group sizes; each group is
    padded to the next multiple of ``dp`` as ``minipar.parallel.zero.flat`` lays it out, so ``P`` =
    sum over groups of ``ceil(n / dp)`` (exactly ``Psi / dp`` when ``dp`` divides every group).
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    groups = [params] if isinstance(params, int) else list(params)
    if any(n < 0 for n in groups):
        raise ValueError(f"parameter counts must be >= 0, got {groups}")
    shard = sum(-(-n // dp) for n in groups)
    return {"device->cpu": grad_bytes * shard, "cpu->device": param_bytes * shard}
