"""Reading gin files: includes resolve from the including file, then the working directory,
then the repository, without an ERROR log line for the places an include is not."""

import logging
import os
import subprocess
import sys

import pytest

from ulysses_jax.cli import gin_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_includes_resolve_from_the_including_file_first(tmp_path, monkeypatch, caplog):
  (tmp_path / "exp").mkdir()
  (tmp_path / "exp" / "my.gin").write_text("include 'base.gin'\nTrainConfig.steps = 7\n")
  (tmp_path / "exp" / "base.gin").write_text(
      "include 'configs/tiny_cpu.gin'\nTrainConfig.log_every = 3\n")
  # A file of the same name in the working directory loses to the including file's sibling.
  (tmp_path / "base.gin").write_text("TrainConfig.log_every = 99\n")
  monkeypatch.chdir(tmp_path)
  with caplog.at_level(logging.DEBUG, logger=""):
    config = gin_config.read(["exp/my.gin"], [])
  assert (config.train.steps, config.train.log_every) == (7, 3)
  assert config.model.num_layers > 0  # configs/tiny_cpu.gin came from the repository
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_missing_include_names_its_including_file(tmp_path, monkeypatch):
  (tmp_path / "my.gin").write_text("TrainConfig.steps = 7\ninclude 'nope.gin'\n")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(FileNotFoundError, match=rf"^gin file 'nope.gin', included by "
                     rf"{tmp_path / 'my.gin'}, not found \(looked in {tmp_path}, {REPO}\)"):
    gin_config.parse(["my.gin"], [])


def test_a_config_run_from_another_directory_logs_no_error(tmp_path):
  """``python -m ulysses_jax.train`` from outside the repository: the shipped configs'
  includes (``configs/runs/gpu.gin``, ...) are found without a line about where they are not."""
  for config in ("llama8b_8gpu_8m.gin", "tiny_cpu.gin"):
    out = subprocess.run(
        [sys.executable, "-m", "ulysses_jax.train", f"--gin_file={REPO}/configs/{config}",
         f"--workdir={tmp_path / 'run'}", "--gin_param=TrainConfig.stepz = 1"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2  # bad input (ulysses_jax.cli)
    assert out.stderr.startswith("error: Configurable 'TrainConfig' doesn't have a parameter "
                                 "named 'stepz'."), out.stderr
    assert "ERROR" not in out.stderr and "not found" not in out.stderr, out.stderr
