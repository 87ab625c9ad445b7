"""A roofline prediction of one training step's time and MFU from the compiled GPU program.

A prediction, not a measurement: nothing has run, and nothing was autotuned. ``ASSUMPTIONS``
lists what it takes for granted; the figure is a lower bound on the step time of the program
as compiled (real kernels reach a fraction of peak) and an upper bound on MFU.
"""

from typing import NamedTuple

from ulysses_jax.aot.cost import Op
from ulysses_jax.gpus import Gpu

ASSUMPTIONS = (
    "every operation runs at the GPU's peak: max(FLOPs / dense bf16 tensor-core peak, "
    "bytes / HBM bandwidth), summed over the operations launched (no overlap between them)",
    "FLOPs: dots, cuBLAS GEMMs and our flash-attention kernels only (ulysses_jax.aot.cost)",
    "bytes: each operation's inputs and outputs, of a stacked buffer only the slice it reads "
    "or updates in place (ulysses_jax.aot.cost)",
    "collectives run after one another at the link's bandwidth per direction, per device, "
    "each sending what NCCL's ring algorithms send over a group of n: (n-1)/n of an "
    "all-gather's result or an all-to-all's, n-1 times a reduce-scatter's result, 2(n-1)/n of "
    "an all-reduce's; all-to-alls on NVLink (the seq axis stays in a node); all-gathers, "
    "reduce-scatters, all-reduces and ring permutes on InfiniBand when the cluster has "
    "several nodes, else NVLink",
    "host transfers (offloaded state read and written back, offloaded activations written and "
    "read) at PCIe bandwidth per direction, both directions at once",
    "compute, collectives and host transfers do not overlap (XLA overlaps some: a bound)",
    "MFU counts the model FLOPs 6 N + attention (ulysses_jax.metrics.flops_per_token) per "
    "token over the dense bf16 peak",
)


class Prediction(NamedTuple):
  """Seconds per step by part; ``mfu`` is the model FLOPs' share of the GPUs' peak."""
  compute_s: float
  collective_s: float
  host_s: float
  step_s: float
  mfu: float


def predict(gpu: Gpu, ops: list[Op], sent_bytes: dict[str, int], host_bytes: int,
            nodes: int, model_flops_per_step: float, num_devices: int) -> Prediction:
  """The prediction for one device (all devices run the same program).

  ``sent_bytes``: what each device sends per step, by collective kind
  (``hlo.executed_collective_bytes(..., sent=True)``); ``host_bytes``: per device, moved each
  way once per step; ``model_flops_per_step``: the whole step's model FLOPs over all
  devices."""
  compute = sum(op.count * max(op.flops / gpu.bf16_flops, op.bytes / gpu.memory_bandwidth)
                for op in ops)
  collective = link_seconds(gpu, sent_bytes, nodes)
  host = host_bytes / gpu.pcie_bandwidth
  step = compute + collective + host
  mfu = model_flops_per_step / (num_devices * gpu.bf16_flops * step) if step else 0.0
  return Prediction(compute, collective, host, step, mfu)


def link_seconds(gpu: Gpu, sent_bytes: dict[str, int], nodes: int) -> float:
  """Seconds the collectives take one after another (``ASSUMPTIONS``), from what each device
  sends by kind."""
  across = gpu.network_bandwidth if nodes > 1 else gpu.nvlink_bandwidth
  return sum(nbytes / (gpu.nvlink_bandwidth if kind == "all-to-all" else across)
             for kind, nbytes in sent_bytes.items())
