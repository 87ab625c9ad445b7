"""One training step of a small model on the devices present: does it run, how long does it
take against ``aot``'s roofline prediction of the same compiled step, its MFU against the
measured matmul peak and the datasheet's (``metrics.mfu_text``), and how much memory does the
runtime use against the compiled figure (what ``aot`` reports, and what its "fits" rests
on)?

The model is Llama-3.2-1B's shapes cut to 4 layers on GPUs (head dim 64) and the 0.5M-parameter
"cpu-demo" model on CPUs, with all devices on the ``seq`` axis (Ulysses), 8,192 tokens per GPU
(256 per CPU device), the trainer's own step (``step_builder.build_train_step``).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ulysses_jax import metrics as metrics_lib
from ulysses_jax import sharding as sharding_lib
from ulysses_jax import step_builder
from ulysses_jax.aot import report as report_lib
from ulysses_jax.data.pipeline import DataConfig
from ulysses_jax.gpus import Gpu, gpu_of_kind
from ulysses_jax.models.config import preset
from ulysses_jax.run_config import RunConfig, TrainConfig

TIMED_STEPS = 3
# The measured peak may exceed the compiled figure by allocator rounding and the runtime's own
# buffers (the batch's host copy, the RNG, the compiled code): more than this is a real miss.
MEMORY_SLACK = 1.10
# The roofline is a lower bound on the step time (every operation at its peak rate; see
# aot.roofline): a measured step faster than this share of it means the prediction is wrong.
ROOFLINE_FLOOR = 0.9


def small_config(devices: list, on_gpu: bool) -> RunConfig:
  """The doctor's step: all ``devices`` on the seq axis, a model that fits any of them."""
  n = len(devices)
  if on_gpu:
    model = preset("llama3.2-1b", num_layers=4, dtype="bfloat16", remat_policy="full",
                   attention_backend="auto")
    seq_len = 8192 * n
  else:
    model = preset("cpu-demo", attention_backend="xla", remat_policy="none")
    seq_len = 256 * n
  return RunConfig(train=TrainConfig(mesh_data=1, mesh_seq=n, steps=1 + TIMED_STEPS),
                   model=model, data=DataConfig(seq_len=seq_len, batch_size=1))


def gpu_of(device) -> tuple[Gpu, str]:
  """Our description of ``device``'s GPU model (``gpus.gpu_of_kind``: its row, or the nearest by
  compute capability and XLA's memory pool) and what was assumed ("" for a known GPU)."""
  capability = getattr(device, "compute_capability", None)
  limit = (device.memory_stats() or {}).get("bytes_limit")
  _, gpu, assumed = gpu_of_kind(device.device_kind, capability and tuple(
      int(c) for c in str(capability).split(".")), limit)
  return gpu, assumed


def run_step(devices: list, on_gpu: bool) -> dict:
  """Builds, compiles and runs the small step; returns the measurements (JSON-ready)."""
  config = small_config(devices, on_gpu)
  built = step_builder.build_train_step(config, step_builder.run_mesh(config.train, devices))
  mesh, seq_len = built.mesh, config.data.seq_len
  batch = _random_batch(mesh, seq_len, config.model.vocab_size)
  start = time.perf_counter()
  compiled = built.step.lower(built.state, batch).compile()
  compile_s = time.perf_counter() - start
  state = step_builder.initial_state(built)
  state, metrics = compiled(state, batch)  # the first step: allocations, autotuning
  jax.block_until_ready(state)
  times = []
  for _ in range(TIMED_STEPS):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
  result = {"model": config.model.preset, "layers": config.model.num_layers,
            "seq_len": seq_len, "mesh": dict(mesh.shape), "compile_s": compile_s,
            "loss": float(metrics["loss"]), "step_s": float(np.median(times)),
            "compiled_memory_gib": metrics_lib.compiled_memory_gib(compiled),
            "peak_memory_gib": metrics_lib.peak_memory_gib()}
  tokens_per_s = seq_len / result["step_s"]
  model_flops = metrics_lib.flops_per_token(config.model, seq_len) * tokens_per_s
  result["mfu"] = model_flops / metrics_lib.measure_peak_flops(config.model.dtype)
  datasheet = metrics_lib.datasheet_peak_flops(devices[0])
  result["mfu_datasheet"] = datasheet and model_flops / (datasheet * len(devices))
  if on_gpu:
    gpu, assumed = gpu_of(devices[0])
    prediction = report_lib.describe(compiled, built, gpu, nodes=1)["prediction"]
    result.update(predicted_step_s=prediction["step_s"], gpu=gpu.name)
    if assumed:
      result["gpu_assumed"] = assumed
  return result


def checks(result: dict, on_gpu: bool) -> list[dict]:
  """Pass/fail lines of the step's measurements (``name``, ``passed``, ``detail``); None for
  ``passed`` where the check needs a GPU."""
  rows = [{"name": "step runs, loss finite", "passed": bool(np.isfinite(result["loss"])),
           "detail": f"loss {result['loss']:.4f} after {TIMED_STEPS + 1} steps"}]
  peak, compiled = result["peak_memory_gib"], result["compiled_memory_gib"]
  if on_gpu and peak is not None:
    rows.append({"name": "peak memory within the compiled figure",
                 "passed": peak <= compiled * MEMORY_SLACK,
                 "detail": f"measured peak {peak:.2f} GiB, compiled {compiled:.2f} GiB "
                           f"(allowed up to x{MEMORY_SLACK})"})
  else:
    rows.append({"name": "peak memory within the compiled figure", "passed": None,
                 "detail": f"needs a GPU (compiled {compiled:.3f} GiB)"})
  predicted = result.get("predicted_step_s")
  if predicted is not None:
    rows.append({"name": "step time at or above the roofline",
                 "passed": result["step_s"] >= ROOFLINE_FLOOR * predicted,
                 "detail": f"measured {result['step_s']:.4f} s, predicted {predicted:.4f} s "
                           f"({predicted / result['step_s']:.0%} of the roofline reached)" +
                           (f"; {result['gpu_assumed']}" if "gpu_assumed" in result else "")})
  else:
    rows.append({"name": "step time at or above the roofline", "passed": None,
                 "detail": f"needs a GPU (measured {result['step_s']:.4f} s)"})
  return rows


def _random_batch(mesh, seq_len: int, vocab_size: int) -> dict:
  """One row of random tokens as the trainer's batch dict, sharded like its batches."""
  sharding = NamedSharding(mesh, sharding_lib.batch_spec(mesh, seq_len))
  tokens = np.random.default_rng(0).integers(0, vocab_size, (1, seq_len + 1), np.int32)
  arrays = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "positions": np.arange(seq_len, dtype=np.int32)[None],
            "segment_ids": np.ones((1, seq_len), np.int32)}
  return {k: jax.device_put(jnp.asarray(v), sharding) for k, v in arrays.items()}

