"""The terminal timeline: per-rank lanes of labelled blocks, a time ruler, legend and traffic table (rich).

Each rank gets a lane of character cells, each covering the same slice of the step window (see
``viz.analysis``). A cell shows the compute span that covers more than half of it; a span too short
to win any cell still claims its best-overlapping idle cell, so short spans do not vanish. Cells
left free show a collective call (``viz.messages.collective_spans``: all of a rank's messages of
one call, one span from its first step to its last), a point-to-point message (``~``, sending or
waiting in a receive; a message without an algorithm: send, recv, a parameter server's push and pull,
Ring Attention's K/V pass) or nothing (``.``, idle). A collective the rank's own thread runs inside a
compute span shows as that span: the computation waits in it, nothing overlaps it.

Labels: a block gets its label (``F0``, ``B3.1`` with chunks, ``F2↑`` for Chimera's up pipeline
(drawn in reverse: the kind's colour on white), ``opt``; ``allreduce ring`` for a
collective call) only where the label fits inside it with at least one cell between it and the
previous label; otherwise the label is shortened (chunk dropped; ``ring`` or ``allreduce``
alone) or left out and the block is filled with its kind's character (``>`` forward,
``<`` backward, ``(`` input gradient and ``=`` weight gradient of a split backward, ``*`` optimizer,
``#`` other, ``~`` communication). With colour each block is also
painted by kind, so the lanes read with and without colour. A lost rank's lane ends in ``X`` (blank
after), a survivor's "peer declared dead" is ``!`` (``viz.faults``).

Cell size (``layout``): a block needs a cell per character of its short label plus one, so a
cell is the lower quartile over compute spans (calls if there are none) of duration / (label
length + 1): three in four get their label. When that needs more cells than the terminal has
columns, the lanes fold into up to ``MAX_BANDS`` bands, each under a ruler of the time since the
step's start; beyond, cells grow.

Under ``mpiexec`` stdout is not a terminal: set ``FORCE_COLOR=1`` or pass your own ``Console`` for
colour; the width is still the terminal's (``viz.width.terminal_width``).
Cost: O(E log E + E * C) for E events and C cells.
"""

from __future__ import annotations

import math
import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

from minipar.trace import Event, Trace, load
from viz import analysis as A
from viz import faults
from viz import messages as M
from viz.style import clock, ranks
from viz.width import terminal_width

STYLES = {"forward": "bold white on blue", "backward": "bold black on dark_orange",
          "input gradient": "bold white on red3", "weight gradient": "bold black on dark_cyan",
          "recompute": "bold white on purple4",
          "optimizer": "bold white on green", "other": "bold white on grey50"}
FILL = {"forward": ">", "backward": "<", "input gradient": "(", "weight gradient": "=", "recompute": "^",
        "optimizer": "*", "other": "#"}
LETTERS = {"forward": "F0", "backward": "B0", "input gradient": "I0", "weight gradient": "W0", "recompute": "R",
           "optimizer": "opt", "other": "name"}  # a legend entry's sample label
COMM_CHAR, IDLE_CHAR = "~", "."
COMM_STYLE, CALL_STYLE, IDLE_STYLE, RULER_STYLE = "magenta", "bold magenta", "grey39", "dim"
PREFIX_FMT = "rank {:<{w}} "
SUFFIX_WIDTH = len("  idle 100%")
MAX_BANDS = 4
UP_STYLE = " reverse"  # added to a kind's style for Chimera's up pipeline (args["direction"])


Call = M.CommSpan  # one collective call as one rank took part in it


def collective_calls(trace: Trace) -> dict[int, list[Call]]:
    """Each rank's collective calls: ``viz.messages.collective_spans`` without point-to-point messages
    (those without an algorithm: send, recv, push, pull, ring_kv, ...)."""
    calls: dict[int, list[Call]] = {r: [] for r in range(trace.world_size)}
    for span in M.collective_spans(trace):
        if span.algorithm is not None and span.rank in calls:
            calls[span.rank].append(span)
    return calls


def _call_labels(call: Call, several: set[str]) -> list[str]:
    """``allreduce ring``; shorter: the algorithm if the trace runs the op with several, else the op."""
    if not call.algorithm:
        return [call.op]
    return [f"{call.op} {call.algorithm}", call.algorithm if call.op in several else call.op]


def _ops_with_several_algorithms(trace: Trace) -> set[str]:
    algorithms: dict[str, set[str | None]] = {}
    for e in trace.events:
        if e.kind == "comm" and e.algorithm is not None:
            algorithms.setdefault(str(e.op), set()).add(e.algorithm)
    return {op for op, algs in algorithms.items() if len(algs) > 1}


