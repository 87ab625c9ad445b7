"""The hardware the planner's time and memory model assumes (``plan.model``): a GPU of the
table (``ulysses_jax.gpus``) at the share of its datasheet peaks a step reaches."""

import dataclasses

from ulysses_jax.gpus import Gpu, gpu_named

_GB = 1e9

# The share of a GPU's datasheet peaks (``ulysses_jax.gpus``) the time model assumes is reached:
# about 40 % of the dense bf16 peak, two thirds of NVLink's per-direction rate for all-to-alls,
# 90 % of InfiniBand's and of HBM's, 40 % of PCIe's for host transfers of pinned memory (on
# an H100: 396 TFLOP/s, 300, 45 and 25.6 GB/s, 3.0 TB/s).
_ACHIEVED = {"flops": 0.4, "nvlink": 2 / 3, "network": 0.9, "hbm": 0.9, "pcie": 0.4}


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Per-device memory budget and achieved speeds (bytes, per second); ``Hardware.of``
  derives them from the GPU table."""
  budget_bytes: float          # device bytes a step may use (``Gpu.budget_bytes``)
  host_bytes: float            # host bytes per device
  intra_node: int              # devices per node
  intra_bw: float              # per device, all-to-all inside a node (NVLink)
  inter_bw: float              # per device across nodes
  hbm_bw: float
  flops: float                 # achieved dense bf16 FLOP/s
  pcie_bw: float               # per device, device <-> pinned host

  @classmethod
  def of(cls, gpu: Gpu | str = "h100", *, intra_node: int = 8,
         host_gb_per_gpu: float = 256.0) -> "Hardware":
    """``gpu`` (a table entry or its name) in nodes of ``intra_node``, with that much host
    memory (GB) per GPU."""
    gpu = gpu_named(gpu) if isinstance(gpu, str) else gpu
    return cls(budget_bytes=gpu.budget_bytes, host_bytes=host_gb_per_gpu * _GB,
               intra_node=intra_node, intra_bw=gpu.nvlink_bandwidth * _ACHIEVED["nvlink"],
               inter_bw=gpu.network_bandwidth * _ACHIEVED["network"],
               hbm_bw=gpu.memory_bandwidth * _ACHIEVED["hbm"],
               flops=gpu.bf16_flops * _ACHIEVED["flops"],
               pcie_bw=gpu.pcie_bandwidth * _ACHIEVED["pcie"])
