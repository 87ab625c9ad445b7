"""Compile the real GPU program on any machine: compile-only GPU devices (``gpu_devices``), the
GPUs described (``GPUS``), and ``python -m ulysses_jax.aot``, which compiles the train step of a
config for a GPU cluster and reports its memory, collectives, kernels and predicted speed."""

from ulysses_jax.aot.devices import (AotError, cuda_plugin_installed, gpu_devices, gpu_spec,
                                     parse_topology)
from ulysses_jax.gpus import GPUS, Gpu

__all__ = ["AotError", "GPUS", "Gpu", "cuda_plugin_installed", "gpu_devices", "gpu_spec",
           "parse_topology"]
