"""``pytest --nbmake``'s run of each walkthrough notebook also holds the notebook's stored outputs to
that fresh run (``lessons.notebooks.stale``): the same execution, compared, so a notebook whose stored
numbers no longer match what the code prints fails, naming the cell, until ``make notebooks`` stores
them again."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from lessons.notebooks import stale, storable


def _run_and_compare(item: pytest.Item) -> None:
    """nbmake's ``NotebookItem.runtest`` (execute, fail on a cell's error) with the comparison added."""
    from nbmake.nb_result import NotebookError
    from nbmake.pytest_items import NotebookFailedException, NotebookRun

    option = item.config.option
    source = Path(item.config.rootdir) / item.filename
    res = NotebookRun(source, option.nbmake_timeout, verbose=bool(option.verbose), kernel=option.nbmake_kernel,
                      find_import_errors=option.nbmake_find_import_errors).execute()
    if res.error is None:
        problems = stale(nbformat.read(source, as_version=4), res.nb)
        if problems:
            summary = (f"{source.name} in {source.parent.name}: stored outputs differ from a fresh run; store them "
                       f"again: .venv/bin/python -m lessons.notebooks {source.relative_to(item.config.rootdir)}")
            res.error = NotebookError(summary=summary, trace="\n".join([summary, *problems]), failing_cell_index=0)
    if option.overwrite:  # nbmake's --overwrite: the fresh outputs stored, as make notebooks stores them
        nbformat.write(storable(res.nb), str(source))
    if res.error is not None:
        raise NotebookFailedException(res)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if getattr(item, "nbmake", False) and Path(item.filename).name == "walkthrough.ipynb":
            item.runtest = lambda item=item: _run_and_compare(item)  # type: ignore[method-assign]
