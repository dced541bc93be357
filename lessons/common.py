"""What every lesson does at the start and the end: ranks (mpiexec or in-process threads, with the
same checks), a console that keeps colour under mpiexec, the clock its times are on (``Clock``:
replayed by default, ``--clock wall`` for the times as recorded, with the time-sharing note), and the
closing terminal timeline plus HTML report (the replay, with a button for the wall clock)."""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from minipar import datasets
from minipar.cli_args import int_in
from minipar.comm import launch, world
from minipar.comm.mpi import under_mpiexec
from minipar.comm.startup import env_rank_size, outside_mpiexec_env
from minipar.cost.cluster import Cluster
from minipar.replay import ReplayError, check_replayable, cluster_named, replay
from minipar.span_costs import earlier_steps
from minipar.trace import Trace, load
from viz.width import Table, terminal_width

if TYPE_CHECKING:
    import numpy as np
    import plotly.graph_objects as go


def blas_threads(n: int = 1) -> int | None:
    """Set numpy's OpenBLAS to ``n`` threads in this process, as ``OPENBLAS_NUM_THREADS=n`` before numpy's import
    would, unless that variable is set (``make demo`` and the tests set it to 1); returns OpenBLAS's thread
    count after, or None (the variable set, or no OpenBLAS found beside numpy). A lesson's ranks each stand
    for a device with a core of its own (the replay's model); BLAS threads of ranks that share the cores spin
    against each other: lesson 2 under ``mpiexec -n 4`` on 2 cores trained in 77 s with OpenBLAS's default of
    a thread per core in every rank, in 16 s with one (load 10 either way)."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return None
    import numpy as np

    here = Path(np.__file__).parent  # numpy's wheels: numpy.libs/ (Linux), numpy/.dylibs/ (macOS)
    for lib in sorted([*here.parent.glob("numpy.libs/*openblas*"), *here.glob(".dylibs/*openblas*")]):
        try:
            blas = ctypes.CDLL(str(lib))  # the copy numpy loaded: dlopen hands back the same library
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "")):
            setter = getattr(blas, f"{prefix}_set_num_threads{suffix}", None)
            getter = getattr(blas, f"{prefix}_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                setter(n)
                return int(getter())
    return None


def run_ranks(body: Callable[..., Any], ranks: int, check: Callable[[int], str | None] | None = None,
              **kwargs: Any) -> Any:
    """Run ``body(comm, **kwargs)`` on every rank and return rank 0's result (None on other ranks).

    Under ``mpiexec`` the ranks are its processes; otherwise ``ranks`` threads in this process, said
    in one line. ``check(world_size)`` returns what is wrong with that world size (or None): the
    message is printed once, by rank 0, and every rank exits with status 2 before any message. BLAS
    runs on one thread per process (``blas_threads``).
    """
    blas_threads(1)
    mpi = under_mpiexec()
    comm = world() if mpi else None
    size, rank = (comm.size, comm.rank) if comm is not None else (ranks, 0)
    exit_if_wrong(check(size) if check is not None else None, rank)
    if comm is not None:
        result = body(comm, **kwargs)
        return result if comm.rank == 0 else None
    say_threads(ranks, "--ranks N to change, or mpiexec -n N for real processes")
    return launch(body, ranks, "threads", **kwargs)[0]


def exit_if_wrong(problem: str | None, rank: int) -> None:
    """What every rank does with what is wrong with the world size (``problem``, None when nothing):
    rank 0 prints ``error: <problem>`` once, and every rank exits with status 2 before any message."""
    if problem:
        if rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


def rerun_outside_mpiexec(script: str | os.PathLike[str], argv: Sequence[str],
                          check: Callable[[int], str | None]) -> int:
    """A lesson that starts its own launchers, started by a plain ``mpiexec``: every rank checks the
    world's size (``check``, as ``exit_if_wrong``); rank 0 runs ``script`` with ``argv`` as a process
    outside this job (``startup.outside_mpiexec_env``) and returns its exit status, the others 0."""
    rank, size = env_rank_size() or (0, 1)
    exit_if_wrong(check(size), rank)
    if rank != 0:
        return 0
    return subprocess.run([sys.executable, os.fspath(script), *argv], env=outside_mpiexec_env()).returncode


def say_threads(ranks: int, how: str) -> None:
    """The one line a lesson prints when its ``ranks`` run as threads of this process (no mpiexec),
    ending with ``how`` to change that."""
    print(textwrap.fill(f"(no mpiexec: {ranks} ranks run as threads of this process; {how})", terminal_width()))


def shared_folder(comm: Any, path: str | os.PathLike[str]) -> Path:
    """``path`` made (with its parents) by rank 0 of ``comm``, every rank waiting until it exists; returns it."""
    folder = Path(path)
    if comm.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    return folder


MAX_RANKS = 64  # --ranks: threads of this process
MAX_STEPS = 10_000


def lesson_parser(doc: str | None, steps: int, ranks: int) -> argparse.ArgumentParser:
    """The arguments every lesson takes: ``--steps``, ``--ranks`` (threads, when not under mpiexec; 0
    allowed only where it is the default, meaning the lesson's own count), ``--clock`` and ``--cluster``
    (``Clock.of_args``); a lesson adds its own to the parser. Parse with ``parse_lesson_args``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int_in(1, MAX_STEPS), default=steps, help=f"training steps (default {steps})")
    parser.add_argument("--ranks", type=int_in(0 if ranks == 0 else 1, MAX_RANKS), default=ranks,
                        help="ranks when not under mpiexec (threads)")
    parser.add_argument("--verbose", action="store_true",
                        help="print every table and section (default: the key table, the figure and the conclusion)")
    return clock_arguments(parser)


