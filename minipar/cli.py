"""The ``minipar`` command.

    minipar view TRACE... -o report.html      one self-contained HTML report of the traces
    minipar view TRACE... --terminal [--width N]   the timeline in the terminal (the default)
    minipar view TRACE --chrome out.json       Chrome-trace JSON for https://ui.perfetto.dev
    minipar view TRACE [--clock replay|wall] [--cluster local|nvlink|infiniband|FILE]   which times to show
    minipar replay TRACE --cluster local|nvlink|infiniband|a100-selene|FILE -o OUT.json   re-timed on a cluster
    minipar simulate 1f1b --stages 4 --microbatches 8 [-o sim.json]   a pipeline schedule, simulated
    minipar simulate interleaved --chunks 2                           (v model chunks per rank)
    minipar simulate KIND ...                                         any kind the runtime has, any case (--help)
    minipar calibrate -n 4 -o cluster.json [--backend mpi|threads] [--quick]   this machine as a cluster file
    minipar plan --model gpt3-175b --gpus 3072 [--preset a100-selene | --cluster FILE] [--zero 0 1]   fastest first
    minipar plan --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 --gpus 64   any GPT
    minipar run --elastic -n 3 [--max-restarts K] [--min-ranks M] [--attempt-timeout S] script.py [args]

Bad input (a missing, truncated or corrupt trace, a folder instead of a trace, a newer format, an
output path that cannot be written, a bad option) prints one line ``minipar: error: ...`` on
stderr and exits with status 2, without a traceback, before anything is printed or written.
Subcommands are registered in ``COMMANDS``; add one with a ``(configure_parser, run)`` pair.
``viz`` is imported only inside ``view`` so the library itself never depends on the viewer.
``view`` shows a recorded trace replayed (``minipar.replay``: CPU time per span, the ``--cluster``
network, default ``local``) when it has CPU times, its wall-clock times with ``--clock wall``; the
report of a replay has a button on its timelines for the times as recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from minipar import cli_plan, cli_simulate
from minipar.cli_args import UsageError, check_width, check_writable

if TYPE_CHECKING:
    from minipar.trace import Trace

EXIT_USAGE = 2
EXAMPLE_TRACE = "runs/02_pipeline/1f1b.json"
MAX_RANKS = 1024  # processes or threads started on this machine (calibrate, run)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _traces_in(folder: str, limit: int = 4) -> tuple[list[str], int]:
    """Up to ``limit`` minipar trace files in ``folder`` and its direct subfolders (known by their
    header), and how many there are in all."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(dirs) if os.path.samefile(root, folder) else []
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".json"):
                try:
                    with open(path, "rb") as fh:
                        if b'"minipar-trace"' in fh.read(64):
                            found.append(path)
                except OSError:
                    continue
    return found[:limit], len(found)


def _not_a_folder(path: str) -> None:
    """Raise ``UsageError`` naming the traces inside when ``path`` is a folder, not a trace file."""
    if not os.path.isdir(path):
        return
    shown, total = _traces_in(path)
    if not shown:
        raise UsageError(f"{path} is a directory with no minipar traces in it; give a trace file, "
                         f"e.g. {EXAMPLE_TRACE} (a lesson writes them under runs/)")
    more = f" and {total - len(shown)} more" if total > len(shown) else ""
    raise UsageError(f"{path} is a directory; give one or more trace files, e.g. {shown[0]} "
                     f"(traces inside: {', '.join(shown)}{more})")


def _configure_view(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s) written by minipar.trace")
    p.add_argument("-o", "--output", metavar="HTML", help="write a self-contained HTML report here")
    p.add_argument("--title", action="append", metavar="TITLE",
                   help="title of each trace in the report (repeat once per TRACE)")
    p.add_argument("--terminal", action="store_true", help="print the timeline in the terminal")
    p.add_argument("--width", type=int, metavar="N", help="terminal line width (default: the terminal's)")
    p.add_argument("--chrome", metavar="JSON", help="export the (single) TRACE as Chrome-trace JSON")
    p.add_argument("--clock", choices=("replay", "wall"), help="replay (CPU time per span on --cluster; the "
                   "default for a trace with CPU times) or wall (the times as recorded)")
    p.add_argument("--cluster", metavar="PRESET|FILE", help="network of the replay: local (default), nvlink, "
                   "infiniband, a100-selene, or a cluster file from 'minipar calibrate'")


