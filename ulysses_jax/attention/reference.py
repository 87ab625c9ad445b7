"""Plain dense attention: the oracle every other attention path is tested against.

It materialises the full ``[B, H, Sq, Sk]`` score matrix in float32, so use it only on
short sequences. Masking rules shared by every backend:

* causal: query at position ``q_positions[i]`` sees key ``kv_positions[j]`` iff
  ``q_positions[i] >= kv_positions[j]`` (positions default to ``arange``);
* sliding window (transformers' definition, causal only): a query also needs
  ``q_positions[i] - kv_positions[j] < sliding_window``, so it sees itself and the
  ``sliding_window - 1`` positions before it;
* packed sequences: a query sees a key only if their segment ids are equal;
* a query that sees no key returns 0 (and a log-sum-exp of -inf), never NaN;
* sinks (gpt-oss, ``attention.sinks``): one more logit per query head in every row's softmax,
  with no value; a row that sees no key then returns 0 with a log-sum-exp equal to the sink.
"""

import jax.numpy as jnp

from ulysses_jax.kernels.variants import check_sliding_window


def attention_mask(q_len, kv_len, *, causal, q_segment_ids=None, kv_segment_ids=None,
                   q_positions=None, kv_positions=None, sliding_window=None):
  """Boolean visibility mask, ``[B or 1, Sq, Sk]``; True where the query sees the key."""
  check_sliding_window(sliding_window, causal)
  mask = jnp.ones((1, q_len, kv_len), dtype=bool)
  if causal:
    q_pos = jnp.arange(q_len) if q_positions is None else q_positions
    kv_pos = jnp.arange(kv_len) if kv_positions is None else kv_positions
    distance = q_pos[:, None] - kv_pos[None, :]
    mask = mask & (distance >= 0)[None]
    if sliding_window is not None:
      mask = mask & (distance < sliding_window)[None]
  if q_segment_ids is not None:
    mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
  return mask


def dense_attention(q_BSHD, k_BSKD, v_BSKD, *, causal=True, q_segment_ids=None,
                    kv_segment_ids=None, q_positions=None, kv_positions=None, scale=None,
                    sliding_window=None, return_lse=False, sinks=None):
  """Exact attention in float32; q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, Hq % Hkv == 0.

  Query head ``h`` uses key/value head ``h // (Hq // Hkv)``. Segment ids are ``[B, S]`` ints
  (both or neither). ``sinks``: None, or ``[Hq]`` logits, one more (unscaled) column of every
  row's scores whose probability multiplies no value (transformers' ``GptOssAttention``).
  Returns ``[B, Sq, Hq, D]`` in q's dtype, and with ``return_lse`` also the log-sum-exp of
  the scaled scores (and the sink), ``[B, Hq, Sq]`` float32.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither.")
  b, sq, hq, d = q_BSHD.shape
  sk, hkv = k_BSKD.shape[1], k_BSKD.shape[2]
  groups = hq // hkv
  scale = d ** -0.5 if scale is None else scale
  q = q_BSHD.astype(jnp.float32).reshape(b, sq, hkv, groups, d)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k_BSKD.astype(jnp.float32)) * scale
  mask = attention_mask(sq, sk, causal=causal, q_segment_ids=q_segment_ids,
                        kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                        kv_positions=kv_positions,
                        sliding_window=sliding_window)[:, None, None]
  if sinks is not None:  # the sink: one more column, always visible
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, groups, 1, 1),
                            scores.shape[:-1] + (1,))
    scores = jnp.concatenate([scores, sink], axis=-1)
    mask = jnp.concatenate([jnp.broadcast_to(mask, sink.shape[:-1] + (sk,)),
                            jnp.ones(sink.shape, bool)], axis=-1)
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(probs, axis=-1, keepdims=True)
  probs = probs[..., :sk]  # the sink's column has no value
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs / jnp.where(denom == 0, 1.0, denom),
                   v_BSKD.astype(jnp.float32))
  out = out.reshape(b, sq, hq, d).astype(q_BSHD.dtype)
  if not return_lse:
    return out
  lse = jnp.where(denom[..., 0] == 0, -jnp.inf, row_max[..., 0] + jnp.log(denom[..., 0]))
  return out, lse.reshape(b, hq, sq)


def mean_visible_keys(seq_len: int, sliding_window: int | None = None) -> float:
  """Keys a causal query sees, averaged over a sequence of ``seq_len`` (no packing): ``S/2``,
  and with a window W < S, ``W - W²/(2S)`` (the first W queries see a growing prefix, the
  rest W keys each). Both are the continuous approximation FLOP counts use (the exact means
  are (S+1)/2 and W - W(W-1)/(2S)); they agree at W = S."""
  if sliding_window is None or sliding_window >= seq_len:
    return seq_len / 2
  return sliding_window - sliding_window ** 2 / (2 * seq_len)
