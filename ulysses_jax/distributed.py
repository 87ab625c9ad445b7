"""Multi-process start-up: platform settings, then ``jax.distributed.initialize``.

One process per host (CPU) or per GPU. The processes find each other either through
explicit flags (``coordinator_address``, ``num_processes``, ``process_id``: what
``scripts/launch_local.sh`` passes) or through the environment of a cluster launcher, which
``jax.distributed.initialize`` reads itself: SLURM under ``srun`` (one task per GPU, as in
``scripts/launch_slurm.sh``) or Open MPI's ``mpirun``. A single process needs none of this.

Everything here must run before JAX starts its backends (before the first array or
``jax.devices()`` call).
"""

import importlib.metadata
import math
import os
import pkgutil
import re

import jax
import numpy as np
from jax.experimental import multihost_utils

from ulysses_jax.gpus import RUNTIME_RESERVE_FRACTION

PLATFORMS = ("cpu", "gpu", "cuda", "tpu")
# JAX's GPU plugins are modules jax_plugins.xla_cuda12, xla_cuda13, xla_rocm7, ...: the backend
# each registers is in its name. (JAX reads jax_platforms="gpu" as "cuda and rocm": on a machine
# with one of them, the other fails to start.)
_GPU_PLUGIN = re.compile(r"^(?:jax_plugins\.)?xla_(cuda|rocm)[0-9]*$")
NO_GPU_FIX = ("run on a machine whose GPUs nvidia-smi lists, with JAX's plugin for them (pip "
              "install 'jax[cuda13]'), or choose the CPU: --platform cpu "
              "(TrainConfig.platform = \"cpu\")")
# JAX's GPU client preallocates this share of each GPU for XLA (both names are read; the second
# is the older one, and setting both is an error).
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _launcher_size() -> int:
  """How many processes the environment's launcher started (1 when none is detected)."""
  for var in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
    if os.environ.get(var, "").isdigit():
      return int(os.environ[var])
  return 1


