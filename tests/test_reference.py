"""The dense oracle's own masking rules, checked against plain Python loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from ulysses_jax.attention.reference import attention_mask, dense_attention


@pytest.mark.parametrize("window", [1, 3, 7, 40])
def test_sliding_window_mask_is_transformers_causal_window(window):
  q_pos = jnp.array([0, 1, 2, 5, 6, 9, 10, 11])
  kv_pos = jnp.arange(12)
  segments = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
  mask = attention_mask(8, 12, causal=True, q_positions=q_pos, kv_positions=kv_pos,
                        q_segment_ids=segments[:, np.asarray(q_pos)], kv_segment_ids=segments,
                        sliding_window=window)
  expected = np.array([[[0 <= int(i) - j < window and segments[0, int(i)] == segments[0, j]
                         for j in range(12)] for i in q_pos]])
  np.testing.assert_array_equal(np.asarray(mask), expected)


def test_a_window_longer_than_the_sequence_is_the_causal_mask():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in range(3))
  np.testing.assert_array_equal(dense_attention(q, k, v, sliding_window=16),
                                dense_attention(q, k, v))
  assert not np.allclose(dense_attention(q, k, v, sliding_window=4), dense_attention(q, k, v))


@pytest.mark.parametrize("window, causal, message", [
    (0, True, "positive int"), (2.5, True, "positive int"), (True, True, "positive int"),
    (4, False, "needs causal=True")])
def test_bad_sliding_windows_are_clear_errors(window, causal, message):
  with pytest.raises(ValueError, match=message):
    attention_mask(4, 4, causal=causal, sliding_window=window)