def parse_lesson_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                      ranks_check: Callable[[argparse.Namespace], str | None] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then ``ranks_check(args)``: what is wrong with the world size of the
    threads ``--ranks`` (and the other values) ask for, or None; not under mpiexec, where ``run_ranks``
    checks the world's size. A problem is reported as argparse reports a bad value (usage, ``error:
    argument --ranks: ...``, exit status 2), before any work."""
    args = parser.parse_args(argv)
    problem = ranks_check(args) if ranks_check is not None and not under_mpiexec() else None
    if problem:
        parser.error(f"argument --ranks: {problem}")
    return args


def run_lesson(run: Callable[..., Any], args: argparse.Namespace, check: Callable[[int], str | None],
               ranks: int | None = None, **kwargs: Any) -> Any:
    """The main of a lesson whose arguments are ``lesson_parser``'s: ``run(comm, steps=, clock=, verbose=,
    **kwargs)`` on every rank (``run_ranks``: ``ranks`` threads, default ``args.ranks``, when not under
    mpiexec; ``check`` the world size); rank 0's result."""
    return run_ranks(run, args.ranks if ranks is None else ranks, check, steps=args.steps,
                     clock=Clock.of_args(args), verbose=args.verbose, **kwargs)


def clock_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--clock`` and ``--cluster`` (``Clock.of_args``) on ``parser``: ``lesson_parser``'s, and a lesson's
    own parser's when it takes no ``--steps``."""
    parser.add_argument("--clock", choices=("replay", "wall"), default="replay",
                        help="times compared and drawn: replay (each rank's CPU time on --cluster, one core per "
                             "rank: the default) or wall (as recorded, time-sharing included)")
    parser.add_argument("--cluster", type=_cluster_spec, default="local", metavar="PRESET|FILE",
                        help="network of the replay: local (this machine, measured; the default), nvlink, "
                             "infiniband, a100-selene, or a cluster file from 'minipar calibrate'")
    return parser


def _cluster_spec(spec: str) -> str:
    try:
        cluster_named(spec)
    except ReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


