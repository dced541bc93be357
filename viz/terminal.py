"""The terminal timeline: per-rank lanes of F/B blocks, legend, bubbles and a traffic table (rich).

Each rank gets one lane of ``columns`` character cells covering the step window (see
``viz.analysis``) in equal time slices. A cell shows the compute span that covers more than half
of it; a span too short to win any cell still claims its best-overlapping idle cell (if there is
one), so short spans do not vanish. Each block starts with its label (``F0``, ``B3``, ``B3.1``
with chunks; the chunk, then the micro-batch, are dropped when the block is too narrow) and is
filled with spaces; with colour the whole block is painted by kind (forward blue, backward
orange, optimizer green, other grey). Cells where the rank only communicates (sends, or waits in
a receive) show ``~``, idle cells ``.``, so the lanes read without colour too.

Under ``mpiexec`` stdout is not a terminal: set ``FORCE_COLOR=1`` or pass your own ``Console``.
Cost: O(E * C) for E events and C columns.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

from minipar.trace import Event, Trace, load
from viz import analysis as A

STYLES = {
    "forward": "bold white on blue",
    "backward": "bold black on dark_orange",
    "optimizer": "bold white on green",
    "other": "bold white on grey50",
}
COMM_CHAR, IDLE_CHAR = "~", "."
COMM_STYLE, IDLE_STYLE = "magenta", "grey39"
PREFIX_FMT = "rank {:<{w}} "


def _as_trace(trace_or_path: Trace | str | os.PathLike[str]) -> Trace:
    return trace_or_path if isinstance(trace_or_path, Trace) else load(trace_or_path)


def _cells(trace: Trace, rank: int, columns: int, lo: float, hi: float) -> list[Event | str | None]:
    """Per cell: the compute Event shown there, COMM_CHAR, or None (idle)."""
    dt = (hi - lo) / columns
    edges = [(lo + c * dt, lo + (c + 1) * dt) for c in range(columns)]

    def overlap(e: Event, c: int) -> float:
        return max(0.0, min(e.t1, edges[c][1]) - max(e.t0, edges[c][0]))

    spans = A.compute_spans(trace, rank)
    cells: list[Event | str | None] = [None] * columns
    best = [0.0] * columns
    for e in spans:
        first = max(0, min(columns - 1, int((e.t0 - lo) / dt)))
        last = max(0, min(columns - 1, int((e.t1 - lo) / dt)))
        for c in range(first, last + 1):
            ov = overlap(e, c)
            if ov > dt / 2 and ov >= best[c]:
                cells[c], best[c] = e, ov
    shown = {id(x) for x in cells if isinstance(x, Event)}
    for e in spans:  # too short to win a cell: take its best idle cell
        if id(e) in shown or e.t1 <= lo or e.t0 >= hi:
            continue
        first = max(0, min(columns - 1, int((e.t0 - lo) / dt)))
        last = max(0, min(columns - 1, int((e.t1 - lo) / dt)))
        free = [c for c in range(first, last + 1) if cells[c] is None]
        if free:
            c = max(free, key=lambda c: overlap(e, c))
            cells[c] = e
    for e in trace.events:
        if e.kind == "comm" and e.rank == rank and e.t1 > e.t0 and e.t1 > lo and e.t0 < hi:
            first = max(0, min(columns - 1, int((e.t0 - lo) / dt)))
            last = max(0, min(columns - 1, int((e.t1 - lo) / dt)))
            for c in range(first, last + 1):
                if cells[c] is None and overlap(e, c) > 0:
                    cells[c] = COMM_CHAR
    return cells


def _fit(e: Event, chunks: bool, width: int) -> str:
    """The longest label that fits: ``F3.1``, else ``F3`` (chunk dropped), else ``F``, else cut."""
    for lab in (A.label(e, chunks), A.label(e), e.name):
        if len(lab) <= width:
            return lab
    return e.name[:width]


def lanes(trace: Trace, columns: int) -> list[Text]:
    """One styled lane of exactly ``columns`` cells per rank (no prefix or suffix)."""
    if columns < 1:
        raise ValueError(f"timeline needs at least 1 column, got {columns}; pass a larger width")
    lo, hi = A.window(trace)
    chunks = A.shows_chunks(trace)
    out = []
    for rank in range(trace.world_size):
        text = Text()
        if hi <= lo:
            text.append(IDLE_CHAR * columns, IDLE_STYLE)
            out.append(text)
            continue
        cells = _cells(trace, rank, columns, lo, hi)
        c = 0
        while c < columns:
            cell = cells[c]
            end = c + 1
            while end < columns and cells[end] is cell:
                end += 1
            if isinstance(cell, Event):
                lab = _fit(cell, chunks, end - c)
                text.append(lab.ljust(end - c), STYLES[A.kind_of(cell)])
            elif cell == COMM_CHAR:
                text.append(COMM_CHAR * (end - c), COMM_STYLE)
            else:
                text.append(IDLE_CHAR * (end - c), IDLE_STYLE)
            c = end
        out.append(text)
    return out


def _columns(trace: Trace, width: int) -> tuple[int, int, int]:
    """(prefix width, timeline cells, suffix width) of a ``width``-character lane line."""
    prefix = len(PREFIX_FMT.format(0, w=len(str(trace.world_size - 1))))
    suffix = 11 if A.bubble_fractions(trace) is not None else 0  # "  idle 100%"
    columns = width - prefix - suffix
    if columns < 4:
        raise ValueError(f"width {width} leaves {columns} columns for the timeline; use a width of at "
                         f"least {width - columns + 4}")
    return prefix, columns, suffix


def timeline_text(trace: Trace, width: int = 80) -> list[Text]:
    """Lanes with ``rank r`` in front and the bubble fraction behind, ``width`` characters in all."""
    w = len(str(trace.world_size - 1))
    fractions = A.bubble_fractions(trace)
    _, columns, suffix_w = _columns(trace, width)
    out = []
    for r, lane in enumerate(lanes(trace, columns)):
        line = Text()
        line.append(PREFIX_FMT.format(r, w=w), "bold")
        line.append_text(lane)
        if fractions is not None:
            line.append(f" idle {100 * fractions[r]:3.0f}%".rjust(suffix_w))
        out.append(line)
    return out


def legend(cell: float | None = None, unit: str = "s", width: int = 80) -> list[Text]:
    """What the blocks and characters mean (and the time one cell covers), wrapped to ``width``."""
    items = []
    for kind, letters in (("forward", "F"), ("backward", "B/W"), ("optimizer", "opt"), ("other", "name")):
        item = Text()
        item.append(f" {letters} ", STYLES[kind])
        item.append(f" {kind}")
        items.append(item)
    items.append(Text.assemble((COMM_CHAR, COMM_STYLE), " message (sending or waiting)"))
    items.append(Text.assemble((IDLE_CHAR, IDLE_STYLE), " idle"))
    if cell is not None:
        items.append(Text(f"1 cell = {A.fmt_time(cell, unit)}"))
    lines = [Text()]
    for item in items:
        if lines[-1].cell_len and lines[-1].cell_len + 2 + item.cell_len > width:
            lines.append(Text())
        if lines[-1].cell_len:
            lines[-1].append("  ")
        lines[-1].append_text(item)
    return lines


def traffic_table(trace: Trace) -> Table | None:
    """Bytes sent per rank, per op/algorithm, and the formula's bytes: a "formula" row for the
    scalar ``expected_bytes`` (every rank the same), and for a key of ``expected_bytes_by_rank`` a
    "formula" column next to the measured column(s) it covers, one number per rank."""
    by_op = A.bytes_by_op(trace)
    if not by_op:
        return None
    by_rank = A.formula_by_rank(trace)
    keys = list(by_op)

    def covers(fkey: str, key: str) -> bool:  # a bare "op" formula covers every "op/algorithm" column
        return fkey == key or fkey == key.split("/")[0]

    after: dict[int, list[tuple[str, list[float]]]] = {}  # measured column index -> formula columns
    for fkey, _, values in by_rank:
        hits = [i for i, k in enumerate(keys) if covers(fkey, k)]
        after.setdefault(hits[-1] if hits else len(keys) - 1, []).append((fkey, values))
    columns: list[tuple[str, str | None, list[float] | None]] = []  # (header, measured key, formula)
    for i, key in enumerate(keys):
        columns.append((key, key, None))
        for fkey, values in after.get(i, []):
            columns.append(("formula" if fkey == key else f"{fkey} formula", None, values))
    table = Table(title="bytes sent per rank", title_justify="left")
    table.add_column("rank", justify="right")
    for header, key, _ in columns:
        table.add_column(header, justify="right", style=None if key else "italic")
    table.add_column("total", justify="right", style="bold")
    for r in range(trace.world_size):
        cells = [f"{by_op[key][r]:,}" if key else f"{values[r]:,.0f}" for _, key, values in columns]
        table.add_row(str(r), *cells, f"{sum(by_op[k][r] for k in keys):,}")
    ranked = {fkey for fkey, _, _ in by_rank}
    expected = {k: v for k, _, v in A.measured_vs_formula(trace) if k not in ranked}
    if expected:
        row = []
        for _, key, _ in columns:  # a bare "op" key of the formula applies to every "op/algorithm" column
            v = None if key is None else expected.get(key, expected.get(key.split("/")[0]))
            row.append("" if v is None else f"{v:,.0f}")
        table.add_row("formula", *row, "", style="italic")
    return table


def print_timeline(trace_or_path: Trace | str | os.PathLike[str], console: Console | None = None,
                   width: int | None = None, title: str | None = None) -> None:
    """Print the timeline, legend, bubble fractions and traffic table of one trace.

    ``width`` is the whole line's width (default: the console's). Pass a ``Console`` to choose
    colour handling (e.g. ``Console(force_terminal=True)`` under ``mpiexec``).
    """
    trace = _as_trace(trace_or_path)
    if console is None:
        console = Console(width=width) if width else Console()
    width = width or console.width
    meta = trace.meta
    s = A.summary(trace)
    unit = A.time_unit(trace)
    head = title or ", ".join(str(x) for x in (meta.get("paradigm", "trace"), meta.get("schedule"),
                                                f"{trace.world_size} ranks", meta.get("backend")) if x)
    bubble = "" if s["bubble_fraction"] is None else f", bubble {100 * s['bubble_fraction']:.1f}%"
    # Lines are laid out to ``width`` here; soft_wrap stops rich from cropping them to a narrower
    # console (e.g. 80 columns when stdout is not a terminal, as under mpiexec).
    console.print(Text(head, "bold"), soft_wrap=True)
    console.print(f"step {A.fmt_time(s['step_time'], unit)}{bubble}", soft_wrap=True, highlight=False)
    for line in timeline_text(trace, width):
        console.print(line, soft_wrap=True)
    lo, hi = A.window(trace)
    columns = _columns(trace, width)[1]
    for line in legend((hi - lo) / columns if hi > lo else None, unit, width):
        console.print(line, soft_wrap=True)
    table = traffic_table(trace)
    if table is not None:
        console.print(table, width=width)

