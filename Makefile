# Entry points: `make demo`, `make test` (ruff, then pytest), `make lint`, `make mutate`, `make docs` and
# `make docs-serve`. Each creates .venv when missing and is idempotent.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ds4sci-installed
# Extras installed for tests: dev (pytest, hypothesis, transformers, mkdocs) and openfold (openfold3, ~1 minute).
EXTRAS ?= dev,openfold

.PHONY: install demo lint test mutate docs docs-serve clean

# pip prints a line per package it collects and installs (no -q: a fresh install takes minutes), without the
# progress bar a CI log cannot bear; each step first says what it installs. --no-compile: pip does not byte-compile
# all it installs (half the install's time); Python writes each module's .pyc at its first import instead, so the
# commands make runs do not get PYTHONDONTWRITEBYTECODE (set on the development machines): with it, every process
# would compile torch from source at import, many times the suite's CPU.
unexport PYTHONDONTWRITEBYTECODE
PIP := $(PY) -m pip install --progress-bar off --no-compile

$(PY):
	@echo "make: creating the virtual environment $(VENV) and updating pip, setuptools and wheel"
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel

# torch first, pinned to the CPU wheel on local disk: a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): $(PY) setup.py pyproject.toml Makefile
	@echo "make: installing torch 2.13.0 (CPU)"
	$(PIP) torch==2.13.0
	@echo "make: installing ds4sci (editable) with the extras $(EXTRAS) and their dependencies (a few minutes)"
	$(PIP) -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	@echo "make: running examples/demo.py (a few minutes on a 2-core CPU; each step says what it does)"
	$(PY) examples/demo.py

# ruff's rules are in pyproject.toml ([tool.ruff]); a finding fails `make test` before pytest starts.
lint: install
	$(PY) -m ruff check .

# Two pytest workers (pytest-xdist), one test module at a time each, so a module's fixtures are built once: much of
# the suite is single-threaded (the Triton interpreter, subprocess start-up). JOBS=0 runs it in this process.
# --no-loadscope-reorder keeps the collection order (tests/conftest.py puts the compile gates first, then the modules
# with a slow or distributed test, so the suite ends on short modules); by default pytest-xdist (>= 3.8, which has the
# option) orders modules by their number of tests, which started the gates last.
# pytest exits 5 when it collected no test: that is a failure here, never a pass.
JOBS ?= 2
test: lint
	@$(PY) -m pytest -n $(JOBS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# Mutation testing of the package source files changed against BASE (commits and uncommitted edits), or of FILES,
# with the tests that import them (tests/mutate.py); prints the mutants no test killed. MUTATE_TIMEOUT bounds the run
# in seconds; MUTATE_ARGS=--dry-run lists the files and their tests only.
BASE ?= main
FILES ?=
MUTATE_TIMEOUT ?= 1800
mutate: install
	$(PY) tests/mutate.py --base $(BASE) --timeout $(MUTATE_TIMEOUT) $(MUTATE_ARGS) $(FILES)

# The documentation site (mkdocs.yml, docs/): built strictly into site/ (no broken link, no unresolved API reference,
# no page outside the navigation; the CLI and config references generated from the code by docs/hooks.py).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) build *.egg-info .mutate site
