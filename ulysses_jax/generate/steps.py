"""The jitted programs of generation, built from the model's own layers: prefill and decode.

Both run ``Llama``'s embedding, layers (``DecoderLayer.block``) and final norm, with an
attention sublayer built from the layer's own projections (``UlyssesAttention.project_qkv``,
``project_out``), and write each layer's k and v into its slice of its kind's stack (a rolling
buffer for a windowed layer), in place (``cache.write_chunk``, ``cache.write_token``).

* ``prefill`` writes one chunk of T prompt tokens (a traced chunk index, one compile for all
  chunks), the layers in a ``lax.scan`` as in training. With the whole prompt in one chunk its
  attention is the model's own sequence-parallel attention (``UlyssesAttention.attend``:
  Ulysses, data x seq, the hybrid); with several chunks each chunk's queries attend the cache
  written so far (``attention.cache_attention``). It keeps the last prompt token's hidden
  state of each row, never logits for the whole sequence.
* ``first_token`` turns those hidden states into the first new token.
* ``decode`` feeds one token per row, attends the cache and the token itself, writes its k
  and v and returns the next token. The cache is donated to both programs and comes back
  aliased.

Attention sinks (gpt-oss) enter the cache attention once, after the partial results are
combined over the devices (``attention.cache_attention``); a one-pass prefill attends as
training does. Mixture-of-experts layers run the model's own ``MoE``: in prefill on the
chunk's (data, seq)-sharded tokens, in decode on the rows spread over the devices
(``_decode_block``).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax.generate import cache as cache_lib
from ulysses_jax.generate import experts
from ulysses_jax.generate.attention import cache_attention
from ulysses_jax.generate.cache import CacheLayout, KVCache
from ulysses_jax.generate.sampling import Sampling, sample
from ulysses_jax.mesh import DATA, sequence_axes, sequence_shards


def _segments(config, layout: CacheLayout) -> list[tuple[int, int]]:
  """``[(start, stop)]``: the runs of consecutive layers of one attention type (one for most
  models; Gemma 3's five sliding layers and one full, repeated)."""
  types = config.attention_types()
  starts = [i for i in range(len(types)) if i == 0 or types[i] != types[i - 1]]
  return list(zip(starts, starts[1:] + [len(types)]))


def _rope(config, layer_type: str) -> dict:
  rope = config.layer_attention(layer_type)
  return dict(rope_theta=rope["rope_theta"], rope_scaling=rope["rope_scaling"])


def prefill(graphdef, layout: CacheLayout, params, cache: KVCache, tokens_BT, chunk,
            lengths_B, last_BE):
  """Chunk ``chunk`` of the prompts (``tokens_BT``, int ``[B, T]``; ``lengths_B`` tokens per
  row) through the model: ``(cache, last_BE)``, the cache with the chunk written and
  ``last_BE`` (float32 ``[B, E]``) the final hidden state before the norm of each row's last
  prompt token where it lies in this chunk (kept from ``last_BE`` elsewhere).

  The layers run as the training forward does, in a ``lax.scan`` (one per run of layers of
  one attention type), so no layer's activations outlive it; each layer writes its slice of
  its kind's stack (carried through the scan, updated in place)."""
  model = nnx.merge(graphdef, params)
  config = model.config
  t = layout.chunk_len
  positions_BT = chunk * t + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_BT.shape)
  positions = tuple(
      jax.lax.with_sharding_constraint(
          cache_lib.chunk_positions(layout, kind, chunk, lengths_B),
          NamedSharding(layout.mesh, layout.positions_spec()))
      for kind in layout.kinds)
  layers_graphdef, layer_states = nnx.split(model.layers)
  # The MoE layers' router takes only the prompts' tokens into its statistics (unused here).
  valid_BT = positions_BT < lengths_B[:, None]
  sparse_L = jnp.array(config.sparse_layers())
  ks, vs = list(cache.k), list(cache.v)
  x_BTE = model.embed(tokens_BT)
  for start, stop in _segments(config, layout):
    kind = layout.layer_kind(start)
    n, base = layout.stack_index(start)
    window = layout.layer_windows[start]
    rope = _rope(config, config.attention_types()[start])

    def body(carry, i, kind=kind, n=n, base=base, window=window, rope=rope, start=start):
      x_BTE, k_stack, v_stack = carry
      layer = nnx.merge(layers_graphdef, jax.tree.map(
          lambda s: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), layer_states))
      j = i - start + base
      written = {}

      def attention(x_BTE):
        q, k, v = layer.attn.project_qkv(x_BTE, positions_BT, norm=layer.attn_norm, **rope)
        written["k"] = cache_lib.write_chunk(layout, kind, k_stack, j, k, chunk, lengths_B)
        written["v"] = cache_lib.write_chunk(layout, kind, v_stack, j, v, chunk, lengths_B,
                                             values=True)
        if layout.chunks == 1:
          out = layer.attn.attend(q, k, v, sliding_window=window)
        else:
          k_layer, v_layer = (jax.lax.dynamic_index_in_dim(written[x], j, keepdims=False)
                              for x in "kv")
          out = cache_attention(layout, q, k_layer, v_layer, positions_BT, positions[n],
                                scale=layer.attn.attention_scale_or_default(),
                                window=window, sinks_H=layer.attn.sink_logits())
        return layer.attn.project_out(out)

      x_BTE, _ = layer.block(x_BTE, attention, valid_BT, sparse_L[i])
      return (x_BTE, written["k"], written["v"]), None

    (x_BTE, ks[n], vs[n]), _ = jax.lax.scan(body, (x_BTE, ks[n], vs[n]),
                                            jnp.arange(start, stop))
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
  token of each row) at positions ``lengths_B + step``; returns ``(cache, next_tokens_B)``.

  The layers run one by one (a Python loop), each attending the cache as it came in, where it
  lies, plus the new token's own k and v; every layer's new k and v are written at the end,
  one slot per row in each kind's stack, in place. (Writing each layer's before its attention
  reads the cache would interleave reads and in-place writes of one buffer, which XLA's CPU
  compiler resolves by copying the cache.) A rolling buffer's slot for the new token held a
  position the window has left, so attending the old cache loses nothing."""
  model = nnx.merge(graphdef, params)
  config = model.config
  positions_B = lengths_B + step
  new = {n: ([], []) for n in range(len(layout.kinds))}
  stacked = experts.uses_stacked_experts(config, layout.mesh)
  x_B1E = model.embed(tokens_B[:, None])
  for i, layer_type in enumerate(config.attention_types()):
    layer = model.layer(i)
    n, j = layout.stack_index(i)

    def attention(x_B1E, layer=layer, n=n, j=j, layer_type=layer_type, i=i):
      q, k, v = layer.attn.project_qkv(x_B1E, positions_B[:, None], norm=layer.attn_norm,
                                       **_rope(config, layer_type))
      new[n][0].append(k)
      new[n][1].append(v)
      return layer.attn.project_out(cache_attention(
          layout, q, cache.k[n], cache.v[n], positions_B[:, None], cache.positions[n],
          scale=layer.attn.attention_scale_or_default(), window=layout.layer_windows[i],
          new_kv=(k, v), sinks_H=layer.attn.sink_logits(), layer=j))

    feed_forward = None
    if config.sparse_layers()[i] and stacked:
      feed_forward = functools.partial(experts.stacked_experts, model, i, norm=layer.mlp_norm)
    x_B1E = _decode_block(layer, layout, x_B1E, attention, config.sparse_layers()[i],
                          feed_forward)
  ks, vs, positions = [], [], []
  for n, kind in enumerate(layout.kinds):
    slots_B = cache_lib.token_slots(layout, kind, step, positions_B)
    ks.append(cache_lib.write_token(layout, cache.k[n], jnp.stack(new[n][0]), slots_B))
    vs.append(cache_lib.write_token(layout, cache.v[n], jnp.stack(new[n][1]), slots_B,
                                    values=True))
    positions.append(cache_lib.write_token(layout, cache.positions[n], positions_B, slots_B))
  return KVCache(tuple(ks), tuple(vs), tuple(positions)), _next_token(model, x_B1E[:, 0],
                                                                      sampling, step + 1)


def _decode_block(layer, layout: CacheLayout, x_B1E, attention, sparse: bool,
                  feed_forward=None):
  """One decoder layer of a decode step: ``[B, 1, E]`` (rows over ``data``) -> the same.

  A dense layer runs as it comes. In a model with experts, each row's token is one token of
  the MoE layer's (data, seq)-sharded input: the B/data rows of a data shard are spread over
  its seq x ring devices (padded with zero rows to a multiple of them, dropped after), so
  each device routes and multiplies ⌈B/(data·seq·ring)⌉ tokens, not every row of its shard,
  and the layer runs ``MoE`` as training does, or ``feed_forward`` (the experts over the
  whole stack, ``experts.stacked_experts``). The attention sublayer sees the rows as they
  came in."""
  if layer.moe is None:
    return layer.block(x_B1E, attention)[0]
  mesh = layout.mesh
  b, _, e = x_B1E.shape
  shards = sequence_shards(mesh)
  data = mesh.shape[DATA]
  rows = b // data
  padded = -(-rows // shards) * shards
  spread = NamedSharding(mesh, P(DATA, sequence_axes(mesh)))

  def to_tokens(x_B1E):
    x_dRE = jnp.pad(x_B1E.reshape(data, rows, e), [(0, 0), (0, padded - rows), (0, 0)])
    return jax.lax.with_sharding_constraint(x_dRE, spread)

  def to_rows(x_dRE):
    x_B1E = x_dRE[:, :rows].reshape(b, 1, e)
    return jax.lax.with_sharding_constraint(x_B1E, rows_sharding(layout, 3))

  valid_dR = jax.lax.with_sharding_constraint(
      jnp.broadcast_to(jnp.arange(padded) < rows, (data, padded)), spread)
  x_dRE, _ = layer.block(to_tokens(x_B1E), lambda x: to_tokens(attention(to_rows(x))),
                         valid_dR, sparse, feed_forward)
  return to_rows(x_dRE)


def rows_sharding(layout: CacheLayout, ndim: int = 1) -> NamedSharding:
  """Rows over ``data``, the rest replicated: the steps' per-row inputs and outputs."""
  return NamedSharding(layout.mesh, P(DATA, *([None] * (ndim - 1))))
