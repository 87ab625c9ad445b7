"""The GPUs the project knows: one table that ``ulysses_jax.aot`` (the compiler's target), its
roofline and ``ulysses_jax.plan`` (the layout planner) all read. A leaf module: it imports
nothing of the package.

Sources. The device facts (SM count, shared memory and registers per SM, clock, memory size and
bandwidth, L2, compute capability) are those of XLA's published target descriptions
(openxla/xla ``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``, ``h200.txtpb``,
``a100_sxm_80.txtpb``, ``b200.txtpb``), which record what the CUDA driver reports for each GPU.
Peak bfloat16 tensor-core rates and interconnect bandwidths are NVIDIA's datasheet figures
(H100/H200 SXM: 989 TFLOP/s dense, NVLink 4 at 450 GB/s per direction, PCIe 5 x16 at 64 GB/s
per direction; A100 SXM 80GB: 312 TFLOP/s, NVLink 3 at 300 GB/s, PCIe 4 x16 at 32 GB/s; HGX
B200: 2.25 PFLOP/s dense (4.5 with sparsity), NVLink 5 at 900 GB/s per direction (1.8 TB/s
both), PCIe 5 x16), and one 400 Gb/s (H100/H200/B200) or 200 Gb/s (A100) InfiniBand NIC per
GPU as in NVIDIA's DGX systems.
"""

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU model: compiler-facing device facts and peak rates (bytes, per second)."""
  name: str                  # the device kind the compile-only devices report
  compute_capability: tuple[int, int]
  accelerated_features: bool  # sm_90a / sm_100a (wgmma, TMA) rather than sm_90 / sm_100
  sm_count: int
  fp32_lanes_per_sm: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  clock_ghz: float
  memory_bytes: int           # what the driver reports
  memory_bandwidth: float     # HBM, bytes/s
  l2_bytes: int
  bf16_flops: float           # dense tensor-core peak, FLOP/s
  nvlink_bandwidth: float     # per GPU per direction, bytes/s
  network_bandwidth: float    # per GPU per direction across nodes (InfiniBand), bytes/s
  pcie_bandwidth: float       # host <-> device per direction, bytes/s
  cudnn_version: tuple[int, int, int]
  # What the runtime holds outside XLA's program (CUDA context, library workspaces, NCCL
  # buffers). 0 for now: a step fits when its compiled bytes fit the whole capacity.
  runtime_reserve_bytes: int = 0

  @property
  def budget_bytes(self) -> int:
    """Device bytes a compiled step may use: the one budget ``aot``'s fit check and the
    planner both read (capacity minus the runtime reserve)."""
    return self.memory_bytes - self.runtime_reserve_bytes


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
    "b200": Gpu(name="NVIDIA B200", compute_capability=(10, 0), accelerated_features=True,
                sm_count=148, fp32_lanes_per_sm=128, shared_memory_per_sm=233472,
                shared_memory_per_block_optin=232448, clock_ghz=1.965,
                memory_bytes=191514411008, memory_bandwidth=7.67232e12, l2_bytes=132644864,
                bf16_flops=2250e12, nvlink_bandwidth=900 * GB, network_bandwidth=50 * GB,
                pcie_bandwidth=64 * GB, cudnn_version=(9, 10, 0)),
}


def gpu_named(name: str) -> Gpu:
  """The table's GPU ``name`` (``"h100"``, ...); a ``ValueError`` naming the choices if none."""
  if name not in GPUS:
    raise ValueError(f"unknown GPU {name!r}: expected one of {sorted(GPUS)}; pick the closest "
                     "of these (they are the GPUs ulysses_jax ships descriptions for).")
  return GPUS[name]
