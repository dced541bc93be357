"""The stored walkthrough notebooks (issue 28, item 5): small enough for a code host, no figure payload,
and the rules ``lessons.notebooks.stale`` holds a stored output to a fresh run by (``lessons/conftest.py``
applies them to the run ``pytest --nbmake`` makes). Reads files and strings only."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from lessons.notebooks import FIGURE, MAX_BYTES, OMITTED, VARIES, notebooks, numbers, same, stale, storable


def _nb(*printed: str | None) -> nbformat.NotebookNode:
    """A notebook with a markdown cell and one code cell per ``printed`` (None: no output)."""
    cells = [new_markdown_cell("# title")]
    for text in printed:
        cells.append(new_code_cell("print(...)", outputs=[] if text is None else [
            new_output("stream", name="stdout", text=text)]))
    return new_notebook(cells=cells)


def test_every_walkthrough_is_stored_small_and_without_figure_payloads() -> None:
    paths = notebooks()
    assert len(paths) >= 12
    for path in paths:
        assert path.stat().st_size <= MAX_BYTES, f"{path}: {path.stat().st_size:,} bytes"
        nb = nbformat.read(path, as_version=4)
        assert not [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                    if FIGURE in o.get("data", {})], f"{path} stores a Plotly figure: make notebooks"


def test_times_percentages_and_ratios_are_not_compared_names_and_shapes_are_not_numbers() -> None:
    printed = ("step 0: loss 2.903, 1,024 bytes in 12 ms (0.5 s wall), idle 95.7%, 1.8x faster; a 4x5 @ 5x8 "
               "matmul in /tmp/tmpk2j3, max |y - y1| 6.7e-16, step 13.")
    assert numbers(printed) == ["0", "2.903", "1,024", "6.7e-16", "13"]
    timeline = "step 606 ms\n       |0 ms      |50 ms\nrank 0 F0 B0....~~**..\nrank 12 ..F0<<X\nrank 3: dead\n"
    assert numbers(timeline) == ["3"]  # a lane and the axis left out (their bands follow the times)


@pytest.mark.parametrize("stored,fresh,equal", [
    ("80", "80", True), ("80", "81", False), ("1,024", "1024", True),  # counts and bytes: exactly
    ("2.903", "2.904", True), ("2.903", "2.905", False),  # d decimals: within one unit of the last digit
    ("1.2e-03", "1.3e-03", True), ("1.2e-03", "1.4e-03", False),
    ("6.7e-16", "0.0e+00", True), ("6.7e-16", "2.0e-09", False),  # rounding error, below NOISE on both sides
])
def test_a_printed_number_agrees_within_its_last_digit(stored: str, fresh: str, equal: bool) -> None:
    assert same(stored, fresh) is equal


def test_stale_names_the_cell_whose_numbers_changed_and_a_cell_stored_without_output() -> None:
    stored = _nb("bytes 4096, loss 2.903\n", "took 5 ms\n", None)
    fresh = _nb("bytes 4096, loss 2.903\n", "took 9 ms\n", "8 ranks\n")
    assert stale(stored, fresh) == ["code cell 3: no stored output"]
    problems = stale(_nb("bytes 4096, loss 2.903\n"), _nb("bytes 4608, loss 2.903\n"))
    assert len(problems) == 1 and problems[0].startswith("code cell 1: stored 4096") and "fresh run 4608" in problems[0]
    assert stale(_nb("3 ranks\n"), _nb("3 ranks\n4 steps\n")) != []  # a number more: stale too
    varies = _nb("loss 2.903\n")
    varies.cells[1].metadata["tags"] = [VARIES]  # refresh saw its numbers differ between two runs
    assert stale(varies, _nb("loss 2.687\n")) == []


def test_a_figure_is_stored_as_one_line_and_not_compared() -> None:
    figure = new_output("display_data", data={FIGURE: {"data": []}, "text/html": "<div>" + "x" * 10_000 + "</div>"})
    fresh = _nb("2 figures\n")
    fresh.cells[1].outputs.append(figure)
    stored = storable(nbformat.from_dict(fresh))
    assert stored.cells[1].outputs[1].data == {"text/plain": OMITTED}
    assert stale(stored, fresh) == []