def _replayed(traces: list[Trace], paths: list[str], clock: str | None, spec: str | None) -> list[Trace]:
    """The traces on the clock ``view`` shows: replayed on ``spec`` (default local) with ``--clock replay``,
    and by default when a recorded trace has CPU times (else, or if it cannot be, as recorded, said
    on stderr), span costs pooled with the earlier steps each lists; a replay's output as it is."""
    from minipar.replay import ReplayError, cluster_named, replay
    from minipar.span_costs import earlier_steps
    from minipar.trace import has_cpu_times

    done = [t.meta.get("clock") == "replay" for t in traces]
    if clock == "wall" and (spec or any(done)):
        raise UsageError("--clock wall shows recorded times: drop --cluster, and view the recorded trace, not a replay")
    try:
        cluster = cluster_named(spec or "local")
        out = []
        for t, path, was in zip(traces, paths, done, strict=True):
            try:
                out.append(replay(t, cluster, samples=earlier_steps(path, t))
                           if not was and (clock == "replay" or clock is None and has_cpu_times(t)) else t)
            except ReplayError as exc:
                if clock == "replay":
                    raise
                print(f"times as recorded: {exc}", file=sys.stderr)
                out.append(t)
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    if any(t.meta.get("clock") == "replay" and not was for t, was in zip(out, done, strict=True)):
        print(f"times replayed: one core per rank, network {cluster.name} (--clock wall: as recorded)", file=sys.stderr)
    return out


def _run_view(args: argparse.Namespace) -> int:
    from minipar.chrome import to_chrome
    from minipar.trace import TraceError, load

    if args.chrome and len(args.traces) != 1:
        raise UsageError(f"--chrome exports one trace, got {len(args.traces)}; pass a single TRACE")
    if args.title and len(args.title) != len(args.traces):
        raise UsageError(f"got {len(args.title)} --title for {len(args.traces)} traces; give one per TRACE")
    check_width(args.width)
    for path in args.traces:
        _not_a_folder(path)
    for path, option in ((args.output, "-o"), (args.chrome, "--chrome")):
        if path:
            check_writable(path, option)
    try:
        traces = [load(path) for path in args.traces]
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    recorded, traces = traces, _replayed(traces, args.traces, args.clock, args.cluster)
    terminal = args.terminal or not (args.output or args.chrome)
    try:
        if args.output:  # a replay's timelines with a button for the recorded times
            from viz.report import write_report

            others = [r if t is not r else None for r, t in zip(recorded, traces, strict=True)]
            write_report(traces, args.output, titles=args.title or list(args.traces), others=others)
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


def _configure_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="a trace recorded by a run (with CPU times)")
    p.add_argument("--cluster", required=True, metavar="PRESET|FILE",
                   help="local, nvlink, infiniband, a100-selene, or a cluster file from 'minipar calibrate'")
    p.add_argument("-o", "--output", metavar="JSON", required=True, help="write the replayed trace here")
    p.add_argument("--costs", choices=("median", "cpu"), default="median",
                   help="a compute span lasts the median CPU time of the repeats of its work (default) or its own")
    p.add_argument("--host", action="store_true",
                   help="replay the ranks as this machine ran them: a rank's threads (the collectives' worker "
                        "too) share its one core, and their CPU time outside spans counts")


def _run_replay(args: argparse.Namespace) -> int:
    from minipar.replay import ReplayError, cluster_named, replay
    from minipar.span_costs import earlier_steps
    from minipar.trace import TraceError, load, save

    _not_a_folder(args.trace)
    check_writable(args.output, "-o")
    try:
        cluster = cluster_named(args.cluster)
        trace = load(args.trace)
        out = replay(trace, cluster, args.costs, earlier_steps(args.trace, trace), host=args.host)
    except (TraceError, ReplayError) as exc:
        raise UsageError(str(exc)) from None
    try:
        save(out, args.output)
    except OSError as exc:
        raise UsageError(f"cannot write output {args.output} (-o): {exc.strerror or exc}") from None
    spans = [e for e in out.events if e.kind in ("compute", "comm")]
    step = max((e.t1 for e in spans), default=0.0) - min((e.t0 for e in spans), default=0.0)
    print(f"{out.meta['replay']['label']}: {step * 1e3:.3f} ms from first to last event")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _configure_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--ranks", type=int, default=4, help="ranks to launch and calibrate (default 4)")
    p.add_argument("--backend", choices=("mpi", "threads"), default="mpi",
                   help="mpi (mpiexec from this Python's environment, the default) or threads (in this process)")
    p.add_argument("-o", "--output", metavar="JSON", required=True, help="write the cluster file here")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (under 10 s)")


