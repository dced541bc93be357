"""The walkthrough notebooks stored with their outputs, so they read where code is browsed, and held
to what the code prints today.

    .venv/bin/python -m lessons.notebooks                         # every lessons/*/walkthrough.ipynb
    .venv/bin/python -m lessons.notebooks lessons/10_faults/walkthrough.ipynb   # some of them

``refresh`` (``make notebooks``) executes a notebook as nbmake does (``nbclient``, the ``python3``
kernel of this interpreter, in the notebook's folder) and stores it with its outputs: text and
tables; a Plotly figure, which a code host does not draw and which carries plotly.js, becomes one
line saying where to see it. Nothing is downloaded at run time. It runs each notebook twice and tags
a code cell whose numbers differ between the two runs ``numbers-vary`` (an asynchronous parameter
server's losses follow the order in which pushes arrive), naming it.

``stale`` compares a stored notebook with a fresh run of it (``lessons/conftest.py`` does so on the
run ``pytest --nbmake`` makes, so the check costs no second run). Compared: the numbers of each code
cell's output (stdout, text results and displays; not stderr, not figures, not a ``numbers-vary``
cell), in order. Not compared, because they vary from run to run: durations and rates (a number
followed by a time unit, ``%`` or ``x``: times are wall clock or replayed from CPU times, and idle or
bubble fractions and speed-ups are ratios of times) and a terminal timeline's lanes and axis (its
number of bands follows the times). The rest must match:

- a number printed without a fraction or exponent (bytes, counts, steps, ranks) exactly;
- a number printed with ``d`` decimals within one unit of its last digit: it is the computed value
  rounded to that digit, so two computations within half a unit of each other (float64 rounding on
  another CPU differs by ~1e-16 relative) print at most one unit apart;
- a number below ``NOISE`` in magnitude on both sides counts as rounding error, not as a value (the
  notebooks print such differences, e.g. ``max |y - y1| 6.7e-16``, and assert them below 1e-10).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent
NOISE = 1e-10  # the bound the notebooks assert differences below: smaller numbers are rounding error
TIMEOUT = 600  # seconds a cell may run
FIGURE = "application/vnd.plotly.v1+json"
OMITTED = "(a Plotly figure: run the notebook, or open the lesson's HTML report, to see it)"
MAX_BYTES = 300_000  # a stored notebook's size at most
VARIES = "numbers-vary"  # the tag refresh gives a cell whose numbers differ between two runs

_NUMBER = r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NUMBER = re.compile(rf"(?<![\w.]){_NUMBER}(?!\w|\.\d|,\d)")  # not in a word, a name or a shape
TIMELINE = re.compile(r"rank \d+ |\s+\|")  # viz.terminal's lane prefix ("rank 3 "), its axis ("   |0 ms")
VARYING = re.compile(rf"(?<![\w.]){_NUMBER}\s?(?:[mµun]?s|min|%|x|×)(?!\w)")  # 12 ms, 0.5 s, 95.7%, 1.8x


def notebooks() -> list[Path]:
    """Every lesson's walkthrough, in lesson order."""
    return sorted(HERE.glob("*/walkthrough.ipynb"))


def execute(path: Path) -> NotebookNode:
    """``path`` run top to bottom in its folder, outputs cleared first (as nbmake runs it)."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3", record_timing=False).execute(cwd=str(path.parent))
    return nb


def storable(nb: NotebookNode) -> NotebookNode:
    """``nb`` with each figure output replaced by the one line ``OMITTED``."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = [nbformat.v4.new_output("display_data", data={"text/plain": OMITTED})
                        if FIGURE in out.get("data", {}) else out for out in cell.outputs]
    return nb


def refresh(path: Path) -> int:
    """Execute ``path`` twice and store the first run with its outputs (``storable``), each code cell whose
    numbers differ between the two runs tagged ``VARIES`` (and named); returns the stored size in bytes."""
    nb, again = execute(path), execute(path)
    for i, (cell, other) in enumerate([(c, o) for c, o in zip(nb.cells, again.cells) if c.cell_type == "code"], 1):
        tags = [t for t in cell.metadata.get("tags", []) if t != VARIES]
        if differs(cell, other):
            tags.append(VARIES)
            print(f"{path}: code cell {i}: its numbers differ between two runs ({differs(cell, other)}): not compared")
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
    nbformat.write(storable(nb), path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"error: {path} is {size:,} bytes with its outputs, more than {MAX_BYTES:,}: print less")
    return size


def text(outputs: list[NotebookNode]) -> str:
    """What a cell's outputs print (stdout, text results and displays), figures and stderr left out."""
    parts = []
    for out in outputs:
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data") and FIGURE not in out.data:
            plain = out.data.get("text/plain", "")
            parts.append("" if plain == OMITTED else plain)
    return ANSI.sub("", "\n".join(parts))  # rich's text/plain carries its styles as escape codes


def numbers(printed: str) -> list[str]:
    """The numbers ``printed`` shows, those that vary between runs left out (``VARYING``, and the lines of a
    terminal timeline: its lanes and time axis, whose number of bands follows the times)."""
    kept = [line for line in printed.splitlines() if not TIMELINE.match(line)]
    return NUMBER.findall(VARYING.sub(" ", "\n".join(kept)))


def same(stored: str, fresh: str) -> bool:
    """Whether two printed numbers agree (the module docstring's rules)."""
    a, b = (float(x.replace(",", "")) for x in (stored, fresh))
    if abs(a) < NOISE and abs(b) < NOISE:
        return True
    mantissa, _, exponent = stored.lower().partition("e")
    if "." not in mantissa and not exponent:
        return a == b
    unit = 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))  # one unit of the last digit
    return abs(a - b) <= unit * (1 + 1e-9)


def differs(stored: NotebookNode, fresh: NotebookNode) -> str | None:
    """How one code cell's stored outputs differ from a fresh run's (None: they agree)."""
    old, new = numbers(text(stored.get("outputs", []))), numbers(text(fresh.outputs))
    if not stored.get("outputs") and fresh.outputs:
        return "no stored output"
    if len(old) == len(new) and all(same(a, b) for a, b in zip(old, new)):
        return None
    at = next((k for k, (a, b) in enumerate(zip(old, new)) if not same(a, b)), min(len(old), len(new)))
    return (f"stored {' '.join(old[at:at + 6]) or 'nothing'}, fresh run {' '.join(new[at:at + 6]) or 'nothing'} "
            f"(number {at + 1} of {len(old)} / {len(new)})")


def stale(stored: NotebookNode, fresh: NotebookNode) -> list[str]:
    """How ``stored``'s outputs differ from ``fresh``'s (the same notebook run again): one line per code
    cell whose numbers differ or that stored no output where the fresh run printed some; cells tagged
    ``VARIES`` are not compared."""
    pairs = [(s, f) for s, f in zip(stored.cells, fresh.cells, strict=True) if s.cell_type == "code"]
    found = [(i, differs(s, f)) for i, (s, f) in enumerate(pairs, 1) if VARIES not in s.metadata.get("tags", [])]
    return [f"code cell {i}: {what}" for i, what in found if what]


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or notebooks()
    for path in paths:
        if not path.is_file() or path.suffix != ".ipynb":
            print(f"error: {path} is not a notebook file", file=sys.stderr)
            return 2
    for path in paths:
        print(f"{path}: {refresh(path):,} bytes with outputs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
