# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv (if missing), install minipar into it, then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP := $(VENV)/.installed-stamp
export OPENBLAS_NUM_THREADS ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install bytecode demo test test-sse thorough notebook notebooks lint browser bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
	@$(PY) -c "import minipar, mpi4py, rich, plotly, hypothesis" && touch $(STAMP)

install: $(STAMP)

# The main job: a lesson under mpiexec with its terminal timeline and HTML report. Under mpiexec stdout
# is a pipe and the shell does not export COLUMNS: the terminal's width (viz.width, 80 without one) is
# passed on.
demo: install bytecode
	COLUMNS=$$($(PY) -c 'from viz.width import terminal_width; print(terminal_width())') FORCE_COLOR=1 \
		$(MPIEXEC) -n 4 $(PY) lessons/02_pipeline/lesson.py

# Debian's chromium for the real-browser test of the HTML report (needs root or sudo). Outside CI a
# failed install only skips that test; in CI (CI set) it fails the run.
browser:
	@bash scripts/install-chromium.sh || { test -z "$$CI" && echo "warning: chromium not installed; the browser test will be skipped"; }

# The project's bytecode, compiled once: on a machine that sets PYTHONDONTWRITEBYTECODE (this one does)
# would otherwise compile minipar, lessons and viz again in every process the suite starts (every rank of
# every mpiexec job: about 0.1 CPU-second each, some 40 CPU-seconds over the suite). Incremental.
bytecode: install
	@$(PY) -m compileall -q minipar lessons viz tests benchmarks > /dev/null

# Three pytest-xdist workers on 2 cores: an mpiexec job spends about half its wall time starting up and
# waiting, so a third worker fills the cores; the longest tests go first (tests/conftest.py), handed out
# one at a time (--maxschedchunk 1: xdist's default gives each worker a first batch of a quarter of its
# share in list order, so one worker got every mpiexec job and ran 224 s while the others idled from 110 s).
XDIST := -n 3 --maxschedchunk 1
test: install browser bytecode
	$(PY) -m pytest tests lessons --nbmake -p no:cacheprovider $(XDIST)

# The equality tests (marker `equality`, tests/conftest.py) again with SSE-only kernels: numpy's dispatch
# targets above the baseline turned off (every one the installed numpy names) and OpenBLAS's Prescott
# kernels, so a tolerance is proven on other rounding than this CPU's. CI runs it after `make test`.
test-sse: install bytecode
	OPENBLAS_CORETYPE=Prescott NPY_DISABLE_CPU_FEATURES="$$($(PY) -c 'from numpy._core._multiarray_umath import __cpu_dispatch__ as d; print(" ".join(d))')" \
		$(PY) -m pytest tests -m equality -p no:cacheprovider $(XDIST)

# Exploration: random draws, ten times as many examples per property, the run's seed printed (run it
# before resolving an issue; what it finds becomes an @example).
thorough: install browser bytecode
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest tests -p no:cacheprovider $(XDIST)

# JupyterLab on the lessons' walkthrough notebooks (they run on the in-process threads backend).
notebook: install
	$(PY) -m pip install -q -e '.[dev,notebook]'
	$(VENV)/bin/jupyter lab lessons/

# The walkthrough notebooks executed and stored with their outputs (text and tables; a figure becomes a
# line saying where to see it), so they read on a code host; make test fails on a stored number that no
# longer matches a fresh run (lessons/notebooks.py). NOTEBOOKS=lessons/10_faults/walkthrough.ipynb for one.
notebooks: install bytecode
	$(PY) -m lessons.notebooks $(NOTEBOOKS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/autograd.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
