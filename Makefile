# Quick start:  make test   (sets everything up in .venv, builds the extension, runs the suite)
#               make test-fast  (the same without the slow tests: the edit loop)
#               make bench  (same set-up, runs the whole benchmark suite; make bench-quick: small sizes)
PYTHON_SYS    ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.13.0
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip
DEPS_STAMP    := $(VENV)/.deps-torch-$(TORCH_VERSION)
EXT_STAMP     := $(VENV)/.ext-built
CSRC          := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh') setup.py parallel_layers/_extension.py
PYTEST_ARGS   ?= --durations=25
# Two pytest workers (pytest-xdist) on the 2-core CI machine: one process's tests leave the cores idle much of
# the time (ranks waiting on each other, subprocesses starting, timeouts run out on purpose): 36:37 -> 29:00 for
# the tests here; each worker keeps its own pools of ranks (peak 17 GiB used in all). TEST_WORKERS=0: one process.
TEST_WORKERS  ?= 2
XDIST         := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))
BENCH_ARGS    ?=

.PHONY: setup lint test test-fast bench bench-quick demo gpu-check gpu-check-dry device-env device-test clean

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
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

# The edit loop: the suite without the tests marked slow (tests/conftest.py: SLOW); make test runs them all.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS) tests

bench: setup
	$(PY) -m parallel_layers bench --readme $(BENCH_ARGS)

bench-quick: setup
	$(PY) -m parallel_layers bench --quick --readme $(BENCH_ARGS)

demo: setup
	$(PY) -m parallel_layers demo

# On a one-GPU machine, with its own python3 (no venv, no network; docs/gpu.md): build in place, CUDA tests,
# training parity, NCCL probes, GPU benchmarks; logs, junit XML, CSV rows and summary.md in gpu_check_out/.
GPU_PYTHON    ?= python3
gpu-check:
	$(GPU_PYTHON) -m parallel_layers gpu-check --out gpu_check_out

# The GPU machine's versions on this CPU machine (requirements-device.txt): Python 3.12, torch 2.11.0+cu130,
# triton 3.6.0, transformers 5.17.0, and the whole extension, CUDA part included, built in place for sm_90.
DEVICE_VENV   ?= .venv-device
DEVICE_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
DEVICE_PY     := $(DEVICE_VENV)/bin/python
DEVICE_DEPS   := $(DEVICE_VENV)/.deps-stamp
DEVICE_EXT    := $(DEVICE_VENV)/.ext-built
DEVICE_ARCH   ?= 9.0
$(DEVICE_PY):
	@test -n "$(DEVICE_PYTHON)" || { echo "device-env needs Python 3.12 (set DEVICE_PYTHON=...)"; exit 1; }
	$(DEVICE_PYTHON) -m venv $(DEVICE_VENV)

$(DEVICE_DEPS): $(DEVICE_PY) requirements-device.txt
	$(DEVICE_PY) -m pip install -q --upgrade pip
	$(DEVICE_PY) -m pip install -q -r requirements-device.txt
	touch $@

# As gpu-check builds on the GPU machine: setup.py build_ext --inplace (parallel_layers/_C.cpython-312-*.so)
$(DEVICE_EXT): $(DEVICE_DEPS) $(CSRC)
	TORCH_CUDA_ARCH_LIST=$(DEVICE_ARCH) MAX_JOBS=$${MAX_JOBS:-$$(nproc)} $(DEVICE_PY) setup.py -q build_ext --inplace
	touch $@

device-env: $(DEVICE_EXT)

# Under the device's versions: the first shot rehearsed (tests/test_device_env.py: gpu-check --dry-run from a
# clean clone of the committed tree, offline, with the prebuilt module carried over), then the suite's fast
# subset (every Triton kernel in triton 3.6's interpreter). Required before a commit that touches a kernel, a
# collective or a version pin (docs/gpu.md).
# PYTHONPATH: the checkout is used in place, not installed (as gpu-check runs its steps on the GPU machine).
device-test: device-env
	PYTHONPATH=$(CURDIR) $(DEVICE_PY) -m pytest -q $(PYTEST_ARGS) tests/test_device_env.py
	PYTHONPATH=$(CURDIR) $(DEVICE_PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

clean:
	rm -rf build *.egg-info parallel_layers/*.so $(EXT_STAMP) $(DEVICE_EXT)
