"""Colours and titles shared by the figures (one place, so every chart agrees).

- Compute kinds: forward blue, backward orange, optimizer green, other grey; a split backward's
  halves (zero bubble) in colours of their own: input gradient (I) red, weight gradient (W) teal,
  so the W's that fill 1F1B's cool-down stand out (Qi et al. 2024, Fig. 3); a recomputed forward
  (R, ``minipar.recompute``) purple, drawn inside its backward. Model chunks of an
  interleaved schedule are shades of their kind: chunk 0 the full colour, later chunks lighter, as
  Narayanan et al. (2021, Fig. 4) draw them ("dark colors show the first chunk and light colors
  show the second chunk").
- Ranks in bar charts: a qualitative palette (Tableau 10 without its red), one distinct hue per rank.
- Collectives in timelines: one hue per op and algorithm (all-reduce ring, all-gather ring, ...)
  or, for point-to-point, parameter-server and Ring Attention messages, per op (send, recv, pull,
  push, ring_kv, ring_dkv). Every op and algorithm ``minipar.comm`` has (``ALGORITHMS_BY_OP``) gets a
  colour of its own, none shared with another op or a compute kind, so no two kinds drawn in one
  report look alike; an op outside the table gets a spare colour by its letters.
- Clocks: ``clock(trace)`` names what a trace's times are and what costs they come from, in the words
  the lessons use (``lessons.common.Clock.label``): "replayed: one core per rank, network <cluster>",
  "wall clock, as recorded", "simulated, unit costs: forward 1, backward 2" or "simulated, costs per
  stage: forward <t>, backward <t>" (what the simulator was given), for every title that shows a time.
"""

from __future__ import annotations

from minipar.trace import Trace
from viz.analysis import fmt_time, is_simulated, time_unit

COLORS = {"forward": "#4C78A8", "backward": "#F58518", "input gradient": "#E45756", "weight gradient": "#72B7B2",
          "recompute": "#6B4C9A", "optimizer": "#54A24B", "other": "#9D9D9D"}
RANK_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#72B7B2", "#EECA3B", "#9D755D", "#BAB0AC",
               "#FF9DA6", "#79706E"]
# one hue per collective (op and algorithm) or point-to-point op, the same in every figure
COMM_COLORS = {"allreduce/ring": "#B279A2", "allreduce/recursive_doubling": "#2CA1A1", "allreduce/naive": "#843C39",
               "allreduce/native": "#7B4173", "reduce_scatter/ring": "#E7BA52", "reduce_scatter/native": "#8CA252",
               "allgather/ring": "#5254A3", "allgather/native": "#9C9EDE", "all_to_all/pairwise": "#8C564B",
               "all_to_all/native": "#C49C94", "broadcast/tree": "#8C6D31", "broadcast/native": "#B5CF6B",
               "reduce/tree": "#AD494A", "reduce/native": "#E7969C", "barrier/dissemination": "#BAB0AC",
               "barrier/native": "#E7CB94", "send": "#6B6ECF", "recv": "#17BECF", "pull": "#BD9E39",
               "push": "#637939", "ring_kv": "#393B79", "ring_dkv": "#CE6DBD"}
SPARE_COLORS = ["#DE9ED6", "#BCBD22", "#9467BD", "#E377C2", "#7F7F7F", "#AEC7E8"]
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
    """What the trace's times are, in the words of ``lessons.common.Clock.label``: "replayed: one core per
    rank, network <cluster>" (``minipar.replay``'s output; ``short``: "replayed on <cluster>"), "wall
    clock, as recorded" (a recorded run: with more ranks than cores, the operating system's time-sharing is
    in it; ``short``: "wall clock"), "simulated, <costs>" (the pipeline simulator, ``simulated_costs``;
    ``short``: "simulated"), or "" when the trace does not say (made by hand)."""
    meta = trace.meta
    if meta.get("clock") == "replay":
        label = (meta.get("replay") or {}).get("label")
        return f"replayed on {meta.get('cluster')}" if short or not label else str(label)
    if is_simulated(trace):
        costs = simulated_costs(trace)
        return "simulated" if short or not costs else f"simulated, {costs}"
    if meta.get("clock") == "wall":
        return "wall clock" if short else "wall clock, as recorded"
    return ""


def simulated_costs(trace: Trace) -> str:
    """The costs a simulated schedule was played with (its meta's per-stage ``forward`` / ``backward``):
    "unit costs: forward 1, backward 2" (the papers' figures), else "costs per stage: forward 3.2 ms,
    backward 6.1 ms" (means over stages when they differ); "" when the meta does not say."""
    fwd, bwd = trace.meta.get("forward"), trace.meta.get("backward")
    if not isinstance(fwd, list) or not isinstance(bwd, list) or not fwd or not bwd:
        return ""
    if set(fwd) == {1} and set(bwd) == {2}:
        return "unit costs: forward 1, backward 2"
    unit = time_unit(trace)
    each = "" if len(set(fwd)) == 1 and len(set(bwd)) == 1 else " (means over stages)"
    return (f"costs per stage: forward {fmt_time(sum(fwd) / len(fwd), unit)}, backward "
            f"{fmt_time(sum(bwd) / len(bwd), unit)}{each}")


def with_clock(text: str, trace: Trace) -> str:
    """``text (clock)`` for a figure's title, ``text`` when the trace does not name its clock."""
    name = clock(trace)
    return f"{text} ({name})" if name else text


def ranks(n: int) -> str:
    """'1 rank', '4 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"
