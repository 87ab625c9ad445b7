"""Training metrics: the ``metrics.jsonl`` + TensorBoard writer, model FLOPs, device peaks.

MFU (model FLOPs utilisation) = ``flops_per_token * tokens_per_sec / peak_flops``:

* ``flops_per_token = 6 * N + 12 * h * (sum over layers of k)``: 6 FLOPs per parameter per
  token for the dense matmuls (forward 2, backward 4), N the parameters that take part in a
  matmul (all but the embedding lookup; the output head counts, tied or not; of a mixture of
  experts the active ones, the experts a token runs, not all of them); attention scores and
  values cost ``12 * k * h`` per token and layer forward+backward (h = query heads * head
  dim), k the keys a query sees on average: S/2 under the causal mask over S tokens, about
  W under a sliding window W << S (``reference.mean_visible_keys``, per layer from
  ``LlamaConfig.layer_windows``). Rematerialisation is not counted (this is MFU, not
  hardware FLOPs utilisation). Attention sinks (``LlamaConfig.attention_sinks``) take part in
  no matmul: their L·Hq logits are not in N, and their elementwise work (a sigmoid per query
  row and head, a product per output element) is not counted, so they leave the count as it
  is.
* ``peak_flops``: the measured matmul throughput, in the model's compute dtype, of all
  devices together (``measure_peak_flops``), or a given per-device figure times the
  device count.

Published figures divide by the datasheet's dense bf16 peak instead (989 TFLOP/s for an H100
or H200, where a timed bf16 matmul reaches about 800): ``datasheet_peak_flops`` gives it for
the GPUs of ``ulysses_jax.gpus``, and the records, the trainer's summary, doctor and
``benchmarks/train_step.py`` state MFU against both (``mfu`` and ``mfu_datasheet``).
"""

