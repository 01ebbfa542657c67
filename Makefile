# Quick start:  make test   (sets everything up in .venv, builds the extension, runs the suite)
#               make test-fast  (the same without the slow tests: the edit loop)
#               make bench  (same set-up, runs the whole benchmark suite; make bench-quick: < 5 min)
PYTHON_SYS    ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.13.0
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip
DEPS_STAMP    := $(VENV)/.deps-torch-$(TORCH_VERSION)
EXT_STAMP     := $(VENV)/.ext-built
CSRC          := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh') setup.py parallel_layers/_extension.py
PYTEST_ARGS   ?= --durations=25
BENCH_ARGS    ?=

.PHONY: setup lint test test-fast bench bench-quick demo gpu-check clean

$(PY):
	$(PYTHON_SYS) -m venv $(VENV)

$(DEPS_STAMP): $(PY) requirements-dev.txt
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -r requirements-dev.txt
	touch $@

# The extension is rebuilt when a C++/CUDA source changes (ninja keeps the rebuild incremental).
$(EXT_STAMP): $(DEPS_STAMP) $(CSRC)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

setup: $(EXT_STAMP)

# ruff with the rules in pyproject.toml ([tool.ruff]); CI runs it before the tests
lint: $(DEPS_STAMP)
	$(PY) -m ruff check .

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# The edit loop: the suite without the tests marked slow (tests/conftest.py: SLOW); make test runs them all.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

bench: setup
	$(PY) -m parallel_layers bench --readme $(BENCH_ARGS)

bench-quick: setup
	$(PY) -m parallel_layers bench --quick --readme $(BENCH_ARGS)

demo: setup
	$(PY) -m parallel_layers demo

# On a one-GPU machine: build, CUDA tests with compiled Triton, training parity, NCCL and gloo-on-CUDA
# probes, GPU kernel benchmarks; logs, junit XML, CSV rows and summary.md in gpu_check_out/ (< 9 min).
gpu-check: setup
	$(PY) -m parallel_layers gpu-check --out gpu_check_out

clean:
	rm -rf build *.egg-info parallel_layers/*.so $(EXT_STAMP)
