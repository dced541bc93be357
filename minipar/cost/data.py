"""Data parallelism: the bytes each rank sends per step with DDP and with a parameter server.

- ``ddp_bytes(buckets, p, rank, algorithm)``: DDP (Li et al., VLDB 2020) all-reduces
  every gradient once per step, bucket by bucket: the sum of one all-reduce per bucket
  (``collectives.allreduce_bytes``); the ring's rank average is ``2 (p-1)/p`` of the gradient bytes.
- ``ps_bytes(shard_bytes, world_size, steps)``: a parameter server (Dean et al. 2012; Li et al.,
  OSDI 2014) with servers on ranks ``0..S-1`` owning ``shard_bytes[s]`` and the other ranks as
  workers: per step every worker pulls every shard and pushes a gradient of every shard, so each
  worker-server link carries the shard once each way. A server sends ``W shard_bytes[s]`` (W workers)
  per step, a worker the whole model once: the hot links a ring avoids.
"""

from __future__ import annotations

from collections.abc import Sequence

from minipar.checks import counts, whole
from minipar.cost.collectives import allreduce_bytes


def _ps(who: str, shard_bytes: Sequence[int], world_size: int, steps: int) -> list[int]:
    """``shard_bytes`` checked: byte counts, one per server, servers fewer than ``world_size`` ranks."""
    shard_bytes = counts(who, "shard_bytes", shard_bytes)
    whole(who, "world_size", world_size, least=len(shard_bytes) + 1)
    whole(who, "steps", steps, least=0)
    return shard_bytes


def ddp_bytes(buckets: Sequence[tuple[int, int]], p: int, rank: int, algorithm: str) -> int:
    """Payload bytes ``rank`` sends in one synchronised DDP step: one all-reduce per bucket of
    ``(numel, itemsize)``."""
    if any(not isinstance(b, tuple | list) or len(b) != 2 for b in buckets):
        raise ValueError(f"ddp_bytes: buckets={buckets!r} must be (numel, itemsize) pairs")
    return sum(allreduce_bytes(numel, itemsize, p, rank, algorithm) for numel, itemsize in buckets)


def ps_link_bytes(shard_bytes: Sequence[int], world_size: int, steps: int) -> dict[tuple[int, int], int]:
    """Bytes per directed link ``(src, dst)`` over ``steps`` steps: ``steps * shard_bytes[s]`` from
    server s to each worker (pulls) and from each worker to server s (pushes)."""
    shard_bytes = _ps("ps_link_bytes", shard_bytes, world_size, steps)
    servers, workers = range(len(shard_bytes)), range(len(shard_bytes), world_size)
    out = {}
    for s in servers:
        for w in workers:
            out[(s, w)] = out[(w, s)] = steps * shard_bytes[s]
    return out


def ps_bytes(shard_bytes: Sequence[int], world_size: int, steps: int) -> dict[str, list[int]]:
    """Bytes each rank sends over ``steps`` steps, by kind: ``{"pull": [...], "push": [...]}`` by rank
    (servers send pulls, workers send pushes)."""
    shard_bytes = _ps("ps_bytes", shard_bytes, world_size, steps)
    n_servers = len(shard_bytes)
    n_workers = world_size - n_servers
    return {"pull": [steps * n_workers * shard_bytes[r] if r < n_servers else 0 for r in range(world_size)],
            "push": [0 if r < n_servers else steps * sum(shard_bytes) for r in range(world_size)]}
