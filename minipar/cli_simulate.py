"""``minipar simulate KIND``: a pipeline schedule of any kind the runtime has, simulated.

    minipar simulate 1f1b --stages 4 --microbatches 8 [-o sim.json]   a schedule, simulated
    minipar simulate interleaved --chunks 2                           (v model chunks per rank)
    minipar simulate chimera -p 4 -m 8                                two pipelines in opposite directions

Kinds (``kinds()``): every generator in ``minipar.parallel.pipeline.GENERATORS`` (naive, GPipe, 1F1B,
interleaved, ZB-H1, ZB-H2, ZB-V, and any kind added there as docs/adding-a-paradigm.md says), the
asynchronous PipeDream and PipeDream-2BW (``asynchronous.py``: a stage's update ``U`` inside the step,
taking no time here) and Chimera (``chimera.simulate_chimera``), in any case (``1F1B``, ``ZB-V``).

Every argument is checked before any work, and one that cannot be run is a one-line ``minipar:
error:`` naming it, exit status 2: numbers out of range (``MAX_STAGES``, ...; durations finite and
>= 0), and a schedule of more than ``MAX_ACTIONS`` compute actions (about 10 s of simulation). The
bubble's closed form (``minipar.cost.pipeline``) is printed beside the simulated one where there is
one for the kind, the sizes and the durations; elsewhere "no closed form". The timeline is
``viz.terminal.print_timeline`` when every lane and span fits the terminal, else the downsampled
``viz.overview`` (a few ranks, each cell what filled most of it); the action order likewise lists
at most ``viz.overview.MAX_LANES`` ranks, each line elided in the middle when it is too long.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from minipar.cli_args import UsageError, check_width, check_writable, duration, int_in

MAX_STAGES, MAX_MICROBATCHES, MAX_CHUNKS = 4096, 65536, 64
MAX_ACTIONS = 1 << 18  # compute actions of one simulated step: -p 64 -m 512 1f1b is 65,536, ~2 s
ASYNCHRONOUS = ("pipedream", "2bw")  # asynchronous.pipedream / pipedream_2bw: U actions, weight versions
ALIASES = {"pipedream-2bw": "2bw"}
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-v", "dualpipev")  # F, I, W: closed forms for F = I = W (backward = 2 forward)


def kinds() -> tuple[str, ...]:
    """Every kind ``minipar simulate`` runs: the registry's generators, then PipeDream, 2BW, Chimera."""
    from minipar.parallel.pipeline import GENERATORS

    return (*GENERATORS, *ASYNCHRONOUS, "chimera")


def _kind(text: str) -> str:
    kind = text.strip().lower()
    return ALIASES.get(kind, kind)


def configure(p: argparse.ArgumentParser) -> None:
    """The ``simulate`` subcommand's arguments."""
    known = kinds()
    p.add_argument("kind", type=_kind, choices=known, metavar="KIND",
                   help=f"schedule, any case: {', '.join(known)}")
    p.add_argument("--stages", "-p", type=int_in(1, MAX_STAGES), default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", "-m", type=int_in(1, MAX_MICROBATCHES), default=8,
                   help="micro-batches per step (default 8)")
    p.add_argument("--chunks", "-v", type=int_in(1, MAX_CHUNKS), metavar="V",
                   help="model chunks per rank, interleaved only (default 2 there; >= 2)")
    p.add_argument("--forward", type=duration, default=1.0, help="duration of one forward (default 1)")
    p.add_argument("--backward", type=duration, default=2.0, help="duration of one backward (default 2)")
    p.add_argument("-o", "--output", metavar="TRACE", help="also write the simulated trace here")
    p.add_argument("--width", type=int, metavar="N", help="terminal line width (default: the terminal's)")


def _chunks(kind: str, chunks: int | None) -> int:
    """v for ``kind``, or ``UsageError`` when ``--chunks`` does not apply."""
    from minipar.parallel.pipeline.generators import CHUNKED, FIXED_CHUNKS

    if kind in CHUNKED:
        if chunks is not None and chunks < 2:
            raise UsageError(f"{kind} needs --chunks >= 2 model chunks per rank, got {chunks} "
                             "(with one chunk it is 1F1B: 'minipar simulate 1f1b')")
        return chunks or 2
    fixed = FIXED_CHUNKS.get(kind, 2 if kind == "chimera" else 1)
    if chunks not in (None, 1, fixed):
        where = " or ".join(f"'minipar simulate {k} --chunks {chunks}'" for k in CHUNKED)
        raise UsageError(f"--chunks {chunks} applies to the {', '.join(CHUNKED)} schedule only; drop it, "
                         f"or run {where}")
    return fixed


def _simulated(kind: str, p: int, m: int, v: int, forward: float, backward: float) -> tuple[Any, dict[int, list[str]]]:
    """(the simulator's result, each rank's compute order as text)."""
    from minipar.parallel.pipeline import make_schedule, pipedream, pipedream_2bw, simulate
    from minipar.parallel.pipeline.chimera import chimera_schedule, simulate_chimera

    if kind == "chimera":
        schedule = chimera_schedule(p, m)
        order = {r: [f"{d[0]}{a}" for d, a in steps] for r, steps in schedule.items()}
        return simulate_chimera(p, m, forward, backward, schedule=schedule), order
    sched = {"pipedream": lambda: pipedream(p, m), "2bw": lambda: pipedream_2bw(p, m)}.get(
        kind, lambda: make_schedule(kind, p, m, v))()
    return simulate(sched, forward=forward, backward=backward), {r: [str(a) for a in acts] for r, acts in sched.items()}


