"""Fitting the terminal: its width, also under ``mpiexec``, and tables that never cut a number.

``terminal_width()``: ``COLUMNS`` when set (``make demo`` passes it to ``mpiexec``), else the size of
the first of stdout, stderr and stdin that is a terminal, else of the controlling terminal
(``/dev/tty``: under ``mpiexec`` every standard stream may be a pipe while the person still looks at
a terminal), else ``FALLBACK`` (80) columns.

``Table``: a ``rich.table.Table`` that, when its columns do not fit, keeps every number whole: each
numeric column (every cell a number, optionally with a unit, or several: ``1,024 / 1,024``, ``4 3 2 1``) is fixed at
its widest number (its header wraps under it) so rich narrows the text columns, whose cells wrap.
Only if the numbers alone are wider than the line does rich cut them (with ``…``); the lessons'
width test (``tests/test_lesson_widths.py``) fails on that.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rich import table as rich_table
from rich.console import Console, ConsoleOptions
from rich.text import Text

FALLBACK = 80  # columns when there is no terminal at all

_NUM = r"[-+−]?(?:\d[\d,_]*(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?"
_UNIT = r"(?:%|x|×|[kKMGT]?i?B(?:/s)?|[mµun]?s|pts?)"
_ITEM = rf"\(?[~≈<>≤≥]?\s?{_NUM}(?:\s?{_UNIT})?\)?"
NUMBER = re.compile(rf"{_ITEM}(?:\s*[/=±:]?\s*{_ITEM})*")  # several: "1,024 / 1,024", "4 3 2 1", "3 (3)"
BLANK = re.compile(r"[-–—?]?")  # an empty cell, or a dash for "none": allowed in a numeric column


def terminal_width(fallback: int = FALLBACK) -> int:
    """Columns of the terminal the person is looking at (see the module's docstring)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    for fd in (1, 2, 0):
        try:
            width = os.get_terminal_size(fd).columns
        except (OSError, ValueError):
            continue
        if width > 0:
            return width
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return fallback
    try:
        width = os.get_terminal_size(fd).columns
    except OSError:
        width = 0
    finally:
        os.close(fd)
    return width if width > 0 else fallback


def is_number(text: str) -> bool:
    """Whether a cell's text is a number (``1,024``, ``0.5 ms``, ``3.2x``, ``1,024 / 1,024``)."""
    return NUMBER.fullmatch(text.strip()) is not None


def _plain(console: Console, cell: Any) -> str | None:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return console.render_str(cell).plain
    return None


def numeric_width(console: Console, column: rich_table.Column) -> int | None:
    """The width that shows every number of ``column`` whole and its header's longest word, or None
    when the column is not numeric (a cell is text or not a string)."""
    cells = [_plain(console, c) for c in column._cells]
    if not cells or any(c is None for c in cells):
        return None
    lines = [line for c in cells for line in c.splitlines()]  # type: ignore[union-attr]
    numbers = [line.strip() for line in lines if not BLANK.fullmatch(line.strip())]
    if not numbers or not all(is_number(n) for n in numbers):
        return None
    header = _plain(console, column.header) or ""
    return max(Text(n).cell_len for n in [*numbers, *header.split()])


class Table(rich_table.Table):
    """A ``rich.table.Table`` that keeps numbers whole when it is too wide (see the module docstring)."""

    def _calculate_column_widths(self, console: Console, options: ConsoleOptions) -> list[int]:
        natural = sum(self._measure_column(console, options, c).maximum for c in self.columns)
        fixed: list[tuple[rich_table.Column, int | None]] = []
        if natural > options.max_width:
            for column in self.columns:
                need = numeric_width(console, column) if column.width is None else None
                if need is not None:
                    fixed.append((column, column.width))
                    column.width = need
        try:
            return super()._calculate_column_widths(console, options)
        finally:
            for column, width in fixed:
                column.width = width