def _labels(owner: Event | Call, chunks: bool, several: set[str]) -> list[str]:
    """Labels of a block, longest first (``F embed`` for a span of a named layer, as tensor parallelism's)."""
    if isinstance(owner, Call):
        return _call_labels(owner, several)
    layer = [f"{owner.name} {owner.args['layer']}"] if "layer" in owner.args and owner.microbatch is None else []
    return list(dict.fromkeys((*layer, A.label(owner, chunks), A.label(owner))))


Owner = Event | Call | str | None  # a compute span, a collective call, COMM_CHAR, or idle


def _cells(trace: Trace, rank: int, n: int, lo: float, dt: float, calls: list[Call]) -> list[Owner]:
    """Per cell: the compute Event shown there, the collective Call, COMM_CHAR, or None (idle)."""

    def cover(t0: float, t1: float) -> range:
        return range(max(0, min(n - 1, int((t0 - lo) / dt))), max(0, min(n - 1, int((t1 - lo) / dt))) + 1)

    def overlap(t0: float, t1: float, c: int) -> float:
        return max(0.0, min(t1, lo + (c + 1) * dt) - max(t0, lo + c * dt))

    hi = lo + n * dt
    spans = A.compute_spans(trace, rank)
    cells: list[Owner] = [None] * n
    best = [0.0] * n
    for e in spans:
        for c in cover(e.t0, e.t1):
            ov = overlap(e.t0, e.t1, c)
            if ov > dt / 2 and ov >= best[c]:
                cells[c], best[c] = e, ov
    shown = {id(x) for x in cells if isinstance(x, Event)}
    for e in spans:  # too short to win a cell: take its best idle cell
        if id(e) in shown or e.t1 <= lo or e.t0 >= hi:
            continue
        free = [c for c in cover(e.t0, e.t1) if cells[c] is None]
        if free:
            cells[max(free, key=lambda c: overlap(e.t0, e.t1, c))] = e
    p2p = [(e.t0, e.t1, COMM_CHAR) for e in trace.events
           if e.kind == "comm" and e.rank == rank and e.algorithm is None and e.t1 > e.t0]
    for t0, t1, owner in [(k.t0, k.t1, k) for k in calls] + p2p:
        if t1 > lo and t0 < hi:
            for c in cover(t0, t1):
                if cells[c] is None and (overlap(t0, t1, c) > 0 or t0 == t1):
                    cells[c] = owner
    return cells


def _render(cells: list[Owner], chunks: bool, several: set[str], labelled: set[int]) -> Text:
    """Draw a run of cells: each block once (back-to-back calls of one op and algorithm as one),
    labelled where its label fits (see the docstring). ``labelled`` holds the ids of the blocks
    already labelled (in an earlier band); updated in place."""

    def same(a: Owner, b: Owner) -> bool:
        return a is b or (isinstance(a, Call) and isinstance(b, Call) and (a.op, a.algorithm) == (b.op, b.algorithm))

    text = Text()
    free = 0  # the first cell where a label may start: one cell after the previous label
    c = 0
    while c < len(cells):
        owner, end = cells[c], c + 1
        while end < len(cells) and same(cells[end], owner):
            end += 1
        members = {id(x) for x in cells[c:end]}
        if owner is None:
            text.append(IDLE_CHAR * (end - c), IDLE_STYLE)
        elif isinstance(owner, str):
            text.append(owner * (end - c), faults.CHAR_STYLES.get(owner, COMM_STYLE))
        else:
            is_call = isinstance(owner, Call)
            fill = COMM_CHAR if is_call else FILL[A.kind_of(owner)]
            pad = fill if is_call else " "  # around a label, and where a labelled block goes on
            s = max(c, free)
            fits = [lab for lab in _labels(owner, chunks, several) if s + len(lab) <= end]
            if members & labelled or not fits:
                body = (pad if members & labelled else fill) * (end - c)
            else:
                labelled |= members
                body = pad * (s - c) + fits[0] + pad * (end - s - len(fits[0]))
                free = s + len(fits[0]) + 1
            text.append(body, CALL_STYLE if is_call else _style(owner))
        c = end
    return text


def _style(span: Event) -> str:
    """The kind's style; a span of Chimera's up pipeline in reverse (the kind's colour on white)."""
    return STYLES[A.kind_of(span)] + (UP_STYLE if A.direction(span) == "up" else "")


