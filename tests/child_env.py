"""The environment of a Python process a test starts (a command line, a docs snippet)."""

import importlib.metadata
import os

OLDER_CPU_FUSION_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _cpu_compile_flags() -> str:
  """XLA's flags for compiling the tests' programs faster on a machine without a GPU, which
  conftest.py sets and a child process profits from as much:

  - no LLVM optimisation passes on the CPU (~1.6x less compile time);
  - before jax 0.11, XLA's older CPU fusion code generators instead of its MLIR fusion emitters
    (jax 0.10.2, one process, quick tests of test_three_steps_match_single_device and
    test_logits_match_reference: 49 -> 26 s, 2026-11-28; newer XLA has only the emitters and
    rejects the flag);
  - from jax 0.12, no autotuning of GPU programs compiled for compile-only devices, which
    cannot time the candidate GEMM configurations: XLA compiled them all and kept the same
    program (identical HLO and memory: Llama-3.2-1B at 64K and Llama-3.1-8B at 512K on one
    H100, 2026-11-28) in about twice the time (1B: 19.0 -> 11.5 s; the slow gpu_compile tests
    965 -> 739 s). Not for jax 0.11.2, whose default configuration fails on a small GEMM
    ("No supported config found", the 1B decode step's float32 [8, 2, 2048] o projection), and
    not in ``ulysses_jax.aot`` for users, whose JAX may be such a version."""
  flags = ["--xla_backend_optimization_level=0"]
  jaxlib = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
  if jaxlib < (0, 11):
    flags.append(OLDER_CPU_FUSION_FLAG)
  if jaxlib >= (0, 12):
    flags.append("--xla_gpu_autotune_level=0")
  return " ".join(flags)


CPU_COMPILE_FLAGS = _cpu_compile_flags()


def older_cpu_fusion() -> bool:
  """Whether this process compiles with XLA's older CPU fusion code generators (jax 0.10's tests):
  they round the same computation differently in two programs (a forward and its recompute in
  a backward), where the MLIR emitters give the same bits."""
  return OLDER_CPU_FUSION_FLAG in os.environ.get("XLA_FLAGS", "").split()


def child_env(**overrides: str) -> dict:
  """This process's environment for a child on the CPU, with XLA's flags less the virtual device
  count: the child sets its own (the commands' --cpu_devices, or ``devices`` XLA_FLAGS)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), **overrides}


def user_env(devices: int = 8) -> dict:
  """A bare user's shell running a docs snippet on ``devices`` virtual CPU devices."""
  return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {CPU_COMPILE_FLAGS}",
          "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
