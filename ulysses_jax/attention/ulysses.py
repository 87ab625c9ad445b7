"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses, arXiv 2309.14509).

Activations arrive sharded along the sequence over the mesh axis ``seq`` (P devices). One
all-to-all turns "all heads, S/P tokens" into "H/P heads, all S tokens"; each device then runs
exact attention over the full sequence for its heads; a second all-to-all turns the result
back. Per device each all-to-all moves O(B·S·H·D/P) elements, constant when S and P grow
together.

Heads that P does not divide are handled by ``plan_heads``: key/value heads are replicated
the minimum number of times, and only if no replication works are query (and key/value)
heads padded with zero heads, whose outputs are dropped. Padding costs compute and traffic
in proportion to the padded head count. Sequences that P does not divide are padded at the
end; the padding is masked out. Attention sinks (one logit per query head) follow their query
heads through the same plan (zero for padded heads), and each device receives those of its
H/P heads.

This module is plain Ulysses and knows nothing of ring attention. ``all_to_all_attention`` is
the exchange around any per-device attention; ``ulysses_attention`` here runs it with a local
backend on a ``("data", "seq")`` mesh. The hybrid (``hybrid.py``) passes ring attention as the
per-device attention; it imports this module, never the reverse, so the public
``ulysses_jax.ulysses_attention``, which takes every mesh, lives there.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ulysses_jax.attention import backends
from ulysses_jax.attention.common import Layout, pad_sequence, validate_inputs
from ulysses_jax.mesh import DATA, SEQ, ring_size, sequence_axes

# attend(q_BShD, k_BSkD, v_BSkD, segment_ids_BS or None, sinks_h or None) -> out_BShD, run
# inside shard_map; sinks_h are the sinks of the device's query heads.
LocalAttention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None],
                          jax.Array]


def seq_to_heads(x_BsHD: jax.Array, axis_name: str = SEQ) -> jax.Array:
  """All-to-all inside ``shard_map``: local ``[B, S/P, H, D]`` -> ``[B, S, H/P, D]``.

  Device ``i`` receives head block ``i`` from every device and concatenates the sequence
  chunks in device order, so the sequence comes back in its global order.
  """
  return lax.all_to_all(x_BsHD, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BShD: jax.Array, axis_name: str = SEQ) -> jax.Array:
  """The inverse all-to-all: local ``[B, S, H/P, D]`` -> ``[B, S/P, H, D]``."""
  return lax.all_to_all(x_BShD, axis_name, split_axis=1, concat_axis=2, tiled=True)


@dataclasses.dataclass(frozen=True)
class HeadPlan:
  """How heads are reshaped so that P divides them.

  Query heads are viewed as ``[kv_heads, groups]`` (head ``h`` = kv head ``h // groups``).
  Both factors are zero-padded (to ``padded_kv_heads`` and ``padded_groups``), then every
  key/value head is repeated ``kv_repeat`` times. The exchanged shapes have
  ``padded_kv_heads * padded_groups`` query heads and ``padded_kv_heads * kv_repeat``
  key/value heads, both divisible by P, and each device's query heads use only its own
  key/value heads.
  """
  kv_heads: int
  groups: int
  padded_kv_heads: int
  padded_groups: int
  kv_repeat: int

  @property
  def exchanged_q_heads(self):
    return self.padded_kv_heads * self.padded_groups

  @property
  def exchanged_kv_heads(self):
    return self.padded_kv_heads * self.kv_repeat


def plan_heads(q_heads: int, kv_heads: int, seq_shards: int) -> HeadPlan:
  """Cheapest layout: fewest query heads after padding (compute), then fewest KV heads (traffic)."""
  groups = q_heads // kv_heads
  best = None
  for padded_kv in range(kv_heads, kv_heads + seq_shards):
    for padded_groups in range(groups, groups + seq_shards):
      if (padded_kv * padded_groups) % seq_shards:
        continue
      for repeat in range(1, padded_groups + 1):
        if padded_groups % repeat == 0 and (padded_kv * repeat) % seq_shards == 0:
          cost = (padded_kv * padded_groups, padded_kv * repeat)
          if best is None or cost < best[0]:
            best = (cost, HeadPlan(kv_heads, groups, padded_kv, padded_groups, repeat))
          break
  return best[1]


