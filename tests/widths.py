"""What "fits the terminal" means for a lesson's output, checked on its text (``width_problems``): no
line longer than the width, no table cut at the right (a row that opens with a border and does not
close with one), no number cut (a cell ending in ``…`` right after a digit-led word: ``157,…``); and
what "short" means for a lesson's default output (``length_problems``: at most ``MAX_LINES`` lines)."""

from __future__ import annotations

import re

from rich.cells import cell_len

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
OPEN, CLOSE = "┏┃┡│└┌╭", "┓┃┩│┘┐╮┤"  # the first and last character of a rich table's lines
CUT_NUMBER = re.compile(r"(?:^|\s)[-+−~≈]?\d[\d,._]*…$")
MAX_LINES = 60  # a lesson's default output: its key table, its figure and its conclusion (issue 28)


def width_problems(text: str, width: int) -> list[str]:
    """Each line of ``text`` (ANSI codes stripped) longer than ``width``, each table line cut at the
    right and each numeric cell cut with an ellipsis, as one message per problem (none: it fits)."""
    problems = []
    for n, line in enumerate(ANSI.sub("", text).splitlines(), 1):
        if cell_len(line) > width:
            problems.append(f"line {n} is {cell_len(line)} > {width} columns: {line!r}")
        body = line.strip()
        if body and body[0] in OPEN and body[-1] not in CLOSE:
            problems.append(f"line {n}: a table cut at the right: {line!r}")
        for cell in re.split(r"[│┃]", line):
            if CUT_NUMBER.search(cell.strip()):
                problems.append(f"line {n}: a number cut: {cell.strip()!r} in {line!r}")
    return problems


def length_problems(text: str, lines: int = MAX_LINES) -> list[str]:
    """One message when ``text`` has more than ``lines`` lines (a lesson's default output, printed at the
    width it was checked at: wrapped lines count), else none."""
    count = len(text.rstrip("\n").splitlines())
    return [f"{count} lines > {lines}: move the rest behind --verbose"] if count > lines else []
