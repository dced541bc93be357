"""Offload: the time of a move between memory tiers, and ZeRO-Offload's bytes per step.

**Moves between tiers** (``transfer_seconds``). minipar has no accelerator; the device is a byte
budget (``minipar.tiers``) and a move between tiers is modelled per request as a latency plus
``nbytes / bandwidth`` of the link it crosses (Hockney's alpha-beta line, as for a message):
host <-> device over PCIe (``pcie``, both directions), host -> NVMe at ``nvme_write``, NVMe -> host
at ``nvme_read``, and a synced write (the NVMe tier's atomic write: a new file, ``fdatasync``, a
rename) adds ``nvme_sync`` and ``nvme_sync_per_byte`` per byte. A move between the device and NVMe
is staged through host memory (as in ZeRO-Infinity, Rajbhandari et al. 2021, Sec. 6): the two
links one after the other. The rates are typical figures with no latency unless measured on the
machine (``minipar.tiers.rates.measure``: ``minipar calibrate``, lesson 7), where the latency is
what a small request (64 KiB) is made of.

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

from minipar.checks import counts, number, one_of, whole, wholes

TIERS = ("cpu", "device", "nvme")


class Rates(Protocol):
    pcie: float
    nvme_read: float
    nvme_write: float
    pcie_latency: float
    nvme_read_latency: float
    nvme_write_latency: float
    nvme_sync: float
    nvme_sync_per_byte: float


def transfer_seconds(nbytes: int, src: str, dst: str, bandwidth: Rates, synced: bool = False) -> float:
    """Modelled seconds to move ``nbytes`` from tier ``src`` to tier ``dst`` (``"cpu"``, ``"device"``,
    ``"nvme"``) at ``bandwidth``'s rates (bytes/s) and latencies (seconds per request); 0 within one
    tier. ``synced``: a write to NVMe made durable and atomic on its own (adds ``nvme_sync`` +
    ``nbytes x nvme_sync_per_byte``: a new file's extents written, then flushed)."""
    for name, tier in (("src", src), ("dst", dst)):
        if tier not in TIERS:
            raise ValueError(f"transfer_seconds: {name}: unknown tier {tier!r}; tiers are {TIERS}")
    number("transfer_seconds", "nbytes", nbytes)
    if src == dst:
        return 0.0
    if "nvme" in (src, dst) and "device" in (src, dst):  # staged through host memory
        return (transfer_seconds(nbytes, src, "cpu", bandwidth)
                + transfer_seconds(nbytes, "cpu", dst, bandwidth, synced))
    if "device" in (src, dst):
        return bandwidth.pcie_latency + nbytes / bandwidth.pcie
    if dst == "nvme":
        synced_s = bandwidth.nvme_sync + nbytes * bandwidth.nvme_sync_per_byte if synced else 0.0
        return bandwidth.nvme_write_latency + nbytes / bandwidth.nvme_write + synced_s
    return bandwidth.nvme_read_latency + nbytes / bandwidth.nvme_read


def zero_offload_bytes(params: int | Sequence[int], param_bytes: int = 2, grad_bytes: int = 2,
                       dp: int = 1) -> dict[str, int]:
    """Bytes one rank moves between device and CPU per ZeRO-Offload step (Ren et al. 2021, Sec. 3-4).

    ``{"device->cpu": grad_bytes * P, "cpu->device": param_bytes * P}`` with ``P`` the parameters
    this rank offloads: all of them on one rank (``4 Psi`` bytes in fp16), its partition under ZeRO
    stage 2 on ``dp`` ranks. ``params`` is ``Psi``, or a list of flat group sizes; each group is
    padded to the next multiple of ``dp`` as ``minipar.parallel.zero.flat`` lays it out, so ``P`` =
    sum over groups of ``ceil(n / dp)`` (exactly ``Psi / dp`` when ``dp`` divides every group).
    """
    wholes("zero_offload_bytes", dp=dp, param_bytes=param_bytes, grad_bytes=grad_bytes)
    groups = counts("zero_offload_bytes", "params", [params] if isinstance(params, int) else params)
    shard = sum(-(-n // dp) for n in groups)
    return {"device->cpu": grad_bytes * shard, "cpu->device": param_bytes * shard}


def zero_offload_device_need(groups: Sequence[int], dp: int = 1, itemsize: int = 2) -> dict[str, int]:
    """Device bytes at ZeRO-Offload's peak on every rank (``minipar.parallel.offload.ZeroOffload``),
    ``groups`` the buckets' parameter counts, each padded to ``L_b``, a multiple of ``dp``::

        parameters       itemsize x sum L_b     every working parameter stays resident
        gradient bucket  itemsize x max L_b     one bucket's gradients, reduce-scattered, then reused
        upload           itemsize x max L_b/dp  one updated partition on its way up (freed at once)

    and their ``total``: the smallest budget that trains (activations are not charged)."""
    whole("zero_offload_device_need", "itemsize", itemsize)
    padded = [s * dp for s in _shard_elements("zero_offload_device_need", groups, dp)]
    need = {"parameters": itemsize * sum(padded), "gradient bucket": itemsize * max(padded),
            "upload": itemsize * max(padded) // dp}
    return {**need, "total": sum(need.values())}


def zero_offload_reach(groups: Sequence[int], dp: int = 1, itemsize: int = 2, state_bytes: int = 16) -> float:
    """Model states over the device bytes ZeRO-Offload needs: ``state_bytes x Psi / total`` (16 Psi in
    mixed precision: fp16 parameters 2, fp16 gradients 2, fp32 master and moments 12). Always below
    ``state_bytes / itemsize`` (8 in mixed precision): the device keeps every working parameter
    (``itemsize`` of the ``state_bytes``), and besides them a bucket and an upload, so
    ``reach = 8 Psi / (sum L_b + max L_b (1 + 1/dp))``, 8 only in the limit of buckets small
    against the model (docs/formulas.md, section 7)."""
    whole("zero_offload_reach", "state_bytes", state_bytes)
    return state_bytes * sum(groups) / zero_offload_device_need(groups, dp, itemsize)["total"]


# ---- ZeRO-Infinity (Rajbhandari et al. 2021, Sec. 5-6) -------------------------------------------------
# bytes per element of a shard: the working parameters (and gradients), and what the step reads and
# writes: fp64 the parameters are the master (8) and two fp64 moments (16); mixed the fp32 master (4)
# and two fp32 moments (8) are read, and the fp16 parameters (2) written besides them
INFINITY_ITEMS = {"fp64": {"param": 8, "step_read": 8 + 16, "step_write": 8 + 16},
                  "mixed": {"param": 2, "step_read": 4 + 8, "step_write": 2 + 4 + 8}}


def _shard_elements(who: str, units: Sequence[int], dp: int) -> list[int]:
    whole(who, "dp", dp)
    units = counts(who, "units", units)
    if not units:
        raise ValueError(f"{who}: units=[] must list at least one unit's parameters")
    return [-(-n // dp) for n in units]


def zero_infinity_bytes(units: Sequence[int], dp: int = 1, precision: str = "fp64") -> dict[str, int]:
    """Bytes one rank moves between tiers per applied ZeRO-Infinity step (Rajbhandari et al. 2021,
    Sec. 5-6), ``units`` the parameters of each unit (each padded to a multiple of ``dp``; this rank's
    shard is ``s_u = ceil(n_u / dp)`` elements, s = sum s_u), ``p`` the working item (8 / 2 bytes)::

        nvme->cpu    2 p s + R s    the shard before each unit's forward and again before its backward
                                    (only this rank's 1/dp: bandwidth-centric partitioning, Sec. 6.1),
                                    and the step's reads, R = 24 (fp64: param, m, v) or 12 (mixed: master, m, v)
        cpu->nvme    W s            the step's writes, W = 24 (fp64) or 14 (mixed: fp16 param, master, m, v)
        cpu->device  2 p s          the shard up, forward and backward (the all-gather assembles the unit)
        device->cpu  p s            this rank's reduce-scattered gradient partition

    (fp64: 40 s, 24 s, 16 s, 8 s; mixed: 16 s, 14 s, 4 s, 2 s). A step skipped on an fp16 overflow
    moves no optimizer state: its nvme traffic is the 2 p s alone, nothing written.
    """
    one_of("zero_infinity_bytes", "precision", precision, tuple(INFINITY_ITEMS))
    s, it = sum(_shard_elements("zero_infinity_bytes", units, dp)), INFINITY_ITEMS[precision]
    return {"nvme->cpu": (2 * it["param"] + it["step_read"]) * s, "cpu->nvme": it["step_write"] * s,
            "cpu->device": 2 * it["param"] * s, "device->cpu": it["param"] * s}


def zero_infinity_device_need(units: Sequence[int], dp: int = 1, itemsize: int = 8) -> dict[str, int]:
    """Device bytes at ZeRO-Infinity's peak on every rank: the largest unit gathered (``L`` = its size
    padded to a multiple of ``dp``) beside its flat gradient buffer during its backward, ``2 L``
    items (the shard copied up before the all-gather, ``L / dp``, is freed before the gradients exist)."""
    whole("zero_infinity_device_need", "itemsize", itemsize)
    largest = max(s * dp for s in _shard_elements("zero_infinity_device_need", units, dp))
    return {"gathered unit": itemsize * largest, "gradient buffer": itemsize * largest, "total": 2 * itemsize * largest}


# ---- chunks (PatrickStar, Fang et al. 2021) -------------------------------------------------------------


def in_order_misses(n_chunks: int, fit: int) -> int:
    """Chunk misses per step of a model that uses its chunks in order in forward and in reverse in
    backward (``nn.GPT``, an MLP), ``fit`` chunks fitting beside the activations at the start of
    backward: every chunk comes up once in forward (the step left them all on the CPU); backward finds
    the last ``fit`` still resident and fetches the other ``n_chunks - fit`` again. LRU and the
    warm-up's order (Belady) both keep the most recently used chunks here, so both miss this many."""
    wholes("in_order_misses", n_chunks=n_chunks, fit=fit)
    return n_chunks + max(0, n_chunks - fit)


def chunk_offload_bytes(chunk_bytes: int, misses: int) -> dict[str, int]:
    """Bytes the chunk manager moves per step: each miss (a chunk needed while on the CPU) brings the
    chunk up once, and it goes down once, evicted or at the CPU step, so ``chunk_bytes x misses`` each
    way (``misses`` from the schedule of uses: ``in_order_misses``, or counted by hand)."""
    wholes("chunk_offload_bytes", 0, chunk_bytes=chunk_bytes, misses=misses)
    return {"cpu->device": chunk_bytes * misses, "device->cpu": chunk_bytes * misses}


def chunk_dp_bytes(chunk_bytes: int, world: int, misses: int, groups: int) -> dict[str, int]:
    """Bytes per rank per step of the chunk manager on ``world`` data-parallel ranks (PatrickStar,
    Fang et al. 2021, Sec. 5): the chunks form ``groups`` communication groups of ``world`` consecutive
    chunks (the chunk list padded with empty chunks), a rank owning one chunk of each. A group miss
    moves this rank's owned chunk up and (evicted, or at the step) down once, ``chunk_bytes`` each way,
    and all-gathers the group (ring: ``(world - 1) x chunk_bytes`` sent); after backward every group's
    gradients are reduce-scattered once (ring: ``(world - 1) x chunk_bytes`` sent). ``misses`` counts
    groups (``in_order_misses(groups, fit)`` for an in-order model, ``fit`` the groups beside the
    activations). ``world = 1``: ``chunk_offload_bytes`` and nothing sent."""
    wholes("chunk_dp_bytes", 0, chunk_bytes=chunk_bytes, misses=misses, groups=groups)
    whole("chunk_dp_bytes", "world", world)
    return {**chunk_offload_bytes(chunk_bytes, misses), "sent": (world - 1) * chunk_bytes * (misses + groups)}
