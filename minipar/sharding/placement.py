"""Placements of a tensor on one mesh axis: OneFlow's SBP (Yuan et al. 2021), GSPMD's shardings.

- ``Shard(dim)`` (``S(dim)``): the ranks of the axis hold equal consecutive blocks of dimension ``dim``,
  in the order of their coordinate on the axis.
- ``Replicate()`` (``B``, broadcast): every rank of the axis holds the same values.
- ``Partial("sum")`` (``P``): the tensor is the sum of the ranks' pieces (a matmul's output before its
  all-reduce). Only the sum is supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard: dim must be a non-negative int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op != "sum":
            raise ValueError(f"Partial: only op='sum' is supported, got {self.op!r}")

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial


def describe(placements: Sequence[object]) -> str:
    """``[S(0), B]``."""
    return "[" + ", ".join(str(p) for p in placements) + "]"
