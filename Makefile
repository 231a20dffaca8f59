# Set-up and the two everyday commands. `make example` and `make test` each build the virtual
# environment on first use (Python >= 3.10 as python3), so both work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lossmask-installed

.PHONY: example test bench setup clean

example: $(STAMP)
	$(VENV)/bin/lossmask example

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pytest benchmarks --benchmark-enable --benchmark-only -s

setup: $(STAMP)

# torch is pinned to the CPU wheel the test machines carry (a bare `torch` pulls a multi-GB CUDA build).
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,all]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .benchmarks