def configure_platform(platform: str = "", cpu_devices: int = 0, compilation_cache: str = ""):
  """Selects the JAX platform, the number of virtual CPU devices and the compile cache.

  Args:
    platform: "" (JAX's default: GPU if present), or one of ``PLATFORMS`` ("gpu": the GPU
      backend installed, ``resolve_platform``).
    cpu_devices: virtual CPU devices per process (0: JAX's default, one), so that a laptop
      can run a multi-device mesh.
    compilation_cache: a directory for JAX's persistent compilation cache ("" = off).

  If JAX already started (a notebook, a test session), nothing can change any more: the
  settings are checked against what is running instead, with a clear error on a mismatch.
  """
  if platform and platform not in PLATFORMS:
    raise ValueError(f"unknown platform {platform!r}; choose one of {PLATFORMS} or '' for "
                     "JAX's default")
  if platform:
    jax.config.update("jax_platforms", resolve_platform(platform))
  if platform not in ("cpu", "tpu"):
    reserve_gpu_memory()
  if cpu_devices:
    try:
      jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError:
      pass  # backends already up: checked in check_platform
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if compilation_cache:
    jax.config.update("jax_compilation_cache_dir", compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def gpu_plugins() -> dict[str, str]:
  """JAX's GPU plugins installed here, read from their packages without starting JAX:
  backend ("cuda", "rocm") -> the package that provides it (e.g. "jax-cuda12-pjrt 0.10.2")."""
  modules = {e.value: e.dist and f"{e.dist.name} {e.dist.version}"
             for e in importlib.metadata.entry_points(group="jax_plugins")}
  try:
    import jax_plugins  # pylint: disable=import-outside-toplevel  # a namespace package
    modules.update({f"jax_plugins.{m.name}": None for m in pkgutil.iter_modules(
        jax_plugins.__path__) if f"jax_plugins.{m.name}" not in modules})
  except ImportError:
    pass
  found = {}
  for module, package in sorted(modules.items()):
    match = _GPU_PLUGIN.match(module)
    if match:
      found.setdefault(match.group(1), package or module)
  return found


def resolve_platform(platform: str) -> str:
  """The ``jax_platforms`` value of ``platform``: "gpu" is the GPU backend whose plugin is
  installed ("cuda" or "rocm"; JAX's own choice among them when both are), the rest as they
  are. Raises ``RuntimeError`` (before JAX starts) for "gpu" without a GPU plugin."""
  if platform != "gpu":
    return platform
  plugins = gpu_plugins()
  if not plugins:
    raise RuntimeError(f"the config asks for platform 'gpu' but JAX {jax.__version__} has no "
                       f"GPU plugin here (no package provides jax_plugins.xla_cuda* or "
                       f"xla_rocm*); {NO_GPU_FIX}")
  return next(iter(plugins)) if len(plugins) == 1 else ""


def reserve_gpu_memory() -> None:
  """Gives XLA the budget ``ulysses_jax.aot`` and the planner check against: each GPU's memory
  less ``RUNTIME_RESERVE_FRACTION`` for the CUDA context, the libraries and NCCL (JAX's
  default leaves a quarter). A fraction the user set stays. Call before JAX's GPU backend
  starts (``configure_platform`` does)."""
  if not any(os.environ.get(var) for var in MEM_FRACTION_VARS):
    os.environ[MEM_FRACTION_VARS[0]] = f"{1 - RUNTIME_RESERVE_FRACTION:.2f}"


def gpu_pool_gib(every_process: bool = False) -> float | None:
  """The smallest of XLA's memory pools on this process' devices, GiB (None: a device does not
  report one, as on CPU). ``every_process``: the smallest on any process' devices, the same
  figure everywhere, so that decisions made from it agree (a collective: every process must
  call it)."""
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
  smallest = math.nan if None in limits else min(limits) / 2**30
  if every_process and jax.process_count() > 1:
    # NaN (a process without a figure) wins: np.min propagates it.
    smallest = float(np.min(multihost_utils.process_allgather(np.float64(smallest))))
  return None if math.isnan(smallest) else smallest


def gpu_memory_line() -> str:
  """What XLA's pool on the first local GPU is and where its size came from (for the log)."""
  pool = gpu_pool_gib()
  var = next((v for v in MEM_FRACTION_VARS if os.environ.get(v)), None)
  setting = f"{var}={os.environ[var]}" if var else "JAX's default fraction, 0.75"
  budget = 1 - RUNTIME_RESERVE_FRACTION
  note = ("the rest is left to the CUDA context, the libraries and NCCL, as aot's budget "
          "assumes" if float(os.environ[var] if var else 0.75) <= budget + 1e-9 else
          f"above the {budget:.0%} aot's budget assumes: the CUDA context, the libraries and "
          f"NCCL may not find the memory they need")
  size = "unknown" if pool is None else f"{pool:.2f} GiB"
  return f"XLA's memory pool per GPU: {size} ({setting}; {note})"


def check_platform(platform: str = "", cpu_devices: int = 0):
  """Raises if the running backend differs from what ``configure_platform`` asked for (a GPU
  asked for where JAX found none: what it found, and the fix)."""
  wanted = {"cuda": "gpu"}.get(platform, platform)
  try:
    backend = jax.default_backend()
  except (RuntimeError, AssertionError) as e:  # JAX 0.10 asserts when no platform started
    if wanted != "gpu":
      raise
    raise RuntimeError(_no_gpu(platform, str(e) or "no GPU device")) from e
  if wanted == "gpu" and backend != "gpu":
    raise RuntimeError(_no_gpu(platform, f"only {backend!r} devices"))
  if platform and backend != wanted:
    raise RuntimeError(f"the config asks for platform {platform!r} but JAX runs on "
                       f"{backend!r}: JAX started before the setting could apply, or no "
                       f"{platform} device is visible")
  if cpu_devices and backend == "cpu" and jax.local_device_count() != cpu_devices:
    raise RuntimeError(
        f"the config asks for {cpu_devices} CPU devices per process but JAX already started "
        f"with {jax.local_device_count()}; start a fresh process (python -m "
        f"ulysses_jax.train) or set XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{cpu_devices} before JAX is imported")


def _no_gpu(platform: str, found: str) -> str:
  plugins = gpu_plugins()
  installed = ", ".join(f"{b} ({p})" for b, p in plugins.items()) or "none"
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  hidden = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
  return (f"the config asks for platform {platform!r} but JAX {jax.__version__} found no GPU "
          f"(its GPU plugins: {installed}{hidden}; JAX: {found}); {NO_GPU_FIX}")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Joins the processes of a multi-process run; returns whether there are several.

  With no arguments, initializes only when a launcher (SLURM ``srun``, ``mpirun``) started
  more than one process, and lets JAX read the rest from its environment. Explicit
  arguments must come together.
  """
  given = [a is not None for a in (coordinator_address, num_processes, process_id)]
  if any(given) and not all(given):
    raise ValueError("multi-process flags come together: give --coordinator_address, "
                     "--num_processes and --process_id (or none, to detect a SLURM/MPI "
                     "launcher)")
  if all(given):
    if not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} must be in [0, --num_processes="
                       f"{num_processes})")
    if num_processes == 1:
      return False
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True
  if _launcher_size() > 1:
    jax.distributed.initialize()
    return jax.process_count() > 1
  return False
