# Two commands from a clean clone: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow test-all lint train bench-comm clean gpu-compile-venv test-gpu-compile \
	newest-jax-venv test-newest-jax machine-jax-venv test-machine-jax doctor ci-times docs \
	docs-serve

# pip compiles the installed packages' bytecode one file after another (60 of the install's 107 s
# on CI's 2 cores, 2026-11-29); compileall does it on every core. A file that does not compile
# (some packages ship templates named .py) stays as pip would leave it: without bytecode.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --no-compile -e '.[dev,hf,data,grain,wandb]' 'torch==2.13.0'  # the CPU build: an unpinned torch pulls GBs of CUDA
	$(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || true
	touch $(STAMP)

setup: $(STAMP)

# How every suite runs: one pytest worker per core (pytest-xdist; each worker has its own 8
# virtual devices), and JAX's persistent compilation cache in .cache/jax, shared by the suites
# and the runs after them (the key holds the JAX version and the compiler options, so one
# directory serves every environment). Each suite writes a JUnit report under runs/ci/ for
# `make ci-times`. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
PYTEST = -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider

# The CI suite: everything except tests marked slow (and gpu tests, which skip on CPU).
# Budget: 10 minutes on CI's 2 cores; one test at most 30 s (tests/conftest.py).
test: $(STAMP)
	$(PY) $(PYTEST) -m "not slow" --durations=20 --junitxml=runs/ci/quick.xml

# The linter (rules in pyproject.toml); CI runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check ulysses_jax tests benchmarks

# The tests marked slow (CI runs them after `make test`) but the Mosaic kernels' (`mosaic`): CI
# runs those in test-newest-jax, whose GPU interpreter is ~3x faster than jax 0.10's (1,100 s of
# test time there, 2026-11-28) and has the race detector. `make test-all` runs them here too.
test-slow: $(STAMP)
	$(PY) $(PYTEST) -m "slow and not mosaic" --durations=20 --junitxml=runs/ci/slow.xml

# Everything, slow tests included.
test-all: $(STAMP)
	$(PY) $(PYTEST)

# The slowest 25 tests of each suite that ran here (from runs/ci/*.xml).
ci-times:
	$(PYTHON) scripts/ci_times.py --top 25

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

# The quick tests marked gpu_compile: compiled for H100 clusters, no GPU needed. The slow ones
# run on the newest JAX (test-newest-jax), the one GPU users install, and not again here, for
# CI's time; all of them here: make test-gpu-compile GPU_COMPILE_TESTS=gpu_compile.
GPU_COMPILE_TESTS ?= gpu_compile and not slow
test-gpu-compile: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_PY) $(PYTEST) -m "$(GPU_COMPILE_TESTS)" --durations=10 \
	  --junitxml=runs/ci/gpu_compile.xml

# The newest JAX the package index serves, on Python 3.12: what GPU users install. A third
# environment (JAX's CUDA plugin included, so JAX_PLATFORMS=cpu) in which CI runs the CPU suite
# and the whole gpu_compile suite again. Nothing is pinned: each fresh environment takes the
# newest release (today jax 0.12.0.1), so a JAX release that breaks us turns CI red.
NEWEST_PYTHON ?= $(shell scripts/find_python.sh 3.12)
NEWEST_VENV := .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed

$(NEWEST_STAMP): pyproject.toml
	test -x $(NEWEST_PY) || $(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	$(NEWEST_PY) -m pip install -q --upgrade -e '.[dev,gpu-compile]'
	touch $(NEWEST_STAMP)

newest-jax-venv: $(NEWEST_STAMP)

# "not slow" there includes the quick gpu_compile tests (the plugin is installed), with the slow
# gpu_compile and Mosaic ones in the same run (one start, the two workers balanced over both).
# torch and transformers are left out: their tests skip.
# A quick test may take 60 s there (the 30 s budget holds for `make test`): a few compile-only
# ones took up to 27.5 s beside the slow Mosaic tests (the rehearsal of 5cbb7f6, 2026-11-29) and
# the race detector's tests, up to 38.6 s in slow hours, are marked slow (2026-11-29).
test-newest-jax: $(NEWEST_STAMP)
	$(NEWEST_PY) -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)'
	JAX_PLATFORMS=cpu ULYSSES_QUICK_TEST_LIMIT_S=60 $(NEWEST_PY) $(PYTEST) --dist worksteal \
	  -m "not slow or ((gpu_compile or mosaic) and slow)" --durations=10 \
	  --junitxml=runs/ci/newest_jax.xml

# The JAX of the GPU machines we measure on (jax 0.11.2 with a CUDA 13 plugin; here its CUDA 12
# one, compile-only): its XLA compiled our step unlike 0.10 and 0.12 (it ran attention's forward
# twice per layer until kernels.variants put optimization barriers in, 2026-11-27), so the
# quick gpu_compile suite and that step's check run on it too (scripts/test_other_jax.sh, in
# .venv-jax0.11.2), but the programs for clusters (8 and 16 GPUs, B200s): a lent machine is one
# GPU, and GPU users' JAX is the newest, which runs them. Pinned on purpose: a test environment.
MACHINE_JAX := 0.11.2
OTHER_JAX := scripts/test_other_jax.sh $(NEWEST_PYTHON) $(MACHINE_JAX)

machine-jax-venv:
	$(OTHER_JAX) --install-only

test-machine-jax:
	ULYSSES_QUICK_TEST_LIMIT_S=45 $(OTHER_JAX) -n $(TEST_WORKERS) --dist worksteal -p no:cacheprovider \
	  -m "gpu_compile and not slow or machine_jax" -k "not one_node and not two_nodes and not b200" \
	  --durations=10 \
	  --junitxml=runs/ci/machine_jax.xml

# The first command on a GPU machine: kernels against the reference, their speed, one step
# against aot's prediction (docs/get-started/first-gpu-run.md). On a CPU it checks what it can.
doctor: $(STAMP)
	$(PY) -m ulysses_jax.doctor --json runs/doctor.json

bench-comm: $(STAMP)
	$(PY) -m benchmarks.comm_volume --json benchmarks/results/comm_volume.json

# The docs site (mkdocs.yml; docs/) in its own environment: the docs extra alone, neither JAX nor
# the package (mkdocstrings reads the source). --strict: any warning fails the build.
DOCS_VENV := .venv-docs
DOCS_PY := $(DOCS_VENV)/bin/python
DOCS_STAMP := $(DOCS_VENV)/.installed
export NO_MKDOCS_2_WARNING := 1

$(DOCS_STAMP): pyproject.toml
	test -x $(DOCS_PY) || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install -q --upgrade pip
	$(DOCS_PY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' \
	  > $(DOCS_VENV)/requirements.txt
	$(DOCS_PY) -m pip install -q -r $(DOCS_VENV)/requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(DOCS_VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	$(DOCS_VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) $(GPU_VENV) $(NEWEST_VENV) $(DOCS_VENV) site runs .cache