def _run_calibrate(args: argparse.Namespace) -> int:
    from minipar.calibrate import run_calibration, tiers_path
    from minipar.testing import HarnessError

    if args.ranks < 2:
        raise UsageError(f"-n {args.ranks}: calibrate needs at least 2 ranks (messages go between ranks)")
    if args.ranks > MAX_RANKS:
        raise UsageError(f"-n {args.ranks}: calibrate runs at most {MAX_RANKS} ranks on this machine")
    check_writable(args.output, "-o")
    try:
        measured = run_calibration(args.ranks, args.backend, quick=args.quick,
                                   disk_dir=os.path.dirname(os.path.abspath(args.output)))  # the disk it goes to
    except HarnessError as exc:
        raise UsageError(f"calibration failed under mpiexec -n {args.ranks}: {str(exc).splitlines()[0]}") from None
    print(measured.table())
    written = [args.output] + ([tiers_path(args.output)] if measured.tiers is not None else [])
    try:
        measured.cluster.save(args.output)
        if measured.tiers is not None:  # the memory tiers' rates beside it (lesson 07 reads them)
            measured.tiers.save(written[1])
    except OSError as exc:
        raise UsageError(f"cannot write output {args.output} (-o): {exc.strerror or exc}") from None
    print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0


def _configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--ranks", type=int, required=True, help="ranks of the first run")
    p.add_argument("--elastic", action="store_true", help="restart with the survivors when ranks are lost")
    p.add_argument("--max-restarts", type=int, metavar="K", help="restarts at most (default 3; --elastic)")
    p.add_argument("--min-ranks", type=int, default=1, metavar="M", help="give up below this many ranks (default 1)")
    p.add_argument("--restart-n", type=int, metavar="N", help="restart with N ranks instead of the survivors")
    p.add_argument("--attempt-timeout", type=float, metavar="S",
                   help="seconds the ranks of an attempt may outlive the first to end (done, or given up on a "
                        "dead peer) before they are killed as stuck (lost) (default 2 x MINIPAR_TIMEOUT; --elastic)")
    p.add_argument("script", help="the Python script every rank runs (mpiexec -n N python script ...)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _run_run(args: argparse.Namespace) -> int:
    from minipar.elastic import elastic_loop, mpiexec_launcher

    if not os.path.isfile(args.script):
        raise UsageError(f"no script {args.script}; give the path of a Python file")
    if not args.elastic and (args.restart_n is not None or args.max_restarts is not None
                             or args.attempt_timeout is not None):
        raise UsageError("--max-restarts, --restart-n and --attempt-timeout need --elastic")
    for option, value in (("-n", args.ranks), ("--min-ranks", args.min_ranks), ("--restart-n", args.restart_n),
                          ("--max-restarts", args.max_restarts)):
        if value is not None and value > MAX_RANKS:
            raise UsageError(f"{option} {value}: at most {MAX_RANKS} on one machine")
    if args.attempt_timeout is not None and not args.attempt_timeout > 0:
        raise UsageError(f"--attempt-timeout must be > 0 seconds, got {args.attempt_timeout}")
    restarts = (3 if args.max_restarts is None else args.max_restarts) if args.elastic else 0
    launcher = mpiexec_launcher([sys.executable, args.script, *args.script_args], attempt_timeout=args.attempt_timeout)
    try:
        status, _ = elastic_loop(args.ranks, launcher, restarts, args.min_ranks, args.restart_n)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return status


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "view": ("show traces: HTML report, terminal timeline or Chrome trace", _configure_view, _run_view),
    "replay": ("re-time a recorded trace on a modelled cluster (CPU time per span, alpha-beta links)",
               _configure_replay, _run_replay),
    "simulate": ("simulate a pipeline schedule of any kind: action order, bubble, stash, timeline",
                 cli_simulate.configure, cli_simulate.run),
    "calibrate": ("measure this machine's alpha, beta, gamma and FLOP/s; write a cluster file",
                  _configure_calibrate, _run_calibrate),
    "plan": ("rank layouts (dp tp pp sp, schedule, ZeRO, recomputation) of a GPT on a cluster by predicted step time",
             cli_plan.configure, cli_plan.run),
    "run": ("run a script under mpiexec; --elastic restarts it with the surviving ranks after a loss",
            _configure_run, _run_run),
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
    except BrokenPipeError:  # output piped into e.g. head, which stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
