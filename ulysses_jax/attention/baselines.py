"""Context-parallel attention schemes we compare Ulysses against.

``allgather_kv_attention``: the Llama-3 / Megatron context-parallel scheme. Queries stay
sharded along the sequence; keys and values are all-gathered over ``seq`` so every device
attends its S/P queries to all S keys. Per-device traffic is about 2·B·S·Hkv·D elements:
it grows with S whatever P is, unlike Ulysses' O(S/P).

``ring_attention`` (defined in ``ring.py``, re-exported here): K/V rotate around the ring
with ``ppermute``; about 2·B·S·Hkv·D elements per device too, overlapped with compute.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.attention.common import pad_sequence, validate_inputs
from ulysses_jax.attention.ring import ring_attention  # noqa: F401  (re-exported)
from ulysses_jax.mesh import DATA, SEQ


def allgather_kv_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh,
                           causal: bool = True, segment_ids: jax.Array | None = None,
                           backend: Literal["auto", "xla"] = "auto",
                           scale: float | None = None) -> jax.Array:
  """Same contract as ``ulysses_attention``; only the ``"xla"`` local backend (``"auto"``)."""
  validate_inputs(q, k, v, mesh=mesh, segment_ids=segment_ids, scale=scale)
  if backend not in ("auto", "xla"):
    raise ValueError(f"allgather_kv_attention supports backend 'auto' or 'xla', got "
                     f"{backend!r}: its queries sit at a sequence offset, which only the XLA "
                     "attention takes.")
  return _allgather_kv_attention(q, k, v, segment_ids, mesh=mesh, causal=causal,
                                 scale=None if scale is None else float(scale))


@functools.partial(jax.jit, static_argnames=("mesh", "causal", "scale"))
def _allgather_kv_attention(q, k, v, segment_ids, *, mesh, causal, scale):
  s = q.shape[1]
  q, k, v, segment_ids = pad_sequence(mesh.shape[SEQ], q, k, v, segment_ids, causal=causal)

  def attend_local(q_BsHD, k_BsKD, v_BsKD, segment_ids_Bs):
    k_full, v_full = (lax.all_gather(x, SEQ, axis=1, tiled=True) for x in (k_BsKD, v_BsKD))
    local_len = q_BsHD.shape[1]
    q_positions = lax.axis_index(SEQ) * local_len + jnp.arange(local_len, dtype=jnp.int32)
    kv_segment_ids = (None if segment_ids_Bs is None else
                      lax.all_gather(segment_ids_Bs, SEQ, axis=1, tiled=True))
    return chunked_attention(q_BsHD, k_full, v_full, causal=causal,
                             q_segment_ids=segment_ids_Bs, kv_segment_ids=kv_segment_ids,
                             q_positions=q_positions, scale=scale)

  act = P(DATA, SEQ, None, None)
  seg_spec = None if segment_ids is None else P(DATA, SEQ)
  out = jax.shard_map(attend_local, mesh=mesh, in_specs=(act, act, act, seg_spec),
                      out_specs=act, check_vma=False)(q, k, v, segment_ids)
  return out[:, :s]
