"""Eviction policies of the chunk manager (``chunks.py``): which device-resident chunk goes to the CPU
when room is needed. The manager only offers chunks none of whose tensors is COMPUTE.

- ``Lru``: the chunk used least recently (PatrickStar's fallback, and what warm-up itself must use).
- ``WarmupOrder``: the warm-up iteration records the order in which chunks are used; every later
  iteration repeats it (the same model, the same batch shape), so the manager knows the future and
  evicts the chunk whose next use is farthest ahead, Belady's rule (Belady 1966, "A study of
  replacement algorithms for a virtual-storage computer"), as PatrickStar does with its tracer's
  statistics (Fang et al. 2021, Sec. 5). A chunk not used again before the step is the farthest.
  Belady's rule minimises the misses of a cache of fixed-size pages; each miss here is one chunk up
  and (by eviction or at the CPU step) one chunk down, so it minimises the bytes moved.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


class Lru:
    """Least recently used. ``touch`` on every use; ``choose`` among candidates (ties: lower index)."""

    name = "lru"

    def __init__(self) -> None:
        self._tick = 0
        self.last: dict[int, int] = {}

    def touch(self, chunk: int) -> None:
        self._tick += 1
        self.last[chunk] = self._tick

    def learn(self, uses: Sequence[int]) -> None:
        """The warm-up's order of uses: LRU ignores it."""

    def choose(self, candidates: Sequence[int], position: int) -> int:
        """The chunk to evict; ``position``: how many uses this iteration has made so far."""
        return min(candidates, key=lambda c: (self.last.get(c, 0), c))


class WarmupOrder(Lru):
    """Belady's rule on the order of uses recorded in warm-up (LRU until it is learned)."""

    name = "warmup"

    def __init__(self) -> None:
        super().__init__()
        self.positions: dict[int, list[int]] | None = None

    def learn(self, uses: Sequence[int]) -> None:
        self.positions = {}
        for at, chunk in enumerate(uses):
            self.positions.setdefault(chunk, []).append(at)

    def next_use(self, chunk: int, position: int) -> float:
        """Position of ``chunk``'s next use at or after ``position`` in the recorded order (inf: none)."""
        ps = (self.positions or {}).get(chunk, [])
        i = bisect.bisect_left(ps, position)
        return ps[i] if i < len(ps) else math.inf

    def choose(self, candidates: Sequence[int], position: int) -> int:
        if self.positions is None:
            return super().choose(candidates, position)
        return max(candidates, key=lambda c: (self.next_use(c, position), -self.last.get(c, 0), -c))


POLICIES = {"lru": Lru, "warmup": WarmupOrder}
