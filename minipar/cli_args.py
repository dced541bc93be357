"""What the ``minipar`` command's subcommands share: ``UsageError`` (one line ``minipar: error: ...``,
exit status 2) and argparse ``type``s that name the bad value and the range that works."""

from __future__ import annotations

import argparse
from collections.abc import Callable

MAX_DURATION = 1e9


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in [lo, hi], else an error naming the value and the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi:,}, got {text.strip()[:20]}")
        return value

    return parse


def duration(text: str) -> float:
    """An argparse ``type``: a finite number of time units in [0, ``MAX_DURATION``]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
    if not 0 <= value <= MAX_DURATION:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a finite number between 0 and {MAX_DURATION:g}, got {text[:40]}")
    return value