@dataclass(frozen=True)
class Clock:
    """The times a lesson compares and draws. ``replay`` (the default): every recorded trace re-timed
    by ``minipar.replay`` on ``cluster`` (a preset or a ``minipar calibrate`` file): each span lasts its
    CPU time (repeats of the same work: their median), each rank has a core of its own, messages take
    the cluster's links, so the numbers mean the same however many ranks share this machine. ``wall``:
    the times as recorded, which include waiting for a core when ranks outnumber cores (``caveat``)."""

    kind: str = "replay"
    cluster_spec: str = "local"

    @classmethod
    def of_args(cls, args: argparse.Namespace) -> Clock:
        return cls(args.clock, args.cluster)

    @property
    def cluster(self) -> Cluster:
        return cluster_named(self.cluster_spec)

    @property
    def label(self) -> str:
        """What the times are, for every table and figure that shows one."""
        if self.kind == "wall":
            return "wall clock, as recorded"
        return f"replayed: one core per rank, network {self.cluster.name}"

    @property
    def short(self) -> str:
        """One word for a column: "replayed" or "wall clock"."""
        return "wall clock" if self.kind == "wall" else "replayed"

    def caveat(self, ranks: int) -> str | None:
        """The time-sharing note (``time_sharing``): with wall-clock times only."""
        return time_sharing(ranks) if self.kind == "wall" else None

    def of(self, trace: str | os.PathLike[str] | Trace) -> Trace:
        """``trace`` (a recorded run, or its path) on this clock: replayed, or as recorded with ``wall``
        and for a trace a replay cannot re-time (a simulated schedule, a run that lost ranks)."""
        if not isinstance(trace, Trace):
            path = os.fspath(trace)
            return _replayed(path, os.stat(path).st_mtime_ns, self) if self.kind == "replay" else load(path)
        return replay(trace, self.cluster) if self.kind == "replay" and replayable(trace) else trace

    def other(self, trace: str | os.PathLike[str] | Trace) -> Trace | None:
        """The recorded run on the other clock (wall for a replay, replay for wall); None when a replay
        cannot re-time it (a simulated schedule, a run that lost ranks)."""
        recorded = trace if isinstance(trace, Trace) else load(trace)
        if not replayable(recorded):
            return None
        return recorded if self.kind == "replay" else Clock("replay", self.cluster_spec).of(trace)


REPLAY = Clock()  # the lessons' default: replayed on "local", this machine with one core per rank


@cache
def _replayed(path: str, mtime_ns: int, clock: Clock) -> Trace:
    """A trace file's replay, once per version of the file (lessons read a trace several times), its
    span costs pooled with the run's earlier steps the trace lists (``replay.earlier_steps``)."""
    trace = load(path)
    return replay(trace, clock.cluster, samples=earlier_steps(path, trace)) if replayable(trace) else trace


def replayable(trace: Trace) -> bool:
    """Whether ``minipar.replay`` can re-time ``trace`` (recorded with CPU times, no rank lost)."""
    try:
        check_replayable(trace)
    except ReplayError:
        return False
    return True


def by_rank(values: Sequence[int]) -> str:
    """Bytes (or counts) per rank in a table cell: '1,024' when every rank agrees, else grouped runs of
    ranks, 'r0 3,072 · r1-3 1,024'."""
    if len(set(values)) == 1:
        return f"{values[0]:,}"
    groups: list[tuple[int, int, int]] = []
    for r, v in enumerate(values):
        if groups and groups[-1][2] == v:
            groups[-1] = (groups[-1][0], r, v)
        else:
            groups.append((r, r, v))
    return " · ".join(f"r{a}{'' if a == b else f'-{b}'} {v:,}" for a, b, v in groups)


def one_process(model: Any, optimizer: Any, batches: Iterable[tuple[Any, Any]]) -> list[float]:
    """The reference every lesson compares with: ``model`` trained by ``optimizer`` in one process on
    each ``(x, y)`` of ``batches`` (the whole global batch); the losses, step by step."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def max_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """The largest absolute difference between two state dicts (the same names), over every element."""
    import numpy as np

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def lm_batches(steps: int, vocab: int, batch: int, seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The lessons' data: ``steps`` (tokens, next tokens) batches of ``batch`` x ``seq`` from one
    synthetic stream of 20,000 tokens over ``vocab`` (``datasets.token_stream``, seed 0); step s's
    batch is the same on every rank and in the single-process reference."""
    return [lm_batch(s, vocab, batch, seq) for s in range(steps)]


