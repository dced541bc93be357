"""What every lesson does at the start and the end: a console that keeps colour under mpiexec,
and the closing terminal timeline plus HTML report."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from minipar.trace import Trace


def console(width: int | None = None) -> Console:
    """A rich console: colour under mpiexec when FORCE_COLOR is set (stdout is no terminal there),
    and the terminal's width (110 columns when there is none) unless ``width`` is given."""
    width = width or shutil.get_terminal_size(fallback=(110, 24)).columns
    return Console(force_terminal=bool(os.environ.get("FORCE_COLOR")) or None, width=width)


def finish(traces: Sequence[str | os.PathLike[str] | Trace], out_html: str | os.PathLike[str],
           out: Console, timeline: str | os.PathLike[str] | Trace | None = None,
           titles: Sequence[str] | None = None) -> Path:
    """Print the terminal timeline of ``timeline`` (default: the first trace) and write one HTML
    report of all ``traces``; returns the report's path."""
    from viz.report import write_report
    from viz.terminal import print_timeline

    print_timeline(timeline if timeline is not None else traces[0], console=out)
    path = Path(write_report(list(traces), out_html, titles=titles))
    out.print(f"[bold]report:[/bold] {path}  (open it in a browser; it works offline)")
    return path
