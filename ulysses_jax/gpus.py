"""The GPUs the project knows: one table that ``ulysses_jax.aot`` (the compiler's target), its
roofline and ``ulysses_jax.plan`` (the layout planner) all read. A leaf module: it imports
nothing of the package.

Sources. The device facts (SM count, shared memory and registers per SM, clock, memory size and
bandwidth, L2, compute capability) are those of XLA's published target descriptions
(openxla/xla ``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``, ``h200.txtpb``,
``a100_sxm_80.txtpb``, ``b200.txtpb``, ``gb200.txtpb``), which record what the CUDA driver
reports for each GPU.
Peak bfloat16 tensor-core rates and interconnect bandwidths are NVIDIA's datasheet figures
(H100/H200 SXM: 989 TFLOP/s dense, NVLink 4 at 450 GB/s per direction, PCIe 5 x16 at 64 GB/s
per direction; A100 SXM 80GB: 312 TFLOP/s, NVLink 3 at 300 GB/s, PCIe 4 x16 at 32 GB/s; HGX
B200: 2.25 PFLOP/s dense (4.5 with sparsity), NVLink 5 at 900 GB/s per direction (1.8 TB/s
both), PCIe 5 x16; GB200 NVL72: 2.5 PFLOP/s dense per GPU (NVIDIA's 360 PFLOP/s of sparse
FP16/BF16 per 72-GPU rack, halved), NVLink 5 at 900 GB/s per direction across the whole rack,
and NVLink-C2C to the Grace CPU at 900 GB/s both ways, shared by the two GPUs of a superchip:
225 GB/s per GPU per direction to host memory), and one 400 Gb/s (H100/H200/B200/GB200) or
200 Gb/s (A100) InfiniBand NIC per GPU as in NVIDIA's DGX systems. ``nvlink_domain`` is how
many GPUs one NVLink fabric joins: the 8 of an HGX/DGX board, the 72 of a GB200 NVL72 rack;
traffic between domains crosses the network at ``network_bandwidth``.
"""

import dataclasses

GB = 1e9
GIB = 2**30
# The share of each GPU's memory left to what runs outside XLA's program: the CUDA context and
# the kernels' modules (about 0.5-1 GiB), cuBLAS/cuDNN handles, and NCCL's communicators with
# their buffers, one set per group of devices that talk (a mesh has several: data, seq, ring,
# and the FSDP axes together). NCCL alone was measured at 1.6 GB for one communicator and about
# 6 GB for three or more (NVIDIA/nccl issue 864), and NVLink SHARP (NVLS) communicators take
# more still: NVIDIA's JAX containers turned NVLS off because creating them ran out of memory
# (NVIDIA/JAX-Toolbox pull request 383). A tenth of the GPU (7.9 GiB of an H100's 79.1, 14.1 of
# an H200's) covers those with some room for the allocator; JAX's own default keeps a quarter
# (it preallocates 75 %). The trainer hands XLA the rest (XLA_CLIENT_MEM_FRACTION), so the
# budget aot and the planner check against is the pool the real run gets.
RUNTIME_RESERVE_FRACTION = 0.10


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
  nvlink_domain: int          # GPUs one NVLink fabric joins (a node; a GB200 NVL72 rack)
  pcie_bandwidth: float       # host <-> device per direction, bytes/s
  cudnn_version: tuple[int, int, int]
  # What the runtime holds outside XLA's program, as a share of memory_bytes.
  runtime_reserve_fraction: float = RUNTIME_RESERVE_FRACTION

  @property
  def runtime_reserve_bytes(self) -> int:
    """Device bytes left to the CUDA context, the libraries and NCCL (not XLA's)."""
    return round(self.memory_bytes * self.runtime_reserve_fraction)

  @property
  def budget_bytes(self) -> int:
    """Device bytes a compiled step may use: the one budget ``aot``'s fit check and the
    planner both read (capacity minus the runtime reserve), and the pool XLA gets in a run."""
    return self.memory_bytes - self.runtime_reserve_bytes

  def with_reserve(self, reserve_gib: float | None) -> "Gpu":
    """This GPU with a runtime reserve of ``reserve_gib`` GiB (None: unchanged); a
    ``ValueError`` unless it leaves some of the memory to XLA."""
    if reserve_gib is None:
      return self
    if not 0 <= reserve_gib * GIB < self.memory_bytes:
      raise ValueError(f"the runtime reserve must be at least 0 and below the GPU's "
                       f"{self.memory_bytes / GIB:.2f} GiB, got {reserve_gib:g} GiB")
    return dataclasses.replace(self, runtime_reserve_fraction=reserve_gib * GIB
                               / self.memory_bytes)


_H100 = Gpu(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0),
            accelerated_features=True, sm_count=132, fp32_lanes_per_sm=128,
            shared_memory_per_sm=233472, shared_memory_per_block_optin=232448,
            clock_ghz=1.98, memory_bytes=84942979072, memory_bandwidth=3.35232e12,
            l2_bytes=52428800, bf16_flops=989.4e12, nvlink_bandwidth=450 * GB,
            network_bandwidth=50 * GB, nvlink_domain=8, pcie_bandwidth=64 * GB,
            cudnn_version=(9, 10, 0))

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
                network_bandwidth=25 * GB, nvlink_domain=8, pcie_bandwidth=32 * GB,
                cudnn_version=(8, 9, 4)),
    "b200": Gpu(name="NVIDIA B200", compute_capability=(10, 0), accelerated_features=True,
                sm_count=148, fp32_lanes_per_sm=128, shared_memory_per_sm=233472,
                shared_memory_per_block_optin=232448, clock_ghz=1.965,
                memory_bytes=191514411008, memory_bandwidth=7.67232e12, l2_bytes=132644864,
                bf16_flops=2250e12, nvlink_bandwidth=900 * GB, network_bandwidth=50 * GB,
                nvlink_domain=8, pcie_bandwidth=64 * GB, cudnn_version=(9, 10, 0)),
    # One GPU of a GB200 NVL72 rack (XLA's gb200.txtpb): 72 GPUs share one NVLink domain.
    "gb200": Gpu(name="NVIDIA GB200", compute_capability=(10, 0), accelerated_features=True,
                 sm_count=152, fp32_lanes_per_sm=128, shared_memory_per_sm=233472,
                 shared_memory_per_block_optin=232448, clock_ghz=2.062,
                 memory_bytes=197897748480, memory_bandwidth=7.928064e12, l2_bytes=135528448,
                 bf16_flops=2500e12, nvlink_bandwidth=900 * GB, network_bandwidth=50 * GB,
                 nvlink_domain=72, pcie_bandwidth=225 * GB, cudnn_version=(9, 10, 0)),
}


def gpu_named(name: str) -> Gpu:
  """The table's GPU ``name`` (``"h100"``, ...); a ``ValueError`` naming the choices if none."""
  if name not in GPUS:
    raise ValueError(f"unknown GPU {name!r}: expected one of {sorted(GPUS)}; pick the closest "
                     "of these (they are the GPUs ulysses_jax ships descriptions for).")
  return GPUS[name]


def gpu_of_kind(device_kind: str) -> Gpu | None:
  """The table's GPU a device reporting ``device_kind`` is, or None: its name, or the start of
  it (a real H200 reports "NVIDIA H200", the compile-only devices the longer name). Other
  variants of a chip (H100 PCIe or NVL: other clocks and peaks) are not in the table."""
  return next((gpu for gpu in GPUS.values()
               if gpu.name == device_kind or gpu.name.startswith(device_kind + " ")), None)
