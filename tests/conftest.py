"""Hypothesis profiles: ``default`` is reproducible, ``thorough`` explores.

- ``default`` (``make test``, CI): ``derandomize=True`` and no example database, so every run on every
  machine draws the same examples: a newcomer's ``make test`` gives the result CI gave.
- ``thorough`` (``make thorough``, run before an issue is resolved): random draws, ten times the
  examples (``strategies.budget``). The run's seed is printed at the end (``--hypothesis-seed=N``
  replays the whole run) and a failure prints its ``@reproduce_failure`` blob; what it finds becomes an
  ``@example`` on the test and a fix.

    HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests

An ``mpiexec`` property draws here, in the pytest process: each example is one job, a world size and a
list of configurations (``strategies.mpi_jobs``) that ``minipar.testing.run_each`` runs in one
``mpiexec``; the ranks never draw.

``make test`` runs three pytest-xdist workers on the 2 cores, every test beside others, ``mpiexec`` jobs
included: such a job spends much of its wall time starting up and waiting (its CPU time is about half
of it), so a third worker fills the cores. The longest tests are handed out first, one at a time
(``--maxschedchunk 1`` in the Makefile). Every test passes on
a loaded machine: no test asserts a duration, and the time bounds of the watchdog and fault tests
state their margins for one.

The end of the run also names the CPU features numpy dispatches to and those turned off
(``NPY_DISABLE_CPU_FEATURES``), and the OpenBLAS core type: CI runs the equality tests a second time
with SSE-only kernels (docs/architecture.md, "Testing").
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_common = {"deadline": None, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("default", max_examples=10, derandomize=True, database=None, **_common)
settings.register_profile("thorough", max_examples=100, derandomize=False, **_common)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)


def _run_facts(config: pytest.Config) -> list[str]:
    """The profile (and a thorough run's seed) and the numpy / OpenBLAS kernels this run computes with."""
    import numpy as np
    from numpy._core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__

    on = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    off = [f for f in __cpu_dispatch__ if not __cpu_features__.get(f)]
    seed = config.getoption("hypothesis_seed", None)
    lines = [f"minipar: hypothesis profile {PROFILE!r}"
             + (f", seed {seed} (replay this run with --hypothesis-seed={seed})" if PROFILE == "thorough" else
                " (derandomized: the same examples on every run)"),
             f"minipar: numpy {np.__version__} baseline {' '.join(__cpu_baseline__)}; dispatch targets on: "
             f"{' '.join(on) or 'none'}; off: {' '.join(off) or 'none'} "
             f"(NPY_DISABLE_CPU_FEATURES={os.environ.get('NPY_DISABLE_CPU_FEATURES', '')!r}, "
             f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')!r})"]
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Printed at the end of every run (``-q`` hides the header): what the run drew and computed with."""
    for line in _run_facts(config):
        terminalreporter.write_line(line)


# The modules whose tests compare floating-point results with one process or with numpy (marker
# ``equality``): CI runs them a second time with SSE-only kernels (``make test-sse``), where numpy's
# exp, tanh and reductions round differently in the last bit. Bytes, memory, schedules, formulas, the
# viewer and the fault tests are exact or kernel-free and run once.
EQUALITY = {"test_autograd", "test_nn", "test_optim", "test_init", "test_training", "test_split_backward",
            "test_comm_collectives", "test_comm_mpi", "test_data_parallel", "test_ddp_overlap", "test_param_server",
            "test_pipeline_runtime", "test_pipedream", "test_chimera", "test_zero_bubble", "test_tensor_parallel",
            "test_tensor2d", "test_tensor2p5d", "test_tensor3d", "test_sequence_parallel", "test_zero",
            "test_zero_resume", "test_zero_checkpoint", "test_zero_edges", "test_zero_offload", "test_chunks",
            "test_chunks_mixed", "test_infinity", "test_infinity_commit", "test_hybrid", "test_sharding",
            "test_sharding_autograd", "test_sharding_propagate", "test_elastic"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the equality tests, and puts the long ones first (``mpiexec`` jobs, then the notebooks):
    pytest-xdist hands tests out in this order, one at a time (``--maxschedchunk 1``), so the run does
    not end on one worker's long test while the others idle (longest first, as for scheduling jobs)."""
    for item in items:
        if item.path.stem in EQUALITY:
            item.add_marker(pytest.mark.equality)
    items.sort(key=lambda item: 0 if item.get_closest_marker("mpi") else 1 if item.path.suffix == ".ipynb" else 2)


def pytest_configure(config: pytest.Config) -> None:
    if PROFILE == "thorough" and config.getoption("hypothesis_seed", None) is None:
        # one seed for the whole run: drawn by the controller, inherited by pytest-xdist's workers (they
        # start after this hook, with its environment)
        from hypothesis import core
        seed = int(os.environ.setdefault("MINIPAR_HYPOTHESIS_SEED", str(int.from_bytes(os.urandom(4), "little"))))
        config.option.hypothesis_seed = core.global_force_seed = seed
