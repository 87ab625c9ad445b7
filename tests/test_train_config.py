"""The trainer's configs and bad input, in-process (``ulysses_jax.train``, ``cli.train``): gin
names, the shipped configs, the run's values, the GPU platform, XLA's memory budget, runs that
fail before training, the multi-process flags. Runs of the real command: ``test_train.py``."""

import glob
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from child_env import child_env
from ulysses_jax import cli, distributed, train
from ulysses_jax.cli import gin_config
from ulysses_jax.cli import train as train_cli
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.run_config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "configs/tiny_cpu.gin"
FAST = ["LlamaConfig.preset = 'tiny'", "LlamaConfig.loss_chunk = 32", "DataConfig.seq_len = 128",
        "DataConfig.batch_size = 8", "TrainConfig.eval_batches = 1"]


def test_unknown_or_misspelt_gin_names_are_errors(tmp_path):
  with pytest.raises(ValueError, match="Configurable 'TrainConfig' doesn't have a parameter "
                     "named 'stepz'. Did you mean 'steps'?"):
    gin_config.parse([TINY], ["TrainConfig.stepz = 3"])
  with pytest.raises(ValueError, match="No configurable matching 'TrianConfig'. Did you mean "
                     "'TrainConfig'?"):
    gin_config.parse([TINY], ["TrianConfig.steps = 3"])
  with pytest.raises(ValueError, match=r"named 'zzz'.\n"):  # nothing near: no guess
    gin_config.parse([TINY], ["TrainConfig.zzz = 3"])
  bad = tmp_path / "bad.gin"
  bad.write_text("include 'configs/tiny_cpu.gin'\nLlamaConfig.hiden_dim = 3\n")
  with pytest.raises(ValueError, match=r"(?s)'LlamaConfig' doesn't have a parameter named "
                     r"'hiden_dim'. Did you mean 'hidden_dim'\?.*bad.gin\", line 2"):
    gin_config.parse([str(bad)], [])
  with pytest.raises(FileNotFoundError, match="gin file 'configs/nope.gin' not found"):
    gin_config.parse(["configs/nope.gin"], [])
  with pytest.raises(ConfigError, match=r"cannot parse 'LlamaConfig.remat_policy=full' "
                     r"\(--gin_param\): .*strings need quotes"):
    gin_config.parse([TINY], ["LlamaConfig.remat_policy=full"])
  bad.write_text("include 'configs/tiny_cpu.gin'\nLlamaConfig.remat_policy = full\n")
  with pytest.raises(ConfigError, match=r"bad.gin, line 2\): .*strings need quotes"):
    gin_config.parse([str(bad)], [])
  with pytest.raises(ValueError, match="give at least one --gin_file"):
    gin_config.parse([], [])
  assert train_cli.main([f"--workdir={tmp_path}"]) == cli.EXIT_USAGE


@pytest.mark.parametrize("gin_file", sorted(
    os.path.relpath(f, REPO) for f in glob.glob(os.path.join(REPO, "configs", "*.gin"))))
def test_every_shipped_config_builds_its_configs(gin_file):
  with open(os.path.join(REPO, gin_file), encoding="utf-8") as f:
    required = re.findall(r"^(\S+) = %gin\.REQUIRED", f.read(), re.MULTILINE)
  if required:  # e.g. the fine-tuning config's checkpoint: no run without it
    with pytest.raises(ValueError, match=re.escape(required[0]) + ".*not subsequently overridden"):
      gin_config.read([gin_file], [])
    return
  config = gin_config.read([gin_file], [])
  assert isinstance(config.model, LlamaConfig) and config.gin


def test_train_config_values_are_checked():
  with pytest.raises(ConfigError, match="TrainConfig.steps must be >= 1, got 0"):
    TrainConfig(steps=0)
  with pytest.raises(ConfigError, match="TrainConfig.steps must be an int, got '10'"):
    TrainConfig(steps="10")
  with pytest.raises(ValueError, match="unknown platform 'gpux'"):
    distributed.configure_platform("gpux")


@pytest.mark.skipif(bool(distributed.gpu_plugins()), reason="JAX has a GPU plugin here")
def test_platform_gpu_without_a_gpu_plugin_fails_before_jax_starts(tmp_path, capsys):
  """--platform gpu in a CPU-only JAX: our error and exit 2 before any work, not JAX's."""
  assert distributed.resolve_platform("cuda") == "cuda"
  code = train_cli.main([f"--gin_file={TINY}", f"--workdir={tmp_path / 'w'}", "--platform=gpu"])
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert code == cli.EXIT_USAGE and not (tmp_path / "w").exists()
  assert error.startswith(f"error: the config asks for platform 'gpu' but JAX {jax.__version__} "
                          "has no GPU plugin here"), error
  assert "--platform cpu" in error and "rocm'" not in error


@pytest.mark.gpu_compile
@pytest.mark.skipif("cuda" not in distributed.gpu_plugins(),
                    reason="needs JAX's CUDA plugin: run `make test-gpu-compile`")
