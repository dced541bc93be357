"""The README and docs/architecture.md in step with the tree (issue 28, item 6): the README's lesson
table has one row per ``lessons/NN_*`` folder and no other; the README's layout and the architecture's
module list name every module and package of ``minipar/`` and of ``minipar/parallel/``, every
subcommand of the ``minipar`` command, and no file or folder that does not exist. Reads text only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minipar.cli import COMMANDS
from minipar.testing import ROOT

SKIP = {"runs", "__pycache__"}  # what runs and the interpreter write: not the project's files
LAYOUTS = [("README.md", "## Layout"), ("docs/architecture.md", "## Layers")]
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b")  # cli.py, viz/overview.py, install-chromium.sh
FOLDER = re.compile(r"(?<![\w./-])(\w+)/(?=[\s,)]|$)")  # comm/, pipeline/ (not record/save/load)


def section(doc: str, heading: str) -> str:
    """The text of ``doc`` from ``heading`` to the next heading of its level."""
    text = (ROOT / doc).read_text()
    start = text.index(f"\n{heading}\n")
    level = heading.split()[0]
    end = text.find(f"\n{level} ", start + len(heading) + 2)
    return text[start:end if end >= 0 else None]


def code_block(doc: str, heading: str) -> str:
    """The first fenced block of ``doc``'s section ``heading``."""
    return section(doc, heading).split("```")[1]


def lesson_folders() -> set[str]:
    return {p.name for p in (ROOT / "lessons").iterdir() if p.is_dir() and re.match(r"\d\d", p.name)}


def modules(package: Path) -> set[str]:
    """``name.py`` for each module and ``name/`` for each package directly in ``package``."""
    return ({p.name for p in package.glob("*.py") if p.name != "__init__.py"}
            | {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()})


def tree_names() -> set[str]:
    """Every file and folder name of the project (``a/b.py`` also as ``b.py``), to resolve a name."""
    names: set[str] = set()
    for p in ROOT.rglob("*"):
        parts = p.relative_to(ROOT).parts
        if any(part.startswith(".") or part in SKIP or part.endswith(".egg-info") for part in parts):
            continue
        for i in range(len(parts)):
            names.add("/".join(parts[i:]) + ("/" if p.is_dir() else ""))
    return names


def named(block: str) -> tuple[set[str], set[str]]:
    """The files (``x.py``) and folders (``x/``) a layout block names."""
    return set(FILE.findall(block)), {f"{m}/" for m in FOLDER.findall(block)}


def test_the_readme_has_one_row_per_lesson() -> None:
    rows = re.findall(r"^\| `(\w+)`", section("README.md", "## Lessons"), flags=re.MULTILINE)
    assert len(rows) == len(set(rows)), f"a lesson has two rows: {rows}"
    folders = lesson_folders()
    assert not folders - set(rows), f"lessons without a row in the README's table: {sorted(folders - set(rows))}"
    assert not set(rows) - folders, f"README rows for lessons that do not exist: {sorted(set(rows) - folders)}"


@pytest.mark.parametrize("doc,heading", LAYOUTS)
def test_the_layout_names_every_module_and_package(doc: str, heading: str) -> None:
    files, folders = named(code_block(doc, heading))
    for package in (ROOT / "minipar", ROOT / "minipar" / "parallel"):
        missing = sorted(modules(package) - files - folders)
        assert not missing, f"{doc}, {heading}: {package.relative_to(ROOT)}/ has {missing}, not named"


@pytest.mark.parametrize("doc,heading", LAYOUTS)
def test_the_layout_names_nothing_that_does_not_exist(doc: str, heading: str) -> None:
    files, folders = named(code_block(doc, heading))
    ghosts = sorted((files | folders) - tree_names())
    assert not ghosts, f"{doc}, {heading} names what the tree does not have: {ghosts}"


@pytest.mark.parametrize("doc,heading", LAYOUTS)
def test_the_layout_names_every_subcommand(doc: str, heading: str) -> None:
    line = next(line for line in code_block(doc, heading).splitlines() if line.strip().startswith("cli.py"))
    missing = [name for name in COMMANDS if not re.search(rf"\b{name}\b", line)]
    assert not missing, f"{doc}, {heading}: cli.py's line does not name minipar {missing}: {line.strip()!r}"
