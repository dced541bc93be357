"""Hypothesis profiles. ``default`` (CI) keeps the suite short; ``thorough`` runs ten times more examples.

    HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests

Examples are drawn at random on every run (no global ``derandomize``): cases that must always run are
``@example``s on the test. A failure is shrunk and printed with its ``@reproduce_failure`` blob, and
``--hypothesis-seed=N`` replays a whole run. ``strategies.budget(n)`` scales a test's example count with
the profile. An ``mpiexec`` property draws here, in the pytest process: each example is one job, a world
size and a list of configurations (``strategies.mpi_jobs``) that ``minipar.testing.run_each`` runs in
one ``mpiexec``; the ranks never draw.
"""

import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_common = {"deadline": None, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("default", max_examples=10, **_common)
settings.register_profile("thorough", max_examples=100, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