def _spread_heads(plan, q_BSHD, k_BSKD, v_BSKD):
  b, s, _, d = q_BSHD.shape
  q = q_BSHD.reshape(b, s, plan.kv_heads, plan.groups, d)
  q = jnp.pad(q, [(0, 0), (0, 0), (0, plan.padded_kv_heads - plan.kv_heads),
                  (0, plan.padded_groups - plan.groups), (0, 0)])
  q = q.reshape(b, s, plan.exchanged_q_heads, d)
  kv_pad = [(0, 0), (0, 0), (0, plan.padded_kv_heads - plan.kv_heads), (0, 0)]
  k, v = (jnp.repeat(jnp.pad(x, kv_pad), plan.kv_repeat, axis=2) for x in (k_BSKD, v_BSKD))
  return q, k, v


def _spread_sinks(plan, sinks_H):
  """Sinks ``[Hq]`` laid out like ``_spread_heads``' query heads (zero for padded heads,
  whose outputs are dropped): ``[exchanged_q_heads]``, or None."""
  if sinks_H is None:
    return None
  sinks = sinks_H.reshape(plan.kv_heads, plan.groups)
  sinks = jnp.pad(sinks, [(0, plan.padded_kv_heads - plan.kv_heads),
                          (0, plan.padded_groups - plan.groups)])
  return sinks.reshape(plan.exchanged_q_heads)


def _gather_heads(plan, out_BSHD):
  b, s, _, d = out_BSHD.shape
  out = out_BSHD.reshape(b, s, plan.padded_kv_heads, plan.padded_groups, d)
  return out[:, :, :plan.kv_heads, :plan.groups].reshape(b, s, plan.kv_heads * plan.groups, d)


