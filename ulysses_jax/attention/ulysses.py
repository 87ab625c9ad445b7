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
end; the padding is masked out.

Hybrid (USP, arXiv 2405.07719): on a mesh with a ``ring`` axis of size R > 1 the sequence is
sharded over (``ring``, ``seq``). The all-to-alls run over ``seq`` only, so each device then
holds H/P heads of its ring position's S/R tokens, and ``ring.attend_shard`` completes the
attention by rotating K/V over ``ring``. Heads need only divide (after ``plan_heads``) by P,
not P·R, and only the K/V ring crosses the slower ``ring`` links. With R = 1 this is plain
Ulysses; with P = 1 plain ring attention.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ulysses_jax.attention import backends
from ulysses_jax.mesh import DATA, RING, SEQ, ring_size, sequence_axes

# Segment id given to sequence padding; real segment ids are >= 0, so padding never mixes
# with real tokens (pad queries see only pad keys, so they stay finite).
PAD_SEGMENT = -1


def seq_to_heads(x_BsHD, axis_name=SEQ):
  """All-to-all inside ``shard_map``: local ``[B, S/P, H, D]`` -> ``[B, S, H/P, D]``.

  Device ``i`` receives head block ``i`` from every device and concatenates the sequence
  chunks in device order, so the sequence comes back in its global order.
  """
  return lax.all_to_all(x_BsHD, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BShD, axis_name=SEQ):
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


def _gather_heads(plan, out_BSHD):
  b, s, _, d = out_BSHD.shape
  out = out_BSHD.reshape(b, s, plan.padded_kv_heads, plan.padded_groups, d)
  return out[:, :, :plan.kv_heads, :plan.groups].reshape(b, s, plan.kv_heads * plan.groups, d)


def validate_inputs(q, k, v, *, mesh, segment_ids, scale):
  """Raises a ValueError naming expected vs actual values before any work is done."""
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
                     "with ulysses_jax.make_mesh(data=..., seq=...).")
  missing = [a for a in (DATA, SEQ) if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}; build the mesh with "
                     "ulysses_jax.make_mesh(data=..., seq=...).")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape "
                       f"{tuple(x.shape)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {x.dtype}.")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                     f"{tuple(v.shape)}.")
  b, s, hq, d = q.shape
  if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
    raise ValueError(f"k/v [batch, seq, _, head_dim] must match q's ({b}, {s}, _, {d}), got "
                     f"{tuple(k.shape)}.")
  hkv = k.shape[2]
  if hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}): each "
                     "key/value head serves Hq/Hkv query heads.")
  data = mesh.shape[DATA]
  if b % data:
    raise ValueError(f"batch ({b}) must be divisible by the mesh's data axis ({data}); change "
                     "the batch size or build the mesh with a data size that divides it.")
  if segment_ids is not None:
    if tuple(segment_ids.shape) != (b, s):
      raise ValueError(f"segment_ids must have shape [batch, seq] = ({b}, {s}), got "
                       f"{tuple(segment_ids.shape)}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}.")
  if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
    raise ValueError(f"scale must be a positive number or None (1/sqrt(head_dim)), got {scale!r}.")


def pad_sequence(seq_shards, q, k, v, segment_ids, *, causal):
  """Pads the sequence axis to a multiple of ``seq_shards``; returns padded arrays and segments.

  With a causal mask the padding (at the end) is invisible to real queries already; otherwise
  segment ids are created or extended with ``PAD_SEGMENT`` to mask it.
  """
  s = q.shape[1]
  pad = -s % seq_shards
  if not pad:
    return q, k, v, segment_ids
  q, k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
  if segment_ids is None and not causal:
    segment_ids = jnp.zeros(q.shape[:1] + (s,), jnp.int32)
  if segment_ids is not None:
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, pad)],
                          constant_values=PAD_SEGMENT)
  return q, k, v, segment_ids