def layout(trace: Trace, columns: int, max_bands: int = MAX_BANDS) -> tuple[float, int]:
    """(time per cell, bands): three compute spans in four (collective calls in a trace without
    compute) get a cell per character of their short label plus one, in at most ``max_bands``
    bands of ``columns`` cells (every band full)."""
    lo, hi = A.window(trace)
    if hi <= lo:
        return 0.0, 1
    several = _ops_with_several_algorithms(trace)
    blocks = [e for e in trace.events if e.kind == "compute"] or [  # calls only in a trace of calls alone
        k for calls in collective_calls(trace).values() for k in calls]
    # room for the shortest label: F3 (no chunk), ring or allreduce
    need = [(b.t1 - b.t0) / (len(_labels(b, False, several)[-1]) + 1) for b in blocks if b.t1 > b.t0]
    target = sorted(need)[len(need) // 4] if need else hi - lo  # the lower quartile
    bands = max(1, min(max_bands, math.ceil((hi - lo) / (columns * target))))
    return (hi - lo) / (bands * columns), bands


def lanes(trace: Trace, columns: int, bands: int = 1) -> list[list[Text]]:
    """Per band, one styled lane of exactly ``columns`` cells per rank (no prefix or suffix); the
    step window is cut into ``bands * columns`` equal cells."""
    if columns < 1:
        raise ValueError(f"timeline needs at least 1 column, got {columns}; pass a larger width")
    lo, hi = A.window(trace)
    if hi <= lo:
        return [[Text(IDLE_CHAR * columns, IDLE_STYLE) for _ in range(trace.world_size)]] * bands
    chunks, several = A.shows_chunks(trace), _ops_with_several_algorithms(trace)
    dt = (hi - lo) / (bands * columns)
    out: list[list[Text]] = [[] for _ in range(bands)]
    calls = collective_calls(trace)
    for rank in range(trace.world_size):
        cells = faults.mark_cells(trace, rank, _cells(trace, rank, bands * columns, lo, dt, calls[rank]), lo, dt)
        labelled: set[int] = set()
        for b in range(bands):
            out[b].append(_render(cells[b * columns:(b + 1) * columns], chunks, several, labelled))
    return out


def _columns(trace: Trace, width: int) -> tuple[int, int, int]:
    """(prefix width, timeline cells, suffix width) of a ``width``-character lane line."""
    prefix = len(PREFIX_FMT.format(0, w=len(str(trace.world_size - 1))))
    suffix = SUFFIX_WIDTH if A.bubble_fractions(trace) is not None else 0
    columns = width - prefix - suffix
    if columns < 4:
        raise ValueError(f"width {width} leaves {columns} columns for the timeline; use a width of at "
                         f"least {width - columns + 4}")
    return prefix, columns, suffix


def _tick_text(t: float, step: float, unit: str) -> str:
    if unit != "s":
        return f"{t:g} {unit}"
    scale, name = next(((s, n) for s, n in ((1.0, "s"), (1e-3, "ms")) if step >= s), (1e-6, "µs"))
    return f"{round(t / scale, 6):g} {name}"


def ruler(first_cell: int, columns: int, dt: float, unit: str) -> Text:
    """Times since the step's start (round numbers) at the cells where they fall, ``columns`` wide."""
    line = [" "] * columns
    if dt > 0:
        widest = len(_tick_text((first_cell + columns) * dt, dt, unit)) + 2
        step = next(m * 10.0 ** k for k in range(math.floor(math.log10(dt)) - 1, 400) for m in (1, 2, 5)
                    if m * 10.0 ** k >= widest * dt)
        t = math.ceil(first_cell * dt / step) * step
        while (c := int(round(t / dt, 9)) - first_cell) < columns:
            label = "|" + _tick_text(t, step, unit)
            if c + len(label) <= columns:
                line[c:c + len(label)] = label
            t += step
    return Text("".join(line), RULER_STYLE)


def timeline_text(trace: Trace, width: int = 80, max_bands: int = MAX_BANDS) -> list[Text]:
    """Per band a ruler, then each rank's lane with ``rank r`` in front; the idle fraction behind
    the last band's lanes. Every line is at most ``width`` characters."""
    w = len(str(trace.world_size - 1))
    fractions = A.bubble_fractions(trace)
    prefix, columns, suffix = _columns(trace, width)
    dt, bands = layout(trace, columns, max_bands)
    unit = A.time_unit(trace)
    out = []
    for b, band in enumerate(lanes(trace, columns, bands)):
        out.append(Text(" " * prefix).append_text(ruler(b * columns, columns, dt, unit)))
        for r, lane in enumerate(band):
            line = Text()
            line.append(PREFIX_FMT.format(r, w=w), "bold")
            line.append_text(lane)
            if fractions is not None and b == bands - 1:
                line.append(f" idle {100 * fractions[r]:3.0f}%".rjust(suffix))
            out.append(line)
    return out


def legend(cell: float | None = None, unit: str = "s", width: int = 80, kinds: tuple[str, ...] = tuple(STYLES),
           call: str | None = None, directions: bool = False, lost: bool = False) -> list[Text]:
    """What the blocks (of ``kinds``) and characters mean, and the time one cell covers, wrapped to
    ``width``; ``call`` (e.g. "allreduce ring") explains collective calls, ``directions`` Chimera's
    two pipelines."""
    items = []
    for kind, letters in LETTERS.items():
        if kind in kinds:
            items.append(Text.assemble((f" {letters} {FILL[kind] * 2}", STYLES[kind]), f" {kind}"))
    if directions and kinds:
        first = STYLES[kinds[0]]
        items.append(Text.assemble((f" F0{A.ARROWS['down']} ", first), " down pipeline  ",
                                   (f" F2{A.ARROWS['up']} ", first + UP_STYLE), " up pipeline (reversed colours)"))
    if kinds:
        items.append(Text(f"({', '.join(FILL[k] for k in STYLES if k in kinds)}: too short for a label)"))
    if call:
        items.append(Text.assemble((f"{call}~~", CALL_STYLE), " one collective call"))
    items.append(Text.assemble((COMM_CHAR, COMM_STYLE), " message (sending or waiting)"))
    items.append(Text.assemble((IDLE_CHAR, IDLE_STYLE), " idle"))
    if lost:
        items.append(Text.assemble((faults.KILL_CHAR, faults.CHAR_STYLES[faults.KILL_CHAR]), " killed (lane ends)  ",
                                   (faults.DETECT_CHAR, faults.CHAR_STYLES[faults.DETECT_CHAR]), " peer declared dead"))
    if cell is not None:
        items.append(Text(f"1 cell = {A.fmt_time(cell, unit)}"))
    lines = [Text()]
    for item in items:
        if lines[-1].cell_len and lines[-1].cell_len + 2 + item.cell_len > width:
            lines.append(Text())
        if lines[-1].cell_len:
            lines[-1].append("  ")
        if item.cell_len > width:  # longer than a line: word-wrapped on lines of its own
            lines[-1:] = [*item.wrap(Console(width=width), width), Text()]
            continue
        lines[-1].append_text(item)
    return [line for line in lines if line.cell_len]


def traffic_tables(trace: Trace, width: int = 80) -> list[Table]:
    """Bytes sent per rank, per op/algorithm, and the formula's bytes: a "formula" row for the
    scalar ``expected_bytes`` (every rank the same), and for a key of ``expected_bytes_by_rank`` a
    "formula" column next to the measured column(s) it covers, one number per rank; none when no
    message carries bytes. Headers break
    at ``/`` and are never cut: columns that do not fit in ``width`` go to a further table."""
    by_op = A.bytes_by_op(trace)
    if not any(any(row) for row in by_op.values()):  # no bytes (the simulator's messages): no table
        return []
    by_rank = A.formula_by_rank(trace)
    keys = list(by_op)

    after: dict[int, list[tuple[str, list[float]]]] = {}  # measured column index -> formula columns
    for fkey, _, values in by_rank:  # a bare "op" formula covers every "op/algorithm" column
        hits = [i for i, k in enumerate(keys) if fkey in (k, k.split("/")[0])]
        after.setdefault(hits[-1] if hits else len(keys) - 1, []).append((fkey, values))
    ranked = {fkey for fkey, _, _ in by_rank}
    expected = {k: v for k, _, v in A.measured_vs_formula(trace) if k not in ranked}
    p = trace.world_size
    # (header, cells: one per rank then the formula row's, style)
    columns: list[tuple[str, list[str], str | None]] = []
    for i, key in enumerate(keys):
        v = expected.get(key, expected.get(key.split("/")[0]))  # a bare "op" key covers "op/algorithm"
        columns.append((key.replace("/", "\n"), [f"{n:,}" for n in by_op[key]] + ["" if v is None else f"{v:,.0f}"],
                        None))
        for fkey, values in after.get(i, []):
            header = "formula" if fkey == key else fkey.replace("/", "\n") + "\nformula"
            columns.append((header, [f"{x:,.0f}" for x in values] + [""], "italic"))
    columns.append(("total", [f"{sum(by_op[k][r] for k in keys):,}" for r in range(p)] + [""], "bold"))
    rows = [str(r) for r in range(p)] + (["formula"] if expected else [])

    w = [max(len(s) for s in [*h.split("\n"), *cells]) + 3 for h, cells, _ in columns]  # padding, border
    first = max(len(s) for s in ["rank", *rows]) + 4
    units: list[list[int]] = []  # a measured column with its formula columns, unless too wide together
    for i, (_, _, style) in enumerate(columns):
        if style == "italic" and units and first + sum(w[j] for j in units[-1]) + w[i] <= width:
            units[-1].append(i)
        else:
            units.append([i])
    groups: list[list[int]] = [[]]
    used = first
    for unit in units:
        if groups[-1] and used + sum(w[i] for i in unit) > width:
            groups.append([])
            used = first
        groups[-1].extend(unit)
        used += sum(w[i] for i in unit)
    steps = A.traced_steps(trace)
    over = f", all {steps} traced steps" if steps else ""
    tables = []
    for g, group in enumerate(groups):
        title = f"bytes sent per rank{over}" + (" (continued)" if g else "")
        table = Table(title=title, title_justify="left")
        table.add_column("rank", justify="right", no_wrap=True)
        for i in group:
            header, _, style = columns[i]
            table.add_column(header, justify="right", style=style, no_wrap=True, min_width=w[i] - 3)
        for r, name in enumerate(rows):
            table.add_row(name, *[columns[i][1][r] for i in group], style="italic" if name == "formula" else None)
        tables.append(table)
    return tables


def print_timeline(trace_or_path: Trace | str | os.PathLike[str], console: Console | None = None,
                   width: int | None = None, title: str | None = None, max_bands: int = MAX_BANDS,
                   traffic: bool = True) -> None:
    """Print the timeline, legend, bubble fractions and traffic table of one trace (``traffic=False``:
    without the table), the step line naming the clock of its times (``style.clock``: replayed on a
    cluster, simulated, wall clock).

    ``width`` is the whole line's width (default: the console's; without a console, the terminal's,
    ``viz.width.terminal_width``); no line is longer. Pass a ``Console`` to choose colour handling
    (e.g. ``Console(force_terminal=True)`` under ``mpiexec``).
    """
    trace = trace_or_path if isinstance(trace_or_path, Trace) else load(trace_or_path)
    if console is None:  # the terminal's width, also under mpiexec (viz.width.terminal_width)
        console = Console(width=width or terminal_width())
    width = width or console.width
    meta = trace.meta
    s = A.summary(trace)
    unit = A.time_unit(trace)
    head = title or ", ".join(str(x) for x in (meta.get("paradigm", "trace"), meta.get("schedule"),
                                                ranks(trace.world_size), meta.get("backend")) if x)
    idle = "bubble" if meta.get("paradigm") == "pipeline" else "idle"  # a bubble is a pipeline's idle time
    bubble = "" if s["bubble_fraction"] is None else f", {idle} {100 * s['bubble_fraction']:.1f}%"
    # Lines are laid out to ``width`` here; soft_wrap stops rich from cropping them to a narrower
    # console (e.g. 80 columns when stdout is not a terminal, as under mpiexec).
    steps = A.traced_steps(trace)  # a trace of several steps: its time is theirs, not one step's
    step = (f"{steps} steps traced: {A.fmt_time(s['step_time'], unit)}" if steps else
            f"step {A.fmt_time(s['step_time'], unit)}") + bubble + (f"; {clock(trace)}" if clock(trace) else "")
    for line in [*Text(head, "bold").wrap(Console(width=width), width), *Text(step).wrap(Console(width=width), width)]:
        console.print(line, soft_wrap=True)
    for line in timeline_text(trace, width, max_bands):
        console.print(line, soft_wrap=True)
    dt, _ = layout(trace, _columns(trace, width)[1], max_bands)
    kinds = tuple(k for k in STYLES if any(A.kind_of(e) == k for e in trace.events if e.kind == "compute"))
    calls = sorted((c for cs in collective_calls(trace).values() for c in cs),
                   key=lambda c: c.op == "barrier")  # a call that moves data explains more
    call = _labels(calls[0], False, _ops_with_several_algorithms(trace))[0] if calls else None
    directions = any(A.direction(e) for e in trace.events if e.kind == "compute")
    lost = bool(faults.lost_ranks(trace) or faults.detections(trace))
    for line in legend(dt or None, unit, width, kinds, call, directions, lost):
        console.print(line, soft_wrap=True)
    for table in traffic_tables(trace, min(width, console.width)) if traffic else []:
        console.print(table)
