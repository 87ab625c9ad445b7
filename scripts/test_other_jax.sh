#!/usr/bin/env bash
# Runs the test suite on the CPU with another Python and JAX than `make test` installs, e.g. the
# GPU machine's pair before a GPU session:
#
#   scripts/test_other_jax.sh python3.12 0.11.2 [pytest args...]
#   scripts/test_other_jax.sh python3.12 0.11.2 --install-only
#
# The environment goes to .venv-jax<VERSION> (made once, ignored by git), with JAX's CUDA plugin
# (compile-only here: JAX_PLATFORMS=cpu), so the gpu_compile tests run too. torch, transformers
# and tokenizers are left out, so the tests that need them skip.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 PYTHON JAX_VERSION [pytest args... | --install-only]" >&2
  exit 2
fi
python=$1
version=$2
shift 2
cd "$(dirname "$0")/.."
venv=.venv-jax$version
if [[ ! -f $venv/.installed ]]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "jax[cuda12-local]==$version" -e '.[dev]'
  touch "$venv/.installed"
fi
if [[ ${1:-} == --install-only ]]; then
  exit 0
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
"$venv/bin/python" -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)'
"$venv/bin/python" -m pytest -q "$@"
