"""Fitting the terminal: its width, also under ``mpiexec``, and tables that never cut a number.

``terminal_width()``: ``COLUMNS`` when set, else the size of the first of stdout, stderr and stdin
that is a terminal, else of the controlling terminal (``/dev/tty``: every standard stream redirected
while the person still looks at a terminal), else ``FALLBACK`` (80) columns. MPICH's ``mpiexec``
starts its ranks with pipes for streams and without a controlling terminal, so the width has to come
from ``COLUMNS``, which the shell does not export: ``make demo`` passes it on,
``COLUMNS=$(tput cols) mpiexec ...`` does the same by hand.

``Table``: a ``rich.table.Table`` that, when its columns do not fit, keeps every number whole: each
numeric column (every cell a number, optionally with a unit, or several: ``1,024 / 1,024``, ``4 3 2 1``)
is fixed at its widest number (its header wraps under it) so rich narrows the text columns, whose
cells wrap. When even that is too wide, the table is printed as several tables, left to right: each
repeats the first ``key`` columns (what names a row) and takes its share of the next columns (as few
tables as fit, of even widths; a "formula" column stays beside the column it is the formula of), the
later ones titled "(continued)", the caption under the last. Only a single column wider than
the line is still cut (with ``…``); the lessons' width test (``tests/test_lesson_widths.py``) fails
on that.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from rich import table as rich_table
from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

FALLBACK = 80  # columns when there is no terminal at all
TEXT_MIN = 16  # a text column is not narrowed below its longest word, up to this many characters
GLUED = ("formula", "sim.")  # headers of columns kept next to the column before them when a table is split

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


def _text_width(console: Console, column: rich_table.Column) -> int:
    """A text column's narrowest width that breaks no word (at most ``TEXT_MIN``); a ``no_wrap`` one's
    widest line."""
    cells = [_plain(console, c) or "" for c in [column.header, *column._cells]]
    pieces = [piece for c in cells for piece in (c.splitlines() if column.no_wrap else c.split())]
    widest = max((Text(w).cell_len for w in pieces), default=1)
    return widest if column.no_wrap else min(TEXT_MIN, widest)


class Table(rich_table.Table):
    """A ``rich.table.Table`` that keeps numbers whole when it is too wide (see the module docstring);
    ``key``: the leading columns repeated in each part of a table split to fit."""

    def __init__(self, *headers: Any, key: int = 1, **kwargs: Any) -> None:
        super().__init__(*headers, **kwargs)
        self.key = key
        self._part = False  # a part of a split table: never split again

    @classmethod
    def of(cls, title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], text: int = 1,
           **kwargs: Any) -> Table:
        """A table titled ``title`` (left-justified) with ``columns`` (the first ``text`` of them text,
        left-justified; the others numbers, right-justified) and ``rows`` of cells."""
        table = cls(title=title, title_justify="left", **kwargs)
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i < text else "right")
        for row in rows:
            table.add_row(*row)
        return table

    def _needs(self, console: Console) -> list[int]:
        """Per column, the narrowest width (padding included) that cuts no number and breaks no word."""
        out = []
        for column in self.columns:
            number = numeric_width(console, column) if column.width is None else column.width
            need = number if number is not None else _text_width(console, column)
            out.append(need + self._get_padding_width(column._index))
        return out

    def _parts(self, console: Console, max_width: int) -> list[list[int]]:
        """Column indices of each part: the key columns and the next ones, as few parts as fit
        ``max_width``, their widths as even as can be; a column headed "formula" or "sim." stays with
        the one before it (what it is the formula or simulation of)."""
        needs = self._needs(console)

        def width(cols: list[int]) -> int:
            edges = (2 if self.show_edge else 0) + len(cols) - 1 if self.box else 0
            return sum(needs[c] for c in cols) + edges

        key = list(range(min(self.key, len(self.columns) - 1)))
        units: list[list[int]] = []
        for c in range(len(key), len(self.columns)):
            header = (_plain(console, self.columns[c].header) or "").strip()
            if units and header in GLUED and width(key + units[-1] + [c]) <= max_width:
                units[-1].append(c)
            else:
                units.append([c])

        def pack(limit: int) -> list[list[int]]:
            parts: list[list[int]] = [[]]
            for unit in units:
                if parts[-1] and width(key + parts[-1] + unit) > limit:
                    parts.append([])
                parts[-1].extend(unit)
            return parts

        fewest = len(pack(max_width))
        limit = max_width  # the narrowest limit that needs no more parts: parts of even width
        while limit > 1 and len(pack(limit - 1)) <= fewest:
            limit -= 1
        return [key + part for part in pack(limit)]

    def _part_of(self, cols: list[int], first: bool, last: bool) -> Table:
        part = copy.copy(self)
        part._part = True
        part.columns = []
        for i, c in enumerate(cols):
            column = copy.copy(self.columns[c])
            column._index = i
            part.columns.append(column)
        if not first and isinstance(self.title, str):
            part.title = f"{self.title} (continued)"
        if not last:
            part.caption = None
        return part

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        max_width = self.width if self.width is not None else options.max_width
        parts = [] if self._part or not self.columns else self._parts(console, max_width)
        if len(parts) <= 1:
            yield from super().__rich_console__(console, options)
            return
        for i, cols in enumerate(parts):
            yield self._part_of(cols, i == 0, i == len(parts) - 1)

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
