"""Colours and titles shared by the figures (one place, so every chart agrees).

- Compute kinds: forward blue, backward orange, optimizer green, other grey; a split backward's
  halves (zero bubble) in colours of their own: input gradient (I) red, weight gradient (W) teal,
  so the W's that fill 1F1B's cool-down stand out (Qi et al. 2024, Fig. 3). Model chunks of an
  interleaved schedule are shades of their kind: chunk 0 the full colour, later chunks lighter, as
  Narayanan et al. (2021, Fig. 4) draw them ("dark colors show the first chunk and light colors
  show the second chunk").
- Ranks in bar charts: a qualitative palette (Tableau 10 without its red), one distinct hue per rank.
- Collectives in timelines: one hue per op and algorithm (all-reduce ring, all-gather ring, ...)
  or, for point-to-point and parameter-server messages, per op (send, recv, pull, push).
- Clocks: ``clock(trace)`` names what a trace's times are (replayed on a cluster, simulated, wall
  clock), for every title that shows a time.
"""

from __future__ import annotations

from minipar.trace import Trace
from viz.analysis import is_simulated

COLORS = {"forward": "#4C78A8", "backward": "#F58518", "input gradient": "#E45756", "weight gradient": "#72B7B2",
          "optimizer": "#54A24B", "other": "#9D9D9D"}
RANK_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#72B7B2", "#EECA3B", "#9D755D", "#BAB0AC",
               "#FF9DA6", "#79706E"]
# one hue per collective (op and algorithm) or point-to-point op, the same in every figure
COMM_COLORS = {"allreduce/ring": "#B279A2", "allreduce/recursive_doubling": "#2CA1A1", "allreduce/naive": "#D6616B",
               "allreduce/native": "#7B4173", "reduce_scatter/ring": "#E7BA52", "allgather/ring": "#5254A3",
               "broadcast/tree": "#8C6D31", "barrier/dissemination": "#BAB0AC", "send": "#6B6ECF",
               "recv": "#17BECF", "pull": "#BD9E39", "push": "#637939"}
SPARE_COLORS = ["#CE6DBD", "#AD494A", "#393B79", "#843C39", "#9C9EDE", "#E7969C"]
FORMULA_COLOR = "#D62728"
MEMORY_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6"]


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def shade(color: str, chunk: int | None, chunks: int) -> str:
    """``color`` for chunk 0, mixed towards white for later chunks (at most 65% white)."""
    if not chunk or chunks <= 1:
        return color
    mix = 0.65 * chunk / (chunks - 1)
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


def comm_color(key: str) -> str:
    """The colour of a collective ``"op/algorithm"`` or a bare ``"op"``; other keys get a spare
    colour chosen by their letters, so a key has one colour in every figure."""
    return COMM_COLORS.get(key) or SPARE_COLORS[sum(map(ord, key)) % len(SPARE_COLORS)]


def title(trace: Trace, what: str) -> str:
    """``"what: paradigm, schedule, 4 ranks, backend"`` from the trace's metadata."""
    meta = trace.meta
    parts = [str(meta.get("paradigm", "trace"))]
    if meta.get("schedule"):
        parts.append(str(meta["schedule"]))
    parts.append(ranks(trace.world_size))
    if meta.get("backend"):
        parts.append(str(meta["backend"]))
    return f"{what}: {', '.join(parts)}" if what else ", ".join(parts)


def clock(trace: Trace, short: bool = False) -> str:
    """What the trace's times are: "replayed: one core per rank, network <cluster>" (``minipar.replay``'s
    output; ``short``: "replayed on <cluster>"), "simulated" (the pipeline simulator), "wall clock" (a
    recorded run, as recorded: with more ranks than cores, the operating system's time-sharing is in
    it), or "" when the trace does not say (made by hand)."""
    meta = trace.meta
    if meta.get("clock") == "replay":
        label = (meta.get("replay") or {}).get("label")
        return f"replayed on {meta.get('cluster')}" if short or not label else str(label)
    if is_simulated(trace):
        return "simulated"
    return "wall clock" if meta.get("clock") == "wall" else ""


def with_clock(text: str, trace: Trace) -> str:
    """``text (clock)`` for a figure's title, ``text`` when the trace does not name its clock."""
    name = clock(trace)
    return f"{text} ({name})" if name else text


def ranks(n: int) -> str:
    """'1 rank', '4 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"
