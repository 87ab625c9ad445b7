"""The first-contact check on ring meshes (``ulysses_jax.kernel_check``), on 8 CPU devices: the
ring and the Ulysses x ring hybrid run as the run's mesh runs them, the Triton kernels in
interpret mode. A fault injected where only a ring runs it (a ring step's kernel output, the
kernel's log-sum-exp that the merge reads, the ring's merge) is caught and the run falls back,
or stops when every backend shares the fault. A check of the local kernel alone passes each of
these faults, and so does no check. (The Mosaic ring is not run here: GPU interpret mode
deadlocks with eight devices each simulating three warpgroups; see tests/test_ring.py.)"""

import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import pytest

from ulysses_jax import kernel_check, make_mesh, train
from ulysses_jax.attention import ring, ring_steps
from ulysses_jax.cli import gin_config
from ulysses_jax.kernel_check import cases
from ulysses_jax.kernels import target as target_lib
from ulysses_jax.models.config import LlamaConfig

TOKENS_PER_RING_DEVICE = 16  # the check's, so that interpret mode is quick (the kernels' least)


@pytest.fixture(autouse=True)
def small_ring_check(monkeypatch):
  monkeypatch.setattr(cases, "RING_CHECK_LEN", TOKENS_PER_RING_DEVICE)


def _mesh(seq, ring_shards):
  return make_mesh(data=1, seq=seq, ring=ring_shards, devices=jax.devices()[:seq * ring_shards])


def _tiny(**fields) -> LlamaConfig:
  """2 layers, head dim 16, 4 query / 2 KV heads, with ``fields``."""
  return LlamaConfig(preset="tiny-gqa", **fields)


def _faulty_kernel(fault, changes):
  """The ring steps' flash kernel calls with ``changes(out, lse, kwargs) -> (out, lse)``."""
  real = ring_steps.flash_attention

  def faulty(*args, **kwargs):
    return changes(*real(*args, **kwargs), kwargs)
  fault(ring_steps, "flash_attention", faulty)


def _off_by_a_quarter(out, lse, kwargs, where):
  return (out + jnp.asarray(0.25, out.dtype) if where(kwargs) else out), lse


# --- quick ----------------------------------------------------------------------------------

def test_a_fault_in_the_rings_merge_fails_every_backend_and_stops_the_run(fault):
  """The ring's merge of partial results (every backend's) ignores their log-sum-exps, on a
  seq x ring mesh: the XLA ring, the only backend on CPU, fails, and nothing is left."""
  real = ring.merge

  def unweighted(out, lse, part, part_lse):
    return out + part.astype(jnp.float32), real(out, lse, part, part_lse)[1]
  fault(ring, "merge", unweighted)
  mesh = _mesh(2, 2)
  with pytest.raises(kernel_check.KernelCheckError) as error:
    kernel_check.settle(_tiny(), mesh, seq_len=256)
  message = str(error.value)
  assert message.startswith("ring attention on this mesh ({'data': 1, 'ring': 2, 'seq': 2}) "
                            "fails the self-check with every backend it can run, xla: full "
                            "attention (checked on a ring of 2 x 16 tokens): xla FAILED: error")
  assert "--mesh_seq 2 --mesh_ring 2" in message and "TrainConfig.mesh_ring=1" in message
  assert kernel_check.settle(_tiny(), mesh, seq_len=256, check=False).backend == "xla"


def test_a_windowed_ring_is_decided_with_the_runs_tokens_per_ring_device(monkeypatch):
  """On Hopper (a stand-in target: no check runs) "auto" runs the Mosaic ring for a window
  within S/R and the XLA ring beyond; the check's problem keeps that side of its own 16 tokens
  per ring device. A set kernel where the window reaches past S/R is refused before any check,
  with the fix."""
  hopper = target_lib.Target("gpu", "NVIDIA H100 80GB HBM3", 9.0)
  monkeypatch.setattr(target_lib, "current", lambda *args, **kwargs: hopper)
  mesh = _mesh(1, 4)
  config = _tiny(head_dim=64, dtype="bfloat16", sliding_window=1024)
  within = kernel_check.settle(config, mesh, seq_len=4 * 1024, check=False)
  beyond = kernel_check.settle(config, mesh, seq_len=4 * 512, check=False)
  assert (within.backend, beyond.backend) == ("pallas_mosaic", "xla")
  assert "sliding window 1024, inside ring attention on NVIDIA H100" in within.choice.reason
  shapes = dict(dtype="bfloat16", head_dim=64, num_q_heads=4, num_kv_heads=2, causal=True,
                segment_ids_given=True)
  kind = kernel_check.AttentionKind(1024)
  [within_case, beyond_case] = [kernel_check.make_case(kind, shapes, mesh, "auto", seq_len=s)
                                for s in (4 * 1024, 4 * 512)]
  assert within_case.problem.window == cases.ring_window_stand_in(16) <= 16
  assert beyond_case.problem.window == 16 + cases.ring_window_stand_in(16)
  assert within_case.label == ("sliding window 1024 (checked with window 6 on a ring of 4 x 16 "
                               "tokens)")
  with pytest.raises(ValueError, match=r"sliding_window \(1024\) inside ring attention needs "
                                       r"backend='xla' or 'auto', got 'pallas'"):
    kernel_check.settle(config.replace(attention_backend="pallas"), mesh, seq_len=4 * 512)


