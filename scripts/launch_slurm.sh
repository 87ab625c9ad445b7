#!/usr/bin/env bash
# Multi-node training under SLURM: one process per GPU; JAX finds its peers from SLURM's
# environment (jax.distributed.initialize auto-detection), so no coordinator flags.
#
#   sbatch --nodes=4 scripts/launch_slurm.sh --gin_file=configs/llama8b_512k.gin \
#       --gin_param=DataConfig.batch_size=4 --workdir=/shared/runs/llama8b_512k
#
# Submit from the repository root. The workdir must be on a filesystem every node sees
# (checkpoints are written by all processes). Submit again with the same workdir to resume;
# with --requeue a preempted job resumes by itself. 5 minutes before the time limit SLURM sends SIGTERM, and the trainer
# saves a checkpoint at the current step and exits.
#
# Environment: PYTHON (default: the repo's .venv/bin/python if present, else python).
# Edit the #SBATCH lines (or override them on the sbatch command line) for your cluster.
#
#SBATCH --job-name=ulysses
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
echo "$(date): ${SLURM_JOB_NUM_NODES:-1} nodes x ${SLURM_NTASKS_PER_NODE:-1} processes; $*"
srun --kill-on-bad-exit=1 "$PYTHON" -m ulysses_jax.train "$@"
