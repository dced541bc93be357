"""Numbered lessons: each folder holds a script runnable under mpiexec and a Jupyter walkthrough.

Folder names start with digits, so they are not importable by name; ``load("00_autograd")`` gives a
lesson's ``lesson.py`` as a module (the notebooks use it). Each lesson is that one file: what several
lessons share is ``lessons/common.py``, what a user would call lives in ``minipar`` or ``viz``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load(name: str) -> ModuleType:
    """Import ``lessons/<name>/lesson.py`` (e.g. ``load("02_pipeline")``)."""
    path = HERE / name / "lesson.py"
    if not path.exists():
        known = sorted(p.name for p in HERE.iterdir() if (p / "lesson.py").exists())
        raise FileNotFoundError(f"no lesson {name!r}; lessons: {', '.join(known)}")
    mod_name = f"lessons.l{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module
