#!/usr/bin/env bash
# Runs the trainer as NUM_PROCESSES processes on this machine, joined by jax.distributed
# over localhost (what several nodes do, on one).
#
#   scripts/launch_local.sh NUM_PROCESSES [trainer flags...]
#
# CPU: 2 processes x 4 virtual devices = the 8 devices of configs/tiny_cpu.gin:
#   scripts/launch_local.sh 2 --gin_file=configs/tiny_cpu.gin \
#       --gin_param=TrainConfig.cpu_devices=4 --workdir=runs/tiny_2proc
# GPUs: the visible GPUs are split evenly, each process sees its share
#   (CUDA_VISIBLE_DEVICES); e.g. 8 GPUs and 8 processes: one each.
#
# Environment: PYTHON (default: .venv/bin/python if present, else python),
# PORT (coordinator port; default: a free one). SIGTERM and SIGINT (Ctrl-C) reach every
# process as SIGTERM: they save a checkpoint and exit.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES [python -m ulysses_jax.train flags...]" >&2
  exit 2
fi
num=$1
shift
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
port=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}

gpus=()
if [[ -z ${CUDA_VISIBLE_DEVICES:-} ]] && command -v nvidia-smi > /dev/null; then
  mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader)
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
fi
if (( ${#gpus[@]} && ${#gpus[@]} % num )); then
  echo "$0: ${#gpus[@]} GPUs do not split evenly over $num processes" >&2
  exit 2
fi

pids=()
forward() { kill -s "$1" "${pids[@]}" 2> /dev/null || true; }
trap 'forward TERM' TERM
# Bash starts a script's background jobs with SIGINT ignored, and the trainer leaves an ignored
# signal ignored: Ctrl-C reaches the processes as SIGTERM, which they treat the same way.
trap 'forward TERM' INT
for ((i = 0; i < num; i++)); do
  env_vars=()
  if (( ${#gpus[@]} )); then
    per=$(( ${#gpus[@]} / num ))
    share=$(IFS=,; echo "${gpus[*]:i * per:per}")
    env_vars=(CUDA_VISIBLE_DEVICES="$share")
  fi
  env "${env_vars[@]}" "$PYTHON" -m ulysses_jax.train --coordinator_address="localhost:$port" \
      --num_processes="$num" --process_id="$i" "$@" &
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do
  # `wait` returns early when a forwarded signal arrives; wait again until the child exits.
  while true; do
    set +e
    wait "$pid"
    code=$?
    set -e
    if ! kill -0 "$pid" 2> /dev/null; then break; fi
  done
  if (( code != 0 && status == 0 )); then status=$code; fi
done
exit "$status"
