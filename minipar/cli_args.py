"""What the ``minipar`` command's subcommands share: ``UsageError`` (one line ``minipar: error: ...``,
exit status 2) and argparse ``type``s that name the bad value and the range that works."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

MAX_DURATION = 1e9
MIN_WIDTH = 40  # room for a lane ("rank r ", cells, "  idle 100%") and a traffic table column
MAX_WIDTH = 1000  # wider is no terminal (and the lines are built in memory)


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


def check_writable(path: str, option: str) -> None:
    """Raise ``UsageError`` before any work when ``path`` (given to ``option``) cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = f"{path} is a directory; give a file name, e.g. {os.path.join(path, 'out.json')}"
    elif not os.path.isdir(folder):
        problem = f"directory {folder} does not exist; create it first or choose another path"
    elif not os.access(folder, os.W_OK):
        problem = f"no permission to write in {folder}; choose another path"
    else:
        return
    raise UsageError(f"cannot write output {path} ({option}): {problem}")


def check_width(width: int | None) -> None:
    """Raise ``UsageError`` when ``--width`` is outside [``MIN_WIDTH``, ``MAX_WIDTH``]."""
    if width is not None and width < MIN_WIDTH:
        raise UsageError(f"--width {width} is too narrow; use at least {MIN_WIDTH}")
    if width is not None and width > MAX_WIDTH:
        raise UsageError(f"--width {width} is too wide; use at most {MAX_WIDTH}")
