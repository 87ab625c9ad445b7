"""XLA's rematerialisation warning and its GPU scheduler's "exceeds the base limit" error,
written from C++ to file descriptor 2, each become one line of ours; every other line on the
descriptor passes through unchanged. (The scheduler's line from a real compile for an H100:
tests/test_gpu_compile_cli.py.)"""

import logging
import os

import numpy as np
import pytest

from ulysses_jax import xla_log

REMAT = (b"W1124 14:13:09.815749   30646 hlo_rematerialization.cc:3402] Can't reduce memory use "
         b"below 83.63GiB (89795223790 bytes) by rematerialization; only reduced to 108.56GiB "
         b"(116565132608 bytes), down from 110.81GiB (118979082592 bytes) originally\n")
# As jax 0.10.2 logs it compiling for one H100 a step that donates 100 GiB of pinned-host state
SCHEDULE = (b"E1125 14:25:22.807106    9129 gpu_hlo_schedule.cc:968] The byte size of "
            b"input/output arguments (107382571024) exceeds the base limit (67954383257). This "
            b"indicates an error in the calculation!\n")
OTHER = b"W1124 14:13:10.000001   30646 gpu_compiler.cc:1] some other XLA warning\n"


@pytest.fixture(autouse=True)
def not_yet_explained(monkeypatch):
  monkeypatch.setattr(xla_log, "_explained", set())


def test_each_line_is_explained_once_and_others_pass_through(capfd, caplog):
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    for _ in range(2):
      with xla_log.xla_warnings_explained():
        os.write(2, OTHER + SCHEDULE + REMAT)
  err = capfd.readouterr().err
  assert err == OTHER.decode() * 2
  explained = [r.getMessage() for r in caplog.records if r.name == "ulysses_jax.xla_log"]
  assert explained == [xla_log.schedule_explanation("107382571024", "67954383257"),
                       xla_log.remat_explanation("83.63GiB", "108.56GiB")]
  assert explained[0].startswith("XLA's GPU scheduler logged that the step's inputs and outputs "
                                 "(100.0 GiB) exceed its base limit (63.3 GiB). It counts those "
                                 "kept in host memory")
  assert "could not bring its memory estimate of the step below 83.63GiB" in explained[1]


def test_where_the_limit_is_lowered_on_purpose_it_is_dropped_unexplained(capfd, caplog):
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    with xla_log.xla_warnings_explained(explain=False):
      os.write(2, REMAT + SCHEDULE + OTHER)
  assert capfd.readouterr().err == OTHER.decode()
  assert not caplog.records


def test_stderr_comes_back_after_an_exception(capfd):
  with pytest.raises(RuntimeError, match="compile failed"):
    with xla_log.xla_warnings_explained():
      os.write(2, OTHER)
      raise RuntimeError("compile failed")
  os.write(2, b"after\n")
  assert capfd.readouterr().err == OTHER.decode() + "after\n"


@pytest.mark.slow
def test_the_trainer_explains_it_when_it_compiles_the_step(tmp_path, capfd, caplog, monkeypatch):
  """XLA's CPU compiler does not rematerialise, so the step's compile (before the first step,
  ``train.fit``) writes the line as XLA's GPU compiler would for an offloaded step."""
  from ulysses_jax import step_builder, train  # pylint: disable=import-outside-toplevel
  from ulysses_jax.cli import gin_config
  build = step_builder.build_train_step

  class LoweredThatLogs:
    def __init__(self, lowered):
      self.lowered = lowered

    def compile(self, *args):
      os.write(2, REMAT + OTHER)
      return self.lowered.compile(*args)

  def build_logging_step(config, mesh, **kwargs):
    built = build(config, mesh, **kwargs)
    step = lambda *args: built.step(*args)
    step.lower = lambda *args: LoweredThatLogs(built.step.lower(*args))
    return built._replace(step=step)

  monkeypatch.setattr(step_builder, "build_train_step", build_logging_step)
  np.save(tmp_path / "doc.npy", np.arange(2000) % 256)
  config = gin_config.read(["configs/tiny_cpu.gin"], [
      "LlamaConfig.preset='tiny'", "DataConfig.seq_len=16", "STEPS=2", "TrainConfig.eval_every=0",
      "DataConfig.source='files'", f"DataConfig.paths='{tmp_path / 'doc.npy'}'",
      "DataConfig.eval_fraction=0.0",
      "OptimizerConfig.warmup_steps=0", "TrainConfig.progress_bar=False"])
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    assert train.train(str(tmp_path / "run"), config)["step"] == 2
  err = capfd.readouterr().err
  assert OTHER.decode() in err and "Can't reduce memory use" not in err
  explained = [r.getMessage() for r in caplog.records if r.name == "ulysses_jax.xla_log"]
  assert explained == [xla_log.remat_explanation("83.63GiB", "108.56GiB")]
