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

The variants (H100 PCIe, A100 SXM4 40GB, A100 80GB PCIe) take their device facts from XLA's
``h100_pcie.txtpb``, ``a100_sxm_40.txtpb`` and ``a100_pcie_80.txtpb`` in the same folder; those
XLA has no file for (H100 NVL, H800, GH200 480GB) are the H100 SXM's chip with the datasheet's
memory (its capacity in GB, not a driver's reading), bandwidths and peak: NVIDIA H100 datasheet
(H100 PCIe: 1,513 TFLOP/s bf16 with sparsity, 2 TB/s, an NVLink bridge of 600 GB/s joining two
GPUs, PCIe 5; H100 NVL: 1,671 TFLOP/s with sparsity, 94 GB at 3.9 TB/s, NVLink bridge 600 GB/s),
NVIDIA H800 SXM5 product brief (the H100 SXM with NVLink at 400 GB/s both ways), NVIDIA GH200
Grace Hopper Superchip datasheet (GH200 480GB: 96 GB HBM3 at 4 TB/s, NVLink-C2C to the Grace CPU
at 900 GB/s both ways), NVIDIA A100 datasheet (A100 80GB PCIe: 312 TFLOP/s, NVLink bridge
600 GB/s for two GPUs, PCIe 4). Dense rates are the datasheets' sparse ones halved.

``reported_names``: what drivers call the GPU of a row besides its ``name`` (``nvidia-smi``,
``jax.devices()[0].device_kind``); ``gpu_of_kind`` finds a device's row by them, or the nearest
row by compute capability and memory for a GPU not in the table.
"""

import dataclasses
import math

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
  reported_names: tuple[str, ...] = ()  # other device kinds drivers report for this GPU

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

_A100 = Gpu(name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0),
            accelerated_features=False, sm_count=108, fp32_lanes_per_sm=64,
            shared_memory_per_sm=167936, shared_memory_per_block_optin=166912,
            clock_ghz=1.41, memory_bytes=85100068864, memory_bandwidth=2.03904e12,
            l2_bytes=41943040, bf16_flops=312e12, nvlink_bandwidth=300 * GB,
            network_bandwidth=25 * GB, nvlink_domain=8, pcie_bandwidth=32 * GB,
            cudnn_version=(8, 9, 4))

GPUS = {
    "h100": _H100,
    # XLA's h100_pcie.txtpb: 114 SMs at 1.755 GHz, 2.04 TB/s; NVLink bridges join pairs.
    "h100_pcie": dataclasses.replace(_H100, name="NVIDIA H100 PCIe", sm_count=114,
                                     clock_ghz=1.755, memory_bandwidth=2.03904e12,
                                     bf16_flops=756.5e12, nvlink_bandwidth=300 * GB,
                                     nvlink_domain=2),
    "h100_nvl": dataclasses.replace(_H100, name="NVIDIA H100 NVL", memory_bytes=94 * 10**9,
                                    memory_bandwidth=3.9e12, bf16_flops=835.5e12,
                                    nvlink_bandwidth=300 * GB, nvlink_domain=2),
    "h800": dataclasses.replace(_H100, name="NVIDIA H800", nvlink_bandwidth=200 * GB),
    # The same Hopper chip as the H100 SXM, with 141 GB of faster HBM3e.
    "h200": dataclasses.replace(_H100, name="NVIDIA H200 141GB HBM3e",
                                memory_bytes=151397597184, memory_bandwidth=4.8e12,
                                reported_names=("NVIDIA H200",)),
    # One superchip per node: the Grace CPU's memory over NVLink-C2C, other nodes over the network.
    "gh200": dataclasses.replace(_H100, name="NVIDIA GH200 480GB", memory_bytes=96 * 10**9,
                                 memory_bandwidth=4.0e12, nvlink_domain=1,
                                 pcie_bandwidth=450 * GB),
    "a100": _A100,
    # XLA's a100_sxm_40.txtpb.
    "a100_40gb": dataclasses.replace(_A100, name="NVIDIA A100-SXM4-40GB",
                                     memory_bytes=42331013120, memory_bandwidth=1.5552e12),
    # XLA's a100_pcie_80.txtpb (which calls it "A100 80GB"); NVLink bridges join pairs.
    "a100_pcie": dataclasses.replace(_A100, name="NVIDIA A100 80GB PCIe", clock_ghz=1.1105,
                                     memory_bytes=79050250240, memory_bandwidth=2.039e12,
                                     nvlink_domain=2),
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


def _normalized(kind: str) -> str:
  kind = " ".join(kind.split()).casefold()
  return kind.removeprefix("nvidia ")


def gpu_of_kind(device_kind: str, compute_capability: tuple[int, int] | None = None,
                memory_bytes: int | None = None) -> tuple[str, Gpu, str]:
  """The table's row of a GPU by the name its driver reports (``jax.devices()[0].device_kind``,
  ``nvidia-smi``): ``(key, row, assumed)``, ``assumed`` "" when the name is the row's. For a GPU
  not in the table, the nearest row by compute capability, then by memory (of those given),
  and ``assumed`` a sentence saying which row's values stand in for the GPU's."""
  wanted = _normalized(device_kind)
  for key, gpu in GPUS.items():
    if wanted in {_normalized(n) for n in (gpu.name, *gpu.reported_names)}:
      return key, gpu, ""

  def distance(item):
    gpu = item[1]
    capability = (0 if compute_capability is None else
                  abs(10 * (gpu.compute_capability[0] - compute_capability[0])
                      + gpu.compute_capability[1] - compute_capability[1]))
    memory = 0 if not memory_bytes else abs(math.log(gpu.memory_bytes / memory_bytes))
    return capability, memory

  key, gpu = min(GPUS.items(), key=distance)
  by = [what for what, given in (("compute capability", compute_capability),
                                 ("memory", memory_bytes)) if given]
  return key, gpu, (f"{device_kind!r} is not in ulysses_jax.gpus: assumed the values of "
                    f"{key!r} ({gpu.name}, nearest by {' and '.join(by) or 'nothing known'}): "
                    f"{gpu.bf16_flops / 1e12:g} TFLOP/s bf16, {gpu.memory_bandwidth / 1e12:.2f} "
                    f"TB/s, {gpu.memory_bytes / GIB:.1f} GiB")
