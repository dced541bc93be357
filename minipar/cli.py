"""The ``minipar`` command.

    minipar view TRACE... -o report.html      one self-contained HTML report of the traces
    minipar view TRACE... --terminal [--width N]   the timeline in the terminal (the default)
    minipar view TRACE --chrome out.json       Chrome-trace JSON for https://ui.perfetto.dev
    minipar simulate 1f1b --stages 4 --microbatches 8 [-o sim.json]   a pipeline schedule, simulated

Bad input (a missing, truncated or corrupt trace, a newer format, a bad option) prints one line
``minipar: error: ...`` on stderr and exits with status 2, without a traceback. Subcommands are
registered in ``COMMANDS``; add one with a ``(configure_parser, run)`` pair. ``viz`` is imported
only inside ``view`` so the library itself never depends on the viewer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _configure_view(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s) written by minipar.trace")
    p.add_argument("-o", "--output", metavar="HTML", help="write a self-contained HTML report here")
    p.add_argument("--title", action="append", metavar="TITLE",
                   help="title of each trace in the report (repeat once per TRACE)")
    p.add_argument("--terminal", action="store_true", help="print the timeline in the terminal")
    p.add_argument("--width", type=int, metavar="N", help="terminal line width (default: the terminal's)")
    p.add_argument("--chrome", metavar="JSON", help="export the (single) TRACE as Chrome-trace JSON")


def _run_view(args: argparse.Namespace) -> int:
    from minipar.trace import TraceError, load, to_chrome

    if args.chrome and len(args.traces) != 1:
        raise UsageError(f"--chrome exports one trace, got {len(args.traces)}; pass a single TRACE")
    if args.title and len(args.title) != len(args.traces):
        raise UsageError(f"got {len(args.title)} --title for {len(args.traces)} traces; give one per TRACE")
    if args.width is not None and args.width < 20:
        raise UsageError(f"--width {args.width} is too narrow; use at least 20")
    try:
        traces = [load(path) for path in args.traces]
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    terminal = args.terminal or not (args.output or args.chrome)
    try:
        if args.output:
            from viz.report import write_report

            write_report(traces, args.output, titles=args.title or list(args.traces))
            print(f"wrote {args.output}", file=sys.stderr)
        if args.chrome:
            to_chrome(traces[0], args.chrome)
            print(f"wrote {args.chrome}", file=sys.stderr)
    except OSError as exc:
        raise UsageError(f"cannot write output: {exc}") from None
    if terminal:
        from viz.terminal import print_timeline

        for i, trace in enumerate(traces):
            if i:
                print()
            try:
                print_timeline(trace, width=args.width, title=args.title[i] if args.title else None)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    return 0


def _configure_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", help="schedule: naive, gpipe, 1f1b or interleaved")
    p.add_argument("--stages", "-p", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--chunks", "-v", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--forward", type=float, default=1.0, help="duration of one forward (default 1)")
    p.add_argument("--backward", type=float, default=2.0, help="duration of one backward (default 2)")
    p.add_argument("-o", "--output", metavar="TRACE", help="also write the simulated trace here")
    p.add_argument("--width", type=int, metavar="N", help="terminal line width (default: the terminal's)")


def _run_simulate(args: argparse.Namespace) -> int:
    from minipar.cost import pipeline as pipeline_cost
    from minipar.parallel.pipeline import make_schedule, simulate
    from minipar.trace import save

    try:
        schedule = make_schedule(args.kind, args.stages, args.microbatches, args.chunks)
        result = simulate(schedule, forward=args.forward, backward=args.backward)
    except ValueError as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    for rank, actions in sorted(schedule.items()):
        print(f"rank {rank}: {' '.join(str(a) for a in actions)}")
    p, m, v = args.stages, args.microbatches, args.chunks
    formula = pipeline_cost.bubble_fraction(args.kind, p, m, v)
    print(f"makespan {result.makespan:g}   bubble fraction {result.bubble_fraction:.1%} "
          f"(formula {pipeline_cost.bubble_formula(args.kind)} = {formula:.1%})   "
          f"peak stashed micro-batches per rank {[result.peak_stash[r] for r in range(p)]}")
    if args.output:
        save(result.trace, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    from viz.terminal import print_timeline

    print_timeline(result.trace, width=args.width)
    return 0


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "view": ("show traces: HTML report, terminal timeline or Chrome trace", _configure_view, _run_view),
    "simulate": ("simulate a pipeline schedule: action order, bubble, stash, timeline", _configure_simulate,
                 _run_simulate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minipar", description="minipar: distributed training, rank by rank.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (help_text, configure, _) in COMMANDS.items():
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``minipar`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("no command given; try 'minipar view TRACE --terminal' (see 'minipar --help')")
        return COMMANDS[args.command][2](args)
    except UsageError as exc:
        print(f"minipar: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
