# Two commands from a clean clone: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow test-all lint train bench-comm clean

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

bench-comm: $(STAMP)
	$(PY) -m benchmarks.comm_volume --json benchmarks/results/comm_volume.json

clean:
	rm -rf $(VENV) runs
