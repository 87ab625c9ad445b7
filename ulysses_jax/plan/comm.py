"""The planner's communication terms: the bytes of each collective of one training step per
device, the group of devices it runs over, and so its links (NVLink or the network,
``plan.hardware``) and its seconds. ``plan.step`` decides what compute hides of them.

Per layer and head chunk (n chunks), T tokens per device before attention, S the sequence,
c bytes of the compute dtype, D the head dimension, Hq' and Hkv' one chunk's query and KV
heads as the all-to-all exchanges them (``plan_heads(Hq/n, Hkv/n, seq)``: padded, and KV
heads replicated where ``seq`` exceeds them), s the ring's steps from other devices
(``model.ring_steps``), result bytes (what the compiled program's collectives return):

  all-to-all over seq      (2·Hq' + 2·Hkv')·D·T·c per pass: q, k, v and the output forward,
                           their gradients backward (a device keeps 1/seq of it)
  ring, collective-permute K and V, 2·s·Hkv'·D·T·c, in every forward pass and again in the
                           backward, which also sends dK/dV, 2·(s + 1)·Hkv'·D·T·c (the last
                           hop home); in the natural layout the zigzag exchange moves q, k, v
                           and the output (their gradients backward) once per pass,
                           (2·Hq' + 2·Hkv')·D·T·c
  all-gather KV            (``Layout.attention="allgather_kv"``, the Llama 3 / Megatron
                           context-parallel baseline, ``attention.baselines``): K and V of the
                           whole sequence gathered over seq, 2·S·(Hkv/n)·D·c per forward pass;
                           the backward reduce-scatters dK/dV, 2·(S/seq)·(Hkv/n)·D·c
  FSDP (per step)          one all-gather of the layers' weights per forward pass and its
                           recompute, and of the other weights (embedding, head) once,
                           c·(2·L·layer_params + other), and a reduce-scatter of the
                           gradients, p·params/N (moved: (N - 1)/N of the whole), once per
                           micro-batch
  experts (``plan.moe``)   with the expert placement (``Model.expert_placement``) the experts
                           leave FSDP over every device: X/seq of them per device, FSDP over
                           data and ring (gathered and reduce-scattered there as above), and
                           each MoE layer's dispatch blocks go over seq by all-to-all, there and
                           back, 2·seq·T·min(k, X/seq)·E·c per pass (``moe.block_values``)

Groups: ``seq`` is the innermost mesh axis (consecutive devices), ``ring`` the next (devices
``seq`` apart), FSDP spans every device. Timing (``hardware.GroupLinks``): an all-to-all sends
each member's share over NVLink or the network, both at once; a ring, all-gather or
reduce-scatter moves at the network's rate when one of its hops crosses a domain.
"""

import collections
import dataclasses

