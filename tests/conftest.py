"""Hypothesis profiles. ``default`` (CI) keeps the suite short; ``thorough`` runs ten times more examples.

    HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests

Examples are drawn at random on every run (no global ``derandomize``): cases that must always run are
``@example``s on the test. A failure is shrunk and printed with its ``@reproduce_failure`` blob, and
``--hypothesis-seed=N`` replays a whole run. ``strategies.budget(n)`` scales a test's example count with
the profile. An ``mpiexec`` property draws here, in the pytest process: each example is one job, a world
size and a list of configurations (``strategies.mpi_jobs``) that ``minipar.testing.run_each`` runs in
one ``mpiexec``; the ranks never draw.

Under pytest-xdist (``make test`` runs ``-n 2``) a test marked ``mpi`` or ``alone`` runs with no other
test beside it: an ``mpiexec`` job already fills both cores, and ``alone`` tests measure time. The other
tests (threads, formulas, notebooks: one core each) run two at a time.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_common = {"deadline": None, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("default", max_examples=10, **_common)
settings.register_profile("thorough", max_examples=100, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _lock_files() -> tuple[Path, Path]:
    base = Path(tempfile.gettempdir()) / f"minipar-xdist-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}"
    return Path(f"{base}.gate"), Path(f"{base}.cores")


@contextmanager
def _cores(alone: bool) -> Iterator[None]:
    """A readers-writer lock over the xdist workers of this run: shared for a test that may run beside
    another, exclusive for an ``alone`` one. The gate, held by a waiting exclusive test, stops new shared
    holders from starving it."""
    gate_path, cores_path = _lock_files()
    with open(gate_path, "a") as gate, open(cores_path, "a") as cores:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cores, fcntl.LOCK_UN)


class _SharedCores:
    """Runs every test's call (notebooks too: a global plugin, not this folder's fixture) under ``_cores``."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        with _cores(any(item.get_closest_marker(m) for m in ("mpi", "alone"))):
            return (yield)

    def pytest_unconfigure(self) -> None:
        """A worker with no test left removes the lock files (the other then has the cores to itself)."""
        for path in _lock_files():
            path.unlink(missing_ok=True)


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ and not config.pluginmanager.has_plugin("minipar-shared-cores"):
        config.pluginmanager.register(_SharedCores(), "minipar-shared-cores")
