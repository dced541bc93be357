"""A timeline too big to draw span by span: a few ranks' lanes, each cell what filled most of it.

``viz.terminal.print_timeline`` draws every rank's lane and gives each compute span its own cells;
with many ranks (64 lanes do not fit a screen) or many spans per lane (1,024 spans in ~100 columns
cannot each win a cell) it would draw more than anyone can read, and its per-rank passes over all
events cost O(p E). ``print_overview`` downsamples instead:

- lanes: at most ``max_lanes`` ranks, evenly spaced, always the first and the last
  (``shown_ranks``);
- cells: the step window cut into one line of cells; a cell shows the kind of compute (forward,
  backward, ...; ``viz.terminal``'s characters and colours) that covered most of it, or ``.`` when the
  rank computed less than half of it;
- behind each lane the rank's idle share of the step (exact, from its spans, not from the cells).

One pass over the events, then O(cells) per lane: O(E + L C) for E events, L lanes and C cells.
``fits`` says when ``print_timeline`` can draw the trace instead (the ``minipar simulate`` CLI asks).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from minipar.trace import Trace
from viz import analysis as A
from viz.style import clock, ranks
from viz.terminal import FILL, IDLE_CHAR, IDLE_STYLE, MAX_BANDS, PREFIX_FMT, STYLES, SUFFIX_WIDTH, ruler

MAX_LANES = 16  # lanes drawn at most (a screen's height with the ruler, the legend and the numbers)


def shown_ranks(world_size: int, max_lanes: int = MAX_LANES) -> list[int]:
    """At most ``max_lanes`` ranks of ``world_size``, evenly spaced, the first and the last among them."""
    if world_size <= max_lanes:
        return list(range(world_size))
    if max_lanes < 2:
        return [0]
    step = (world_size - 1) / (max_lanes - 1)
    return sorted({round(i * step) for i in range(max_lanes)})


def fits(world_size: int, spans_per_rank: int, width: int, max_lanes: int = MAX_LANES) -> bool:
    """Whether ``print_timeline`` can draw every lane and give every span a cell: at most ``max_lanes``
    ranks, and at most ``MAX_BANDS`` bands of about ``width`` cells for the busiest rank's spans."""
    return world_size <= max_lanes and spans_per_rank <= MAX_BANDS * max(1, width - 20)


def overview_lines(trace: Trace, width: int, max_lanes: int = MAX_LANES,
                   window: tuple[float, float] | None = None) -> list[Text]:
    """The ruler, then one lane per shown rank (``rank r`` in front, ``idle x%`` behind), each line
    ``width`` characters at most. ``window``: the step's (start, end) if known (else one pass finds it)."""
    world = trace.world_size
    lanes = shown_ranks(world, max_lanes)
    lane_of = {r: i for i, r in enumerate(lanes)}
    lo, hi = window or _window(trace)
    w = len(str(world - 1))
    prefix = len(PREFIX_FMT.format(0, w=w))
    columns = max(4, width - prefix - SUFFIX_WIDTH)
    kinds = list(STYLES)
    dt = (hi - lo) / columns if hi > lo else 0.0
    # share[lane][cell][kind index]: time of that kind in the cell
    share = [[[0.0] * len(kinds) for _ in range(columns)] for _ in lanes]
    spans: list[list[tuple[float, float]]] = [[] for _ in lanes]
    for e in trace.events:
        if e.kind != "compute" or e.rank not in lane_of:
            continue
        t0, t1 = max(e.t0, lo), min(e.t1, hi)
        if t1 <= t0 or dt <= 0:
            continue
        lane, k = lane_of[e.rank], kinds.index(A.kind_of(e))
        spans[lane].append((t0, t1))
        for c in range(min(columns - 1, int((t0 - lo) / dt)), min(columns - 1, int((t1 - lo) / dt)) + 1):
            overlap = min(t1, lo + (c + 1) * dt) - max(t0, lo + c * dt)
            if overlap > 0:
                share[lane][c][k] += overlap
    unit = A.time_unit(trace)
    out = [Text(" " * prefix).append_text(ruler(0, columns, dt, unit))]
    for lane, r in enumerate(lanes):
        line = Text(PREFIX_FMT.format(r, w=w), "bold")
        for cell in share[lane]:
            k = max(range(len(kinds)), key=cell.__getitem__)
            if dt > 0 and sum(cell) >= dt / 2:
                line.append(FILL[kinds[k]], STYLES[kinds[k]])
            else:
                line.append(IDLE_CHAR, IDLE_STYLE)
        idle = 1.0 - A.union_length(spans[lane], lo, hi) / (hi - lo) if hi > lo else 0.0
        line.append(f" idle {100 * idle:3.0f}%".rjust(SUFFIX_WIDTH))
        out.append(line)
    return out


