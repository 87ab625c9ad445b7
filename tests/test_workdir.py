"""The trainer's promises to a user at the command line: bad values are one ``error:`` line
before anything is written; the workdir's ``config.gin``, config history and checkpoints stay
true to what was trained (no-op starts and failed resumes change nothing); a resume states
what changed since its checkpoint."""

import json
import os
import re
import subprocess
import sys

import pytest

from child_env import child_env
from ulysses_jax.cli import gin_config
from ulysses_jax.checkpoint import read_run_config
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.models.config import LlamaConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "configs/tiny_cpu.gin"
PARAMS = ["LlamaConfig.preset = 'tiny'", "DataConfig.seq_len = 128", "DataConfig.batch_size = 8",
          "TrainConfig.eval_batches = 1", "STEPS = 6", "OptimizerConfig.warmup_steps = 1",
          "CheckpointConfig.save_every = 3"]


def _train(workdir, params, cache=None):
  params = params + ([f"TrainConfig.compilation_cache = '{cache}'"] if cache else [])
  return subprocess.run([sys.executable, "-m", "ulysses_jax.train", f"--gin_file={TINY}",
                         f"--workdir={workdir}"] + [f"--gin_param={p}" for p in params],
                        cwd=REPO, env=child_env(), capture_output=True, text=True,
                        timeout=300)


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _assert_one_error_line(out, message):
  assert out.returncode == 2, out.stderr  # bad input (ulysses_jax.cli)
  assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
  assert out.stderr.startswith("error: ") and message in out.stderr, out.stderr


# Each bad value's message, as the trainer reads the config (in this process: a command line
# costs seconds of imports). The command line's own promise, one ``error:`` line and nothing
# written, is checked end to end below for a value read with the config and for the mesh, which
# the trainer checks past reading.
@pytest.mark.parametrize("param, message", [
    ("DataConfig.seq_len = 256.0", "DataConfig.seq_len must be an int, got 256.0"),
    ("DataConfig.batch_size = 0", "DataConfig.batch_size must be >= 1, got 0"),
    ("OptimizerConfig.learning_rate = '3e-3'",
     "OptimizerConfig.learning_rate must be a float, got '3e-3'"),
    ("TrainConfig.steps = 2.5", "TrainConfig.steps must be an int, got 2.5"),
    ("TrainConfig.platform = 'gpux'", "TrainConfig.platform must be one of '', 'cpu'"),
    ("LlamaConfig.remat_policy = 'fast'", "LlamaConfig.remat_policy must be one of 'none'"),
    ("LlamaConfig.preset = 'gpt5'", "LlamaConfig.preset 'gpt5' is unknown"),
    ("CheckpointConfig.keep = 0", "CheckpointConfig.keep must be >= 1, got 0"),
])
def test_a_bad_value_is_named_with_what_it_must_be(param, message):
  with pytest.raises((ConfigError, ValueError, TypeError), match=re.escape(message)):
    gin_config.read([TINY], PARAMS + [param])


@pytest.mark.parametrize("param, message", [
    ("DataConfig.seq_len = 'abc'", "DataConfig.seq_len must be an int, got 'abc'"),
    ("TrainConfig.mesh_seq = 3", "mesh data=2 x seq=3 needs 6 devices but 8 are available"),
])
def test_bad_values_are_one_error_line_and_no_workdir(tmp_path, param, message):
  workdir = tmp_path / "run"
  _assert_one_error_line(_train(workdir, PARAMS + [param]), message)
  assert not workdir.exists()


@pytest.mark.slow
def test_the_workdir_tells_the_truth(tmp_path):
  workdir, cache = tmp_path / "run", str(tmp_path / "cache")
  config_gin, history = workdir / "config.gin", workdir / "config_history"
  assert _train(workdir, PARAMS, cache).returncode == 0
  written, started = _read(config_gin), os.listdir(history)
  assert len(started) == 1 and _read(history / started[0]) == written
  # Each checkpoint carries the config it was trained with.
  step, saved = read_run_config(workdir / "checkpoints")
  assert step == 6 and saved["gin"] == written
  assert LlamaConfig.from_dict(saved["model"]) == gin_config.read([TINY], PARAMS).model

  # A start with nothing to do, and a resume that fails, change nothing.
  out = _train(workdir, PARAMS + ["STEPS = 4"], cache)
  assert out.returncode == 0 and "already at step 6 of 4" in out.stdout
  _assert_one_error_line(_train(workdir, PARAMS + ["LlamaConfig.hidden_dim = 128"], cache),
                         "they were saved with model.hidden_dim = 64 (this run: 128)")
  assert _read(config_gin) == written and os.listdir(history) == started

  # A resume that goes on says what changed, and keeps the history of both starts.
  out = _train(workdir, PARAMS + ["STEPS = 8"], cache)
  assert out.returncode == 0, out.stderr
  assert "changed since the checkpoint of step 6: optimizer.total_steps: 6 -> 8" in out.stderr
  assert "STEPS = 8" in _read(config_gin) and len(os.listdir(history)) == 2
  assert read_run_config(workdir / "checkpoints")[1]["optimizer"]["total_steps"] == 8


def test_a_run_with_other_experts_is_not_resumed_from_the_checkpoints(monkeypatch):
  """The experts (``LlamaConfig.moe``) shape the train state: a new start with other ones is
  told what differs before any restore."""
  from ulysses_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  from ulysses_jax.models.config import MoeConfig  # pylint: disable=import-outside-toplevel
  from ulysses_jax.run_config import RunConfig  # pylint: disable=import-outside-toplevel
  moe = lambda n: RunConfig(model=LlamaConfig(preset="tiny", moe=MoeConfig(
      num_experts=n, experts_per_token=2, expert_mlp_dim=32)))
  saved = json.loads(json.dumps(moe(4).to_dict()))
  monkeypatch.setattr(workdir_lib, "read_run_config", lambda directory: (7, saved))
  assert workdir_lib.why_no_restore("ckpt", moe(4)) is None
  why = workdir_lib.why_no_restore("ckpt", moe(8))
  assert "(newest: step 7)" in why and "model.moe = " in why and "'num_experts': 4" in why