def ulysses_attention(q, k, v, *, mesh, causal=True, segment_ids=None, backend="auto",
                      scale=None, layout="natural"):
  """Exact attention over a sequence sharded on the mesh's ``seq`` axis.

  Args:
    q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]`` with Hq % Hkv == 0. Sharded ``(data, seq)``
      or not; any S, Hq and Hkv (see ``plan_heads`` for the cost of awkward head counts).
    mesh: a mesh with axes ``("data", "seq")``, or ``("data", "ring", "seq")`` for the hybrid
      (``ulysses_jax.make_mesh``).
    causal: causal mask over global positions.
    segment_ids: int ``[B, S]`` (>= 0), or None; tokens attend only within their segment.
      Segments may cross shard boundaries.
    backend: local attention, one of ``backends.BACKENDS``; the hybrid takes all but
      ``"cudnn"`` and ``"pallas_mosaic"`` (``ring.resolve_backend``).
    scale: score scale, default ``1/sqrt(D)``.
    layout: the hybrid's sequence order, ``"natural"`` or ``"zigzag"`` (``ring.to_zigzag``
      with ``ring_size=mesh.shape["ring"]``); see ``ulysses_jax.attention.ring``. Without a
      ``ring`` axis both orders coincide.

  Returns:
    ``[B, S, Hq, D]`` in q's dtype, sharded ``(data, seq)`` (``(data, (ring, seq))``) when the
    shard count divides S.
  """
  # ring.py builds on this module (validation, padding), hence the late import.
  from ulysses_jax.attention import ring
  validate_inputs(q, k, v, mesh=mesh, segment_ids=segment_ids, scale=scale)
  ring.check_layout(layout, q.shape[1], ring_size(mesh), mesh.shape[SEQ])
  resolve = ring.resolve_backend if ring_size(mesh) > 1 else backends.resolve_backend
  backend = resolve(backend, dtype=q.dtype, head_dim=q.shape[3],
                    segment_ids_given=segment_ids is not None)
  return _ulysses_attention(q, k, v, segment_ids, mesh=mesh, causal=causal, backend=backend,
                            scale=None if scale is None else float(scale), layout=layout)


@functools.partial(jax.jit, static_argnames=("mesh", "causal", "backend", "scale", "layout"))
def _ulysses_attention(q, k, v, segment_ids, *, mesh, causal, backend, scale, layout):
  from ulysses_jax.attention import ring
  b, s, hq, d = q.shape
  seq_shards, ring_shards = mesh.shape[SEQ], ring_size(mesh)
  plan = plan_heads(hq, k.shape[2], seq_shards)
  q, k, v = _spread_heads(plan, q, k, v)
  if ring_shards == 1:
    q, k, v, segment_ids = pad_sequence(seq_shards, q, k, v, segment_ids, causal=causal)
  elif layout == "natural":
    # padded_length(s, .) >= s is the next multiple of itself: pads to exactly that length.
    q, k, v, segment_ids = pad_sequence(ring.padded_length(s, ring_shards, seq_shards), q, k,
                                        v, segment_ids, causal=causal)

  def attend_local(q_BsHD, k_BsKD, v_BsKD, segment_ids_Bs):
    q, k, v = (seq_to_heads(x) for x in (q_BsHD, k_BsKD, v_BsKD))
    # Segment ids are [B, S/P] ints, D*H times smaller than q: gathering them is cheap.
    full_segment_ids = (None if segment_ids_Bs is None else
                        lax.all_gather(segment_ids_Bs, SEQ, axis=1, tiled=True))
    if ring_shards == 1:
      out = backends.local_attention(backend, q, k, v, causal=causal,
                                     segment_ids=full_segment_ids, scale=scale)
    else:  # This ring position's S/R tokens: K/V rotate over the ring axis.
      out = ring.attend_shard(q, k, v, full_segment_ids, axis_name=RING,
                              ring_size=ring_shards, causal=causal, scale=scale, layout=layout,
                              backend=backend)
    return heads_to_seq(out)

  seq_axes = SEQ if ring_shards == 1 else sequence_axes(mesh)
  act = P(DATA, seq_axes, None, None)
  seg_spec = None if segment_ids is None else P(DATA, seq_axes)
  # check_vma=False: the local backends carry loop state built from unvarying constants.
  out = jax.shard_map(attend_local, mesh=mesh, in_specs=(act, act, act, seg_spec),
                      out_specs=act, check_vma=False)(q, k, v, segment_ids)
  return _gather_heads(plan, out[:, :s])

