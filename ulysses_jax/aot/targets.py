"""The GPUs ``ulysses_jax.aot`` compiles for: what XLA's GPU compiler needs to know about each
(a ``GpuTargetConfigProto`` in text form) and the peak rates the roofline uses.

Sources. The device facts (SM count, shared memory and registers per SM, clock, memory size and
bandwidth, L2, compute capability) are those of XLA's published target descriptions
(openxla/xla ``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``, ``h200.txtpb``,
``a100_sxm_80.txtpb``), which record what the CUDA driver reports for each GPU. Peak bfloat16
tensor-core rates and interconnect bandwidths are NVIDIA's datasheet figures (H100/H200 SXM:
989 TFLOP/s dense, NVLink 4 at 450 GB/s per direction, PCIe 5 x16 at 64 GB/s per direction;
A100 SXM 80GB: 312 TFLOP/s, NVLink 3 at 300 GB/s, PCIe 4 x16 at 32 GB/s), and one 400 Gb/s
(H100/H200) or 200 Gb/s (A100) InfiniBand NIC per GPU as in NVIDIA's DGX systems.

The text is rendered with only the fields jaxlib 0.10 and 0.11 both parse (XLA's current files
carry ``collective_memory_granularity``, which jaxlib 0.10.2 rejects).
"""

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU model: compiler-facing device facts and roofline peak rates (bytes, per second)."""
  name: str                  # the device kind the compile-only devices report
  compute_capability: tuple[int, int]
  accelerated_features: bool  # sm_90a (wgmma, TMA) rather than sm_90
  sm_count: int
  fp32_lanes_per_sm: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  clock_ghz: float
  memory_bytes: int           # what the driver reports; XLA budgets a fraction of it
  memory_bandwidth: float     # HBM, bytes/s
  l2_bytes: int
  bf16_flops: float           # dense tensor-core peak, FLOP/s
  nvlink_bandwidth: float     # per GPU per direction, bytes/s
  network_bandwidth: float    # per GPU per direction across nodes (InfiniBand), bytes/s
  pcie_bandwidth: float       # host <-> device per direction, bytes/s
  cudnn_version: tuple[int, int, int]


_H100 = Gpu(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0),
            accelerated_features=True, sm_count=132, fp32_lanes_per_sm=128,
            shared_memory_per_sm=233472, shared_memory_per_block_optin=232448,
            clock_ghz=1.98, memory_bytes=84942979072, memory_bandwidth=3.35232e12,
            l2_bytes=52428800, bf16_flops=989.4e12, nvlink_bandwidth=450 * GB,
            network_bandwidth=50 * GB, pcie_bandwidth=64 * GB, cudnn_version=(9, 10, 0))

GPUS = {
    "h100": _H100,
    # The same Hopper chip as the H100 SXM, with 141 GB of faster HBM3e.
    "h200": dataclasses.replace(_H100, name="NVIDIA H200 141GB HBM3e",
                                memory_bytes=151397597184, memory_bandwidth=4.8e12),
    "a100": Gpu(name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0),
                accelerated_features=False, sm_count=108, fp32_lanes_per_sm=64,
                shared_memory_per_sm=167936, shared_memory_per_block_optin=166912,
                clock_ghz=1.41, memory_bytes=85100068864, memory_bandwidth=2.03904e12,
                l2_bytes=41943040, bf16_flops=312e12, nvlink_bandwidth=300 * GB,
                network_bandwidth=25 * GB, pcie_bandwidth=32 * GB, cudnn_version=(8, 9, 4)),
}


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