def all_to_all_attention(attend: LocalAttention, q_BSHD: jax.Array, k_BSKD: jax.Array,
                         v_BSKD: jax.Array, segment_ids_BS: jax.Array | None, *, mesh: Mesh,
                         causal: bool, seq_multiple: int,
                         sinks_H: jax.Array | None = None) -> jax.Array:
  """The Ulysses exchange around a per-device attention ``attend``; call it under ``jit``.

  q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``, segment_ids ``[B, S]`` or None, inputs already
  validated. Heads are laid out by ``plan_heads``, the sequence is padded to a multiple of
  ``seq_multiple`` (masked; S' tokens) and sharded ``(data, sequence_axes(mesh))``. With R
  the size of the sequence axes other than ``seq`` (1 on a plain mesh) and H the planned
  head count, per device inside ``shard_map``:

    q, k, v  ``[B/data, S'/(R·P), H, D]`` -- seq_to_heads -> ``[B/data, S'/R, H/P, D]``
    segment_ids  ``[B/data, S'/(R·P)]`` -- all_gather over seq -> ``[B/data, S'/R]``
    sinks ``[H]`` (or None) -- sharded over seq -> ``[H/P]``: those of the device's heads
    ``attend(q, k, v, segment_ids, sinks)`` -> ``[B/data, S'/R, H/P, D]``
    -- heads_to_seq -> ``[B/data, S'/(R·P), H, D]``

  ``seq_multiple`` must make S' divisible by R·P. Returns ``[B, S, Hq, D]``.
  """
  s = q_BSHD.shape[1]
  plan = plan_heads(q_BSHD.shape[2], k_BSKD.shape[2], mesh.shape[SEQ])
  q, k, v = _spread_heads(plan, q_BSHD, k_BSKD, v_BSKD)
  q, k, v, segment_ids = pad_sequence(seq_multiple, q, k, v, segment_ids_BS, causal=causal)

  def exchange(q_BsHD, k_BsKD, v_BsKD, segment_ids_Bs, sinks_h):
    q, k, v = (seq_to_heads(x) for x in (q_BsHD, k_BsKD, v_BsKD))
    # Segment ids are [B, S/P] ints, D*H times smaller than q: gathering them is cheap.
    full_segment_ids = (None if segment_ids_Bs is None else
                        lax.all_gather(segment_ids_Bs, SEQ, axis=1, tiled=True))
    return heads_to_seq(attend(q, k, v, full_segment_ids, sinks_h))

  act = P(DATA, sequence_axes(mesh), None, None)
  seg_spec = None if segment_ids is None else P(DATA, sequence_axes(mesh))
  # seq_to_heads gives device i of the seq axis the i-th block of heads: so do the sinks.
  sinks_spec = None if sinks_H is None else P(SEQ)
  # check_vma=False: the local backends carry loop state built from unvarying constants.
  out = jax.shard_map(exchange, mesh=mesh, in_specs=(act, act, act, seg_spec, sinks_spec),
                      out_specs=act, check_vma=False)(q, k, v, segment_ids,
                                                      _spread_sinks(plan, sinks_H))
  return _gather_heads(plan, out[:, :s])


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh,
                      causal: bool = True, segment_ids: jax.Array | None = None,
                      backend: str = "auto", scale: float | None = None,
                      layout: Layout = "natural", sliding_window: int | None = None,
                      sinks: jax.Array | None = None) -> jax.Array:
  """Plain Ulysses: exact attention over a sequence sharded on the mesh's ``seq`` axis.

  ``ulysses_jax.ulysses_attention`` (``hybrid.py``) takes the same arguments, and meshes with
  a ``ring`` axis too; this one raises for those.

  Args:
    q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]`` with Hq % Hkv == 0. Sharded ``(data, seq)``
      or not; any S, Hq and Hkv (see ``plan_heads`` for the cost of awkward head counts).
    mesh: a mesh with axes ``("data", "seq")`` (``ulysses_jax.make_mesh``).
    causal: causal mask over global positions.
    segment_ids: int ``[B, S]`` or None (any ids above ``common.MIN_SEGMENT_ID``, negative
      ones included); tokens attend only within their segment.
      Segments may cross shard boundaries.
    backend: local attention, one of ``backends.BACKENDS``.
    scale: score scale, default ``1/sqrt(D)``.
    layout: ``"natural"`` or ``"zigzag"``; without a ring the two orders coincide.
    sliding_window: None, or W >= 1 with ``causal`` (transformers' definition): the query at
      global position p sees the keys at p' with ``0 <= p - p' < W`` (itself and the W - 1
      before it), within its segment. Blocks outside the window are not computed.
    sinks: None, or float ``[Hq]``: one learnable logit per query head in every row's softmax,
      with no value (gpt-oss; ``ulysses_jax.kernels.variants``); differentiable.

  Returns:
    ``[B, S, Hq, D]`` in q's dtype, sharded ``(data, seq)`` when P divides S.
  """
  validate_inputs(q, k, v, mesh=mesh, segment_ids=segment_ids, scale=scale, layout=layout,
                  sinks=sinks)
  if ring_size(mesh) > 1:
    raise ValueError(
        f"ulysses_jax.attention.ulysses.ulysses_attention is plain Ulysses and takes no ring, "
        f"got a mesh with ring={ring_size(mesh)}; call ulysses_jax.ulysses_attention "
        "(ulysses_jax.attention.hybrid), which adds ring attention over the ring axis.")
  backend = backends.resolve_backend(backend, dtype=q.dtype, head_dim=q.shape[3],
                                     num_q_heads=q.shape[2], num_kv_heads=k.shape[2],
                                     causal=causal, segment_ids_given=segment_ids is not None,
                                     mesh=mesh, sliding_window=sliding_window,
                                     sinks_given=sinks is not None)
  return _ulysses_attention(q, k, v, segment_ids, sinks, mesh=mesh, causal=causal,
                            backend=backend, scale=None if scale is None else float(scale),
                            sliding_window=sliding_window)


@functools.partial(jax.jit,
                   static_argnames=("mesh", "causal", "backend", "scale", "sliding_window"))
def _ulysses_attention(q, k, v, segment_ids, sinks, *, mesh, causal, backend, scale,
                       sliding_window):
  attend = lambda q, k, v, segment_ids, sinks: backends.local_attention(
      backend, q, k, v, causal=causal, segment_ids=segment_ids, scale=scale,
      sliding_window=sliding_window, sinks=sinks)
  return all_to_all_attention(attend, q, k, v, segment_ids, mesh=mesh, causal=causal,
                              seq_multiple=mesh.shape[SEQ], sinks_H=sinks)
