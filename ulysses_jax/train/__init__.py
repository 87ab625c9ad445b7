"""The training loop: ``train(workdir, RunConfig(...))``.

The command line (``ulysses-train`` or ``python -m ulysses_jax.train --gin_file=configs/X.gin
--workdir=DIR``, ``ulysses_jax.cli.train``) reads the ``RunConfig`` from gin files; the step
comes from ``ulysses_jax.step_builder`` (``TrainConfig.init_from``'s model shapes included),
the evaluations from ``ulysses_jax.evaluate``. Writes into ``DIR``:

  config.gin      the operative config of the latest start (every value used, defaults
                  included), written once the run is known to proceed
  config_history/ the operative config of every start that trained, named by time and step
  metrics.jsonl   one JSON object per logged step: step, loss, grad_norm, learning_rate,
                  tokens_per_sec, mfu (of the measured matmul peak), mfu_datasheet (of
                  the datasheet's dense bf16 peak, on the GPUs of ulysses_jax.gpus),
                  step_time_s, peak_memory_gib (where the backend
                  reports it), nonfinite_steps, tokens_seen/<source> for a mixture
                  (DataConfig.sources), and eval_loss / eval_accuracy at eval steps;
                  with experts router_aux_loss and each MoE layer's
                  expert_share_min/layer_i, expert_share_max/layer_i (TrainStep's metrics);
                  the first also compiled_memory_gib and the attention backend and its
                  self-check (``ulysses_jax.kernel_check``)
  tensorboard/    the same numbers as TensorBoard events (and a Weights & Biases run under
                  wandb/ with TrainConfig.wandb_project)
  checkpoints/    train state + data position + the run config (``ulysses_jax.checkpoint``)

Started again with the same ``DIR``, it resumes from the newest checkpoint that restores,
on any mesh. SIGTERM/SIGINT save a checkpoint at the current step and exit. A step with
a non-finite loss or gradients is skipped (parameters and optimizer state unchanged) and
counted; ``TrainConfig.max_bad_steps`` of them in a row save the state and stop with an error.
Every check (configs, devices, data, memory, the checkpoint to resume) runs before the
workdir is created or changed: they raise ``ConfigError``. The memory check compiles the step
and compares it with XLA's memory pool, and runs the step compiled under memory pressure where
only that one fits (``ulysses_jax.train.fit``). Too many non-finite steps raise
``NonFiniteError``; XLA's out of memory at the first step raises ``OutOfMemoryError``; a
signal returns a summary whose ``stopped`` names it.
"""

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import NamedTuple

import jax
from tqdm import tqdm

from ulysses_jax import distributed, evaluate, kernel_check, ruler, step_builder
from ulysses_jax.hf import export
from ulysses_jax import metrics as metrics_lib
from ulysses_jax import workdir as workdir_lib
from ulysses_jax.checkpoint import Checkpointer, StopRequest
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.corpus import make_tokenizer
from ulysses_jax.data.pipeline import make_datasets
from ulysses_jax.gpus import gpu_of_kind
from ulysses_jax.models.llama import count_params
from ulysses_jax.run_config import RunConfig, TrainConfig  # noqa: F401  (public here too)
from ulysses_jax.train.fit import (  # noqa: F401  (public here too)
    Fitted, OutOfMemoryError, compile_to_fit, fitted_line, is_out_of_memory, out_of_memory)

_log = logging.getLogger("ulysses_jax.train")


class NonFiniteError(RuntimeError):
  """Too many consecutive steps with non-finite loss or gradients."""