import json
import math
import os
import secrets
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax.attention.reference import mean_visible_keys
from ulysses_jax.gpus import gpu_of_kind
from ulysses_jax.models.llama import LlamaConfig, count_params


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward) of a causal Llama; see the module doc.
  A mixture of experts counts its active parameters: each MoE layer's router and the k of
  its X experts a token runs (``count_params(active=True)``)."""
  embedding = config.vocab_size * config.hidden_dim
  sinks = config.num_layers * config.num_heads if config.attention_sinks else 0
  matmul_params = count_params(config, active=True) - embedding - sinks + (
      embedding if config.tie_embeddings else 0)
  keys = sum(mean_visible_keys(seq_len, window) for window in config.layer_windows())
  attention = 12 * keys * config.num_heads * config.head_dim
  return 6 * matmul_params + attention


def measure_peak_flops(dtype: str = "bfloat16") -> float:
  """FLOP/s of square matmuls in ``dtype`` on all devices at once (all processes).

  Every local device multiplies its own matrices (no communication); the best of a few
  timed runs counts. Processes are assumed alike: the local figure times their number.
  """
  devices = jax.local_devices()
  n = 8192 if devices[0].platform == "gpu" else 256
  mesh = Mesh(np.array(devices), ("d",))
  x = jax.device_put(jnp.full((len(devices), n, n), 1 / n, dtype), NamedSharding(mesh, P("d")))
  repeats = 8

  @jax.jit
  def chain(a):
    return jax.lax.fori_loop(0, repeats, lambda _, b: jnp.einsum("dij,djk->dik", b, a), a)

  chain(x).block_until_ready()
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    chain(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 * repeats * len(devices) / best * jax.process_count()


def datasheet_peak_flops(device=None) -> float | None:
  """The datasheet's dense bf16 tensor-core FLOP/s of one ``device`` (default: the first),
  from ``ulysses_jax.gpus``; None for a CPU, or a GPU the table knows only by its nearest row
  (whose peak may be another chip's)."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return None
  _, gpu, assumed = gpu_of_kind(device.device_kind)
  return None if assumed else gpu.bf16_flops


def mfu_text(mfu: float, mfu_datasheet: float | None, peak_label: str = "measured") -> str:
  """MFU against both peaks, each named: ``mfu`` of the ``peak_label`` matmul peak (the timed
  one by default), ``mfu_datasheet`` of the datasheet's dense bf16 peak (None: not known)."""
  text = f"MFU {mfu:.1%} of the {peak_label} matmul peak"
  return text + (", datasheet peak unknown for this device" if mfu_datasheet is None
                 else f", {mfu_datasheet:.1%} of the datasheet's dense bf16 peak")


def device_breakdown(memory_analysis) -> dict:
  """Bytes on the device, by kind, of a compiled program's ``memory_analysis()``: what the
  program needs on each device (``ulysses_jax.aot`` reports their sum)."""
  m = memory_analysis
  return {"arguments": m.argument_size_in_bytes,
          "outputs": m.output_size_in_bytes - m.alias_size_in_bytes,
          "temporaries": m.temp_size_in_bytes,
          "code": m.generated_code_size_in_bytes}


def compiled_memory_gib(compiled) -> float | None:
  """The device memory a compiled program needs per device (``device_breakdown``'s sum), in GiB;
  None where the backend gives no memory analysis."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else sum(device_breakdown(analysis).values()) / 2**30


def memory_line(record: dict) -> str:
  """The log line after the first step: runtime peak beside the compiled figure."""
  peak, compiled = record.get("peak_memory_gib"), record.get("compiled_memory_gib")
  peak_text = ("not reported by this backend" if peak is None
               else f"{peak:.2f} GiB peak in use (the runtime's memory_stats)")
  compiled_text = "none" if compiled is None else f"{compiled:.2f} GiB"
  return (f"device memory after step {record['step']}, per device: {peak_text}; compiled "
          f"figure of the step {compiled_text} (ulysses_jax.aot predicts the latter)")


def peak_memory_gib() -> float | None:
  """Largest peak device memory in use among local devices, or None if not reported."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


WANDB_HINT = "pip install 'ulysses_jax[wandb]' (or pip install wandb)"


class _WandbRun:
  """A Weights & Biases run of the workdir: its id is kept in ``wandb_run_id``, so a resumed
  run continues it (steps that the stopped run logged after its checkpoint stay there too).
  The numbers are plotted against our ``step``. ``WANDB_MODE=offline`` keeps it on disk."""

  def __init__(self, workdir: str, project: str, config: dict | None):
    try:
      import wandb  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError(f"TrainConfig.wandb_project needs wandb: {WANDB_HINT}") from e
    id_file = os.path.join(workdir, "wandb_run_id")
    if os.path.exists(id_file):
      with open(id_file, encoding="utf-8") as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(4)
      with open(id_file, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    self.run = wandb.init(project=project, id=run_id, resume="allow", dir=workdir,
                          config=config)
    self.run.define_metric("step")
    self.run.define_metric("*", step_metric="step")

  def log(self, numbers: dict):
    self.run.log(numbers)

  def close(self):
    self.run.finish()


class MetricsWriter:
  """Appends one JSON object per logged step to ``metrics.jsonl`` and mirrors every number
  to TensorBoard event files under ``tensorboard/`` and, with ``wandb_project``, to a
  Weights & Biases run (``_WandbRun``; ``run_config`` as its config).

  Only process 0 writes (others get a writer that does nothing). On resume from step
  ``resume_step``, records of later steps (logged after that checkpoint by the run that
  was stopped) are dropped, so the history reads like one uninterrupted run; TensorBoard's
  events are rewritten from the kept records, so they hold each step once.
  """

  def __init__(self, workdir: str, resume_step: int = 0, enabled: bool | None = None, *,
               wandb_project: str = "", run_config: dict | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard_dir = os.path.join(workdir, "tensorboard")
    self._enabled = jax.process_index() == 0 if enabled is None else enabled
    self._wandb = None
    if not self._enabled:
      return
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    os.makedirs(workdir, exist_ok=True)
    kept = []
    if os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
      with open(self.path, "w", encoding="utf-8") as f:
        f.writelines(kept)
    shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
    self._tb = SummaryWriter(self.tensorboard_dir)
    for line in kept:
      self._to_tensorboard(json.loads(line))
    self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    if wandb_project:
      self._wandb = _WandbRun(workdir, wandb_project, run_config)

  def write(self, record: dict):
    """Writes ``record``: ``step``, numbers and strings; None values (not measured) are left
    out, non-finite numbers are written as null (JSON has no NaN), and only finite numbers
    are sent to TensorBoard."""
    if not self._enabled:
      return
    record = {k: v for k, v in record.items() if v is not None}
    finite = {k: v for k, v in record.items() if not isinstance(v, str) and math.isfinite(v)}
    text = {k: v for k, v in record.items() if isinstance(v, str)}
    self._file.write(json.dumps({k: finite.get(k, text.get(k)) for k in record}) + "\n")
    self._file.flush()
    self._to_tensorboard(finite)
    if self._wandb:
      self._wandb.log(finite)

  def _to_tensorboard(self, record: dict):
    """The numbers of ``record`` (a resumed run replays its kept lines: strings, nulls too)."""
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, record["step"])
    self._tb.flush()

  def close(self):
    if self._enabled:
      self._file.close()
      self._tb.close()
    if self._wandb:
      self._wandb.close()


def make_record(step: int, step_metrics: dict, nonfinite_steps: int, *, tokens: int,
                seconds: float, steps: int, flops_per_token: float, peak_flops: float,
                datasheet_flops: float | None = None) -> dict:
  """The metrics record of ``step``: ``steps`` steps of ``tokens`` tokens took ``seconds``;
  ``mfu`` of ``peak_flops``, ``mfu_datasheet`` of ``datasheet_flops`` (all devices; None:
  left out)."""
  m = step_metrics
  record = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "learning_rate": float(m["learning_rate"]),
            "tokens_per_sec": tokens * steps / seconds, "step_time_s": seconds / steps,
            "peak_memory_gib": peak_memory_gib(),
            "nonfinite_steps": int(nonfinite_steps)}
  record["mfu"] = flops_per_token * record["tokens_per_sec"] / peak_flops
  if datasheet_flops:
    record["mfu_datasheet"] = flops_per_token * record["tokens_per_sec"] / datasheet_flops
  if "z_loss" in m and float(m["z_loss"]):
    record["z_loss"] = float(m["z_loss"])
  record.update({k: float(v) for k, v in m.items()
                 if k == "router_aux_loss" or k.startswith("expert_share_")})
  return record


def format_record(record: dict, steps: int) -> str:
  """One log line: step, loss, speed and the eval metrics when present."""
  line = (f"step {record['step']}/{steps}  loss {record['loss']:.4f}  "
          f"{record['tokens_per_sec']:,.0f} tok/s")
  for key in ("eval_loss", "eval_accuracy"):
    if key in record:
      line += f"  {key} {record[key]:.4f}"
  return line


def format_summary(s: dict) -> str:
  """The closing lines printed after training."""
  if s["step"] == s["start_step"]:
    return (f"Nothing to train: {s['checkpoints']} is already at step {s['step']} of "
            f"{s['steps']}; raise TrainConfig.steps to continue, or use a new --workdir")
  lines = [f"Trained steps {s['start_step'] + 1}..{s['step']} in {s['wall_time_s']:.0f} s"
           + (f" (resumed from step {s['restored_step']})" if s["restored_step"] else "")
           + (f"; stopped by {s['stopped']}, rerun the same command to resume"
              if s["stopped"] else "")]
  if s["first_loss"]:
    (a, la), (b, lb) = s["first_loss"], s["last_loss"]
    lines.append(f"  loss         {la:.4f} (step {a}) -> {lb:.4f} (step {b})")
  last = s.get("last_record", {})
  if "eval_loss" in last:
    lines.append(f"  eval         loss {last['eval_loss']:.4f}" + (
        f", retrieval accuracy {last['eval_accuracy']:.3f}" if "eval_accuracy" in last else ""))
  if s["tokens_per_sec"]:
    lines.append(f"  throughput   {s['tokens_per_sec']:,.0f} tokens/s after the first step"
                 + (", " + mfu_text(last["mfu"], last.get("mfu_datasheet"),
                                    s.get("peak_label", "measured")) if "mfu" in last else ""))
  lines += [f"  metrics      {s['metrics']}  (tensorboard --logdir {s['tensorboard']})",
            f"  checkpoints  {s['checkpoints']}  (latest: step {s['latest_checkpoint']})"]
  if s.get("exported"):
    lines.append(f"  exported     {s['exported']}  (a Hugging Face checkpoint)")
  return "\n".join(lines)
