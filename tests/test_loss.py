"""Chunked cross-entropy over a sharded sequence against the plain full-logits loss."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_cases import mesh_of, relative_error
from ulysses_jax.loss import (IGNORE_LABEL, CrossEntropySums, chunked_cross_entropy,
                              cross_entropy_sums)

B, S, E, V = 4, 24, 16, 40


def _inputs(seed, ignore_fraction=0.2):
  keys = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(keys[0], (B, S, E))
  head = jax.random.normal(keys[1], (E, V)) / np.sqrt(E)
  labels = jax.random.randint(keys[2], (B, S), 0, V)
  labels = jnp.where(jax.random.uniform(keys[3], (B, S)) < ignore_fraction, IGNORE_LABEL,
                     labels)
  return hidden, head, labels


def _numpy_sums(hidden, head, labels, z_loss_weight):
  logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
  lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  labels = np.asarray(labels)
  valid = labels != IGNORE_LABEL
  label_logit = np.take_along_axis(logits, np.where(valid, labels, 0)[..., None], -1)[..., 0]
  return (np.sum((lse - label_logit) * valid), np.sum(z_loss_weight * lse ** 2 * valid),
          np.sum(valid))


def test_cross_entropy_sums_match_numpy():
  hidden, head, labels = _inputs(0)
  sums = cross_entropy_sums(hidden @ head, labels, z_loss_weight=1e-3)
  expected = _numpy_sums(hidden, head, labels, 1e-3)
  for got, want in zip(sums, expected):
    assert relative_error(got, want) < 1e-6
  assert sums.count == np.sum(np.asarray(labels) != IGNORE_LABEL)


def test_cross_entropy_gradient_matches_float64_finite_differences():
  """The logits' gradient (one elementwise pass, ``loss._sums_backward``) against central
  differences of the float64 sums, the loss and the z-loss with different cotangents, on rows
  with ignored labels."""
  hidden, head, labels = _inputs(4)
  logits = hidden @ head
  cotangent = {"loss": 0.7, "z_loss": -1.3}
  weight = 1e-2

  def float64_objective(logits_f64):
    loss, z_loss, _ = _numpy_sums(logits_f64, np.eye(V), labels, weight)
    return cotangent["loss"] * loss + cotangent["z_loss"] * z_loss

  _, vjp = jax.vjp(lambda x: cross_entropy_sums(x, labels, z_loss_weight=weight), logits)
  (got,) = vjp(CrossEntropySums(loss=jnp.float32(cotangent["loss"]),
                                z_loss=jnp.float32(cotangent["z_loss"]), count=jnp.float32(0)))
  flat = np.asarray(logits, np.float64).reshape(-1)
  want, eps = np.zeros_like(flat), 1e-6
  for i in range(flat.size):
    step = np.zeros_like(flat)
    step[i] = eps
    want[i] = (float64_objective((flat + step).reshape(logits.shape)) -
               float64_objective((flat - step).reshape(logits.shape))) / (2 * eps)
  assert relative_error(got, want.reshape(logits.shape)) < 1e-5
  ignored = np.asarray(labels) == IGNORE_LABEL
  assert ignored.any() and not np.asarray(got)[ignored].any()


# (mesh, chunk): 6 local tokens per device on (2, 4) cut evenly (2) or padded (4, 5);
# chunk > local length; and a single device. Without a z-loss the gradients are formed in the
# forward scan; with one, the backward recomputes the logits.
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
@pytest.mark.parametrize("mesh_shape,chunk", [((2, 4), 2), ((2, 4), 4), ((1, 8), 5),
                                              ((4, 2), 100), ((1, 1), 7)])
def test_chunked_matches_full_logits_values_and_gradients(mesh_shape, chunk, z_loss_weight):
  mesh = mesh_of(*mesh_shape)
  hidden, head, labels = _inputs(1)

  def chunked(hidden, head):
    return chunked_cross_entropy(hidden, head, labels, mesh=mesh, chunk=chunk,
                                 z_loss_weight=z_loss_weight).mean()

  def full(hidden, head):
    return cross_entropy_sums(hidden @ head, labels, z_loss_weight=z_loss_weight).mean()

  value, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, head)
  want_value, want_grads = jax.value_and_grad(full, argnums=(0, 1))(hidden, head)
  assert relative_error(value, want_value) < 1e-6
  for got, want in zip(grads, want_grads):
    assert relative_error(got, want) < 1e-5


def test_chunked_never_builds_full_logits():
  mesh = mesh_of(1, 8)
  hidden, head, labels = _inputs(2)
  f = lambda h, w: chunked_cross_entropy(h, w, labels, mesh=mesh, chunk=3).mean()
  jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, head))
  # A chunk's logits are [B, P, chunk, V] = [4, 8, 3, 40]; nothing [4, 24, 40] is formed.
  assert "f32[4,8,3,40]" in jaxpr
  assert "f32[4,24,40]" not in jaxpr


@pytest.mark.parametrize("z_loss_weight, logit_products", [(0.0, 1), (1e-2, 2)])
def test_gradient_scales_with_any_cotangent_and_recomputes_logits_only_with_a_z_loss(
    z_loss_weight, logit_products):
  """The sums' gradients for cotangents other than the mean's (the loss's and the z-loss's
  different, the count's nonzero) against the full logits'. Without a z-loss the chunks'
  gradients are formed in the forward, while the logits exist: one logits product per chunk
  in the differentiated program; with one, the backward forms the logits again."""
  mesh = mesh_of(2, 4)
  hidden, head, labels = _inputs(6)
  cotangent = CrossEntropySums(loss=jnp.float32(0.7), z_loss=jnp.float32(-1.3),
                               count=jnp.float32(2.0))
  chunked = lambda h, w: chunked_cross_entropy(h, w, labels, mesh=mesh, chunk=2,
                                               z_loss_weight=z_loss_weight)
  full = lambda h, w: cross_entropy_sums(h @ w, labels, z_loss_weight=z_loss_weight)
  got = jax.vjp(chunked, hidden, head)[1](cotangent)
  want = jax.vjp(full, hidden, head)[1](cotangent)
  for g, w in zip(got, want):
    assert relative_error(g, w) < 1e-5
  jaxpr = str(jax.make_jaxpr(lambda h, w: jax.vjp(chunked, h, w)[1](cotangent))(hidden, head))
  # A chunk's logits [B, P, chunk, V] = [4, 4, 2, 40].
  assert len(re.findall(r"f32\[4,4,2,40\] = dot_general", jaxpr)) == logit_products


def test_ignored_tokens_count_nowhere_and_empty_shards_give_no_nan():
  mesh = mesh_of(4, 2)
  hidden, head, labels = _inputs(3, ignore_fraction=0.0)
  # Rows 0-1 (data shard 0) have no valid label at all; one row is half ignored.
  labels = labels.at[:1].set(IGNORE_LABEL).at[2, :12].set(IGNORE_LABEL)
  f = jax.jit(lambda h: chunked_cross_entropy(h, head, labels, mesh=mesh, chunk=2))
  sums = f(hidden)
  expected = _numpy_sums(hidden[1:], head, labels[1:], 0.0)
  assert relative_error(sums.loss, expected[0]) < 1e-6 and sums.count == expected[2]
  grads = jax.grad(lambda h: f(h).mean())(hidden)
  assert np.all(np.asarray(grads[0]) == 0) and np.all(np.isfinite(grads))

  all_ignored = jnp.full((B, S), IGNORE_LABEL)
  empty = chunked_cross_entropy(hidden, head, all_ignored, mesh=mesh, chunk=2)
  assert float(empty.mean()) == 0.0 and float(empty.count) == 0.0
  assert np.all(np.asarray(jax.grad(lambda h: chunked_cross_entropy(
      h, head, all_ignored, mesh=mesh, chunk=2).mean())(hidden)) == 0)


def test_z_loss_adds_weighted_squared_logsumexp():
  hidden, head, labels = _inputs(4)
  mesh = mesh_of(2, 4)
  plain = chunked_cross_entropy(hidden, head, labels, mesh=mesh, chunk=3)
  with_z = chunked_cross_entropy(hidden, head, labels, mesh=mesh, chunk=3, z_loss_weight=0.5)
  assert float(plain.z_loss) == 0.0
  assert relative_error(with_z.loss, plain.loss) < 1e-6
  assert relative_error(with_z.z_loss, _numpy_sums(hidden, head, labels, 0.5)[1]) < 1e-6
  assert relative_error(with_z.mean(), (plain.loss + with_z.z_loss) / plain.count) < 1e-6


def test_sums_add_and_bad_arguments_raise():
  one = CrossEntropySums(jnp.float32(1), jnp.float32(2), jnp.float32(3))
  assert [float(x) for x in one + one] == [2.0, 4.0, 6.0, 0.0, 0.0]  # no routing statistics
  hidden, head, labels = _inputs(5)
  with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
    chunked_cross_entropy(hidden, head, labels, mesh=mesh_of(1, 1), chunk=0)
  with pytest.raises(ValueError, match=r"labels must be \[batch, seq\] = \(4, 24\), got "
                                       r"\(4, 23\)"):
    chunked_cross_entropy(hidden, head, labels[:, :23], mesh=mesh_of(1, 1), chunk=4)
  with pytest.raises(ValueError, match=r"must be divisible by the sequence shards \(8\)"):
    chunked_cross_entropy(hidden[:, :23], head, labels[:, :23], mesh=mesh_of(1, 8), chunk=4)


def test_bfloat16_head_multiplies_in_bfloat16_and_matches_float32_within_its_rounding():
  """bfloat16 hidden states and head: the loss is that of their float32 copies' product (the
  forward accumulates in float32), and the gradients, whose products take the logit cotangent
  rounded to bfloat16, match within bfloat16 rounding (test_gpu_compile_cli: no float32 x float32
  product in the compiled step)."""
  mesh = mesh_of(2, 4)
  hidden, head, labels = _inputs(4)
  hidden, head = hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16)
  f = lambda h, w: chunked_cross_entropy(h, w, labels, mesh=mesh, chunk=2).mean()
  loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, head)
  wide = (hidden.astype(jnp.float32), head.astype(jnp.float32))
  want_loss, want_grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*wide)
  assert relative_error(loss, want_loss) < 1e-6
  for got, want in zip(grads, want_grads):
    assert got.dtype == jnp.bfloat16 and relative_error(got, want) < 1e-2


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_bfloat16_head_gradient_is_summed_over_many_chunks_in_float32(z_loss_weight):
  """512 chunks of 16 tokens, bfloat16: the head's gradient, summed over the chunks in
  float32 and rounded once, is that of the float32 copies within 5e-3 (summed in bfloat16:
  3.3e-2 without a z-loss, as the backward did before the gradients moved into the forward
  scan; 3.2e-2 with one, before its backward scanned the chunks itself)."""
  mesh = mesh_of(1, 1)
  keys = jax.random.split(jax.random.key(7), 3)
  hidden = jax.random.normal(keys[0], (1, 8192, 32)).astype(jnp.bfloat16)
  head = (jax.random.normal(keys[1], (32, 64)) / np.sqrt(32)).astype(jnp.bfloat16)
  labels = jax.random.randint(keys[2], (1, 8192), 0, 64)
  f = lambda h, w: chunked_cross_entropy(h, w, labels, mesh=mesh, chunk=16,
                                         z_loss_weight=z_loss_weight).mean()
  grad = jax.jit(jax.grad(f, argnums=1))
  got = grad(hidden, head)
  want = grad(hidden.astype(jnp.float32), head.astype(jnp.float32))
  assert got.dtype == jnp.bfloat16 and relative_error(got, want) < 5e-3
