"""Numbered lessons: each folder holds a script runnable under mpiexec and a Jupyter walkthrough.

Folder names start with digits, so they are not importable by name; ``load("00_autograd")`` gives a
lesson's ``lesson.py`` as a module (the notebooks use it), ``load("07_offload", "sweep.py")`` one of its
parts (a lesson too long for one file loads its parts so).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load(name: str, file: str = "lesson.py") -> ModuleType:
    """Import ``lessons/<name>/<file>`` (e.g. ``load("02_pipeline")``, or a lesson's part:
    ``load("07_offload", "sweep.py")``)."""
    path = HERE / name / file
    if not path.exists():
        known = sorted(p.name for p in HERE.iterdir() if (p / "lesson.py").exists())
        raise FileNotFoundError(f"no {file} in lesson {name!r}; lessons: {', '.join(known)}")
    mod_name = f"lessons.l{name}" + ("" if file == "lesson.py" else f"_{Path(file).stem}")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module
