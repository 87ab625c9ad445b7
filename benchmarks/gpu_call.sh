#!/usr/bin/env bash
# One call on a lent GPU machine: several stages of benchmarks/gpu_session.sh, each under its own
# time limit, each packed into one archive as soon as it ends, so that a call cut short still
# returns what finished and no call returns more files than the device tool takes (8).
#
# Usage, from the repository root on the GPU machine (the device tool sets OUT):
#   benchmarks/gpu_call.sh STAGE:SECONDS [STAGE:SECONDS ...]
# e.g. benchmarks/gpu_call.sh speed:420 profile-decode:100
# Writes OUT/env.txt (GPU, driver, Python and library versions), OUT/STAGE.tgz per stage (its
# JSON and logs, from OUT/STAGE/) and OUT/calls.txt (each stage's exit code and seconds; 124:
# its limit ended it). The wheels in .whl/ (gin-config, tensorboardX; see gpu_session.sh) are
# installed first, without a network, where they are missing. GPU_SESSION_DRY=1 passes through
# (the stages' tiny CPU shapes; tests/test_speed_tools.py).
set -uo pipefail
out=${OUT:?"OUT: the folder the device tool returns"}
(( $# )) || { echo "usage: benchmarks/gpu_call.sh STAGE:SECONDS ..." >&2; exit 2; }
for spec in "$@"; do
  [[ $spec =~ ^[a-z0-9-]+:[0-9]+$ ]] || { echo "'$spec': expected STAGE:SECONDS" >&2; exit 2; }
done
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo "no nvidia-smi"
  "$python" -c 'import sys, importlib.metadata as m
print("python", sys.version.split()[0])
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers"):
  try: print(p, m.version(p))
  except m.PackageNotFoundError: print(p, "absent")'
} | tee "$out/env.txt"
if ! "$python" -c 'import gin, tensorboardX' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$out/.site" .whl/*.whl &&
    export PYTHONPATH="$out/.site${PYTHONPATH:+:$PYTHONPATH}"
fi
for spec in "$@"; do
  stage=${spec%%:*} limit=${spec##*:} start=$(date +%s)
  echo "=== $stage (limit ${limit} s) $(date -u +%H:%M:%S)"
  timeout -k 5 "$limit" bash benchmarks/gpu_session.sh "$stage" "$out/$stage"
  code=$?
  tar czf "$out/$stage.tgz" -C "$out" "$stage" && rm -rf "${out:?}/$stage"
  echo "$stage exit $code in $(($(date +%s) - start)) s" | tee -a "$out/calls.txt"
done
rm -rf "${out:?}/.site"
