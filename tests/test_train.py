"""Tests for the trainer (ulysses_jax.train): training, restarts, signals, damaged checkpoints,
resharding and non-finite steps through the real command line (``python -m
ulysses_jax.train``) in subprocesses. Configs and bad input in-process: ``test_train_config.py``.

The subprocess runs share one JAX compilation cache, so only the first run of each program
compiles. They use configs/tiny_cpu.gin shrunk by ``FAST`` to keep each run to seconds.
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from child_env import child_env
from ulysses_jax import cli, metrics, step_builder, train
from ulysses_jax.cli import gin_config
from ulysses_jax.checkpoint import Checkpointer
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.optimizer import make_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "configs/tiny_cpu.gin"
FAST = ["LlamaConfig.preset = 'tiny'", "LlamaConfig.loss_chunk = 32", "DataConfig.seq_len = 128",
        "DataConfig.batch_size = 8", "TrainConfig.eval_batches = 1"]
STEPS = 30
# The reference run: every step logged, checkpoints every 5 steps, the last two kept.
REFERENCE = FAST + [f"STEPS = {STEPS}", "TrainConfig.log_every = 1", "TrainConfig.eval_every = 10",
                    "CheckpointConfig.save_every = 5", "CheckpointConfig.keep = 2"]


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def _command(workdir, params, gin_file=TINY, cache=None, extra=()):
  params = list(params) + ([f"TrainConfig.compilation_cache = '{cache}'"] if cache else [])
  return ([sys.executable, "-m", "ulysses_jax.train", f"--gin_file={gin_file}",
           f"--workdir={workdir}"] + [f"--gin_param={p}" for p in params] + list(extra))


_env = child_env


def _run(workdir, params, cache, check=True, **kw):
  out = subprocess.run(_command(workdir, params, cache=cache, **kw), cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=300)
  if check and out.returncode:
    raise AssertionError(f"trainer failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
  return out


def _start(workdir, params, cache, log):
  with open(log, "w") as f:
    return subprocess.Popen(_command(workdir, params, cache=cache), cwd=REPO, env=_env(),
                            stdout=f, stderr=subprocess.STDOUT)


def _wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while not predicate():
    assert proc.poll() is None, "the trainer exited before the awaited moment"
    assert time.time() < deadline, "timed out"
    time.sleep(0.02)


def _records(workdir):
  """The records of metrics.jsonl (a line still being written is left out)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def _losses(workdir):
  return {r["step"]: r["loss"] for r in _records(workdir)}


def _steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(p) for p in os.listdir(d) if p.isdigit()) if os.path.isdir(d) else []


def _restore_params(checkpoints, params, mesh, step, tmp_path):
  """Parameters of checkpoint ``step`` (copied aside) restored onto ``mesh``."""
  config = gin_config.read([TINY], params)
  _, abstract = step_builder.abstract_train_state(config.model, mesh,
                                                 make_optimizer(config.optimizer))
  directory = tmp_path / f"restore-{step}-{mesh.shape['data']}x{mesh.shape['seq']}"
  shutil.copytree(os.path.join(checkpoints, str(step)), directory / str(step))
  with Checkpointer(directory) as ckpt:
    restored = ckpt.restore(abstract)
  assert restored.step == step
  return jax.tree.map(np.asarray, restored.state.params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
  """An uninterrupted run of STEPS steps: (workdir, completed process)."""
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  return workdir, _run(workdir, REFERENCE, cache_dir)


# ----------------------------------------------------------------------------- bad input

def test_command_line_prints_bad_input_without_a_traceback(tmp_path):
  out = _run(str(tmp_path), ["TrainConfig.stepz = 3"], None, check=False)
  assert out.returncode == cli.EXIT_USAGE
  assert out.stderr.startswith("error: Configurable 'TrainConfig' doesn't have a parameter "
                               "named 'stepz'."), out.stderr
  assert "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- metrics

def test_metrics_writer_drops_steps_after_the_restored_one(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
  for step in (1, 2, 3):
    writer.write({"step": step, "loss": 1.0 / step, "peak_memory_gib": None})
  writer.write({"step": 4, "loss": float("nan")})
  writer.close()
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line) for line in f][2:] == [{"step": 3, "loss": 1 / 3},
                                                    {"step": 4, "loss": None}]
  assert _tensorboard_steps(tmp_path / "tensorboard") == [1, 2, 3]
  writer = metrics.MetricsWriter(str(tmp_path), resume_step=2, enabled=True)
  writer.write({"step": 3, "loss": 0.25})  # step 3 again, after resuming from step 2
  writer.close()
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
  assert _tensorboard_steps(tmp_path / "tensorboard") == [1, 2, 3]  # each step once


