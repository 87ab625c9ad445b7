#!/usr/bin/env bash
# Prints the path of a Python interpreter of version $1 (e.g. 3.12): python$1 on PATH, else one
# that pyenv manages (installed but not selected). Exit 1, saying what to do, when there is none.
set -euo pipefail
version=$1
pyenv_versions="$(pyenv root 2>/dev/null || true)/versions"
for candidate in "python$version" "$pyenv_versions/$version"*/bin/"python$version"; do
  if "$candidate" -c 'import sys; print(sys.executable)' 2>/dev/null; then
    exit 0
  fi
done
echo "no Python $version found: install it (e.g. pyenv install $version) or name one with" \
     "NEWEST_PYTHON=/path/to/python$version" >&2
exit 1
