"""Argument checks shared by the formulas (``minipar.cost``) and the sequence-parallel attentions:
each raises ``ValueError`` with one line ``who: name=value ...`` saying what is allowed, before any
work (so before any message: every rank holding the same numbers raises the same line)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

RECOMPUTE = ("none", "selective", "full")  # activation recomputation: minipar.recompute runs them, cost prices them


def whole(who: str, name: str, value: Any, least: int = 1) -> int:
    """``value`` as an int when it is a whole number (an int, not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        allowed = {1: "a positive whole number", 0: "a whole number >= 0"}.get(least, f"a whole number >= {least}")
        raise ValueError(f"{who}: {name}={value!r} must be {allowed}")
    return int(value)


def wholes(who: str, least: int = 1, **values: Any) -> None:
    """``whole`` for each keyword: ``wholes("f", b=b, s=s)``."""
    for name, value in values.items():
        whole(who, name, value, least)


def counts(who: str, name: str, values: Iterable[Any]) -> list[int]:
    """``values`` as a list of whole numbers >= 0 (element or byte counts)."""
    values = list(values)
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0 for n in values):
        raise ValueError(f"{who}: {name}={values!r} must be whole numbers >= 0")
    return [int(n) for n in values]


def number(who: str, name: str, value: Any, least: float = 0.0) -> float:
    """``value`` as a float when it is a finite real number of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) \
            or not least <= value < float("inf"):  # also NaN
        raise ValueError(f"{who}: {name}={value!r} must be a finite number >= {least:g}")
    return float(value)


def divisible(who: str, name: str, value: int, by: int, by_name: str) -> int:
    """``value // by`` when ``by`` divides ``value`` (both already whole)."""
    if value % by:
        raise ValueError(f"{who}: {name}={value} is not divisible by {by_name}={by}")
    return value // by


def one_of(who: str, name: str, value: Any, options: Sequence[Any]) -> None:
    """``value`` must be one of ``options`` (a bool only when one of them is: True == 1)."""
    if value not in options or isinstance(value, bool) != any(isinstance(o, bool) for o in options):
        raise ValueError(f"{who}: {name}={value!r}; choose one of {', '.join(map(repr, options))}")


def index(who: str, name: str, value: Any, size: int, of: str) -> int:
    """``value`` as an int when it is one of ``range(size)`` (the indices of ``of``)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < size:
        raise ValueError(f"{who}: {name}={value!r} must be one of the {size} {of} (0..{size - 1})")
    return int(value)
