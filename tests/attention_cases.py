"""Shared helpers for attention tests: random inputs and comparison with the dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax import make_mesh
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.kernels.flash_attention import flash_attention

F32_TOL = 1e-5   # relative L2 error, float32 inputs
BF16_TOL = 2e-2  # relative L2 error, bfloat16 inputs


def mesh_of(data, seq):
  return make_mesh(data=data, seq=seq, devices=jax.devices()[:data * seq])


def random_inputs(seed, batch, seq_len, q_heads, kv_heads, head_dim, *, dtype=jnp.float32,
                  num_segments=0):
  """Random q, k, v, a random output cotangent and (optionally) packed segment ids.

  Segment ids are sorted random document ids, so documents have random lengths and cross
  shard boundaries wherever they happen to fall.
  """
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(keys[0], (batch, seq_len, q_heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), dtype)
  d_out = jax.random.normal(keys[3], q.shape, dtype)
  segment_ids = None
  if num_segments:
    segment_ids = jnp.sort(jax.random.randint(keys[4], (batch, seq_len), 0, num_segments), axis=1)
  return q, k, v, d_out, segment_ids


def large_sinks(num_heads, seed=0):
  """Attention sinks ``[num_heads]`` float32 of magnitude 2 to 4 and alternating signs (+ first):
  large enough that dropping them, applying them twice or to the wrong heads fails every
  comparison (zero-initialised sinks would barely change the output)."""
  magnitudes = np.random.default_rng(seed).uniform(2.0, 4.0, num_heads)
  return jnp.asarray(magnitudes * (-1.0) ** np.arange(num_heads), jnp.float32)


def relative_error(actual, expected):
  """||actual - expected|| / ||expected||, with ||expected|| floored at 1.

  The floor matters only when the reference is (nearly) zero, e.g. dq of a query that sees a
  single key; there the error is measured in absolute terms.
  """
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1.0))


def output_and_grads(attention_fn, q, k, v, d_out, *sinks):
  """Forward output and (dq, dk, dv) for the cotangent ``d_out``, in one compiled program;
  with ``sinks`` (``attention_fn(q, k, v, sinks)``) also d(sinks)."""
  def run(d_out, *args):
    out, vjp = jax.vjp(attention_fn, *args)
    return (out, *vjp(d_out))
  return jax.jit(run)(d_out, q, k, v, *sinks)


def assert_matches_reference(attention_fn, q, k, v, d_out, *, causal, segment_ids, tol,
                             sliding_window=None, sinks=None):
  """Compares forward and dq/dk/dv of ``attention_fn(q, k, v)`` with ``dense_attention``;
  with ``sinks`` ``[Hq]``, of ``attention_fn(q, k, v, sinks)``, d(sinks) included."""
  reference = lambda q, k, v, sinks=None: dense_attention(
      q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
      sliding_window=sliding_window, sinks=sinks)
  upcast = lambda x: x.astype(jnp.float32)
  given = () if sinks is None else (sinks,)
  expected = output_and_grads(reference, upcast(q), upcast(k), upcast(v), upcast(d_out), *given)
  actual = output_and_grads(attention_fn, q, k, v, d_out, *given)
  for name, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), actual, expected):
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(np.asarray(a, np.float32))), f"{name} has non-finite values"
    err = relative_error(a, e)
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


def flash_outputs_and_grads(attention, q, k, v, d_out, d_lse, *sinks):
  """(out, lse, dq, dk, dv) of ``attention(q, k, v) -> (out, lse)`` for (d_out, d_lse); with
  ``sinks`` (``attention(q, k, v, sinks)``) also d(sinks)."""
  def run(d_out, d_lse, *args):
    (out, lse), vjp = jax.vjp(attention, *args)
    return (out, lse, *vjp((d_out, d_lse)))
  return jax.jit(run)(d_out, d_lse, q, k, v, *sinks)


def check_flash_against_reference(q, k, v, d_out, *, causal, segment_ids=None,
                                  kv_segment_ids=None, tol=F32_TOL, sliding_window=None,
                                  sinks=None, **kernel_args):
  """Compares out, lse and the gradients (with a random lse cotangent) with dense_attention;
  with ``sinks`` ``[Hq]`` d(sinks) too."""
  kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  d_lse = jax.random.normal(jax.random.PRNGKey(7), (q.shape[0], q.shape[2], q.shape[1]))
  given = () if sinks is None else (sinks,)
  ours = flash_outputs_and_grads(
      lambda q, k, v, sinks=None: flash_attention(
          q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
          return_lse=True, sliding_window=sliding_window, sinks=sinks, **kernel_args),
      q, k, v, d_out, d_lse, *given)
  upcast = lambda x: x.astype(jnp.float32)
  expected = flash_outputs_and_grads(
      lambda q, k, v, sinks=None: dense_attention(
          q, k, v, causal=causal, q_segment_ids=segment_ids, kv_segment_ids=kv_ids,
          return_lse=True, sliding_window=sliding_window, sinks=sinks),
      upcast(q), upcast(k), upcast(v), upcast(d_out), d_lse, *given)
  for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, expected):
    assert actual.shape == wanted.shape, f"{name}: shape {actual.shape} != {wanted.shape}"
    dtype = jnp.float32 if name in ("lse", "dsinks") else q.dtype
    assert actual.dtype == dtype, f"{name}: {actual.dtype}"
    if name != "lse":
      assert np.all(np.isfinite(np.asarray(actual, np.float32))), f"{name} has non-finite values"
      err = relative_error(actual, wanted)
      assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"
  lse, wanted_lse = np.asarray(ours[1]), np.asarray(expected[1])
  assert not np.any(np.isnan(lse)), "lse has NaN"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(wanted_lse))
  visible = np.isfinite(wanted_lse)
  np.testing.assert_allclose(lse[visible], wanted_lse[visible], rtol=tol, atol=tol)
  return ours
