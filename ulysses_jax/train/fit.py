"""The train step in the GPU's memory: compile it before the first step and check it against
XLA's memory pool, compiling it again under memory pressure where that is what fits; and
XLA's out of memory at the first step as one error that names the sizes and the fixes.

Why compile twice. XLA's GPU scheduler and rematerialisation trade time for memory only when
their estimate of the step's peak exceeds a limit, 95 % of the pool by default
(``xla_gpu_memory_limit_slop_factor``). At the pool's edge the step compiled at that limit can
need more than the pool while the step compiled at a tenth of it fits (Llama-3.1-8B at 1M
tokens on 8 H100s, full remat, MLP untiled, group 4: 71.45 GiB as is, 70.43 under pressure,
71.20 the pool; ``ulysses-plan --verify``, benchmarks/RESULTS.md). ``ulysses-plan`` predicts the
smaller of the two, so the trainer runs the smaller where only it fits.
"""

import math
from typing import Callable, NamedTuple

import jax

from ulysses_jax.aot.report import UNDER_PRESSURE, UNDER_PRESSURE_XLA_FLAGS
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.metrics import compiled_memory_gib
from ulysses_jax.xla_log import xla_warnings_explained

class OutOfMemoryError(RuntimeError):
  """The first step ran out of device memory; the message says by how much and what to try."""


class Fitted(NamedTuple):
  """The step to run and what it needs per device."""
  step: Callable  # (state, batch) -> (state, metrics): the jitted step or an executable
  device_gib: float | None  # the program's device memory (None: not reported)
  as_compiled_gib: float | None  # the step compiled as usual (device_gib unless under_pressure)
  under_pressure: bool  # compiled with ``UNDER_PRESSURE`` because only that program fits


def compile_to_fit(step, state, batch, pool_gib: float | None, gpu: str,
                   topology: str) -> Fitted:
  """Compiles the jitted ``step`` for ``(state, batch)`` and checks it against XLA's memory pool
  of ``pool_gib`` per device (None, as on CPU: no check). Returns the jitted ``step`` itself
  where it fits (its first call finds the compiled program in JAX's cache); else the program
  compiled under memory pressure where that one fits; else raises ``ConfigError`` (bad input:
  the run does not fit), before the first step. ``gpu`` and ``topology`` go into the error's
  commands.

  Every process decides alone, so in a multi-process run ``pool_gib`` must be the same on each
  (``distributed.gpu_pool_gib(every_process=True)``): the same program compiles to the same
  size on each, and all run the same program."""
  lowered = step.lower(state, batch)
  with xla_warnings_explained():
    as_is = compiled_memory_gib(lowered.compile())
  if pool_gib is None or as_is is None or as_is <= pool_gib:
    return Fitted(step, as_is, as_is, False)
  with xla_warnings_explained(explain=False):  # the limit is low on purpose here
    pressed = lowered.compile(UNDER_PRESSURE)
  pressed_gib = compiled_memory_gib(pressed)
  if pressed_gib <= pool_gib:
    return Fitted(pressed, pressed_gib, as_is, True)
  raise ConfigError(
      f"the train step needs {as_is:.2f} GiB per device as compiled ({pressed_gib:.2f} compiled "
      f"under memory pressure) but XLA's memory pool holds {pool_gib:.2f} GiB per device; "
      f"nothing ran. {_fixes(gpu, topology, pressure_tried=True)}")


def fitted_line(fitted: Fitted, pool_gib: float) -> str:
  """The log line for a step compiled under memory pressure."""
  return (f"the train step compiled as usual needs {fitted.as_compiled_gib:.2f} GiB per device, "
          f"more than XLA's memory pool ({pool_gib:.2f} GiB); compiled again under memory "
          f"pressure ({UNDER_PRESSURE_XLA_FLAGS.lstrip('-')}) it needs "
          f"{fitted.device_gib:.2f} GiB, which fits: training runs that program (it recomputes "
          "more: a slower step)")


def is_out_of_memory(error: Exception) -> bool:
  """Whether ``error`` is XLA's out of memory (RESOURCE_EXHAUSTED)."""
  return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def out_of_memory(error: Exception, step: int, compiled_gib: float | None,
                  pool_gib: float | None, gpu: str, topology: str) -> OutOfMemoryError:
  """The ``OutOfMemoryError`` for XLA's out-of-memory ``error`` at ``step``: the first line of
  XLA's message, the compiled step's figure per device beside XLA's pool (None: unknown) and
  the fixes, each a setting or a command that checks one for the run's ``gpu`` (a key of
  ``ulysses_jax.gpus.GPUS``) and ``topology`` (aot's ``<slices>x<hosts>x<GPUs per host>``)."""
  sizes = "; ".join(f"{name} {value:.2f} GiB per device" for name, value in (
      ("the compiled step needs", compiled_gib), ("XLA's memory pool holds", pool_gib))
      if value is not None)
  xla = str(error).splitlines()[0]
  return OutOfMemoryError(f"step {step} ran out of device memory ({xla})"
                          f"{'; ' + sizes if sizes else ''}. "
                          f"{_fixes(gpu, topology, pressure_tried=False)}")


def _fixes(gpu: str, topology: str, pressure_tried: bool) -> str:
  """What to run or change when the step does not fit ``gpu``s in ``topology``
  (``pressure_tried``: the step compiled under memory pressure was over the pool too)."""
  pressure = "" if pressure_tried else (
      f"XLA_FLAGS={UNDER_PRESSURE_XLA_FLAGS} compiles the step under memory pressure (smaller, "
      "slower). ")
  return (
      f"{pressure}Without a GPU, ulysses-aot --gin_file=YOUR.gin --gpu={gpu} "
      f"--topology={topology} compiles this step and says whether it fits, and ulysses-plan "
      f"--model=YOUR.gin --gpu={gpu} --devices={math.prod(map(int, topology.split('x')))} "
      "--verify finds a layout that does. Or use less memory: a shorter DataConfig.seq_len, "
      "LlamaConfig.remat_policy=\"full_offload\", LlamaConfig.mlp_chunk=8192, "
      "TrainConfig.offload_optimizer=True.")
