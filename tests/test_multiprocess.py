"""Two trainer processes x 4 CPU devices on localhost (jax.distributed, gloo collectives),
started by scripts/launch_local.sh, give the losses of one process x 8 devices, on a weighted
mixture of two sources, also when both are killed (SIGKILL) and restarted."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pytest

from child_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB = sysconfig.get_paths()["stdlib"]
PARAMS = ["LlamaConfig.num_layers = 2", "LlamaConfig.hidden_dim = 64", "LlamaConfig.head_dim = 16",
          "LlamaConfig.mlp_dim = 128", "LlamaConfig.loss_chunk = 32", "DataConfig.seq_len = 128",
          "TrainConfig.eval_batches = 1", "STEPS = 8", "OptimizerConfig.warmup_steps = 2",
          "TrainConfig.log_every = 1", "CheckpointConfig.save_every = 4",
          "DataConfig.source = 'files'",
          f"DataConfig.sources = '{STDLIB}/json/*.py@0.7,{STDLIB}/email/*.py@0.3'"]


def _args(command, workdir, params):
  return dict(args=command + ["--gin_file=configs/tiny_cpu.gin", f"--workdir={workdir}"] +
              [f"--gin_param={p}" for p in PARAMS + params], cwd=REPO,
              env=child_env(PYTHON=sys.executable))


def _train(command, workdir, params):
  """Runs to the end; returns (completed process, metrics records)."""
  out = subprocess.run(**_args(command, workdir, params), capture_output=True, text=True,
                       timeout=400)
  assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, 9))
  return out, records


def _kill_after_checkpoint(command, workdir, params, step):
  """Starts a run and SIGKILLs all its processes once checkpoint ``step`` is on disk."""
  proc = subprocess.Popen(**_args(command, workdir, params), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
  deadline = time.time() + 400
  while not os.path.isdir(os.path.join(workdir, "checkpoints", str(step))):
    assert proc.poll() is None and time.time() < deadline, "no checkpoint before the kill"
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait(timeout=60)


@pytest.mark.slow
def test_two_processes_match_one_through_a_kill(tmp_path):
  """The batches, and so the losses and each source's token counts, of 2 processes killed at
  step 4 and restarted equal those of 1 uninterrupted process."""
  _, one = _train([sys.executable, "-m", "ulysses_jax.train"], tmp_path / "one", [])
  launch, two_dir = ["bash", "scripts/launch_local.sh", "2"], tmp_path / "two"
  two_params = ["TrainConfig.cpu_devices = 4",  # the restart loads what the first start compiled
                f"TrainConfig.compilation_cache = '{tmp_path / 'cache'}'"]
  _kill_after_checkpoint(launch, two_dir, two_params, 4)
  out, two = _train(launch, two_dir, two_params)
  assert "8 devices as {'data': 2, 'seq': 4}" in out.stderr
  assert "resuming at step 4" in out.stderr
  assert sorted(os.listdir(two_dir / "checkpoints")) == ["4", "8"]
  np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-6)
  seen = [{k: v for k, v in r.items() if k.startswith("tokens_seen/")} for r in one]
  assert [set(s) for s in seen] == [{f"tokens_seen/{STDLIB}/json/_.py",
                                     f"tokens_seen/{STDLIB}/email/_.py"}] * 8
  assert [sum(s.values()) for s in seen] == [4 * 128 * step for step in range(1, 9)]
  assert seen == [{k: v for k, v in r.items() if k.startswith("tokens_seen/")} for r in two]


def test_launcher_usage_errors():
  out = subprocess.run(["bash", "scripts/launch_local.sh", "two"], cwd=REPO, capture_output=True,
                       text=True)
  assert out.returncode == 2
  assert "usage: scripts/launch_local.sh NUM_PROCESSES" in out.stderr
  out = subprocess.run(["bash", "scripts/launch_local.sh", "3", "--workdir=x"], cwd=REPO,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}, capture_output=True,
                       text=True)
  assert out.returncode == 2
  assert "2 GPUs do not split evenly over 3 processes" in out.stderr


@pytest.mark.slow
def test_two_processes_check_the_ring_that_spans_them(tmp_path):
  """A ring of 2 over the two processes (seq 4 within each, as nodes would be): the trainer's
  first-contact check runs the XLA ring across them, against the reference on every device,
  and both processes read one verdict and go on."""
  workdir = tmp_path / "ring"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHON=sys.executable)
  params = [p for p in PARAMS if not p.startswith(("STEPS", "CheckpointConfig", "Optimizer"))] + [
      "STEPS = 1", "OptimizerConfig.warmup_steps = 0", "DataConfig.eval_fraction = 0.0",
      "TrainConfig.cpu_devices = 4", "TrainConfig.mesh_data = 1", "TrainConfig.mesh_seq = 4",
      "TrainConfig.mesh_ring = 2", "DataConfig.batch_size = 2"]
  out = subprocess.run(["bash", "scripts/launch_local.sh", "2", "--gin_file=configs/tiny_cpu.gin",
                        f"--workdir={workdir}"] + [f"--gin_param={p}" for p in params],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
  assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
  assert "8 devices as {'data': 1, 'ring': 2, 'seq': 4}" in out.stderr
  with open(workdir / "metrics.jsonl") as f:
    first = json.loads(f.readline())
  assert first["attention_backend"] == "xla"
  assert first["kernel_check"].startswith("full attention (checked on a ring of 2 x 512 tokens): "
                                          "xla passed: error")
