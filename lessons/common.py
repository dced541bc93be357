"""What every lesson does at the start and the end: ranks (mpiexec or in-process threads, with the
same checks), a console that keeps colour under mpiexec, a note when ranks time-share cores, and
the closing terminal timeline plus HTML report."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from minipar.comm import launch, world
from minipar.comm.mpi import under_mpiexec
from minipar.trace import Trace

if TYPE_CHECKING:
    import plotly.graph_objects as go


def run_ranks(body: Callable[..., Any], ranks: int, check: Callable[[int], str | None] | None = None,
              **kwargs: Any) -> Any:
    """Run ``body(comm, **kwargs)`` on every rank and return rank 0's result (None on other ranks).

    Under ``mpiexec`` the ranks are its processes; otherwise ``ranks`` threads in this process, said
    in one line. ``check(world_size)`` returns what is wrong with that world size (or None): the
    message is printed once, by rank 0, and every rank exits with status 2 before any message.
    """
    mpi = under_mpiexec()
    comm = world() if mpi else None
    size, rank = (comm.size, comm.rank) if comm is not None else (ranks, 0)
    problem = check(size) if check is not None else None
    if problem:
        if rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    if comm is not None:
        result = body(comm, **kwargs)
        return result if comm.rank == 0 else None
    print(f"(no mpiexec: {ranks} ranks run as threads of this process; --ranks N to change, "
          f"or mpiexec -n N for real processes)")
    return launch(body, ranks, "threads", **kwargs)[0]


def lesson_parser(doc: str | None, steps: int, ranks: int) -> argparse.ArgumentParser:
    """The arguments every lesson takes: ``--steps`` and ``--ranks`` (threads, when not under mpiexec);
    a lesson adds its own to the parser."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--ranks", type=int, default=ranks, help="ranks when not under mpiexec (threads)")
    return parser


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


def console(width: int | None = None) -> Console:
    """A rich console: colour under mpiexec when FORCE_COLOR is set (stdout is no terminal there),
    and the terminal's width (110 columns when there is none) unless ``width`` is given."""
    width = width or shutil.get_terminal_size(fallback=(110, 24)).columns
    return Console(force_terminal=os.environ.get("FORCE_COLOR", "0") not in ("", "0") or None, width=width)


def finish(traces: Sequence[str | os.PathLike[str] | Trace], out_html: str | os.PathLike[str],
           out: Console, timeline: str | os.PathLike[str] | Trace | None = None,
           titles: Sequence[str] | None = None, extra_figures: Sequence[tuple[str, go.Figure]] = ()) -> Path:
    """Print the terminal timeline of ``timeline`` (default: the first trace) and write one HTML
    report of all ``traces``, with ``extra_figures`` (title, figure) as sections after its summary;
    returns the report's path."""
    from viz.report import write_report
    from viz.terminal import print_timeline

    print_timeline(timeline if timeline is not None else traces[0], console=out)
    path = Path(write_report(list(traces), out_html, titles=titles, extra_figures=extra_figures))
    out.print(f"[bold]report:[/bold] {path}  (open it in a browser; it works offline)")
    return path