@contextlib.contextmanager
def _config_errors():
  """Re-raises a failure of reading configs, data, devices and checkpoints as
  ``ConfigError``, whose message the command line prints alone (the original stays chained
  as the cause)."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError, OSError, MemoryError, RuntimeError, KeyError) as e:
    raise ConfigError(str(e)) from e


# ----------------------------------------------------------------------------- setup

class Run(NamedTuple):
  """A run ready to train: built and checked before the workdir is created or changed."""
  config: RunConfig  # resolved (init_from's model), the attention backend as configured
  built: step_builder.TrainStep  # the step, its abstract state, the mesh, the resolved config
  restored: object  # checkpoint.Restored, or None (from scratch)
  train_ds: object
  eval_ds: object
  attention: kernel_check.Settled  # the attention backend the step runs, and its self-check
  fitted: Fitted  # the step compiled to fit XLA's memory pool, and its memory per device

  @property
  def start(self) -> int:
    """Steps already taken."""
    return self.restored.step if self.restored else 0


def prepare(workdir: str, config: RunConfig, datasets=None) -> Run:
  """Checks devices, mesh, memory and data, restores the newest good checkpoint of ``workdir``
  (if any) and compiles the step (``compile_to_fit``: it must fit XLA's memory pool); creates
  and writes nothing. Raises ``ConfigError`` with one clear sentence. ``datasets``: (train,
  eval) to use instead of ``make_datasets(config.data)``."""
  cfg = config.train
  with _config_errors():
    distributed.check_platform(cfg.platform, cfg.cpu_devices)
    config = step_builder.resolve(config, workdir)  # init_from's shapes
    mesh = step_builder.run_mesh(cfg)
    # The data first: a bad file is one error line, before the kernel runs or logs anything.
    train_ds, eval_ds = datasets or make_datasets(config.data, mesh,
                                                  vocab_size=config.model.vocab_size)
    for what in ("seq_len", "batch_size"):  # the step's shapes, MFU and logs use the config's
      if getattr(train_ds, what) != getattr(config.data, what):
        raise ConfigError(f"the given training dataset has {what}={getattr(train_ds, what)} but "
                          f"DataConfig.{what}={getattr(config.data, what)}; make them equal")
    attention = kernel_check.settle(config.model, mesh, seq_len=config.data.seq_len,
                                    check=cfg.kernel_check)
    built = step_builder.build_train_step(dataclasses.replace(
        config, model=attention.model_config(config.model)), mesh, workdir=workdir)
    _check_fits(built.state)
    restored = None
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
      # Checked before restoring: a restore into other shapes fails deep in orbax, and its
      # pending reads print tracebacks of their own.
      mismatch = workdir_lib.why_no_restore(os.path.join(workdir, "checkpoints"), config)
      if mismatch:
        raise ConfigError(mismatch)
      with Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint) as ckpt:
        restored = ckpt.restore(built.state)
    if restored is not None:
      train_ds.set_state(restored.data_state)
  # Compiled last, so a checkpoint or data position that cannot resume fails before this wait;
  # and outside _config_errors: a compile that fails is a bug to see whole, not bad input.
  pool_gib = distributed.gpu_pool_gib(every_process=True)
  fitted = compile_to_fit(built.step, built.state, built.batch, pool_gib, *_gpu_and_topology())
  if fitted.under_pressure and jax.process_index() == 0:
    _log.warning(fitted_line(fitted, pool_gib))
  return Run(config, built, restored, train_ds, eval_ds, attention, fitted)


def _gpu_and_topology() -> tuple[str, str]:
  """The devices' kind as a key of ``ulysses_jax.gpus.GPUS`` and the processes as aot's
  topology (``1x<processes>x<local devices>``): what the out-of-memory errors' commands need."""
  return (gpu_of_kind(jax.devices()[0].device_kind)[0],
          f"1x{jax.process_count()}x{jax.local_device_count()}")


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


# ----------------------------------------------------------------------------- training

def train(workdir: str, config: RunConfig, *, datasets=None) -> dict:
  """Trains ``config`` into ``workdir`` (resuming from its checkpoints); returns the run's
  summary (``summary["stopped"]`` names the signal that stopped it, else None).

  For a fresh process call ``distributed.configure_platform`` first (the command line does).
  ``datasets``: (train, eval) to use instead of ``make_datasets(config.data)``.
  """
  cfg = config.train
  run = prepare(workdir, config, datasets)
  config, mesh = run.config, run.built.mesh
  with _config_errors():  # a task that does not fit S stops here, before the workdir changes
    ruler_probe = ruler.Probe(
        cfg.ruler_tasks.split(","), cfg.ruler_samples, make_tokenizer(config.data.tokenizer),
        mesh, seq_len=config.data.seq_len,
        vocab_size=config.model.vocab_size) if cfg.ruler_tasks else None
  start, lead = run.start, jax.process_index() == 0
  summary = {"workdir": workdir, "steps": cfg.steps, "start_step": start, "step": start,
             "restored_step": run.restored.step if run.restored else None, "stopped": None,
             "first_loss": None, "last_loss": None,
             "checkpoints": os.path.join(workdir, "checkpoints")}
  if start >= cfg.steps:
    if lead:
      print(metrics_lib.format_summary(summary), flush=True)
    return summary
  if lead:
    for change in workdir_lib.changes_since(run.restored and run.restored.run_config, config):
      _log.warning("changed since the checkpoint of step %d: %s (the learning-rate schedule "
                   "follows the new values from here on)", start, change)
    workdir_lib.write_configs(workdir, config, start)
  # A resumed run never reads init_from again.
  state = run.restored.state if run.restored else step_builder.initial_state(run.built)
  eval_step = evaluate.make_eval_step(run.built.graphdef, config.data.source == "retrieval")
  position_eval = (evaluate.PositionEval(run.built.graphdef)
                   if cfg.position_eval or ruler_probe else None)
  record_args = dict(
      tokens=config.data.batch_size * config.data.seq_len,
      flops_per_token=metrics_lib.flops_per_token(config.model, config.data.seq_len),
      peak_flops=(cfg.peak_flops * jax.device_count() if cfg.peak_flops
                  else metrics_lib.measure_peak_flops(config.model.dtype)),
      datasheet_flops=(metrics_lib.datasheet_peak_flops() or 0.0) * jax.device_count())
  summary["peak_label"] = "given (TrainConfig.peak_flops)" if cfg.peak_flops else "measured"
  if lead:
    _log.info("%s devices as %s; %s parameters; %d tokens/step; %s", jax.device_count(),
              dict(mesh.shape), f"{count_params(config.model):,}", record_args["tokens"],
              f"resuming at step {start}" if start else "starting from scratch")
    _log.info("attention: %s", run.attention.choice.reason)
    if jax.default_backend() == "gpu":
      _log.info(distributed.gpu_memory_line())
  ckpt = Checkpointer(summary["checkpoints"], config.checkpoint)
  run_config = config.to_dict()
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start,
                                     wandb_project=cfg.wandb_project, run_config=run_config)
  bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
             disable=not (lead and cfg.progress_bar and sys.stderr.isatty()))
  interval_time, interval_steps = 0.0, 0  # since the last record
  steady_time, steady_steps = 0.0, 0  # all steps but the first (which compiles)
  wall_start = time.perf_counter()

  # ---------------------------------------------------------------------------- the loop
  try:
    with StopRequest() as stop:
      batch = next(run.train_ds)
      for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        try:
          state, step_metrics = run.fitted.step(state, batch)
          data_state = run.train_ds.get_state()
          if step < cfg.steps:
            batch = next(run.train_ds)  # host work while the device runs the step
          m, bad, skipped = jax.device_get((step_metrics, state.nonfinite_in_a_row,
                                            state.nonfinite_steps))
        except jax.errors.JaxRuntimeError as e:
          if step == start + 1 and is_out_of_memory(e):
            raise out_of_memory(e, step, run.fitted.device_gib, distributed.gpu_pool_gib(),
                                *_gpu_and_topology()) from e
          raise
        dt = time.perf_counter() - t0
        interval_time, interval_steps = interval_time + dt, interval_steps + 1
        if step > start + 1:
          steady_time, steady_steps = steady_time + dt, steady_steps + 1
        bar.update()
        summary["step"] = step

        # -------------------------------------------------------------- eval, log, save
        do_eval = step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)
        if do_eval or step % cfg.log_every == 0 or step == start + 1:
          record = metrics_lib.make_record(step, m, skipped, seconds=interval_time,
                                           steps=interval_steps, **record_args)
          if hasattr(run.train_ds, "tokens_by_source"):  # a mixture's tokens per source
            record.update(run.train_ds.tokens_by_source(data_state))
          if step == start + 1:
            record.update(run.attention.record(), compiled_memory_gib=run.fitted.device_gib)
            if lead:
              _log.info(metrics_lib.memory_line(record))
          if do_eval and run.eval_ds is not None:
            record.update(evaluate.held_out(eval_step, state.params, run.eval_ds,
                                           cfg.eval_batches))
            if cfg.position_eval:
              by_position = position_eval(state.params, run.eval_ds, cfg.eval_batches)
              record.update({f"eval_loss_pos_{b['start']}_{b['end']}": b["loss"]
                             for b in by_position["buckets"]})
          if do_eval and ruler_probe:
            record.update(ruler_probe(position_eval, state.params))
          writer.write(record)
          interval_time, interval_steps = 0.0, 0
          if math.isfinite(record["loss"]):
            summary["first_loss"] = summary["first_loss"] or (step, record["loss"])
            summary["last_loss"] = (step, record["loss"])
          summary["last_record"] = record
          bar.set_postfix(loss=f"{record['loss']:.3f}",
                          tok_s=f"{record['tokens_per_sec']:,.0f}")
          if lead and bar.disable:
            _log.info(metrics_lib.format_record(record, cfg.steps))
          elif lead and "eval_loss" in record:  # the bar shows the rest
            bar.write(time.strftime("%H:%M:%S ") + metrics_lib.format_record(record, cfg.steps))
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
        ckpt.save(step, state, data_state, run_config=run_config, force=step == cfg.steps)
  finally:
    bar.close()
    writer.close()
    ckpt.close()  # waits for an async save in flight
  if cfg.export_at_end and lead and not summary["stopped"]:
    with _config_errors():
      summary["exported"] = export.export_checkpoint(workdir, cfg.export_at_end)

  # ---------------------------------------------------------------------------- summary
  summary.update(wall_time_s=time.perf_counter() - wall_start,
                 tokens_per_sec=(record_args["tokens"] * steady_steps / steady_time
                                 if steady_steps else None),
                 metrics=writer.path, tensorboard=writer.tensorboard_dir,
                 latest_checkpoint=ckpt.latest_step())
  if lead:
    print(metrics_lib.format_summary(summary), flush=True)
  return summary