def test_platform_gpu_is_the_installed_cuda_backend_and_no_gpu_fails_first(tmp_path):
  """With JAX's CUDA plugin and no GPU (.venv-gpu-compile), "gpu" is the CUDA backend, and a
  shipped GPU config stops at once with our "no GPU" error (exit 2), not JAX's about ROCm."""
  assert distributed.resolve_platform("gpu") == "cuda"
  env = child_env()
  del env["JAX_PLATFORMS"]
  workdir = tmp_path / "w"
  run = subprocess.run([sys.executable, "-m", "ulysses_jax.train",
                        "--gin_file=configs/llama1b_128k.gin", f"--workdir={workdir}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  error = run.stderr.strip().splitlines()[-1]
  assert run.returncode == cli.EXIT_USAGE, run.stderr
  assert error.startswith(f"error: the config asks for platform 'gpu' but JAX {jax.__version__} "
                          "found no GPU (its GPU plugins: cuda (jax-cuda"), error
  assert "--platform cpu" in error and "rocm" not in run.stderr.lower()
  assert not workdir.exists()


def test_xla_gets_the_gpu_budget_unless_the_user_chose_a_fraction(monkeypatch):
  """The trainer (configure_platform, for any platform but CPU and TPU) leaves the runtime
  reserve aot assumes: XLA_CLIENT_MEM_FRACTION = 1 - RUNTIME_RESERVE_FRACTION; a fraction the
  user set, under either name, stays; the log line says where the pool's size came from."""
  for var in distributed.MEM_FRACTION_VARS:
    monkeypatch.delenv(var, raising=False)
  distributed.configure_platform("cpu")
  assert not any(os.environ.get(v) for v in distributed.MEM_FRACTION_VARS)
  distributed.reserve_gpu_memory()
  assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.90"
  assert "XLA_CLIENT_MEM_FRACTION=0.90; the rest is left to the CUDA context" in (
      distributed.gpu_memory_line())
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".98")
  distributed.reserve_gpu_memory()
  assert "XLA_CLIENT_MEM_FRACTION" not in os.environ  # setting both is an error in JAX
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=.98; above the 90% aot's budget assumes" in (
      distributed.gpu_memory_line())


class _Device:
  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return None if self.limit is None else {"bytes_limit": self.limit}


def test_the_memory_pool_the_trainer_fits_to_is_the_smallest_of_every_process(monkeypatch):
  """The trainer fits its step to ``gpu_pool_gib(every_process=True)``: the smallest pool of the
  local devices, then of every process' (gathered from all, so all decide alike); None where a
  device anywhere reports none (CPU)."""
  gib = 2**30
  monkeypatch.setattr(jax, "local_devices", lambda: [_Device(70 * gib), _Device(60 * gib)])
  assert distributed.gpu_pool_gib() == 60.0
  gathered = []
  def process_allgather(x):
    gathered.append(float(x))
    return np.array([float(x), 50.0])  # another process' pool is smaller
  monkeypatch.setattr(distributed.multihost_utils, "process_allgather", process_allgather)
  assert distributed.gpu_pool_gib(every_process=True) == 60.0  # one process: no gathering
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert distributed.gpu_pool_gib() == 60.0 and not gathered
  assert distributed.gpu_pool_gib(every_process=True) == 50.0 and gathered == [60.0]
  monkeypatch.setattr(jax, "local_devices", lambda: [_Device(70 * gib), _Device(None)])
  assert distributed.gpu_pool_gib() is None
  assert distributed.gpu_pool_gib(every_process=True) is None
  monkeypatch.setattr(distributed.multihost_utils, "process_allgather",
                      lambda x: np.array([float(x), np.nan]))
  monkeypatch.setattr(jax, "local_devices", lambda: [_Device(70 * gib)])
  assert distributed.gpu_pool_gib(every_process=True) is None


@pytest.mark.parametrize("param, message", [
    ("TrainConfig.mesh_seq = 3", "mesh data=2 x seq=3 needs 6 devices but 8 are available"),
    ("DataConfig.seq_len = 130", "seq_len=130 does not divide over the mesh's 'seq' axis of 4 "
     "devices"),
    ("DataConfig.batch_size = 3", "batch size 3 does not divide over the mesh's 'data' axis"),
    ("LlamaConfig.vocab_size = 100", "uses ids up to 255, beyond the model's vocab_size=100"),
    ("LlamaConfig.mlp_dim = 1073741824", r"the train state \(parameters \+ optimizer\) needs "
     r".* GiB per device but a device has"),
    ("TrainConfig.cpu_devices = 4", "asks for 4 CPU devices per process but JAX already started "
     "with 8"),
    ("OptimizerConfig.warmup_steps = 40", "need 0 <= warmup_steps < total_steps, got "
     "warmup_steps=40, total_steps=30"),
    ("TrainConfig.master_weights = True", "master_weights=True keeps a float32 copy of "
     "lower-precision parameters, but the parameters are float32 already"),
    ("TrainConfig.offload_params = True", "offload_params=True needs offload_optimizer=True"),
])
def test_bad_runs_fail_before_training(tmp_path, param, message):
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError, match=message):  # ConfigError is a ValueError
    train.train(workdir, gin_config.read([TINY], FAST + ["STEPS = 30", param]))
  assert not os.path.exists(workdir)


def test_multiprocess_flags_come_together():
  with pytest.raises(ValueError, match="give --coordinator_address, --num_processes and "
                     "--process_id"):
    distributed.initialize("localhost:1234", None, None)
  with pytest.raises(ValueError, match=r"--process_id=2 must be in \[0, --num_processes=2\)"):
    distributed.initialize("localhost:1234", 2, 2)
