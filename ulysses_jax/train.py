"""The trainer: ``python -m ulysses_jax.train --gin_file=configs/X.gin --workdir=DIR``.

Configured with gin (``--gin_file`` repeated, then ``--gin_param`` overrides, e.g.
``--gin_param=TrainConfig.steps=50``); gin binds only the config dataclasses TrainConfig,
LlamaConfig, RopeScaling, DataConfig, RetrievalTask, OptimizerConfig, CheckpointConfig.
Writes into ``DIR``:

  config.gin      the operative config (every value used, defaults included)
  metrics.jsonl   one JSON object per logged step: step, loss, grad_norm, learning_rate,
                  tokens_per_sec, mfu, step_time_s, peak_memory_gib (where the backend
                  reports it), nonfinite_steps, and eval_loss / eval_accuracy at eval steps
  tensorboard/    the same numbers as TensorBoard events
  checkpoints/    train state + data position (see ``ulysses_jax.checkpoint``)

Started again with the same ``DIR``, it resumes from the newest checkpoint that restores,
on any mesh. SIGTERM/SIGINT save a checkpoint at the current step and exit. A step with
a non-finite loss or gradients is skipped (parameters and optimizer state unchanged) and
counted; ``TrainConfig.max_bad_steps`` of them in a row save the state and stop with an error.
"""

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time

import gin
import jax
from flax import nnx
from tqdm import tqdm

from ulysses_jax import distributed
from ulysses_jax import metrics as metrics_lib
from ulysses_jax.checkpoint import CheckpointConfig, Checkpointer, StopRequest
from ulysses_jax.data import DataConfig, RetrievalTask, make_datasets, retrieval_accuracy
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models.llama import LlamaConfig, count_params, init_llama
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer
from ulysses_jax.rope import RopeScaling
from ulysses_jax.train_step import init_train_state, make_train_step, state_shardings

_log = logging.getLogger("ulysses_jax.train")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- configs