# --- slow -----------------------------------------------------------------------------------

@pytest.mark.slow  # the Triton windowed ring in interpret mode and the XLA ring: ~10 s
def test_a_fault_in_one_windowed_ring_step_is_caught_on_the_kernel_path(fault, caplog):
  """A window of 8 in a run of 128 tokens per ring device: W <= S/R, so the layers run the
  kernels' windowed ring, and the check runs it too (W as it is, 16 tokens per ring device).
  Its shift-1 step (the previous device's tail, reversed into a causal call without a window)
  is off by 0.25: caught; the run falls back to the XLA ring, which is checked and passes."""
  _faulty_kernel(fault, lambda out, lse, kwargs: _off_by_a_quarter(
      out, lse, kwargs, lambda kw: "sliding_window" not in kw))
  config = _tiny(sliding_window=8, attention_backend="pallas")
  with caplog.at_level(logging.INFO, logger="ulysses_jax"):
    settled = kernel_check.settle(config, _mesh(1, 4), seq_len=4 * 128)
  label = "sliding window 8 (checked on a ring of 4 x 16 tokens)"
  assert [(c.case, c.backend, c.passed) for c in settled.checks] == [
      (label, "pallas", False), (label, "xla", True)]
  failed, xla = settled.checks
  assert failed.max_error > 10 * failed.tolerance and xla.max_error < 1e-4
  assert settled.backend == "xla" and settled.by_case == (("sliding window 8", "xla"),)
  warning = next(r.message for r in caplog.records if r.levelno == logging.WARNING)
  assert warning.startswith(f"attention kernel self-check: {label}: pallas FAILED: error")
  assert warning.endswith("falling back to xla")
  assert settled.record()["kernel_check"].startswith(f"{label}: pallas FAILED")
  assert "attention kernel self-check: 2 checks in " in caplog.text
  assert settled.record()["kernel_check_seconds"] >= failed.seconds + xla.seconds > 0


@pytest.mark.slow  # the Triton ring in interpret mode: ~15 s
def test_a_fault_in_the_ring_steps_kernel_output_falls_back(fault):
  """The kernel calls of every causal ring step after the first (the zigzag chunk tiles, a
  non-causal call) are off by 0.25, on a ring of 4 (the seq x ring mesh: the merge and lse
  faults here)."""
  _faulty_kernel(fault, lambda out, lse, kwargs: _off_by_a_quarter(
      out, lse, kwargs, lambda kw: not kw["causal"]))
  settled = kernel_check.settle(_tiny(attention_backend="pallas"), _mesh(1, 4), seq_len=256)
  assert [(c.backend, c.passed) for c in settled.checks] == [("pallas", False), ("xla", True)]
  assert settled.checks[0].max_error > 10 * settled.checks[0].tolerance
  assert settled.backend == "xla"


@pytest.mark.slow
def test_the_interpret_mode_ring_kernels_pass_in_bfloat16():
  settled = kernel_check.settle(_tiny(attention_backend="pallas", dtype="bfloat16"), _mesh(2, 2),
                                seq_len=256)
  [check] = settled.checks
  assert check.passed and 0 < check.max_error < check.tolerance / 2, check
  assert check.case == "full attention (checked on a ring of 2 x 16 tokens)"
  assert settled.backend == "pallas"


@pytest.mark.slow
def test_the_trainer_falls_back_from_a_kernel_whose_merge_input_is_wrong(tmp_path, fault,
                                                                         caplog):
  """The kernel's log-sum-exp in base 2 (as a kernel working with exp2 might keep it), which
  only a ring's merge reads: the local check cannot see it. On an 8-device seq x ring mesh the
  trainer's check catches it, falls back to the XLA ring and trains."""
  _faulty_kernel(fault, lambda out, lse, kwargs: (out, lse / math.log(2)))
  config = gin_config.read(["configs/tiny_cpu.gin"], [
      "LlamaConfig.preset = 'tiny-gqa'", "LlamaConfig.loss_chunk = 32",
      "LlamaConfig.attention_backend = 'pallas'", "DataConfig.seq_len = 128",
      "DataConfig.batch_size = 2", "TrainConfig.mesh_data = 1", "TrainConfig.mesh_seq = 2",
      "TrainConfig.mesh_ring = 4", "TrainConfig.eval_batches = 1", "STEPS = 2",
      "OptimizerConfig.warmup_steps = 1", "TrainConfig.progress_bar = False"])
  with caplog.at_level(logging.INFO, logger="ulysses_jax"):
    summary = train.train(str(tmp_path), config)
  assert summary["step"] == 2 and summary["last_loss"]
  warning = next(r.message for r in caplog.records if "self-check" in r.message
                 and r.levelno == logging.WARNING)
  assert warning.startswith("attention kernel self-check: full attention (checked on a ring of "
                            "4 x 16 tokens): pallas FAILED: error")
  with open(os.path.join(tmp_path, "metrics.jsonl"), encoding="utf-8") as f:
    record = json.loads(f.readline())
  assert record["attention_backend"] == "xla"
  assert "pallas FAILED" in record["kernel_check"] and "xla passed" in record["kernel_check"]
  assert record["kernel_check_seconds"] > 0
