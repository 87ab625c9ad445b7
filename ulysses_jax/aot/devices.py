"""Compile-only GPU devices: a GPU cluster that XLA compiles for, on any x86-64 Linux machine.

``gpu_devices("h100", "1x1x8")`` returns eight ``jax.Device`` objects of platform ``"gpu"``
that no program can run on but every program can be compiled for: ``make_mesh(seq=8,
devices=gpu_devices(...))`` gives a mesh whose ``jit(...).lower(...).compile()`` is the GPU
compiler's real output (SPMD partitioning, fusions, Triton kernels built to PTX, buffer
assignment), with no GPU attached. It needs JAX's CUDA plugin (``pip install -e
'.[gpu-compile]'``, or ``make gpu-compile-venv``) and a process whose JAX runs on the CPU: the
plugin cannot start a CUDA backend without a GPU, and JAX must not try (``gpu_devices`` sets
``jax_platforms="cpu"`` itself when JAX has not started yet).
"""

import functools
import importlib.util
import re

import jax
from jax.experimental import topologies

from ulysses_jax.aot.targets import target_config
from ulysses_jax.gpus import Gpu, gpu_named
from ulysses_jax.kernels import target as target_lib

_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_TOPOLOGY = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)x([1-9][0-9]*)$")
INSTALL_HINT = ("install JAX's CUDA plugin for this JAX version (no GPU or CUDA libraries "
                "needed): pip install -e '.[gpu-compile]', or `make gpu-compile-venv` and use "
                ".venv-gpu-compile/bin/python")


class AotError(ValueError):
  """A GPU, topology or process that cannot compile for GPUs (the message says how to fix)."""


def gpu_spec(name: str) -> Gpu:
  """The shipped description of GPU ``name`` (``ulysses_jax.gpus.GPUS``: ``"h100"``, ...)."""
  try:
    return gpu_named(name)
  except ValueError as e:
    raise AotError(str(e)) from e


def parse_topology(topology: str) -> tuple[int, int, int]:
  """``"<slices>x<hosts per slice>x<GPUs per host>"`` -> the three counts."""
  match = _TOPOLOGY.match(topology)
  if not match:
    raise AotError(f"malformed topology {topology!r}: expected '<slices>x<hosts per slice>x"
                   f"<GPUs per host>' with positive integers, e.g. '1x1x8' (one 8-GPU node) or "
                   f"'4x1x8' (four nodes).")
  return tuple(int(g) for g in match.groups())


def cuda_plugin_installed() -> bool:
  """Whether JAX's CUDA plugin (CUDA 12 or 13) is importable in this Python."""
  return any(importlib.util.find_spec(p.split(".")[0]) and importlib.util.find_spec(p)
             for p in _PLUGINS)


def _check_plugin():
  if not cuda_plugin_installed():
    raise AotError(f"compiling for GPUs needs JAX's CUDA plugin (one of the modules "
                   f"{', '.join(_PLUGINS)}), which this Python (jax {jax.__version__}) lacks: "
                   f"{INSTALL_HINT}.")


def gpu_devices(gpu: str = "h100", topology: str = "1x1x8") -> list[jax.Device]:
  """Compile-only devices of ``topology`` GPUs of kind ``gpu`` (see the module docstring).

  ``topology`` is ``"<slices>x<hosts per slice>x<GPUs per host>"``: ``"1x1x8"`` is one node of
  8 GPUs, ``"4x1x8"`` four such nodes. Returns slices x hosts x GPUs devices in the order
  ``make_mesh`` expects (the GPUs of one host adjacent, so ``seq`` stays within a node). The
  same arguments return the same device objects, so meshes built on them are equal.
  """
  spec = gpu_spec(gpu)
  parse_topology(topology)
  return list(_devices(spec, topology))


@functools.cache
def _devices(spec: Gpu, topology: str) -> tuple[jax.Device, ...]:
  _check_plugin()
  from jax._src import xla_bridge  # whether JAX started its backends: no public API says
  started = getattr(xla_bridge, "backends_are_initialized", lambda: True)()
  if not started and not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")
  try:
    description = topologies.get_topology_desc(platform="cuda", topology=topology,
                                               target_config=target_config(spec))
  except NotImplementedError as e:
    raise AotError(
        f"JAX in this process already started its backends (jax_platforms="
        f"{jax.config.jax_platforms!r}, running on {jax.default_backend()!r}) without its CUDA "
        f"plugin, which cannot load on a machine without a GPU unless JAX runs on the CPU: "
        f"set JAX_PLATFORMS=cpu in the environment, or call gpu_devices() before any other "
        f"JAX call, in a fresh process ({e}).") from e
  devices = tuple(description.devices)
  target_lib.of_device(devices[0])  # remember the kind's compute capability (kernel tiles)
  return devices