@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The run: length, logging, mesh, devices, fault handling (gin-configurable).

  steps: optimizer steps in total (a resumed run continues up to it).
  log_every: steps between metrics records (step 1 and the last are always logged).
  eval_every: steps between evaluations on held-out data (0: only after the last step).
  eval_batches: held-out batches per evaluation (fewer if the split is smaller).
  mesh_data, mesh_seq: the ("data", "seq") mesh; mesh_data=-1 takes the remaining devices.
  mesh_ring: > 1 adds a "ring" axis: the hybrid, all-to-all over seq and a K/V ring over
    ring (put seq within a node, ring across nodes).
  seed: parameter initialisation.
  accum_steps: micro-batches per step (gradient accumulation).
  z_loss_weight: weight of the z-loss term.
  max_bad_steps: consecutive non-finite steps that stop training.
  offload_optimizer: keep the optimizer state (Adam moments, master weights) in pinned host
    memory; the update streams it through the device one layer at a time.
  offload_params: with offload_optimizer, keep the stacked layer parameters and their
    gradients in pinned host memory too: each layer's weights come to the device when it runs
    (needs accum_steps=1).
  master_weights: with LlamaConfig.param_dtype="bfloat16", the optimizer updates a float32
    copy of the parameters (moments float32 too) and the model gets it rounded.
  platform: "" (JAX's default), "cpu", "gpu" or "tpu".
  cpu_devices: virtual CPU devices per process (0: JAX's default).
  peak_flops: per-device peak FLOP/s for MFU (0: measure at start; see ``metrics``).
  progress_bar: show a tqdm bar on a terminal (else a log line per record).
  compilation_cache: directory of JAX's persistent compilation cache ("" = off): a
    restarted or repeated run loads its compiled programs instead of compiling again.
  """
  steps: int = 1000
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 8
  mesh_data: int = -1
  mesh_seq: int = 1
  mesh_ring: int = 1
  seed: int = 0
  accum_steps: int = 1
  z_loss_weight: float = 0.0
  max_bad_steps: int = 20
  offload_optimizer: bool = False
  offload_params: bool = False
  master_weights: bool = False
  platform: str = ""
  cpu_devices: int = 0
  peak_flops: float = 0.0
  progress_bar: bool = True
  compilation_cache: str = ""

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if f.type is float
            else isinstance(value, f.type) and (f.type is bool or not isinstance(value, bool)))
      if not ok:
        raise TypeError(f"TrainConfig.{f.name} must be a {f.type.__name__}, got {value!r}")
    small = {k: getattr(self, k) for k, low in (
        ("steps", 1), ("log_every", 1), ("eval_every", 0), ("eval_batches", 1),
        ("accum_steps", 1), ("max_bad_steps", 1), ("cpu_devices", 0)) if getattr(self, k) < low}
    if small:
      raise ValueError(f"TrainConfig values out of range: {small} (steps, log_every, "
                       "eval_batches, accum_steps, max_bad_steps >= 1; eval_every, "
                       "cpu_devices >= 0)")
    if self.offload_params and not (self.offload_optimizer and self.accum_steps == 1):
      raise ValueError(f"TrainConfig.offload_params=True needs offload_optimizer=True and "
                       f"accum_steps=1, got offload_optimizer={self.offload_optimizer}, "
                       f"accum_steps={self.accum_steps}.")


# The gin-bound constructors: calling one applies the parsed bindings.
(LlamaConfig, RopeScaling, DataConfig, RetrievalTask, OptimizerConfig, CheckpointConfig) = (
    gin.external_configurable(c, module="ulysses_jax") for c in (
        LlamaConfig, RopeScaling, DataConfig, RetrievalTask, OptimizerConfig, CheckpointConfig))
TrainConfig = gin.configurable(TrainConfig, module="ulysses_jax")
gin.add_config_file_search_path(_REPO_ROOT)  # so `include 'configs/...'` works from any cwd


def parse_gin(files: list[str], params: list[str]):
  """Loads gin files in order, then ``params``; unknown names raise ``ValueError``."""
  if not files:
    raise ValueError("give at least one --gin_file (e.g. --gin_file=configs/tiny_cpu.gin)")
  for f in files:
    if not any(os.path.isfile(os.path.join(d, f)) for d in ("", _REPO_ROOT)):
      raise FileNotFoundError(f"gin file {f!r} not found (looked in {os.getcwd()} and "
                              f"{_REPO_ROOT}); the experiments are in {_REPO_ROOT}/configs")
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(files, params)
  except TypeError as e:  # gin's package-path fallback fails like this on a missing include
    raise FileNotFoundError(f"a gin `include` names a file that does not exist ({e})") from e


# ----------------------------------------------------------------------------- setup

def abstract_train_state(model_config, mesh, optimizer, seed=0, offload_optimizer=False,
                         offload_params=False, master_weights=False):
  """(graphdef, train state as ShapeDtypeStructs carrying their target shardings)."""
  graphdef, shapes = jax.eval_shape(
      lambda: init_train_state(init_llama(model_config, mesh, seed=seed), optimizer,
                               master_weights=master_weights))
  shardings = state_shardings(shapes, mesh, offload_optimizer=offload_optimizer,
                              offload_params=offload_params)
  return graphdef, jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def _check_fits(abstract_state):
  """Raises if the train state alone overflows a device (host memory for CPU devices)."""
  need = {}
  for x in jax.tree.leaves(abstract_state):
    if x.sharding.memory_kind == "pinned_host":
      continue  # the offloaded optimizer state (and parameters)
    for device in x.sharding.device_set:
      shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      need[device] = need.get(device, 0) + shard
  device = jax.local_devices()[0]
  have = (device.memory_stats() or {}).get("bytes_limit")
  if have is None and device.platform == "cpu":
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / jax.local_device_count()
  if have and max(need.values()) > have:
    raise MemoryError(f"the train state (parameters + optimizer) needs "
                      f"{max(need.values()) / 2**30:.1f} GiB per device but a device has "
                      f"{have / 2**30:.1f} GiB; use a smaller model (LlamaConfig), more "
                      "devices or TrainConfig.offload_optimizer=True")


def _make_eval_step(graphdef, retrieval: bool):
  """Jitted (params, batch) -> loss sum, label count and, for the retrieval task, the
  number of labels predicted right (which needs full logits: small vocabulary only)."""
  @jax.jit
  def eval_step(params, batch):
    model = nnx.merge(graphdef, params)
    inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
    sums = model.loss(inputs[0], batch["labels"], *inputs[1:])
    out = {"loss": sums.loss, "count": sums.count}
    if retrieval:
      out["correct"] = retrieval_accuracy(model(*inputs), batch["labels"]) * sums.count
    return out
  return eval_step


def _evaluate(eval_step, params, eval_ds, num_batches) -> dict:
  """Held-out loss (and retrieval accuracy) over the first ``num_batches`` eval batches."""
  totals = {}
  for i in range(min(num_batches, eval_ds.num_batches)):
    for k, v in jax.device_get(eval_step(params, eval_ds.batch(i))).items():
      totals[k] = totals.get(k, 0.0) + float(v)
  count = max(totals["count"], 1.0)
  result = {"eval_loss": totals["loss"] / count}
  if "correct" in totals:
    result["eval_accuracy"] = totals["correct"] / count
  return result


class NonFiniteError(RuntimeError):
  """Too many consecutive steps with non-finite loss or gradients."""


class ConfigError(ValueError):
  """A config, flag, or the data or devices it names, cannot work (found before training)."""


@contextlib.contextmanager
def _config_errors():
  """Re-raises a failure of reading configs, data and devices as ``ConfigError``, whose
  message the command line prints alone (the original stays chained as the cause)."""
  try:
    yield
  except (ValueError, TypeError, OSError, MemoryError, RuntimeError) as e:
    raise ConfigError(str(e)) from e


# ----------------------------------------------------------------------------- training

def train(workdir: str, datasets=None) -> dict:
  """Trains with the gin-bound configs into ``workdir``; returns the run's summary.

  Call after ``parse_gin`` (and, for a fresh process, ``distributed.configure_platform``).
  ``datasets``: (train, eval) to use instead of ``make_datasets(DataConfig())``.
  """
  with _config_errors():
    cfg, model_cfg, data_cfg = TrainConfig(), LlamaConfig(), DataConfig()
    opt_cfg, ckpt_cfg = OptimizerConfig(), CheckpointConfig()
    distributed.check_platform(cfg.platform, cfg.cpu_devices)
    mesh = make_mesh(cfg.mesh_data, cfg.mesh_seq, cfg.mesh_ring)
    optimizer = make_optimizer(opt_cfg)
    graphdef, abstract = abstract_train_state(model_cfg, mesh, optimizer, cfg.seed,
                                              cfg.offload_optimizer, cfg.offload_params,
                                              cfg.master_weights)
    _check_fits(abstract)
    train_ds, eval_ds = datasets or make_datasets(data_cfg, mesh,
                                                  vocab_size=model_cfg.vocab_size)
  tokens_per_step = data_cfg.batch_size * data_cfg.seq_len
  lead = jax.process_index() == 0
  if lead:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.gin"), "w", encoding="utf-8") as f:
      f.write(gin.operative_config_str())
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), ckpt_cfg)
  run_config = {"gin": gin.operative_config_str(), "model": model_cfg.to_dict(),
                "data": dataclasses.asdict(data_cfg), "optimizer": dataclasses.asdict(opt_cfg),
                "train": dataclasses.asdict(cfg)}
  restored = ckpt.restore(abstract)
  if restored is None:
    start, state = 0, init_train_state(init_llama(model_cfg, mesh, seed=cfg.seed), optimizer,
                                       offload_optimizer=cfg.offload_optimizer,
                                       offload_params=cfg.offload_params,
                                       master_weights=cfg.master_weights)[1]
  else:
    start, state = restored.step, restored.state
    train_ds.set_state(restored.data_state)
  step_fn = make_train_step(graphdef, abstract, optimizer, mesh=mesh,
                            seq_len=data_cfg.seq_len, accum_steps=cfg.accum_steps,
                            z_loss_weight=cfg.z_loss_weight,
                            offload_optimizer=cfg.offload_optimizer,
                            offload_params=cfg.offload_params)
  eval_step = _make_eval_step(graphdef, data_cfg.source == "retrieval")
  flops = metrics_lib.flops_per_token(model_cfg, data_cfg.seq_len)
  peak = (cfg.peak_flops * jax.device_count() if cfg.peak_flops
          else metrics_lib.measure_peak_flops(model_cfg.dtype))
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start)
  if lead:
    _log.info("%s devices as %s; %s parameters; %d tokens/step; %s", jax.device_count(),
              dict(mesh.shape), f"{count_params(model_cfg):,}", tokens_per_step,
              f"resuming at step {start}" if start else "starting from scratch")
  summary = {"workdir": workdir, "steps": cfg.steps, "start_step": start, "step": start,
             "restored_step": restored.step if restored else None, "stopped": None,
             "first_loss": None, "last_loss": None}
  bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
             disable=not (lead and cfg.progress_bar and sys.stderr.isatty()))
  interval_time, interval_steps = 0.0, 0  # since the last record
  steady_time, steady_steps = 0.0, 0  # all steps but the first (which compiles)
  wall_start = time.perf_counter()

  # ---------------------------------------------------------------------------- the loop
  try:
    with StopRequest() as stop:
      batch = next(train_ds) if start < cfg.steps else None
      for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        state, step_metrics = step_fn(state, batch)
        data_state = train_ds.get_state()
        if step < cfg.steps:
          batch = next(train_ds)  # host work while the device runs the step
        m, bad, skipped = jax.device_get((step_metrics, state.nonfinite_in_a_row,
                                          state.nonfinite_steps))
        dt = time.perf_counter() - t0
        interval_time, interval_steps = interval_time + dt, interval_steps + 1
        if step > start + 1:
          steady_time, steady_steps = steady_time + dt, steady_steps + 1
        bar.update()
        summary["step"] = step

        # -------------------------------------------------------------- eval, log, save
        do_eval = step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)
        if do_eval or step % cfg.log_every == 0 or step == start + 1:
          record = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                    "learning_rate": float(m["learning_rate"]),
                    "tokens_per_sec": tokens_per_step * interval_steps / interval_time,
                    "step_time_s": interval_time / interval_steps,
                    "peak_memory_gib": metrics_lib.peak_memory_gib(),
                    "nonfinite_steps": int(skipped)}
          record["mfu"] = flops * record["tokens_per_sec"] / peak
          if cfg.z_loss_weight:
            record["z_loss"] = float(m["z_loss"])
          if do_eval and eval_ds is not None:
            record.update(_evaluate(eval_step, state.params, eval_ds, cfg.eval_batches))
          writer.write(record)
          interval_time, interval_steps = 0.0, 0
          if math.isfinite(record["loss"]):
            summary["first_loss"] = summary["first_loss"] or (step, record["loss"])
            summary["last_loss"] = (step, record["loss"])
          summary["last_record"] = record
          bar.set_postfix(loss=f"{record['loss']:.3f}",
                          tok_s=f"{record['tokens_per_sec']:,.0f}")
          if bar.disable and lead:
            _log.info("step %d/%d  loss %.4f  %s tok/s", step, cfg.steps, record["loss"],
                      f"{record['tokens_per_sec']:,.0f}")
        if bad >= cfg.max_bad_steps:
          ckpt.save(step, state, data_state, run_config=run_config, force=True)
          raise NonFiniteError(
              f"stopped at step {step}: the loss or gradients were non-finite in {int(bad)} "
              f"steps in a row (TrainConfig.max_bad_steps={cfg.max_bad_steps}). Those updates "
              f"were all skipped, so {ckpt.directory}/{step} holds the last good parameters. "
              "Lower OptimizerConfig.learning_rate, lengthen warmup_steps or check the data, "
              "then rerun to resume.")
        if stop.should_stop():
          ckpt.save(step, state, data_state, run_config=run_config, force=True)
          summary["stopped"] = f"signal {stop.signum}"
          break
        ckpt.save(step, state, data_state, run_config=run_config,
                  force=step == cfg.steps)
  finally:
    bar.close()
    writer.close()
    ckpt.close()  # waits for an async save in flight

  # ---------------------------------------------------------------------------- summary
  summary.update(wall_time_s=time.perf_counter() - wall_start,
                 tokens_per_sec=tokens_per_step * steady_steps / steady_time if steady_steps
                 else None,
                 metrics=writer.path, tensorboard=writer.tensorboard_dir,
                 checkpoints=os.path.join(workdir, "checkpoints"),
                 latest_checkpoint=ckpt.latest_step())
  if lead:
    print(format_summary(summary), flush=True)
  return summary


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
                 + (f", MFU {last['mfu']:.1%}" if "mfu" in last else ""))
  lines += [f"  metrics      {s['metrics']}  (tensorboard --logdir {s['tensorboard']})",
            f"  checkpoints  {s['checkpoints']}  (latest: step {s['latest_checkpoint']})"]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point

def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m ulysses_jax.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="repeatable")
  parser.add_argument("--gin_param", action="append", default=[], help="repeatable")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--coordinator_address", help="host:port of process 0 (multi-process)")
  parser.add_argument("--num_processes", type=int)
  parser.add_argument("--process_id", type=int)
  args = parser.parse_args(argv)
  logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
  _log.setLevel(logging.INFO)
  with _config_errors():
    parse_gin(args.gin_file, args.gin_param)
    cfg = TrainConfig()
    distributed.configure_platform(cfg.platform, cfg.cpu_devices, cfg.compilation_cache)
    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
  return train(args.workdir)


if __name__ == "__main__":
  try:
    main()
  except (ConfigError, NonFiniteError) as e:
    sys.exit(f"error: {e}")