def bubble_formula(kind: str, p: int, m: int, v: int, forward: float, backward: float) -> str:
    """``formula <text> = <value>`` where the bubble has a closed form for these values, else words
    saying it has none (never an exception)."""
    from minipar.cost import pipeline as pipeline_cost

    if kind == "chimera":  # Li & Hoefler 2021 with equal slots (chimera.py's docstring)
        if p >= 2 and math.isclose(forward, backward):
            return f"formula (p-2)/(2m+p-2) = {(p - 2) / (2 * m + p - 2):.1%}"
        return "no closed form for chimera unless forward = backward (equal slots)"
    base = "1f1b" if kind in ASYNCHRONOUS else kind  # PipeDream and 2BW run 1F1B's order; U takes no time
    if base not in pipeline_cost.SCHEDULES:
        return f"no closed form for {kind}"
    if base in ZERO_BUBBLE and not math.isclose(backward, 2 * forward):
        return f"no closed form for {kind} unless backward = 2 x forward (F = I = W)"
    try:
        value = pipeline_cost.bubble_fraction(base, p, m, v)
    except (ValueError, ZeroDivisionError) as exc:
        return f"no closed form here ({str(exc).split(';')[0]})"
    return f"formula {pipeline_cost.bubble_formula(base)} = {value:.1%}"


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: the simulator allocates a few objects per action (events,
    dicts, tuples), none in a cycle, so the collector's passes over them free nothing; they took 40 %
    of ``-p 64 -m 512`` (1.6 s of simulation instead of 2.6 s without them, measured)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def compute_actions(kind: str, p: int, m: int, v: int) -> int:
    """Compute actions of one step: F and B of every (stage, micro-batch); ZB-H1 and ZB-H2 split B into I and W,
    ZB-V too on two chunks per rank, PipeDream adds a U per backward, interleaved has v chunks; DualPipeV's
    two chunks split 2p - 1 - r backwards on rank r (``dualpipe.py``'s steps 3, 6 and 7)."""
    from minipar.parallel.pipeline.generators import CHUNKED

    if kind == "dualpipev":
        return 4 * p * m + p * (3 * p - 1) // 2

    return p * m * {"zb-h1": 3, "zb-h2": 3, "zb-v": 6, "pipedream": 3}.get(kind, 2) * (v if kind in CHUNKED else 1)


def _order_lines(order: dict[int, list[str]], shown: list[int], width: int) -> list[str]:
    """``rank r: <actions>`` for the shown ranks; a line longer than ``width`` keeps its two ends."""
    lines = []
    for r in shown:
        head, acts = f"rank {r}: ", order[r]
        line = head + " ".join(acts)
        if len(line) > width:
            tail = f" ... ({len(acts):,} actions) ... "
            room = max(2, (width - len(head) - len(tail)) // 2)
            first = " ".join(acts)[:room].rsplit(" ", 1)[0]
            last = " ".join(acts)[-room:].split(" ", 1)[-1]
            line = head + first + tail + last
        lines.append(line)
    if len(shown) < len(order):
        lines.append(f"({len(order) - len(shown)} more ranks not listed; -o TRACE keeps every action)")
    return lines


def run(args: argparse.Namespace) -> int:
    """Check every argument, simulate, print the order, the numbers and the timeline."""
    from minipar.parallel.pipeline.generators import CHUNKED
    from minipar.trace import save

    kind, p, m = args.kind, args.stages, args.microbatches
    v = _chunks(kind, args.chunks)
    check_width(args.width)
    actions = compute_actions(kind, p, m, v)
    if actions > MAX_ACTIONS:
        raise UsageError(f"-p {p} -m {m}{f' -v {v}' if kind in CHUNKED else ''} makes "
                         f"{actions:,} compute actions; the simulator takes at most {MAX_ACTIONS:,} (about 10 s): "
                         "use fewer stages or micro-batches")
    if args.output:
        check_writable(args.output, "-o")
    try:
        with _no_cyclic_gc():
            result, order = _simulated(kind, p, m, v, args.forward, args.backward)
    except ValueError as exc:  # ScheduleError is one
        raise UsageError(str(exc).splitlines()[0]) from None
    if args.output:
        try:
            save(result.trace, args.output)
        except OSError as exc:
            raise UsageError(f"cannot write output {args.output} (-o): {exc.strerror or exc}") from None
    from viz.overview import MAX_LANES, fits, print_overview, shown_ranks
    from viz.terminal import print_timeline
    from viz.width import terminal_width

    width = args.width or terminal_width()
    notes = [f"{kind} with {v} model chunks per rank (the default; --chunks V to change)"] * (
        kind in CHUNKED and args.chunks is None)
    if kind == "chimera":
        notes.append(f"chimera: d = down pipeline (micro-batches 0..{m // 2 - 1}), u = up (stage s on rank "
                     f"p-1-s, micro-batches {m // 2}..{m - 1})")
    for text in notes:
        print(textwrap.fill(text, width))
    for line in _order_lines(order, shown_ranks(p, MAX_LANES), width):
        print(line)
    formula = bubble_formula(kind, p, m, v, args.forward, args.backward)
    numbers = [f"makespan {result.makespan:g}   bubble fraction {result.bubble_fraction:.1%} ({formula})",
               f"peak stashed micro-batches per rank {[result.peak_stash[r] for r in range(p)]}"]
    if result.peak_versions:
        rule = "PipeDream: p - r on stage r once m >= 2 (p - 1 - r)" if kind == "pipedream" else "2BW: at most 2"
        numbers.append(f"peak weight versions per stage {[result.peak_versions[s] for s in range(p)]} ({rule})")
    for text in numbers:
        print(textwrap.fill(text, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    sys.stdout.flush()
    busiest = max((len(acts) for acts in order.values()), default=0)
    if fits(p, busiest, width):
        print_timeline(result.trace, width=width)
    else:
        print_overview(result.trace, width)
    return 0