def _tensorboard_steps(logdir):
  """Steps of the ``loss`` scalars in every event file under ``logdir`` (TFRecord framing:
  8-byte length, 4-byte CRC, the Event proto, 4-byte CRC)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  steps = []
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents*")):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      n = int.from_bytes(data[i:i + 8], "little")
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      steps += [event.step for v in event.summary.value if v.tag == "loss"]
      i += 12 + n + 4
  return sorted(steps)


def test_flops_per_token_formula():
  config = LlamaConfig(vocab_size=256, hidden_dim=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, mlp_dim=128)
  per_layer = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2 + 3 * 64 * 128 + 2 * 64  # attn, mlp, norms
  matmul_params = 2 * per_layer + 64 + 64 * 256  # + final norm + head (embedding excluded)
  assert metrics.flops_per_token(config, 512) == 6 * matmul_params + 6 * 2 * 512 * 4 * 16
  # Attention sinks (L x Hq logits) take part in no matmul: the count stays.
  assert metrics.flops_per_token(config.replace(attention_sinks=True), 512) == (
      metrics.flops_per_token(config, 512))


# ----------------------------------------------------------------------------- training

@pytest.mark.slow
def test_tiny_cpu_learns_and_writes_its_outputs(reference):
  workdir, out = reference
  records = _records(workdir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for r in records:
    assert {"step", "loss", "grad_norm", "learning_rate", "tokens_per_sec", "mfu", "step_time_s",
            "nonfinite_steps"} <= set(r)
    assert r["tokens_per_sec"] > 0 and r["nonfinite_steps"] == 0
  assert [r["step"] for r in records if "eval_loss" in r] == [10, 20, 30]
  losses = [r["loss"] for r in records]
  assert np.mean(losses[-5:]) < losses[0] - 1.5, losses  # from ln(256) = 5.5 to below 4
  assert np.log(256) - 0.2 < losses[0] < np.log(256) + 0.2
  with open(os.path.join(workdir, "config.gin")) as f:
    operative = f.read()
  for line in ("STEPS = 30", "TrainConfig.steps = %STEPS", "LlamaConfig.preset = 'tiny'",
               "TrainConfig.mesh_seq = 4", "DataConfig.source = 'stdlib'"):
    assert line in operative
  assert _steps(workdir) == [25, 30]
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert f"loss         {losses[0]:.4f} (step 1) -> {losses[-1]:.4f} (step 30)" in out.stdout
  assert "tokens/s after the first step, MFU" in out.stdout
  assert os.path.join(workdir, "metrics.jsonl") in out.stdout
  assert os.path.join(workdir, "checkpoints") + "  (latest: step 30)" in out.stdout
  # Started again when finished: nothing to redo.
  again = _run(workdir, REFERENCE, None)
  assert "already at step 30 of 30" in again.stdout
  assert _losses(workdir) == {r["step"]: r["loss"] for r in records}


@pytest.mark.slow
def test_sigterm_and_sigkill_restarts_reproduce_the_uninterrupted_losses(reference, cache_dir,
                                                                        tmp_path):
  ref_dir, _ = reference
  workdir, log = str(tmp_path / "run"), str(tmp_path / "log")
  # SIGTERM: a checkpoint at the step it arrived, then a clean exit.
  proc = _start(workdir, REFERENCE, cache_dir, log)
  _wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")) and
            len(_records(workdir)) >= 3, proc)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == cli.EXIT_STOPPED, open(log).read()
  stopped_at = _records(workdir)[-1]["step"]
  assert stopped_at < STEPS and stopped_at in _steps(workdir)
  assert "stopped by signal 15, rerun the same command to resume" in open(log).read()
  # SIGKILL right after the next periodic checkpoint lands.
  proc = _start(workdir, REFERENCE, cache_dir, log)
  _wait_for(lambda: any(s > stopped_at for s in _steps(workdir)), proc)
  proc.kill()
  proc.wait(timeout=60)
  killed_at = max(_steps(workdir))
  assert killed_at < STEPS
  # The last restart finishes the run.
  out = _run(workdir, REFERENCE, cache_dir)
  assert f"resuming at step {killed_at}" in out.stderr
  assert _losses(workdir) == _losses(ref_dir)  # exactly


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous(reference, cache_dir, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(reference[0], workdir)
  newest = os.path.join(workdir, "checkpoints", str(STEPS))
  for d, _, files in os.walk(os.path.join(newest, "state")):
    for f in files:
      if os.sep + "d" + os.sep in os.path.join(d, f):
        with open(os.path.join(d, f), "wb") as out:
          out.write(b"torn write")
  out = _run(workdir, REFERENCE, cache_dir)
  assert f"checkpoint {newest} failed to restore" in out.stderr
  assert "resuming at step 25" in out.stderr
  assert [p for p in os.listdir(os.path.dirname(newest)) if p.startswith(f"{STEPS}.damaged-")]
  assert _losses(workdir) == _losses(reference[0])


@pytest.mark.slow
@pytest.mark.parametrize("data, seq", [(1, 8), (8, 1)])
def test_resharding_restore_gives_the_same_parameters_and_next_loss(reference, cache_dir,
                                                                    tmp_path, data, seq):
  workdir = str(tmp_path / "run")
  shutil.copytree(reference[0], workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  saved = _restore_params(checkpoints, REFERENCE, make_mesh(2, 4), 25, tmp_path)
  moved = _restore_params(checkpoints, REFERENCE, make_mesh(data, seq), 25, tmp_path)
  jax.tree.map(np.testing.assert_array_equal, moved, saved)
  shutil.rmtree(os.path.join(checkpoints, str(STEPS)))
  mesh = [f"TrainConfig.mesh_data = {data}", f"TrainConfig.mesh_seq = {seq}"]
  _run(workdir, REFERENCE + mesh + ["TrainConfig.steps = 26"], cache_dir)
  np.testing.assert_allclose(_losses(workdir)[26], _losses(reference[0])[26], rtol=2e-6)


@pytest.mark.slow
def test_host_offloaded_optimizer_gives_the_same_losses(reference, cache_dir, tmp_path):
  workdir = str(tmp_path / "run")
  _run(workdir, REFERENCE + ["TrainConfig.offload_optimizer = True", "TrainConfig.steps = 8"],
       cache_dir)
  got, want = _losses(workdir), _losses(reference[0])
  assert sorted(got) == list(range(1, 9))
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-6)


@pytest.mark.slow
def test_bfloat16_parameters_with_host_master_weights_train_and_resume(reference, cache_dir,
                                                                       tmp_path):
  """bfloat16 parameters, float32 master weights and moments in host memory (streamed update),
  the layer parameters in host memory too: the losses follow the float32 run's within bfloat16
  rounding, and a run resumed from its step-5 checkpoint repeats them exactly (the master
  weights were restored, not re-derived)."""
  params = REFERENCE + ["LlamaConfig.param_dtype = 'bfloat16'", "TrainConfig.steps = 8",
                        "TrainConfig.master_weights = True", "TrainConfig.offload_optimizer = True",
                        "TrainConfig.offload_params = True"]
  first, resumed = str(tmp_path / "first"), str(tmp_path / "resumed")
  _run(first, params, cache_dir)
  got, want = _losses(first), _losses(reference[0])
  assert sorted(got) == list(range(1, 9))
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-2)
  shutil.copytree(first, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))
  assert "resuming at step 5" in _run(resumed, params, cache_dir).stderr
  assert _losses(resumed) == got


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_counted_and_stop_training(cache_dir, tmp_path):
  workdir = str(tmp_path / "run")
  params = FAST + ["STEPS = 10", "TrainConfig.log_every = 1", "TrainConfig.max_bad_steps = 3",
                   "OptimizerConfig.learning_rate = 1e12", "OptimizerConfig.warmup_steps = 0",
                   "CheckpointConfig.save_every = 1", "CheckpointConfig.keep = 10"]
  out = _run(workdir, params, cache_dir, check=False)
  assert out.returncode == cli.EXIT_FAILED
  checkpoints = os.path.join(workdir, "checkpoints")
  assert (f"error: stopped at step 4: the loss or gradients were non-finite in 3 steps in a "
          f"row (TrainConfig.max_bad_steps=3). Those updates were all skipped, so "
          f"{checkpoints}/4 holds the last good parameters.") in out.stderr
  records = _records(workdir)
  assert [(r["loss"] is None, r["nonfinite_steps"]) for r in records] == [
      (False, 0), (True, 1), (True, 2), (True, 3)]
  assert _steps(workdir) == [1, 2, 3, 4]
  after_good_step = _restore_params(checkpoints, params, make_mesh(2, 4), 1, tmp_path)
  after_bad_steps = _restore_params(checkpoints, params, make_mesh(2, 4), 4, tmp_path)
  jax.tree.map(np.testing.assert_array_equal, after_bad_steps, after_good_step)


def test_out_of_memory_is_one_error_naming_the_sizes_and_the_fixes():
  # XLA's own error: 1 EiB, more than any address space, fails however memory is overcommitted
  with pytest.raises(jax.errors.JaxRuntimeError) as caught:
    jax.block_until_ready(jax.jit(lambda: jax.numpy.ones(2**60, np.uint8))())
  assert train.is_out_of_memory(caught.value)
  assert not train.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED"))
  message = str(train.out_of_memory(caught.value, 1, compiled_gib=71.45, pool_gib=71.2,
                                    gpu="h200", topology="1x2x8"))
  assert message.startswith("step 1 ran out of device memory (RESOURCE_EXHAUSTED: Out of memory")
  assert ("; the compiled step needs 71.45 GiB per device; XLA's memory pool holds 71.20 GiB "
          "per device. XLA_FLAGS=--xla_gpu_memory_limit_slop_factor=10 compiles the step under "
          "memory pressure (smaller, slower). Without a GPU, ulysses-aot --gin_file=YOUR.gin "
          "--gpu=h200 --topology=1x2x8 compiles this step and says whether it fits, and "
          "ulysses-plan --model=YOUR.gin --gpu=h200 --devices=16 --verify") in message
  no_sizes = str(train.out_of_memory(caught.value, 3, compiled_gib=None, pool_gib=None,
                                     gpu="h100", topology="1x1x1"))
  assert "Out of memory allocating 1152921504606846976 bytes.). XLA_FLAGS=" in no_sizes


def test_a_step_compiled_under_memory_pressure_trains_and_resumes_as_the_jitted_one(
    tmp_path, monkeypatch, caplog):
  """Where only the step compiled under memory pressure fits (``train.fit``; on a GPU), the
  loop runs that executable: its batches, initial and restored states must match the shardings
  it was compiled for. On CPU the pressure changes nothing, so the losses equal the jitted run's."""
  read = lambda steps: gin_config.read([TINY], FAST + [
      "STEPS = 4", f"TrainConfig.steps = {steps}", "OptimizerConfig.warmup_steps = 1",
      "TrainConfig.log_every = 1", "TrainConfig.eval_every = 0",
      "TrainConfig.progress_bar = False", "CheckpointConfig.save_every = 2"])
  train.train(str(tmp_path / "jitted"), read(4))

  steps_run = []

  def under_pressure(step, state, batch, pool_gib, gpu, topology):
    compiled = step.lower(state, batch).compile(train.fit.UNDER_PRESSURE)
    gib = metrics.compiled_memory_gib(compiled)
    return train.Fitted(lambda *args: steps_run.append(1) or compiled(*args), gib, gib, True)

  monkeypatch.setattr(train, "compile_to_fit", under_pressure)
  monkeypatch.setattr(train.distributed, "gpu_pool_gib", lambda every_process=False: 64.0)
  with caplog.at_level("WARNING", logger="ulysses_jax.train"):
    train.train(str(tmp_path / "pressed"), read(2))
    assert train.train(str(tmp_path / "pressed"), read(4))["restored_step"] == 2
  assert caplog.text.count("compiled again under memory pressure") == 2 and len(steps_run) == 4
  assert _losses(str(tmp_path / "pressed")) == _losses(str(tmp_path / "jitted"))


def test_a_step_over_the_memory_pool_is_bad_input_before_the_workdir_changes(tmp_path,
                                                                           monkeypatch):
  monkeypatch.setattr(train.distributed, "gpu_pool_gib", lambda every_process=False: 0.001)
  with pytest.raises(train.ConfigError, match=(
      r"^the train step needs [0-9.]+ GiB per device as compiled \([0-9.]+ compiled under "
      r"memory pressure\) but XLA's memory pool holds 0\.00 GiB per device; nothing ran\. ")):
    train.train(str(tmp_path / "run"), gin_config.read([TINY], FAST))
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_retrieval_is_learned_across_sequence_shards(retrieval_run):
  workdir, stdout = retrieval_run
  config = gin_config.read(["configs/retrieval_cpu.gin"], [])
  data, task, cfg = config.data, config.data.retrieval, config.train
  shard = data.seq_len // cfg.mesh_seq
  assert cfg.mesh_seq == 8 and 2 * task.num_pairs <= shard < data.seq_len - 2  # first vs last
  accuracy = _records(workdir)[-1]["eval_accuracy"]
  assert accuracy > 4 * task.chance, stdout
