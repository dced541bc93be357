"""The ``minipar`` command.

    minipar view TRACE... -o report.html      one self-contained HTML report of the traces
    minipar view TRACE... --terminal [--width N]   the timeline in the terminal (the default)
    minipar view TRACE --chrome out.json       Chrome-trace JSON for https://ui.perfetto.dev

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


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "view": ("show traces: HTML report, terminal timeline or Chrome trace", _configure_view, _run_view),
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
