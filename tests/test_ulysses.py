"""Ulysses attention against the dense single-device oracle, on 8 CPU devices."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec as P

from attention_cases import (BF16_TOL, F32_TOL, assert_matches_reference, large_sinks, mesh_of,
                             random_inputs, relative_error)
from ulysses_jax import ulysses_attention
from ulysses_jax.aot import hlo
from ulysses_jax.attention import backends, ulysses
from ulysses_jax.attention.baselines import allgather_kv_attention
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.kernels import flash_attention as fa
from ulysses_jax.mesh import DATA, SEQ

H100 = "NVIDIA H100 80GB HBM3"

# (data, seq), (batch, seq_len, q_heads, kv_heads, head_dim), causal, num_segments, sinks
# (large attention sinks, each device getting its heads' after the all-to-all).
CASES = [
    ((1, 8), (1, 64, 8, 8, 16), True, 0, False),   # MHA, Hq == P
    ((1, 8), (1, 48, 16, 8, 8), False, 3, False),  # GQA, Hkv % P == 0, packed
    ((1, 8), (1, 40, 8, 2, 8), True, 4, True),     # GQA, P % Hkv == 0: KV replicated
    ((1, 8), (2, 24, 6, 3, 8), True, 0, True),     # neither divides, Hq % P != 0: padded
    ((2, 4), (2, 64, 8, 1, 8), True, 3, False),    # MQA
    ((2, 4), (2, 37, 6, 2, 8), True, 5, True),     # S % P != 0, Hq % P != 0, packed
    ((2, 4), (2, 36, 12, 6, 8), False, 4, True),   # Hkv % P != 0 but Hq % P == 0: repeat by 2
    ((4, 2), (4, 30, 3, 3, 8), False, 0, False),   # MHA, odd heads, not causal
    ((4, 2), (4, 21, 4, 2, 16), True, 2, False),   # S odd
    ((8, 1), (8, 16, 4, 2, 8), True, 2, False),    # pure data parallel
    ((1, 2), (1, 33, 5, 1, 8), False, 3, False),   # two devices only, MQA, odd everything
]


@pytest.mark.parametrize("mesh_shape,shape,causal,num_segments,sinks", CASES)
def test_matches_dense_reference_float32(mesh_shape, shape, causal, num_segments, sinks):
  mesh = mesh_of(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(0, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: ulysses_attention(q, k, v, mesh=mesh, causal=causal,
                                                     segment_ids=segment_ids, sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL, sinks=large_sinks(shape[2]) if sinks else None)


# (data, seq), (batch, seq_len, q_heads, kv_heads, head_dim), num_segments, sliding_window,
# sinks
WINDOW_CASES = [
    ((1, 8), (1, 64, 8, 2, 8), 3, 1, True),     # a token sees only itself, GQA, packed
    ((1, 8), (1, 64, 8, 8, 8), 0, 5, False),    # window < shard (8 tokens)
    ((2, 4), (2, 37, 6, 2, 8), 5, 12, True),    # crosses shards, S % P != 0, packed, padded
    ((2, 4), (2, 40, 4, 1, 8), 0, 40, False),   # window = S, MQA
    ((1, 8), (1, 24, 8, 4, 8), 2, 100, False),  # window > S
]


@pytest.mark.parametrize("mesh_shape,shape,num_segments,window,sinks", WINDOW_CASES)
def test_sliding_window_matches_dense_reference(mesh_shape, shape, num_segments, window, sinks):
  mesh = mesh_of(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(9, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                                                     sliding_window=window, sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=F32_TOL, sliding_window=window,
                           sinks=large_sinks(shape[2], seed=1) if sinks else None)


def test_cudnn_window_is_transformers_window():
  """``local_window_size=(W - 1, 0)`` with ``is_causal`` (what the cuDNN backend passes) masks
  exactly as ``dense_attention``'s ``sliding_window=W``; checked on jax's XLA implementation,
  which builds the mask cuDNN is given."""
  q, k, v, _, _ = random_inputs(10, 1, 40, 4, 2, 8)
  for window in (1, 7, 40):
    jax_out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           local_window_size=(window - 1, 0))
    assert relative_error(jax_out, dense_attention(q, k, v, sliding_window=window)) < F32_TOL


def test_kernel_backends_get_the_window(monkeypatch):
  """``local_attention`` hands the window to the Pallas kernels and to cuDNN."""
  seen = []
  monkeypatch.setattr(fa, "flash_attention", lambda *a, **kw: seen.append(kw))
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: seen.append(kw))
  q, k, v, _, _ = random_inputs(11, 1, 16, 2, 2, 8)
  for backend in ("pallas", "pallas_mosaic", "cudnn"):
    backends.local_attention(backend, q, k, v, causal=True, segment_ids=None, scale=None,
                             sliding_window=5)
  assert [kw.get("sliding_window") for kw in seen[:2]] == [5, 5]
  assert [kw["forward_kernel"] for kw in seen[:2]] == ["triton", "mosaic"]
  assert seen[2]["local_window_size"] == (4, 0)


def test_auto_backend_with_a_window_on_gpus(monkeypatch):
  """On (simulated) Hopper GPUs a windowed layer gets the Mosaic kernels as an unwindowed one
  does (every Pallas kernel takes the window); inside ring attention no Pallas kernel does,
  and "auto" says why."""
  from ulysses_jax.kernels import target as target_lib
  monkeypatch.setitem(target_lib._CAPABILITIES, H100, 9.0)
  device = AbstractDevice(device_kind=H100, num_cores=132, platform="gpu")
  case = dict(dtype=jnp.bfloat16, head_dim=128, num_q_heads=32, num_kv_heads=8, causal=True,
              segment_ids_given=False, sliding_window=256)
  with jax.sharding.use_abstract_mesh(AbstractMesh((1, 8), (DATA, SEQ), abstract_device=device)):
    plain = backends.choose_backend(**case, ring_attention=False)
    ring = backends.choose_backend(**case, ring_attention=True)
    two_steps = backends.choose_backend(**case, ring_attention=True,
                                        ring_window_in_two_steps=True)
    resolved = backends.resolve_backend("pallas_mosaic", **case)
  assert (plain.backend, plain.fallbacks) == ("pallas_mosaic", ("pallas", "cudnn", "xla"))
  assert plain.reason.startswith("our Mosaic GPU (Hopper) kernels for bfloat16, head dim 128, "
                                 "32 query / 8 KV heads, causal mask, no segment ids, sliding "
                                 "window 256 on NVIDIA H100")
  assert (ring.backend, ring.fallbacks) == ("xla", ())
  assert "ring attention cannot use it with sliding_window" in ring.reason
  # A window within a ring device's tokens (natural layout): the kernels run it (not cuDNN).
  assert (two_steps.backend, two_steps.fallbacks) == ("pallas_mosaic", ("pallas", "xla"))
  assert resolved == "pallas_mosaic"


@pytest.mark.parametrize("causal", [False, True])
def test_negative_segment_ids_are_segments_like_any_other(causal):
  """-1 and -2 are ordinary ids (padding uses reserved int32 values), also where the sequence
  is padded (S % P != 0) and blocks are padded inside the local attention."""
  mesh = mesh_of(2, 4)
  q, k, v, d_out, segment_ids = random_inputs(3, 2, 37, 6, 2, 8, num_segments=4)
  segment_ids = segment_ids - 2  # ids -2, -1, 0, 1
  fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal,
                                         segment_ids=segment_ids)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL)


@pytest.mark.parametrize("mesh_shape,shape,causal,num_segments,sinks", CASES[2:7:2])
def test_matches_dense_reference_bfloat16(mesh_shape, shape, causal, num_segments, sinks):
  mesh = mesh_of(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(1, *shape, dtype=jnp.bfloat16,
                                              num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: ulysses_attention(q, k, v, mesh=mesh, causal=causal,
                                                     segment_ids=segment_ids, sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=BF16_TOL, sinks=large_sinks(shape[2]) if sinks else None)


@pytest.mark.parametrize("mesh_shape,shape,causal,num_segments",
                         [CASES[1][:4], CASES[5][:4]])
def test_allgather_baseline_matches_dense_reference(mesh_shape, shape, causal, num_segments):
  mesh = mesh_of(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(2, *shape, num_segments=num_segments)
  fn = lambda q, k, v: allgather_kv_attention(q, k, v, mesh=mesh, causal=causal,
                                              segment_ids=segment_ids)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL)


# Shrinking recompiles for every candidate; a failure prints its full example instead.
@hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                     phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate))
@hypothesis.given(
    mesh_shape=st.sampled_from([(1, 8), (2, 4), (4, 2), (1, 2)]),
    batch_per_shard=st.integers(1, 2), seq_len=st.integers(1, 40),
    kv_heads=st.integers(1, 5), groups=st.integers(1, 3),
    causal=st.booleans(), num_segments=st.integers(0, 4))
def test_random_configurations(mesh_shape, batch_per_shard, seq_len, kv_heads, groups, causal,
                               num_segments):
  mesh = mesh_of(*mesh_shape)
  shape = (mesh_shape[0] * batch_per_shard, seq_len, kv_heads * groups, kv_heads, 8)
  q, k, v, d_out, segment_ids = random_inputs(seq_len, *shape, num_segments=num_segments)
  fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=causal,
                                         segment_ids=segment_ids)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL)


def _rank_coded(shape):
  """Every element encodes its own (batch, seq, head, dim) index, so misplacement shows."""
  return jnp.asarray(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
def test_all_to_all_pair_is_exact_round_trip(mesh_shape):
  mesh = mesh_of(*mesh_shape)
  x = _rank_coded((2, 16, 8, 3))
  seq_sharded, head_sharded = P(DATA, SEQ, None, None), P(DATA, None, SEQ, None)
  to_heads = jax.shard_map(ulysses.seq_to_heads, mesh=mesh, in_specs=seq_sharded,
                           out_specs=head_sharded)
  to_seq = jax.shard_map(ulysses.heads_to_seq, mesh=mesh, in_specs=head_sharded,
                         out_specs=seq_sharded)
  heads = jax.jit(to_heads)(x)
  # Globally the array is unchanged: each device now holds all S tokens of H/P heads.
  np.testing.assert_array_equal(heads, x)
  local = heads.addressable_shards[0].data
  assert local.shape == (2 // mesh_shape[0], 16, 8 // mesh_shape[1], 3)
  np.testing.assert_array_equal(jax.jit(to_seq)(heads), x)


@pytest.mark.parametrize("q_heads,kv_heads,shards", [
    (32, 8, 8), (32, 8, 16), (6, 3, 8), (6, 6, 4), (12, 6, 4), (1, 1, 8), (28, 4, 8)])
def test_head_plan_divides_and_keeps_groups(q_heads, kv_heads, shards):
  plan = ulysses.plan_heads(q_heads, kv_heads, shards)
  assert plan.exchanged_q_heads % shards == 0 and plan.exchanged_kv_heads % shards == 0
  assert plan.padded_groups % plan.kv_repeat == 0
  assert plan.exchanged_q_heads >= q_heads


def test_head_plan_prefers_replication_over_padding():
  assert ulysses.plan_heads(32, 8, 8) == ulysses.HeadPlan(8, 4, 8, 4, 1)   # as is
  assert ulysses.plan_heads(32, 8, 16) == ulysses.HeadPlan(8, 4, 8, 4, 2)  # KV x2, no padding
  assert ulysses.plan_heads(12, 6, 4) == ulysses.HeadPlan(6, 2, 6, 2, 2)   # KV x2, no padding
  assert ulysses.plan_heads(6, 6, 4).exchanged_q_heads == 8                # MHA: 2 zero heads


def test_sharded_inputs_give_sharded_output_and_no_recompile():
  mesh = mesh_of(2, 4)
  q, k, v, _, segment_ids = random_inputs(3, 2, 32, 8, 4, 8, num_segments=3)
  sharding = NamedSharding(mesh, P(DATA, SEQ, None, None))
  q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
  out = ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids)
  assert out.sharding.is_equivalent_to(sharding, 4)
  compiled = ulysses._ulysses_attention._cache_size()
  out2 = ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids)
  assert ulysses._ulysses_attention._cache_size() == compiled
  np.testing.assert_array_equal(out, out2)
  under_jit = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh,
                                                        segment_ids=segment_ids))(q, k, v)
  np.testing.assert_allclose(under_jit, out, rtol=1e-6, atol=1e-6)


def test_compiled_program_uses_all_to_all_and_never_gathers_qkv():
  mesh = mesh_of(1, 8)
  q, k, v, _, segment_ids = random_inputs(4, 1, 64, 8, 8, 16, num_segments=2)
  fn = jax.jit(lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, segment_ids=s))
  found = hlo.collectives(fn.lower(q, k, v, segment_ids).compile().as_text())
  local_qkv_bytes = 1 * 64 * 8 * 16 * 4 // 8
  all_to_all = [nbytes for op, _, nbytes in found if op == "all-to-all"]
  assert sum(all_to_all) == 4 * local_qkv_bytes, found  # q, k, v in; out back
  # The only gather allowed is of the [B, S] int32 segment ids, never of [B, S, H, D] tensors.
  gathered = [shape.split("{")[0] for op, shape, _ in found if op == "all-gather"]
  assert gathered == ["s32[1,64]"], found


@pytest.mark.parametrize("kwargs,message", [
    (dict(q_shape=(2, 16, 4)), r"q must have rank 4"),
    (dict(k_shape=(2, 16, 3, 8)), r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    (dict(k_shape=(2, 16, 2, 4)), r"must match q's \(2, 16, _, 8\)"),
    (dict(v_shape=(2, 16, 1, 8)), r"k and v must have the same shape"),
    (dict(dtype_k=jnp.bfloat16), r"q, k, v must share one dtype"),
    (dict(q_dtype=jnp.int32), r"q must be a floating dtype"),
    (dict(segment_shape=(2, 15)), r"segment_ids must have shape \[batch, seq\] = \(2, 16\)"),
    (dict(segment_dtype=jnp.float32), r"segment_ids must be integers"),
    (dict(segment_value=-2**31), r"segment_ids must be >= -2147483645 \(lower int32 values mark "
     r"padding\), got -2147483648; renumber the segments"),
    (dict(q_shape=(3, 16, 4, 8), k_shape=(3, 16, 2, 8)), r"batch \(3\) must be divisible by "
     r"the mesh's data axis \(2\)"),
    (dict(backend="flash"), r"backend must be one of \('auto', 'xla', 'pallas', 'cudnn', "
     r"'pallas_mosaic'\)"),
    (dict(backend="cudnn"), r"backend='cudnn' needs a CUDA GPU"),
    (dict(backend="pallas_mosaic"), r"backend='pallas_mosaic' needs float16 or bfloat16 inputs "
     r"and head dim in \(64, 128\), got float32 and 8; use backend='pallas'"),
    (dict(scale=-1.0), r"scale must be a positive number"),
    (dict(mesh="bad"), r"mesh must be a jax.sharding.Mesh"),
    (dict(mesh="no_seq"), r"lack \['seq'\]"),
    (dict(sliding_window=0), r"sliding_window must be a positive int"),
    (dict(sliding_window=4, causal=False), r"sliding_window \(4\) needs causal=True"),
    (dict(sinks=jnp.zeros(2)), r"sinks must be a float32 array of shape \[query heads\] = "
     r"\(4,\), one logit per query head, got float32\[2\]"),
    (dict(sinks=jnp.zeros(4, jnp.int32)), r"sinks must be a float32 array .* got int32\[4\]"),
])
def test_bad_input_errors(kwargs, message):
  q_shape = kwargs.get("q_shape", (2, 16, 4, 8))
  k_shape = kwargs.get("k_shape", (2, 16, 2, 8))
  q = jnp.zeros(q_shape, kwargs.get("q_dtype", jnp.float32))
  k = jnp.zeros(k_shape, kwargs.get("dtype_k", jnp.float32))
  v = jnp.zeros(kwargs.get("v_shape", k_shape), jnp.float32)
  segment_ids = jnp.full(kwargs.get("segment_shape", q_shape[:2]),
                         kwargs.get("segment_value", 0), kwargs.get("segment_dtype", jnp.int32))
  mesh = {"bad": "bad", "no_seq": jax.make_mesh((8,), ("data",))}.get(kwargs.get("mesh"),
                                                                       mesh_of(2, 4))
  with pytest.raises(ValueError, match=message):
    ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                      backend=kwargs.get("backend", "auto"), scale=kwargs.get("scale"),
                      causal=kwargs.get("causal", True),
                      sliding_window=kwargs.get("sliding_window"), sinks=kwargs.get("sinks"))
