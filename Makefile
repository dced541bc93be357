# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv (if missing), install minipar into it, then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP := $(VENV)/.installed-stamp
export OPENBLAS_NUM_THREADS ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test thorough notebook lint browser bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
	@$(PY) -c "import minipar, mpi4py, rich, plotly, hypothesis" && touch $(STAMP)

install: $(STAMP)

# The main job: a lesson under mpiexec with its terminal timeline and HTML report.
demo: install
	FORCE_COLOR=1 $(MPIEXEC) -n 4 $(PY) lessons/02_pipeline/lesson.py

# Debian's chromium for the real-browser test of the HTML report (needs root or sudo). Outside CI a
# failed install only skips that test; in CI (CI set) it fails the run.
browser:
	@bash scripts/install-chromium.sh || { test -z "$$CI" && echo "warning: chromium not installed; the browser test will be skipped"; }

# Two pytest-xdist workers: tests on threads and notebooks (one core each) run two at a time; an mpiexec
# test (it fills both cores) or one that measures time (marker `alone`) runs by itself (tests/conftest.py).
test: install browser
	$(PY) -m pytest tests lessons --nbmake -p no:cacheprovider -n 2

# Ten times as many hypothesis examples per property (run before resolving an issue).
thorough: install browser
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest tests -p no:cacheprovider

# JupyterLab on the lessons' walkthrough notebooks (they run on the in-process threads backend).
notebook: install
	$(PY) -m pip install -q -e '.[dev,notebook]'
	$(VENV)/bin/jupyter lab lessons/

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/autograd.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
