"""The jitted programs of generation, built from the model's own layers: prefill and decode.

Both run ``Llama``'s embedding, layers (``DecoderLayer.block``) and final norm, with an
attention sublayer that writes the KV cache (``cache.write_chunk``, ``cache.write_token``)
from the layer's own projections (``UlyssesAttention.project_qkv``, ``project_out``). The
layers run one by one (a Python loop, not the training scan), so each keeps a cache of its own
shape (a rolling buffer for a windowed layer) and updates it in place.

* ``prefill`` writes one chunk of T prompt tokens (a traced chunk index, one compile for all
  chunks). With the whole prompt in one chunk its attention is the model's own
  sequence-parallel attention (``UlyssesAttention.attend``: Ulysses, data x seq, the hybrid);
  with several chunks each chunk's queries attend the cache written so far
  (``attention.cache_attention``). It keeps the last prompt token's hidden state of each row,
  never logits for the whole sequence.
* ``first_token`` turns those hidden states into the first new token.
* ``decode`` feeds one token per row, writes its k and v, attends the cache and returns the
  next token. The cache is donated to both programs and comes back aliased.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax.generate import cache as cache_lib
from ulysses_jax.generate.attention import cache_attention
from ulysses_jax.generate.cache import CacheLayout, KVCache
from ulysses_jax.generate.sampling import Sampling, sample
from ulysses_jax.mesh import DATA


def _run_layers(model, layout: CacheLayout, cache: KVCache, x_BTE, positions_BT, attend):
  """``x`` through every layer; ``attend(layer, i, q, k, v, ks, vs)`` writes layer ``i``'s
  cache (lists ``ks``, ``vs``) and returns the attention output ``[B, T, Hq, D]``."""
  config = model.config
  ks, vs = list(cache.k), list(cache.v)
  for i, layer_type in enumerate(config.attention_types()):
    layer = model.layer(i)
    rope = config.layer_attention(layer_type)

    def attention(x_BTE, layer=layer, i=i, rope=rope):
      q, k, v = layer.attn.project_qkv(x_BTE, positions_BT, norm=layer.attn_norm,
                                       rope_theta=rope["rope_theta"],
                                       rope_scaling=rope["rope_scaling"])
      return layer.attn.project_out(attend(layer, i, q, k, v, ks, vs))

    x_BTE = layer.block(x_BTE, attention)
  return x_BTE, ks, vs


def _kind_index(layout: CacheLayout, layer: int) -> int:
  return layout.kinds.index(layout.layer_kind(layer))


def prefill(graphdef, layout: CacheLayout, params, cache: KVCache, tokens_BT, chunk,
            lengths_B, last_BE):
  """Chunk ``chunk`` of the prompts (``tokens_BT``, int ``[B, T]``; ``lengths_B`` tokens per
  row) through the model: ``(cache, last_BE)``, the cache with the chunk written and
  ``last_BE`` (float32 ``[B, E]``) the final hidden state before the norm of each row's last
  prompt token where it lies in this chunk (kept from ``last_BE`` elsewhere)."""
  model = nnx.merge(graphdef, params)
  t = layout.chunk_len
  positions_BT = chunk * t + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_BT.shape)
  positions = tuple(
      jax.lax.with_sharding_constraint(
          cache_lib.chunk_positions(layout, kind, chunk, lengths_B),
          NamedSharding(layout.mesh, layout.positions_spec()))
      for kind in layout.kinds)

  def attend(layer, i, q, k, v, ks, vs):
    kind = layout.layer_kind(i)
    ks[i] = cache_lib.write_chunk(layout, kind, ks[i], k, chunk, lengths_B)
    vs[i] = cache_lib.write_chunk(layout, kind, vs[i], v, chunk, lengths_B)
    window = layout.layer_windows[i]
    if layout.chunks == 1:
      return layer.attn.attend(q, k, v, sliding_window=window)
    return cache_attention(layout, q, ks[i], vs[i], positions_BT,
                           positions[_kind_index(layout, i)],
                           scale=layer.attn.attention_scale_or_default(), window=window)

  x_BTE, ks, vs = _run_layers(model, layout, cache, model.embed(tokens_BT), positions_BT,
                              attend)
  # The last token's row of x, as a sum over the (sharded) sequence: no gather of x.
  offset_B = lengths_B - 1 - chunk * t
  one_hot_BT = (jnp.arange(t)[None] == offset_B[:, None]).astype(x_BTE.dtype)
  picked_BE = jnp.einsum("bt,bte->be", one_hot_BT, x_BTE, preferred_element_type=jnp.float32)
  here_B = (offset_B >= 0) & (offset_B < t)
  last_BE = jnp.where(here_B[:, None], picked_BE, last_BE)
  return KVCache(tuple(ks), tuple(vs), positions), last_BE


def _next_token(model, x_BE, sampling: Sampling, step):
  hidden_BE = model.final_norm(x_BE.astype(model.config.dtype))
  logits_BV = jnp.einsum("be,ev->bv", hidden_BE, model.lm_head_kernel(),
                         preferred_element_type=jnp.float32)
  return sample(logits_BV, sampling, step)


def first_token(graphdef, sampling: Sampling, params, last_BE):
  """The first new token of each row, from ``prefill``'s ``last_BE``: int32 ``[B]``."""
  return _next_token(nnx.merge(graphdef, params), last_BE, sampling, 0)


def decode(graphdef, layout: CacheLayout, sampling: Sampling, params, cache: KVCache,
           tokens_B, step, lengths_B):
  """Decode step ``step`` (traced int, from 0): feeds ``tokens_B`` (int ``[B]``, the new
  token of each row) at positions ``lengths_B + step``; returns ``(cache, next_tokens_B)``."""
  model = nnx.merge(graphdef, params)
  positions_B = lengths_B + step
  positions = tuple(
      cache_lib.write_token(layout, p, positions_B,
                            cache_lib.token_slots(layout, kind, step, positions_B))
      for kind, p in zip(layout.kinds, cache.positions))

  def attend(layer, i, q, k, v, ks, vs):
    kind = layout.layer_kind(i)
    slots_B = cache_lib.token_slots(layout, kind, step, positions_B)
    # The barrier keeps XLA from fusing the in-place write into the attention's reads of the
    # cache (XLA's CPU compiler then copies the whole layer's cache to compute both).
    ks[i], vs[i] = jax.lax.optimization_barrier((
        cache_lib.write_token(layout, ks[i], k, slots_B),
        cache_lib.write_token(layout, vs[i], v, slots_B)))
    return cache_attention(layout, q, ks[i], vs[i], positions_B[:, None],
                           positions[_kind_index(layout, i)],
                           scale=layer.attn.attention_scale_or_default(),
                           window=layout.layer_windows[i])

  x_B1E, ks, vs = _run_layers(model, layout, cache, model.embed(tokens_B[:, None]),
                              positions_B[:, None], attend)
  return KVCache(tuple(ks), tuple(vs), positions), _next_token(model, x_B1E[:, 0], sampling,
                                                               step + 1)


def rows_sharding(layout: CacheLayout, ndim: int = 1) -> NamedSharding:
  """Rows over ``data``, the rest replicated: the steps' per-row inputs and outputs."""
  return NamedSharding(layout.mesh, P(DATA, *([None] * (ndim - 1))))
