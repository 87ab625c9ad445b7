"""The environment of a Python process a test starts (a command line, a docs snippet)."""

import os

# conftest.py's compile flag for the CPU (XLA without LLVM's optimisation passes), which a
# child process compiling small programs profits from as much as the tests do.
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0"


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
