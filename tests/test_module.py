"""UlyssesAttention (the NNX layer), its projections' one-row contraction and RoPE: against a dense
reference, standalone use."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attention_cases import large_sinks
from model_cases import assert_trees_close, mesh_of, packed_batch, relative_error
from ulysses_jax.attention.module import UlyssesAttention
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.layers import contract
from ulysses_jax.rope import RopeScaling, apply_rope, inverse_frequencies

E, HQ, HKV, D = 32, 4, 2, 8


def _attention(mesh, **kwargs):
  return UlyssesAttention(E, HQ, num_kv_heads=HKV, head_dim=D, mesh=mesh, rngs=nnx.Rngs(0),
                          **kwargs)


def _rms(x, scale, eps=1e-6):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _dense_reference(attn, x, positions, segment_ids, sliding_window=None):
  """The same layer with plain projections and single-device dense attention."""
  project = lambda p: jnp.einsum("bse,ehd->bshd", x, p.kernel[...]) + (
      0.0 if p.bias is None else p.bias[...])
  q, k, v = project(attn.q_proj), project(attn.k_proj), project(attn.v_proj)
  if attn.q_norm is not None:
    q, k = _rms(q, attn.q_norm.scale[...]), _rms(k, attn.k_norm.scale[...])
  inv_freq = inverse_frequencies(D, attn.rope_theta, attn.rope_scaling)
  q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
  out = dense_attention(q, k, v, causal=True, q_segment_ids=segment_ids,
                        kv_segment_ids=segment_ids, sliding_window=sliding_window,
                        sinks=None if attn.sinks is None else attn.sinks[...])
  return jnp.einsum("bshd,hde->bse", out, attn.o_proj.kernel[...])


def _large_sinks(attn):
  """``attn`` with sinks of magnitude 2 to 4 (they start near zero), when it has sinks."""
  if attn.sinks is not None:
    attn.sinks[...] = large_sinks(attn.sinks.shape[0])
  return attn


@pytest.mark.parametrize("mesh_shape,seq_len,features", [
    # S % P != 0: padded inside; sinks on padded heads (4 heads, 2 KV heads, 4 seq shards)
    ((2, 4), 30, dict(qk_norm=True, qkv_bias=True, attention_sinks=True)),
    ((1, 8), 32, dict(rope_scaling=RopeScaling(factor=4.0, original_max_position=8))),
])
def test_matches_dense_reference_with_gradients(mesh_shape, seq_len, features):
  mesh = mesh_of(*mesh_shape)
  graphdef, state = nnx.split(_large_sinks(_attention(mesh, **features)))
  # Random norm scales and biases, so every parameter matters.
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves) + 1)
  state = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])
  batch = packed_batch(0, 2, seq_len, 2)
  x = jax.random.normal(keys[-1], (2, seq_len, E))
  pos, seg = batch["positions"], batch["segment_ids"]

  def loss(layer_fn):
    return lambda s, x: jnp.sum(jnp.sin(layer_fn(nnx.merge(graphdef, s), x)))

  ulysses = loss(lambda a, x: a(x, pos, seg))
  dense = loss(lambda a, x: _dense_reference(a, x, pos, seg))
  out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, pos, seg))(state, x)
  expected = jax.jit(lambda s, x: _dense_reference(nnx.merge(graphdef, s), x, pos, seg))(state, x)
  assert relative_error(out, expected) < 1e-5
  grads = jax.jit(jax.grad(ulysses, argnums=(0, 1)))(state, x)
  assert_trees_close(grads, jax.jit(jax.grad(dense, argnums=(0, 1)))(state, x))


@pytest.mark.parametrize("mesh_shape,head_chunks,call_kwargs,window", [
    ((2, 4), 1, {}, 7),
    pytest.param((1, 8), 2, dict(sliding_window=3), 3, marks=pytest.mark.slow),
    ((2, 4), 1, dict(sliding_window=None), None),
])
def test_sliding_window_from_constructor_and_per_call(mesh_shape, head_chunks, call_kwargs,
                                                      window):
  """The constructor's window (7) by default; a call's ``sliding_window`` overrides it."""
  mesh = mesh_of(*mesh_shape)
  seq_len = 30
  attn = _attention(mesh, sliding_window=7, head_chunks=head_chunks)
  batch = packed_batch(0, 2, seq_len, 2)
  x = jax.random.normal(jax.random.key(2), (2, seq_len, E))
  pos, seg = batch["positions"], batch["segment_ids"]
  loss = lambda x: jnp.sum(jnp.sin(attn(x, pos, seg, **call_kwargs)))
  dense_loss = lambda x: jnp.sum(jnp.sin(_dense_reference(attn, x, pos, seg, window)))
  out, grad = jax.jit(jax.value_and_grad(loss))(x)
  expected, expected_grad = jax.jit(jax.value_and_grad(dense_loss))(x)
  assert relative_error(out, expected) < 1e-5
  assert relative_error(grad, expected_grad) < 1e-5
  other = _dense_reference(attn, x, pos, seg, 2 if window is None else None)
  assert relative_error(other, _dense_reference(attn, x, pos, seg, window)) > 1e-2


def test_head_chunks_with_the_norm_inside_match_the_plain_layer():
  """Heads in 2 chunks (1 query group each, padded to the 4 seq shards) with the pre-norm
  applied inside each chunk: the same output and gradients (parameters, sinks included, input,
  norm scale) as the plain layer on the normalised input."""
  mesh = mesh_of(2, 4)
  features = dict(qkv_bias=True, qk_norm=True, attention_sinks=True)
  graphdef, state = nnx.split(_large_sinks(_attention(mesh, **features)))
  chunked = nnx.graphdef(_attention(mesh, **features, head_chunks=2))
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(2), len(leaves) + 2)
  state = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])
  scale = 1.0 + 0.1 * jax.random.normal(keys[-2], (E,))
  batch = packed_batch(3, 2, 24, 2)
  x = jax.random.normal(keys[-1], (2, 24, E))
  pos, seg = batch["positions"], batch["segment_ids"]

  def loss(graph, norm_inside):
    def f(s, x, scale):
      attn, norm = nnx.merge(graph, s), lambda x: _rms(x, scale)
      y = attn(x, pos, seg, norm=norm) if norm_inside else attn(norm(x), pos, seg)
      return jnp.sum(jnp.sin(y))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

  value, grads = loss(chunked, True)(state, x, scale)
  expected_value, expected_grads = loss(graphdef, False)(state, x, scale)
  assert relative_error(value, expected_value) < 1e-5
  assert_trees_close(grads, expected_grads)


def test_packed_document_sees_only_itself_at_restarted_positions():
  mesh = mesh_of(1, 8)
  attn = nnx.jit(lambda a, *args: a(*args))
  layer = _attention(mesh)
  x = jax.random.normal(jax.random.key(0), (1, 32, E))
  # Document A = tokens 0..12, document B = tokens 13..31 (crossing shard boundaries).
  segment_ids = jnp.where(jnp.arange(32) < 13, 0, 1)[None]
  positions = jnp.where(jnp.arange(32) < 13, jnp.arange(32), jnp.arange(32) - 13)[None]
  packed = attn(layer, x, positions, segment_ids)
  alone = attn(layer, x[:, 13:])  # B on its own, default positions 0..18, S % 8 != 0
  assert relative_error(packed[:, 13:], alone) < 1e-5
  assert relative_error(packed[:, :13], attn(layer, x[:, :13])) < 1e-5


class UserModel(nnx.Module):
  """What a user might write: embedding, one UlyssesAttention layer, mean-pooled classifier."""

  def __init__(self, mesh, rngs):
    self.embed = nnx.Embed(16, E, rngs=rngs)
    self.attn = UlyssesAttention(E, HQ, num_kv_heads=HKV, mesh=mesh, rngs=rngs)
    self.out = nnx.Linear(E, 2, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    return self.out(jnp.mean(x + self.attn(x), axis=1))


def test_usable_in_a_user_nnx_model_with_nnx_optimizer():
  tokens = jax.random.randint(jax.random.key(0), (4, 24), 0, 16)
  targets = (tokens[:, 0] > 7).astype(jnp.int32)

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = {}
  for shape in ((1, 1), (2, 4)):
    model = UserModel(mesh_of(*shape), nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    losses[shape] = [float(train_step(model, optimizer)) for _ in range(4)]
  assert losses[(2, 4)][-1] < losses[(2, 4)][0]
  np.testing.assert_allclose(losses[(2, 4)], losses[(1, 1)], rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_shape,kernel_shape,num_in", [
    ((1, 1, 24), (24, 3, 5), 1),      # q/k/v: [E] -> [H, D]
    ((1, 1, 3, 8), (3, 8, 24), 2),    # o: [H, D] -> [E]
    ((2, 5, 3, 8), (3, 8, 24), 2),    # several rows: a plain tensordot
])
def test_contract_equals_tensordot(x_shape, kernel_shape, num_in, dtype):
  """``layers.contract``'s one-row form (a zero second row, the input dims flattened) computes
  ``tensordot``: float32 to 1e-6, bfloat16 to its rounding (relative 1e-2)."""
  kx, kk = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, x_shape, jnp.float32)
  kernel = jax.random.normal(kk, kernel_shape, jnp.float32)
  want = jnp.tensordot(x, kernel, axes=num_in)
  got = contract(x.astype(dtype), kernel.astype(dtype), num_in)
  assert got.shape == want.shape and got.dtype == dtype
  tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
  assert relative_error(got.astype(jnp.float32), want) < tolerance


def test_rope_depends_only_on_relative_position():
  inv_freq = inverse_frequencies(D, 10_000.0)
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, D))
  score = lambda m, n: jnp.sum(apply_rope(q, jnp.array([[m]]), inv_freq) *
                               apply_rope(k, jnp.array([[n]]), inv_freq))
  assert abs(score(5, 2) - score(103, 100)) < 1e-4
  assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_llama3_rope_scaling_matches_hugging_face():
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  config = transformers.LlamaConfig(
      hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=500_000.0,
      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192))
  expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
  got = inverse_frequencies(128, 500_000.0, RopeScaling(factor=8.0))
  assert relative_error(got, expected.numpy()) < 1e-6


def test_bad_arguments_raise_before_work():
  mesh = mesh_of(1, 1)
  with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads "
                                       r"\(4\)"):
    UlyssesAttention(E, 6, num_kv_heads=4, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"embed_dim \(30\) is not divisible by num_heads \(4\)"):
    UlyssesAttention(30, 4, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"head_chunks \(3\) must divide num_kv_heads \(2\)"):
    UlyssesAttention(E, 4, num_kv_heads=2, head_chunks=3, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="backend must be one of"):
    UlyssesAttention(E, 4, mesh=mesh, backend="flash", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"sliding_window \(8\) needs causal=True"):
    UlyssesAttention(E, 4, mesh=mesh, causal=False, sliding_window=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sliding_window must be a positive int"):
    _attention(mesh)(jnp.zeros((1, 8, E)), sliding_window=0)
  with pytest.raises(ValueError, match="RopeScaling.kind must be one of"):
    RopeScaling(kind="dynamic")