def _window(trace: Trace) -> tuple[float, float]:
    """(start, end) of the compute and communication events, in one pass."""
    lo, hi = float("inf"), float("-inf")
    for e in trace.events:
        if e.kind in ("compute", "comm"):
            lo, hi = min(lo, e.t0), max(hi, e.t1)
    return (lo, hi) if lo <= hi else (0.0, 0.0)


def print_overview(trace: Trace, width: int, console: Console | None = None, max_lanes: int = MAX_LANES) -> None:
    """Print the head line, a note on what is drawn, ``overview_lines`` and the legend."""
    console = console or Console(width=width)
    meta, world = trace.meta, trace.world_size
    lanes = shown_ranks(world, max_lanes)
    unit = A.time_unit(trace)
    columns = max(4, width - len(PREFIX_FMT.format(0, w=len(str(world - 1)))) - SUFFIX_WIDTH)
    per_rank: dict[int, int] = {}
    seen: set[str] = set()
    lo, hi = float("inf"), float("-inf")
    for e in trace.events:  # one pass: the window (as _window), spans per rank, the kinds drawn
        if e.kind in ("compute", "comm"):
            lo, hi = min(lo, e.t0), max(hi, e.t1)
        if e.kind == "compute":
            per_rank[e.rank] = per_rank.get(e.rank, 0) + 1
            seen.add(A.kind_of(e))
    lo, hi = (lo, hi) if lo <= hi else (0.0, 0.0)
    head = ", ".join(str(x) for x in (meta.get("paradigm", "trace"), meta.get("schedule"), ranks(world),
                                       meta.get("backend")) if x)
    steps = A.traced_steps(trace)
    step = (f"{steps} steps traced: " if steps else "step ") + A.fmt_time(hi - lo, unit) + (
        f"; {clock(trace)}" if clock(trace) else "")
    drawn = "every rank" if len(lanes) == world else f"{len(lanes)} of {world} ranks ({_listed(lanes)})"
    busiest = max(per_rank.values(), default=0)
    why = [f"{ranks(world)} are more than {max_lanes} lanes"] * (world > max_lanes) + [
        f"up to {busiest:,} spans per rank cannot each get a cell"] * (not fits(1, busiest, width))
    note = (f"overview ({' and '.join(why) or 'asked for'}): {drawn} drawn, each cell the kind that filled "
            f"most of it ({IDLE_CHAR} = idle over half)")
    for text in (Text(head, "bold"), Text(step), Text(note)):
        for line in text.wrap(Console(width=width), width):
            console.print(line, soft_wrap=True)
    for line in overview_lines(trace, width, max_lanes, (lo, hi)):
        console.print(line, soft_wrap=True)
    items = [Text.assemble((f" {FILL[k] * 2} ", STYLES[k]), f" {k}") for k in STYLES if k in seen]
    items.append(Text.assemble((IDLE_CHAR, IDLE_STYLE), " idle"))
    if hi > lo:
        items.append(Text(f"1 cell = {A.fmt_time((hi - lo) / columns, unit)}"))
    line = Text()
    for item in items:
        if line.cell_len and line.cell_len + 2 + item.cell_len > width:
            console.print(line, soft_wrap=True)
            line = Text()
        line.append_text(Text("  ") if line.cell_len else Text()).append_text(item)
    console.print(line, soft_wrap=True)


def _listed(lanes: list[int]) -> str:
    return ", ".join(map(str, lanes)) if len(lanes) <= 4 else f"{lanes[0]}, {lanes[1]}, ..., {lanes[-1]}"