from ulysses_jax.plan import moe
from ulysses_jax.plan.hardware import GroupLinks, Hardware, group_links
from ulysses_jax.plan.model import (DTYPE_BYTES, Layout, Model, attention_per_token,
                                    chunk_heads, ring_keeps_natural_layout, ring_steps, tokens)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One kind of collective of a step, per device: its bytes, group and seconds."""
  name: str            # "all_to_all", "ring", "allgather_kv", "fsdp_all_gather", ...
  kind: str            # the HLO op: "all-to-all", "collective-permute", "all-gather", ...
  axes: str            # the mesh axes it runs over
  result_bytes: float  # what the program's collectives return, per step
  moved_bytes: float   # of which went to other devices
  links: GroupLinks
  seconds: float

  def describe(self) -> dict:
    """JSON-ready: bytes, group, domain and the effective bandwidth (moved bytes / s)."""
    return {"name": self.name, "collective": self.kind, "axes": self.axes,
            "group": self.links.width, "domain": self.links.domain,
            "bytes": self.result_bytes, "moved_bytes": self.moved_bytes,
            "bandwidth_gb_s": (self.moved_bytes / self.seconds / 1e9 if self.seconds
                               else self.links.bandwidth() / 1e9),
            "seconds": self.seconds}


def layer_traffic(model: Model, layout: Layout, window: int | None, *, seq_len: int,
                  batch: int, dtype: str, forward_passes: int,
                  backward: bool = True) -> dict[str, float]:
  """Result bytes per device of one layer's attention collectives (all head chunks), by
  name (the module docstring's formulas): ``forward_passes`` forward computations (the
  forward and each recompute) and, with ``backward``, the backward."""
  c = DTYPE_BYTES[dtype]
  _, _, t = tokens(layout, batch, seq_len)
  heads = chunk_heads(model, layout)
  chunks, d = layout.attn_head_chunks, model.head_dim
  passes = forward_passes + backward
  if layout.attention == "allgather_kv":
    kv = 2 * (model.num_kv_heads // chunks) * d * c * chunks
    return {"allgather_kv": forward_passes * kv * seq_len * (batch // layout.data),
            "allgather_kv_grad": backward * kv * t}
  per_pass = chunks * attention_per_token(heads, d) * t * c
  traffic = {"all_to_all": passes * per_pass if layout.seq > 1 else 0.0}
  if layout.ring > 1:
    s = ring_steps(layout.ring, seq_len, window)
    kv_block = chunks * heads.exchanged_kv_heads * d * t * c  # K (or V) of every chunk
    exchange = 0 if ring_keeps_natural_layout(layout.ring, seq_len, window) else per_pass
    traffic["ring"] = (passes * (2 * s * kv_block + exchange)
                       + backward * 2 * (s + 1) * kv_block)
  return traffic


_KIND = {"all_to_all": "all-to-all", "ring": "collective-permute",
         "allgather_kv": "all-gather", "allgather_kv_grad": "reduce-scatter",
         "fsdp_all_gather": "all-gather", "fsdp_reduce_scatter": "reduce-scatter",
         "expert_all_to_all": "all-to-all", "expert_all_gather": "all-gather",
         "expert_reduce_scatter": "reduce-scatter"}


def step_collectives(model: Model, layout: Layout, hardware: Hardware, *, seq_len: int,
                     batch: int, dtype: str, param_dtype: str, accum_steps: int,
                     forward_passes: int) -> list[Collective]:
  """Every collective of one training step per device (absent ones left out), with its
  group's links and seconds; ``batch`` rows in ``accum_steps`` micro-batches."""
  c, p = DTYPE_BYTES[dtype], DTYPE_BYTES[param_dtype]
  n = layout.data * layout.seq * layout.ring
  result = {}
  for window, layers in collections.Counter(model.windows()).items():
    for name, nbytes in layer_traffic(model, layout, window, seq_len=seq_len,
                                      batch=batch // accum_steps, dtype=dtype,
                                      forward_passes=forward_passes).items():
      result[name] = result.get(name, 0.0) + layers * accum_steps * nbytes
  layers = model.num_layers * model.layer_params
  split = 0  # layer parameters split over seq (the experts, with the expert placement)
  _, _, t = tokens(layout, batch // accum_steps, seq_len)
  if model.moe_layers and moe.in_use(model, t, layout.seq, c) == "expert":
    split = model.num_layers * moe.split_params(model)
    result["expert_all_to_all"] = (accum_steps * model.moe_layers * (forward_passes + 1)
                                   * moe.block_values(model, t, layout.seq) * c)
    others = layout.data * layout.ring
    result["expert_all_gather"] = accum_steps * 2 * c * split / layout.seq
    result["expert_reduce_scatter"] = accum_steps * p * split / layout.seq / others
  result["fsdp_all_gather"] = accum_steps * c * (2 * (layers - split) + model.params - layers)
  result["fsdp_reduce_scatter"] = accum_steps * p * (model.params - split) / n
  seq_group = group_links(hardware, layout.seq, 1, n)
  others_group = group_links(hardware, layout.data * layout.ring, layout.seq, n)
  groups = {"all_to_all": ("seq", seq_group), "allgather_kv": ("seq", seq_group),
            "allgather_kv_grad": ("seq", seq_group), "expert_all_to_all": ("seq", seq_group),
            "expert_all_gather": ("data,ring", others_group),
            "expert_reduce_scatter": ("data,ring", others_group),
            "ring": ("ring", group_links(hardware, layout.ring, layout.seq, n)),
            "fsdp_all_gather": ("data,ring,seq", group_links(hardware, n, 1, n)),
            "fsdp_reduce_scatter": ("data,ring,seq", group_links(hardware, n, 1, n))}
  found = []
  for name, nbytes in result.items():
    axes, links = groups[name]
    if not nbytes or links.width == 1:
      continue
    w = links.width
    moved = {"all-to-all": nbytes * (w - 1) / w, "collective-permute": nbytes,
             "all-gather": nbytes * (w - 1) / w, "reduce-scatter": nbytes * (w - 1)}[_KIND[name]]
    seconds = (links.all_to_all_seconds(nbytes) if _KIND[name] == "all-to-all"
               else links.ring_seconds(moved))
    found.append(Collective(name, _KIND[name], axes, nbytes, moved, links, seconds))
  return found
