"""The attention kernel's self-check (``ulysses_jax.kernel_check``) and the first step's memory
line, on CPU: our Pallas kernels in interpret mode must pass; a kernel made faulty here (its
output perturbed, raising, or ignoring the sliding window) must fail, and the trainer must fall
back and say so."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import pytest

from ulysses_jax import kernel_check, make_mesh, metrics, train
from ulysses_jax.cli import gin_config
from ulysses_jax.attention import backends
from ulysses_jax.models.config import LlamaConfig

CASE = dict(head_dim=64, num_q_heads=4, num_kv_heads=2, causal=True, segment_ids_given=True)
TINY = ["LlamaConfig.preset = 'tiny'", "LlamaConfig.loss_chunk = 32", "DataConfig.seq_len = 128",
        "DataConfig.batch_size = 8", "TrainConfig.eval_batches = 1", "STEPS = 2",
        "OptimizerConfig.warmup_steps = 1",
        "TrainConfig.progress_bar = False"]


@pytest.fixture
def faulty_pallas(fault):
  """The "pallas" backend with its output off by 0.25 (the other backends untouched)."""
  real = backends.local_attention

  def perturbed(backend, *args, **kwargs):
    out = real(backend, *args, **kwargs)
    return out + jnp.asarray(0.25, out.dtype) if backend == "pallas" else out
  fault(backends, "local_attention", perturbed)


@pytest.fixture
def windowless_pallas(fault):
  """The "pallas" backend ignoring the sliding window (full causal attention instead): wrong
  only for windowed layers, and only where the window hides keys."""
  real = backends.local_attention

  def windowless(backend, *args, sliding_window=None, **kwargs):
    return real(backend, *args, **kwargs,
                sliding_window=None if backend == "pallas" else sliding_window)
  fault(backends, "local_attention", windowless)


@pytest.fixture
def sinkless_pallas(fault):
  """The "pallas" backend ignoring attention sinks."""
  real = backends.local_attention

  def sinkless(backend, *args, sinks=None, **kwargs):
    return real(backend, *args, **kwargs, sinks=None if backend == "pallas" else sinks)
  fault(backends, "local_attention", sinkless)


def _mesh():
  return make_mesh(data=1, seq=1, devices=jax.devices()[:1])


def _tiny(**fields) -> LlamaConfig:
  """The tiny preset (2 layers, head dim 16, 4 heads) with ``fields``."""
  return LlamaConfig(preset="tiny", **fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_interpret_mode_kernels_pass(dtype):
  check = kernel_check.check_backend("pallas", dtype=dtype, **CASE)
  assert check.passed and check.error is None, check
  assert check.tolerance == kernel_check.TOLERANCES[dtype]
  assert 0 < check.max_error < check.tolerance / 2


@pytest.mark.slow  # the Mosaic kernels in GPU interpret mode: 3 minutes on 2 busy cores
@pytest.mark.mosaic
def test_the_interpret_mode_mosaic_kernels_pass():
  check = kernel_check.check_backend("pallas_mosaic", dtype="bfloat16", **CASE)
  assert check.passed, check


def test_a_faulty_kernel_fails_with_its_difference(faulty_pallas):
  check = kernel_check.check_backend("pallas", dtype="float32", **CASE)
  assert not check.passed and check.error is None
  assert check.max_error == pytest.approx(0.25, abs=1e-3)
  assert "pallas FAILED: error 2.50e-01 against the XLA reference" in check.describe()


def test_a_kernel_that_raises_fails_with_its_error(fault):
  real = backends.local_attention

  def broken(backend, *args, **kwargs):
    if backend == "pallas":
      raise RuntimeError("Mosaic GPU lowering failed\nmore detail")
    return real(backend, *args, **kwargs)
  fault(backends, "local_attention", broken)
  check = kernel_check.check_backend("pallas", dtype="bfloat16", **CASE)
  assert not check.passed and check.max_error is None
  assert check.error == "RuntimeError: Mosaic GPU lowering failed"


def test_the_interpret_mode_kernels_pass_with_a_window():
  check = kernel_check.check_backend("pallas", dtype="bfloat16", **CASE,
                                     seq_len=kernel_check.WINDOW_CHECK_LEN,
                                     sliding_window=kernel_check.WINDOW_STAND_IN)
  assert check.passed and 0 < check.max_error < check.tolerance / 2, check


def test_the_interpret_mode_kernels_pass_with_sinks():
  check = kernel_check.check_backend("pallas", dtype="float32", **CASE, sinks_given=True)
  assert check.passed and 0 < check.max_error < check.tolerance / 2, check


def test_a_model_with_sinks_checks_them(sinkless_pallas):
  """A kernel path that drops gpt-oss' sinks fails the check of a model with sinks, and the
  run falls back to XLA."""
  settled = kernel_check.settle(_tiny(attention_sinks=True, attention_backend="pallas"),
                                _mesh(), seq_len=256)
  [check] = settled.checks
  assert not check.passed and check.max_error > 10 * check.tolerance, check
  assert settled.backend == "xla"
  assert kernel_check.check_backend("pallas", dtype="float32", **CASE).passed  # no sinks


def test_a_kernel_that_ignores_a_long_window_fails_the_stand_in_window(windowless_pallas,
                                                                        caplog):
  """Mistral's window (4,096) hides nothing from a check on 256 tokens, so a kernel ignoring it
  passes there; the windowed check (a window of 200 on 1,024 tokens) catches it and the layers
  fall back to XLA."""
  assert kernel_check.check_backend("pallas", dtype="float32", **CASE,
                                    sliding_window=4096).passed
  with caplog.at_level(logging.INFO, logger="ulysses_jax"):
    settled = kernel_check.settle(_tiny(sliding_window=4096, attention_backend="pallas"),
                                  _mesh(), seq_len=1024)
  [check] = settled.checks
  assert check.case == "sliding window 4096 (checked with window 200 on 1,024 tokens)"
  assert not check.passed and check.max_error > 10 * check.tolerance
  assert settled.backend == "xla" and settled.by_case == (("sliding window 4096", "xla"),)
  assert settled.record()["kernel_check"].startswith(
      "sliding window 4096 (checked with window 200 on 1,024 tokens): pallas FAILED")
  assert "sliding window 4096" in settled.choice.reason
  warning = next(r.message for r in caplog.records if "self-check" in r.message)
  assert warning.startswith("attention kernel self-check: sliding window 4096 (checked with "
                            "window 200 on 1,024 tokens): pallas FAILED")
  assert warning.endswith("falling back to xla")


def test_mixed_layers_check_both_attentions_and_run_one_backend_that_passes_both(
    windowless_pallas, caplog):
  """Full and windowed layers (window 64: checked as it is): pallas passes the full attention,
  fails the windowed one; the model runs one backend, so both run XLA."""
  config = _tiny(sliding_window=64, layer_types=("sliding_attention", "full_attention"),
                 attention_backend="pallas")
  with caplog.at_level(logging.INFO, logger="ulysses_jax"):
    settled = kernel_check.settle(config, _mesh(), seq_len=1024)
  assert [(c.case, c.backend, c.passed) for c in settled.checks] == [
      ("sliding window 64 (checked on 1,024 tokens)", "pallas", False),
      ("full attention", "pallas", True)]
  assert settled.backend == "xla"
  assert settled.by_case == (("sliding window 64", "xla"), ("full attention", "xla"))
  assert settled.model_config(config).attention_backend == "xla"
  assert ("the layers run one backend, xla, the first that passes sliding window 64 and full "
          "attention (each alone: xla for sliding window 64, pallas for full attention)"
          in caplog.text)
  record = settled.record()
  assert record["attention_backends"] == "sliding window 64: xla; full attention: xla"
  assert record["kernel_check"].startswith(
      "sliding window 64 (checked on 1,024 tokens): pallas FAILED: error")
  assert "; full attention: pallas passed" in record["kernel_check"]


def test_mixed_layers_run_auto_when_each_attention_passes_its_own_pick(monkeypatch):
  """Where "auto" picks one kernel for the full layers and another for the windowed ones (as
  on Hopper: Mosaic, and Triton for windows; here XLA and pallas), and each passes, every layer
  keeps its pick: the model runs "auto"."""
  real = backends.choose_backend

  def triton_for_windows(**kwargs):
    if kwargs.get("sliding_window") is None:
      return real(**kwargs)
    return backends.BackendChoice("pallas", "pallas for windows (this test)", ("xla",))
  monkeypatch.setattr(backends, "choose_backend", triton_for_windows)
  config = _tiny(sliding_window=300, layer_types=("full_attention", "sliding_attention"))
  settled = kernel_check.settle(config, _mesh(), seq_len=1024)
  assert settled.backend == "auto" and settled.model_config(config).attention_backend == "auto"
  assert settled.by_case == (("full attention", "xla"), ("sliding window 300", "pallas"))
  [check] = settled.checks  # XLA, the reference, is not checked
  assert check.passed and check.case == "sliding window 300 (checked on 1,024 tokens)"
  assert settled.record()["attention_backends"] == (
      "full attention: xla; sliding window 300: pallas")
  assert settled.choice.reason.startswith("full attention layers: the XLA chunked attention")
  assert "; sliding window 300 layers: pallas for windows (this test)" in settled.choice.reason


def _first_record(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return json.loads(f.readline())


@pytest.mark.slow
def test_the_trainer_falls_back_from_a_faulty_kernel_and_records_it(tmp_path, faulty_pallas,
                                                                     caplog):
  config = gin_config.read(["configs/tiny_cpu.gin"],
                           TINY + ["LlamaConfig.attention_backend = 'pallas'"])
  with caplog.at_level(logging.INFO, logger="ulysses_jax"):
    summary = train.train(str(tmp_path), config)
  assert summary["step"] == 2 and summary["last_loss"]  # the run went on, with the fallback
  warning = next(r.message for r in caplog.records if "self-check" in r.message)
  assert "pallas FAILED: error" in warning and "falling back to xla" in warning
  record = _first_record(tmp_path)
  assert record["step"] == 1 and record["attention_backend"] == "xla"
  assert record["kernel_check"].startswith("pallas FAILED")
  assert record["kernel_check_max_error"] == pytest.approx(0.25, abs=1e-2)
  # The compiled figure of step 1 (the CPU runtime reports no peak)
  assert record["compiled_memory_gib"] > 0
  assert "compiled figure of the step" in caplog.text


def test_the_check_can_be_turned_off(tmp_path, faulty_pallas):
  config = gin_config.read(["configs/tiny_cpu.gin"], TINY + [
      "LlamaConfig.attention_backend = 'pallas'", "TrainConfig.kernel_check = False"])
  run = train.prepare(str(tmp_path), config)
  assert run.attention.backend == "pallas" and run.attention.checks == ()
  assert "kernel_check" not in run.attention.record()
  assert run.attention.record()["attention_backend_reason"].startswith(
      "pallas: set by LlamaConfig.attention_backend")


def test_auto_on_cpu_runs_xla_unchecked(tmp_path):
  run = train.prepare(str(tmp_path), gin_config.read(["configs/tiny_cpu.gin"], TINY))
  assert (run.attention.backend, run.attention.checks) == ("xla", ())


def test_memory_line_and_peak_from_a_stub_device(monkeypatch):
  """Formatting only: a stub device that reports memory_stats as a GPU's runtime does."""
  class StubGpu:
    def __init__(self, peak):
      self.peak = peak

    def memory_stats(self):
      return {"peak_bytes_in_use": self.peak, "bytes_limit": 80 * 2**30}
  monkeypatch.setattr(metrics.jax, "local_devices", lambda: [StubGpu(3 * 2**29), StubGpu(2**30)])
  peak = metrics.peak_memory_gib()
  assert peak == 1.5
  line = metrics.memory_line({"step": 1, "peak_memory_gib": peak, "compiled_memory_gib": 1.25})
  assert "1.50 GiB peak in use" in line and "compiled figure of the step 1.25 GiB" in line
  assert "not reported" in metrics.memory_line({"step": 1, "compiled_memory_gib": 1.25})


def test_metrics_jsonl_takes_the_strings_tensorboard_cannot(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
  writer.write({"step": 1, "loss": 2.0, "attention_backend": "xla", "kernel_check_max_error":
                None})
  writer.close()
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    assert json.loads(f.readline()) == {"step": 1, "loss": 2.0, "attention_backend": "xla"}
  # A resumed run replays the kept lines to TensorBoard: the strings stay out of it there too.
  writer = metrics.MetricsWriter(str(tmp_path), resume_step=1, enabled=True)
  writer.write({"step": 2, "loss": 1.5})
  writer.close()
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]
