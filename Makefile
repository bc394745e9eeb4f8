# Two entry points: `make demo` and `make test`. Both create .venv when missing and are idempotent.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ds4sci-installed
# Extras installed for tests: dev (pytest, hypothesis, transformers) and openfold (openfold3, ~1 minute).
EXTRAS ?= dev,openfold

.PHONY: install demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

# torch first, pinned to the CPU wheel on local disk: a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): $(PY) setup.py pyproject.toml Makefile
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/demo.py

# Two pytest workers (pytest-xdist), one test module at a time each, so a module's fixtures are built once: much of
# the suite is single-threaded (the Triton interpreter, subprocess start-up). JOBS=0 runs it in this process.
# --no-loadscope-reorder keeps the collection order (tests/conftest.py puts the compile gates first); by default
# pytest-xdist (>= 3.8, which has the option) orders modules by their number of tests, which started the gates last.
# pytest exits 5 when it collected no test: that is a failure here, never a pass.
JOBS ?= 2
test: install
	@$(PY) -m pytest -n $(JOBS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
