"""The chunked XLA attention (the "xla" backend) against the dense oracle, on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (BF16_TOL, F32_TOL, assert_matches_reference, large_sinks,
                             output_and_grads, random_inputs, relative_error)
from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.attention.reference import dense_attention


@pytest.mark.parametrize("shape,causal,num_segments,blocks,sinks", [
    ((2, 64, 4, 4, 16), True, 0, (16, 16), False),    # several blocks, causal skipping
    ((1, 50, 8, 2, 8), True, 3, (16, 8), True),       # ragged tails, packed, large sinks
    ((2, 37, 6, 1, 8), False, 4, (8, 32), True),      # MQA, not causal, large sinks
    ((1, 24, 4, 4, 64), True, 0, (512, 512), False),  # one block
])
def test_matches_dense_reference(shape, causal, num_segments, blocks, sinks):
  q, k, v, d_out, segment_ids = random_inputs(0, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: chunked_attention(
      q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
      block_q=blocks[0], block_kv=blocks[1], sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL, sinks=large_sinks(shape[2]) if sinks else None)


def test_bfloat16_matches_dense_reference():
  q, k, v, d_out, segment_ids = random_inputs(1, 2, 48, 4, 2, 16, dtype=jnp.bfloat16,
                                              num_segments=3)
  fn = lambda q, k, v: chunked_attention(q, k, v, q_segment_ids=segment_ids,
                                         kv_segment_ids=segment_ids, block_q=16, block_kv=16)
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=BF16_TOL)


# Without and with a window: a query shard at an offset (as in all-gather and ring attention,
# 16 queries at positions 24..39 of 40 tokens), lse differentiated too.
@pytest.mark.parametrize("window", [None, 11])
def test_offset_queries_and_lse_gradient(window):
  q, k, v, _, _ = random_inputs(2, 1, 40, 4, 2, 8)
  q = q[:, 24:]
  positions = jnp.arange(24, 40)

  def loss(attention, q, k, v):
    out, lse = attention(q, k, v, causal=True, q_positions=positions, sliding_window=window,
                         return_lse=True)
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(lse))

  chunked = lambda *a, **kw: chunked_attention(*a, **kw, block_q=8, block_kv=8)
  expected = jax.value_and_grad(loss, argnums=(1, 2, 3))(dense_attention, q, k, v)
  actual = jax.value_and_grad(loss, argnums=(1, 2, 3))(chunked, q, k, v)
  assert relative_error(actual[0], expected[0]) < F32_TOL
  for a, e in zip(actual[1], expected[1]):
    assert relative_error(a, e) < F32_TOL


@pytest.mark.parametrize("sinks", [None, large_sinks(2)], ids=["", "sinks"])
def test_query_without_visible_key_gives_zero_and_finite_gradients(sinks):
  """Output 0 and lse -inf (with sinks: the sink's logit, all the row's mass), zero dq."""
  q, k, v, d_out, _ = random_inputs(3, 1, 16, 2, 2, 8)
  q_segment_ids = jnp.zeros((1, 16), jnp.int32).at[0, 5].set(7)  # segment 7 has no keys
  kv_segment_ids = jnp.zeros((1, 16), jnp.int32)
  fn = lambda q, k, v: chunked_attention(q, k, v, q_segment_ids=q_segment_ids,
                                         kv_segment_ids=kv_segment_ids, block_q=4, block_kv=4,
                                         return_lse=True, sinks=sinks)
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  assert np.all(out[0, 5] == 0)
  if sinks is None:
    assert np.all(np.isneginf(lse[0, :, 5]))
  else:
    np.testing.assert_allclose(lse[0, :, 5], sinks)
  grads = vjp((d_out, jnp.ones_like(lse)))
  assert all(np.all(np.isfinite(g)) for g in grads)
  assert np.all(grads[0][0, 5] == 0)


def test_segment_ids_must_come_in_pairs():
  q, k, v, _, segment_ids = random_inputs(4, 1, 8, 2, 2, 8, num_segments=2)
  with pytest.raises(ValueError, match="pass both q_segment_ids and kv_segment_ids"):
    chunked_attention(q, k, v, q_segment_ids=segment_ids)


def test_memory_stays_linear_inside_a_differentiated_layer_scan():
  """Regression: in a scanned layer stack under grad, no [S, S]-sized residual may be kept."""
  seq_len = 4096
  x = jax.ShapeDtypeStruct((1, seq_len, 1, 32), jnp.float32)
  weights = jax.ShapeDtypeStruct((2, 32, 32), jnp.float32)

  def loss(x, weights):
    def layer(x, w):
      y = x @ w
      return x + chunked_attention(y, y, y), None
    return jax.lax.scan(layer, x, weights)[0].sum()

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, weights).compile()
  one_score_matrix = seq_len * seq_len * 4
  # Measured 11 MB (it was 108 MB when static-bound loops became scans); [S, S] is 64 MB.
  assert compiled.memory_analysis().temp_size_in_bytes < one_score_matrix // 2


@pytest.mark.parametrize("shape,window,num_segments,blocks,sinks", [
    ((1, 64, 4, 2, 8), 1, 3, (16, 16), True),      # a query sees only itself (and the sink)
    ((2, 64, 4, 4, 8), 5, 0, (16, 16), False),     # window < block
    ((1, 64, 2, 1, 8), 21, 4, (16, 8), True),      # crosses block boundaries, MQA, packed
    ((1, 50, 4, 2, 8), 13, 3, (16, 8), False),     # ragged tails in q and kv blocks
    ((1, 40, 2, 2, 8), 40, 2, (8, 8), False),      # window = S: causal
    ((1, 40, 2, 2, 8), 1000, 0, (16, 8), False),   # window > S
])
def test_sliding_window_matches_dense_reference(shape, window, num_segments, blocks, sinks):
  q, k, v, d_out, segment_ids = random_inputs(5, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: chunked_attention(
      q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids, sliding_window=window,
      block_q=blocks[0], block_kv=blocks[1], sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=F32_TOL, sliding_window=window,
                           sinks=large_sinks(shape[2], seed=1) if sinks else None)


@pytest.mark.parametrize("window,causal,match", [
    (0, True, "positive int"), (-3, True, "positive int"), (2.0, True, "positive int"),
    (8, False, "needs causal=True"),
])
def test_bad_sliding_window_is_rejected(window, causal, match):
  q, k, v, _, _ = random_inputs(7, 1, 8, 2, 2, 8)
  with pytest.raises(ValueError, match=match):
    chunked_attention(q, k, v, causal=causal, sliding_window=window)


def test_sliding_window_skips_hidden_blocks():
  """Forward and backward compute O(S·W) tiles, counted with a callback in the tile function.

  S = 1024 in blocks of 64 (16 x 16 tiles): causal computes 136 tiles per pass, a window of
  64 only the diagonal and the one below it, 31.
  """
  from ulysses_jax.attention import chunked
  seq_len, block = 1024, 64
  q, k, v, d_out, _ = random_inputs(8, 1, seq_len, 1, 1, 8)
  tiles = []
  real_tile_probs = chunked._tile_probs

  def counting_tile_probs(*args):
    jax.debug.callback(lambda: tiles.append(1))
    return real_tile_probs(*args)

  def count(window):
    tiles.clear()
    fn = lambda q, k, v: chunked_attention(q, k, v, sliding_window=window, block_q=block,
                                           block_kv=block)
    jax.block_until_ready(output_and_grads(fn, q, k, v, d_out))
    return len(tiles)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(chunked, "_tile_probs", counting_tile_probs)
    # One forward pass, and two backward passes (dq; dk and dv).
    assert count(None) == 3 * 136
    assert count(64) == 3 * 31
    assert count(1) == 3 * 16
