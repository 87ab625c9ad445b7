"""What XLA's GPU compiler needs to know about each GPU of ``ulysses_jax.gpus.GPUS`` (the one
GPU table): a ``GpuTargetConfigProto`` in text form.

The text is rendered with only the fields jaxlib 0.10 and 0.11 both parse (XLA's current files
carry ``collective_memory_granularity``, which jaxlib 0.10.2 rejects).
"""

from ulysses_jax.gpus import Gpu


def target_config(gpu: Gpu) -> str:
  """``gpu`` as a ``stream_executor.GpuTargetConfigProto`` text, for ``get_topology_desc``."""
  major, minor = gpu.compute_capability
  feature = "ACCELERATED_FEATURES" if gpu.accelerated_features else "NONE"
  cudnn = dict(zip(("major", "minor", "patch"), gpu.cudnn_version))
  info = {
      "threads_per_block_limit": 1024, "threads_per_warp": 32,
      "shared_memory_per_block": 49152, "shared_memory_per_core": gpu.shared_memory_per_sm,
      "threads_per_core_limit": 2048, "core_count": gpu.sm_count,
      "fpus_per_core": gpu.fp32_lanes_per_sm, "block_dim_limit_x": 2**31 - 1,
      "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
      "memory_bandwidth": int(gpu.memory_bandwidth), "l2_cache_size": gpu.l2_bytes,
      "clock_rate_ghz": gpu.clock_ghz, "device_memory_size": gpu.memory_bytes,
      "shared_memory_per_block_optin": gpu.shared_memory_per_block_optin,
      "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
      "thread_dim_limit_x": 1024, "thread_dim_limit_y": 1024, "thread_dim_limit_z": 64,
  }
  lines = ["gpu_device_info {"]
  lines += [f"  {key}: {value}" for key, value in info.items()]
  lines += ["  cuda_compute_capability {", f"    major: {major}", f"    minor: {minor}",
            f"    feature_extension: {feature}", "  }",
            '  device_vendor: "NVIDIA Corporation"', f'  name: "{gpu.name}"', "}",
            'platform_name: "CUDA"', "dnn_version_info {"]
  lines += [f"  {key}: {value}" for key, value in cudnn.items()]
  lines += ["}", f'device_description_str: "{gpu.name}"']
  return "\n".join(lines) + "\n"
