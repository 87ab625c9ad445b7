"""``ulysses_attention`` for every mesh: plain Ulysses, or Ulysses around ring attention.

Hybrid (USP, arXiv 2405.07719): on a mesh with a ``ring`` axis of size R > 1 the sequence is
sharded over (``ring``, ``seq``). The all-to-alls (``ulysses.all_to_all_attention``) run over
``seq`` only, so each device then holds H/P heads of its ring position's S/R tokens, and
``ring.attend_shard`` completes the attention by rotating K/V over ``ring``. Heads need only
divide (after ``plan_heads``) by P, not P·R, and only the K/V ring crosses the slower
``ring`` links. With R = 1 this is plain Ulysses (``ulysses.ulysses_attention``); with P = 1
plain ring attention. Sinks reach each device with its heads (``all_to_all_attention``) and
the ring applies them once, after merging its steps.

This module sits on top of ``ulysses.py`` and ``ring.py``, which do not know of each other or
of it; ``ulysses_jax.ulysses_attention`` is the function defined here.
"""

import functools

import jax
from jax.sharding import Mesh

from ulysses_jax.attention import ring, ulysses, zigzag
from ulysses_jax.attention.common import Layout, validate_inputs
from ulysses_jax.mesh import RING, SEQ, ring_size


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh,
                      causal: bool = True, segment_ids: jax.Array | None = None,
                      backend: str = "auto", scale: float | None = None,
                      layout: Layout = "natural", sliding_window: int | None = None,
                      sinks: jax.Array | None = None) -> jax.Array:
  """Exact attention over a sequence sharded on the mesh's ``seq`` (and ``ring``) axes.

  Args:
    q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]`` with Hq % Hkv == 0. Sharded ``(data, seq)``
      or not; any S, Hq and Hkv (see ``ulysses.plan_heads`` for the cost of awkward head
      counts).
    mesh: a mesh with axes ``("data", "seq")``, or ``("data", "ring", "seq")`` for the hybrid
      (``ulysses_jax.make_mesh``).
    causal: causal mask over global positions.
    segment_ids: int ``[B, S]`` or None (any ids above ``common.MIN_SEGMENT_ID``, negative
      ones included); tokens attend only within their segment.
      Segments may cross shard boundaries.
    backend: local attention, one of ``backends.BACKENDS``; the hybrid takes all but
      ``"cudnn"`` (``ring.resolve_backend``).
    scale: score scale, default ``1/sqrt(D)``.
    layout: the hybrid's sequence order, ``"natural"`` or ``"zigzag"`` (``zigzag.to_zigzag``
      with ``ring_size=mesh.shape["ring"]``); see ``ulysses_jax.attention.ring``. Without a
      ``ring`` axis both orders coincide.
    sliding_window: None, or W >= 1 with ``causal`` (transformers' definition): the query at
      global position p sees the keys at p' with ``0 <= p - p' < W`` (itself and the W - 1
      before it), within its segment.
    sinks: None, or float ``[Hq]``: one learnable logit per query head in every row's softmax,
      with no value (gpt-oss; ``ulysses_jax.kernels.variants``); differentiable. Every backend
      but ``"cudnn"`` takes them.

  Returns:
    ``[B, S, Hq, D]`` in q's dtype, sharded ``(data, seq)`` (``(data, (ring, seq))``) when the
    shard count divides S.
  """
  args = dict(mesh=mesh, segment_ids=segment_ids, scale=scale, layout=layout, sinks=sinks)
  if not (isinstance(mesh, Mesh) and ring_size(mesh) > 1):  # plain meshes, and bad ones
    return ulysses.ulysses_attention(q, k, v, causal=causal, backend=backend,
                                     sliding_window=sliding_window, **args)
  validate_inputs(q, k, v, **args)
  zigzag.check_layout(layout, q.shape[1], ring_size(mesh), mesh.shape[SEQ])
  padded = (zigzag.padded_length(q.shape[1], ring_size(mesh), mesh.shape[SEQ])
            if layout == "natural" else q.shape[1])
  backend = ring.resolve_backend(backend, dtype=q.dtype, head_dim=q.shape[3],
                                 num_q_heads=q.shape[2], num_kv_heads=k.shape[2], causal=causal,
                                 segment_ids_given=segment_ids is not None, mesh=mesh,
                                 sliding_window=sliding_window, layout=layout,
                                 local_len=padded // ring_size(mesh),
                                 sinks_given=sinks is not None)
  return _hybrid_attention(q, k, v, segment_ids, sinks, mesh=mesh, causal=causal,
                           backend=backend,
                           scale=None if scale is None else float(scale), layout=layout,
                           sliding_window=sliding_window)


@functools.partial(jax.jit, static_argnames=("mesh", "causal", "backend", "scale", "layout",
                                             "sliding_window"))
def _hybrid_attention(q, k, v, segment_ids, sinks, *, mesh, causal, backend, scale, layout,
                      sliding_window):
  ring_shards, seq_shards = ring_size(mesh), mesh.shape[SEQ]
  # The natural layout pads to the ring's length (its own next multiple); zigzag inputs
  # already have it (zigzag.check_layout).
  seq_multiple = (zigzag.padded_length(q.shape[1], ring_shards, seq_shards)
                  if layout == "natural" else 1)
  attend = functools.partial(ring.attend_shard, axis_name=RING, ring_size=ring_shards,
                             causal=causal, scale=scale, layout=layout, backend=backend,
                             sliding_window=sliding_window)
  return ulysses.all_to_all_attention(attend, q, k, v, segment_ids, mesh=mesh, causal=causal,
                                      seq_multiple=seq_multiple, sinks_H=sinks)
