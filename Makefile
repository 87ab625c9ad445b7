# Two commands from a clean clone: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow test-all lint train bench-comm clean gpu-compile-venv test-gpu-compile

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev,hf]' 'torch==2.13.0'  # the CPU build: an unpinned torch pulls GBs of CUDA
	touch $(STAMP)

setup: $(STAMP)

# The CI suite: everything except tests marked slow (and gpu tests, which skip on CPU).
test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q --durations=20

# The linter (rules in pyproject.toml); CI runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check ulysses_jax tests benchmarks

# Only the tests marked slow (CI runs them after `make test`).
test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q --durations=20

# Everything, slow tests included.
test-all: $(STAMP)
	$(PY) -m pytest -q

# Trains configs/tiny_cpu.gin into runs/tiny (run again: resumes; finished: says so).
train: $(STAMP)
	$(PY) -m ulysses_jax.train --gin_file=configs/tiny_cpu.gin --workdir=runs/tiny

# A second environment with JAX's CUDA plugin (the .[gpu-compile] extra: ~185 MB of wheels, no
# CUDA libraries; matplotlib for the benchmarks' plots), for compiling GPU programs on this
# machine (ulysses_jax.aot, benchmarks.max_seqlen --gpu). Kept apart from
# .venv: with the plugin installed, JAX needs JAX_PLATFORMS=cpu on a machine without a GPU.
GPU_VENV := .venv-gpu-compile
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q -e '.[dev,bench,gpu-compile]'
	touch $(GPU_STAMP)

gpu-compile-venv: $(GPU_STAMP)

# The tests marked gpu_compile: compiled for H100 clusters, no GPU needed.
test-gpu-compile: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_PY) -m pytest -m gpu_compile -q --durations=10

bench-comm: $(STAMP)
	$(PY) -m benchmarks.comm_volume --json benchmarks/results/comm_volume.json

clean:
	rm -rf $(VENV) $(GPU_VENV) runs
