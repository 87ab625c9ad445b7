"""The cluster the planner's time model runs on: each device's memory budget and achieved
speeds (``Hardware``), and which links a collective over a group of devices uses
(``group_links``).

Devices are numbered as ``make_mesh`` lays them out (``seq`` innermost, then ``ring``, then
``data``) and fill NVLink domains of ``Hardware.intra_node`` devices in order: devices
``[0, intra_node)`` share one domain, the next ``intra_node`` the next one. A group of devices
talks over NVLink when all its members share a domain; otherwise each member's bytes to
members of other domains cross the network, at ``inter_bw`` per device (one NIC per GPU).
"""

import collections
import dataclasses
import functools

from ulysses_jax.gpus import GB, Gpu, gpu_named

NVLINK, NETWORK = "NVLink", "network"

# The share of a GPU's datasheet peaks (``ulysses_jax.gpus``) the time model assumes is reached:
# about 40 % of the dense bf16 peak, two thirds of NVLink's per-direction rate for all-to-alls,
# 90 % of InfiniBand's and of HBM's, 40 % of PCIe's for host transfers of pinned memory (on
# an H100: 396 TFLOP/s, 300, 45 and 25.6 GB/s, 3.0 TB/s).
ACHIEVED = {"flops": 0.4, "nvlink": 2 / 3, "network": 0.9, "hbm": 0.9, "pcie": 0.4}


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Per-device memory budget and achieved speeds (bytes, per second); ``Hardware.of``
  derives them from the GPU table."""
  budget_bytes: float          # device bytes a step may use (``Gpu.budget_bytes``)
  host_bytes: float            # host bytes per device
  intra_node: int              # devices per NVLink domain (a node; a GB200 NVL72 rack)
  intra_bw: float              # per device, inside an NVLink domain
  inter_bw: float              # per device, across domains (the network)
  hbm_bw: float
  flops: float                 # achieved dense bf16 FLOP/s
  pcie_bw: float               # per device, device <-> pinned host

  @classmethod
  def of(cls, gpu: Gpu | str = "h100", *, intra_node: int | None = None,
         host_gb_per_gpu: float = 256.0, network_gb_s: float | None = None) -> "Hardware":
    """``gpu`` (a table entry or its name) in NVLink domains of ``intra_node`` devices
    (default: the GPU's, ``Gpu.nvlink_domain``), with that much host memory (GB) per GPU
    and ``network_gb_s`` GB/s of network per GPU per direction (default: the GPU's)."""
    gpu = gpu_named(gpu) if isinstance(gpu, str) else gpu
    intra_node = gpu.nvlink_domain if intra_node is None else intra_node
    network = gpu.network_bandwidth if network_gb_s is None else network_gb_s * GB
    if intra_node < 1 or network <= 0:
      raise ValueError(f"devices per NVLink domain must be >= 1 and the network bandwidth "
                       f"> 0, got {intra_node} and {network / GB:g} GB/s.")
    return cls(budget_bytes=gpu.budget_bytes, host_bytes=host_gb_per_gpu * GB,
               intra_node=intra_node, intra_bw=gpu.nvlink_bandwidth * ACHIEVED["nvlink"],
               inter_bw=network * ACHIEVED["network"],
               hbm_bw=gpu.memory_bandwidth * ACHIEVED["hbm"],
               flops=gpu.bf16_flops * ACHIEVED["flops"],
               pcie_bw=gpu.pcie_bandwidth * ACHIEVED["pcie"])


@functools.cache
def fewest_peers_in_domain(width: int, stride: int, devices: int, intra_node: int) -> int:
  """The fewest members of one group that share an NVLink domain with a given member (itself
  included), over every member of every group of ``width`` devices ``stride`` apart that
  tile ``devices`` (a ``seq`` group: stride 1; a ``ring`` group: stride ``seq``; FSDP over
  all devices: width ``devices``). ``width`` means the group stays inside a domain."""
  fewest = width
  for block in range(0, devices, width * stride):
    for offset in range(stride):
      domains = collections.Counter((block + offset + i * stride) // intra_node
                                    for i in range(width))
      fewest = min(fewest, min(domains.values()))
  return fewest


@dataclasses.dataclass(frozen=True)
class GroupLinks:
  """Where a collective over one group runs: its width, how many of its members share each
  member's domain (at least), and the two bandwidths."""
  width: int
  peers_in_domain: int
  intra_bw: float
  inter_bw: float

  @property
  def domain(self) -> str:
    """``"NVLink"`` when every member shares one domain, else ``"network"``."""
    return NVLINK if self.peers_in_domain == self.width else NETWORK

  def all_to_all_seconds(self, result_bytes: float) -> float:
    """An all-to-all whose result holds ``result_bytes`` per device: the 1/width part a
    device keeps stays, the parts for its domain's members go over NVLink, the rest over
    the network, both at once."""
    w, d = self.width, self.peers_in_domain
    return max(result_bytes * (d - 1) / w / self.intra_bw,
               result_bytes * (w - d) / w / self.inter_bw)

  def ring_seconds(self, moved_bytes: float) -> float:
    """A ring's transfers (point-to-point hops, an all-gather's or reduce-scatter's steps):
    every hop waits for the slowest, the network's when some hop crosses a domain."""
    return moved_bytes / (self.intra_bw if self.domain == NVLINK else self.inter_bw)

  def bandwidth(self) -> float:
    """Bytes per second per device at which a ring over this group moves data."""
    return self.intra_bw if self.domain == NVLINK else self.inter_bw


def group_links(hardware: Hardware, width: int, stride: int, devices: int) -> GroupLinks:
  """The links of the groups of ``width`` devices ``stride`` apart among ``devices``."""
  peers = fewest_peers_in_domain(width, stride, devices, hardware.intra_node)
  return GroupLinks(width, peers, hardware.intra_bw, hardware.inter_bw)
