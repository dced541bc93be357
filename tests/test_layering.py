"""The layers docs/architecture.md draws ("What may import what"), checked on the code.

- Every module of ``minipar`` and ``viz`` imports alone (a fresh set of project modules each time, in
  one subprocess), and what it loads keeps to the drawing: ``viz`` reads ``minipar.trace`` only,
  ``minipar`` never loads ``viz`` or ``lessons``, ``minipar.trace`` loads nothing of ``minipar.comm``,
  the communication layer nothing above it.
- No import circles, counting imports inside functions (the lazy ones), which an import alone does
  not run: the graph of every ``import`` statement outside ``if TYPE_CHECKING:`` has no cycle.
- Nothing in ``minipar`` imports ``minipar.replay`` but the command line and ``rates`` (lazily), and
  nothing but the command line imports ``viz``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from minipar.testing import ROOT

PACKAGES = ("minipar", "viz")
ABOVE_COMM = ("minipar.parallel", "minipar.mesh", "minipar.sharding", "minipar.tiers", "minipar.replay",
              "minipar.elastic", "minipar.cli")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its code, outside ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycles_finds_a_circle_and_only_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_not_even_through_lazy_imports():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_only_the_command_line_imports_viz_and_the_replay():
    known = modules()
    for name, path in known.items():
        if not name.startswith("minipar."):
            continue
        deps = imports(name, path, known)
        if name not in ("minipar.cli", "minipar.cli_simulate"):
            assert not any(d.startswith("viz") for d in deps), name
        if name not in ("minipar.cli", "minipar.rates", "minipar.replay"):
            assert "minipar.replay" not in deps, name


LOADER = """
import importlib, json, sys
names = json.loads(sys.argv[1])
import minipar
base = {k for k in sys.modules if k.split(".")[0] in ("minipar", "viz", "lessons")}
out = {}
for name in names:
    for k in [k for k in sys.modules if k.split(".")[0] in ("minipar", "viz", "lessons")]:
        del sys.modules[k]
    importlib.import_module(name)
    out[name] = sorted(k for k in sys.modules if k.split(".")[0] in ("minipar", "viz", "lessons") and k not in base)
print(json.dumps(out))
"""


def test_every_module_imports_alone_and_keeps_to_its_layer():
    names = list(modules())
    proc = subprocess.run([sys.executable, "-c", LOADER, json.dumps(names)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout)
    assert sorted(loaded) == sorted(names)
    for name, mods in loaded.items():
        if name.startswith("minipar"):
            assert not [m for m in mods if m.split(".")[0] in ("viz", "lessons")], name
        if name.startswith("viz"):  # the viewer reads traces through minipar.trace only
            assert [m for m in mods if m.startswith("minipar")] in ([], ["minipar.trace"]), (name, mods)
        if name == "minipar.trace":
            assert mods == ["minipar.trace"], mods
        if name.startswith("minipar.comm"):
            assert not [m for m in mods if m.startswith(ABOVE_COMM)], (name, mods)