def lm_batch(step: int, vocab: int, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s batch of ``lm_batches`` alone (the stream made once per ``vocab``)."""
    return datasets.lm_batch(_token_stream(vocab), batch, seq, step=step)


@cache
def _token_stream(vocab: int) -> np.ndarray:
    return datasets.token_stream(20_000, vocab, seed=0)


def sections(out: Console) -> Callable[[str], None]:
    """A function printing ``out``'s section rules numbered 1, 2, 3... in the order they are printed
    (a lesson's default output leaves out some of its ``--verbose`` sections; the numbers stay in order)."""
    count = [0]

    def rule(title: str) -> None:
        count[0] += 1
        out.rule(f"[bold]{count[0]}. {title}")

    return rule


def loss_table(reference: Sequence[float], runs: dict[str, Sequence[float]], title: str = "loss per step",
               reference_name: str = "one process", digits: int = 12) -> Table:
    """Losses step by step: the single-process ``reference`` beside each run of ``runs`` (name: losses)."""
    table = Table(title=title, title_justify="left")
    for col in ("step", reference_name, *runs):
        table.add_column(col, justify="right")
    for s, ref in enumerate(reference):
        table.add_row(str(s), f"{ref:.{digits}f}", *(f"{losses[s]:.{digits}f}" for losses in runs.values()))
    return table


def time_sharing(ranks: int) -> str | None:
    """A warning when ``ranks`` outnumber this machine's cores: measured times then include waiting
    for a core, not only for peers (bubbles look larger, overlap smaller); formulas assume one core
    per rank."""
    cores = os.cpu_count() or 1
    if ranks <= cores:
        return None
    return (f"{ranks} ranks time-share {cores} cores: measured times include waiting for a core, "
            "so measured bubbles and idle times are larger than the formula's and schedules that "
            "should differ can look alike")


def print_note(out: Console, note: str | None, after: str = ".") -> None:
    """``note`` (a clock's ``caveat``, a ``time_sharing`` warning), when there is one, as a yellow "note:"
    line ending with ``after`` (what it concerns)."""
    if note:
        out.print(f"[yellow]note:[/yellow] {note}{after}", highlight=False)


def console(width: int | None = None) -> Console:
    """A rich console: colour under mpiexec when FORCE_COLOR is set (stdout is no terminal there),
    and the width of the terminal the person looks at, also under mpiexec (``viz.width.terminal_width``:
    ``COLUMNS``, a standard stream or the controlling terminal; 80 columns when there is none) unless
    ``width`` is given."""
    width = width or terminal_width()
    return Console(force_terminal=os.environ.get("FORCE_COLOR", "0") not in ("", "0") or None, width=width)


READING_ORDER = ("02_pipeline", "03_data_parallel", "04_tensor_parallel", "06_zero", "00_autograd",
                 "01_collectives", "02b_zero_bubble", "05_sequence_parallel", "07_offload", "08_hybrid",
                 "09_sharding", "10_faults", "11_precision")
"""The order the README's reading path gives: the demo (02), then data, tensor and ZeRO parallelism,
then the rest in number order."""


def reading_path(lesson: str) -> str:
    """One line naming the lessons before and after ``lesson`` (its folder name) on the reading path."""
    i = READING_ORDER.index(lesson)
    before = f"previous: lessons/{READING_ORDER[i - 1]}" if i > 0 else "this is the first lesson"
    after = f"next: lessons/{READING_ORDER[i + 1]}" if i + 1 < len(READING_ORDER) else "this is the last lesson"
    return f"{before} | {after}"


BRIEF_BANDS, BRIEF_LANES = 2, 8  # a lesson's default timeline (finish(brief=True)): at most 2 bands of 8 rank lanes


def finish(traces: Sequence[str | os.PathLike[str] | Trace], out_html: str | os.PathLike[str],
           out: Console, timeline: str | os.PathLike[str] | Trace | None = None,
           titles: Sequence[str] | None = None, extra_figures: Sequence[tuple[str, go.Figure]] = (),
           clock: Clock = REPLAY, brief: bool = False) -> Path:
    """Print the terminal timeline of ``timeline`` (default: the first trace) and write one HTML
    report of all ``traces``, with ``extra_figures`` (title, figure) as sections after its summary;
    returns the report's path. Recorded traces are shown on ``clock`` (replayed by default), each
    timeline of the report with a button for the other clock. ``brief`` (a lesson's default output):
    the timeline in at most ``BRIEF_BANDS`` bands and ``BRIEF_LANES`` rank lanes in all (one band of
    8 ranks), without its traffic table."""
    from viz.report import write_report
    from viz.terminal import MAX_BANDS, print_timeline

    shown_timeline = clock.of(timeline if timeline is not None else traces[0])
    bands = min(BRIEF_BANDS, max(1, BRIEF_LANES // shown_timeline.world_size)) if brief else MAX_BANDS
    print_timeline(shown_timeline, console=out, max_bands=bands, traffic=not brief)
    shown = [clock.of(t) for t in traces]
    others = [clock.other(t) for t in traces]
    path = Path(write_report(shown, out_html, titles=titles, extra_figures=extra_figures, others=others))
    out.print(f"[bold]report:[/bold] {path}  (open it in a browser; it works offline)")
    return path
