"""Ring attention and the Ulysses x ring hybrid against the dense oracle, on 8 CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (BF16_TOL, F32_TOL, assert_matches_reference, large_sinks,
                             random_inputs)
from ulysses_jax import make_mesh, ulysses_attention
from ulysses_jax.aot import hlo
from ulysses_jax.attention import ulysses, zigzag
from ulysses_jax.attention.baselines import ring_attention
from ulysses_jax.mesh import DATA, RING, SEQ, ring_size, sequence_axes


def _mesh(data, seq, ring_shards):
  return make_mesh(data=data, seq=seq, ring=ring_shards,
                   devices=jax.devices()[:data * seq * ring_shards])


# (data, seq, ring), (batch, seq_len, q_heads, kv_heads, head_dim), causal, num_segments,
# sinks (large attention sinks, applied once after the ring's merge). ring=1 is plain Ulysses,
# seq=1 plain ring (through ulysses_attention).
FAST = [
    ((1, 1, 8), (1, 64, 4, 2, 8), True, 3, True),    # plain ring, GQA, packed
    ((1, 2, 4), (1, 37, 4, 1, 8), True, 4, True),    # MQA (Hkv < seq*ring), S % 16 != 0, packed
    ((1, 4, 2), (2, 40, 8, 2, 8), False, 3, False),  # not causal, Hkv < seq*ring, packed
    ((1, 8, 1), (1, 24, 8, 8, 8), True, 2, False),   # plain Ulysses
]
SLOW = [
    ((1, 1, 8), (1, 30, 2, 1, 8), False, 0, True),   # S % 8 != 0, not causal
    ((1, 2, 4), (1, 48, 6, 3, 8), False, 2, True),   # Hq % seq != 0 after GQA: padded heads
    ((1, 4, 2), (1, 44, 4, 4, 16), True, 3, False),  # MHA, S % 16 != 0
    ((2, 2, 2), (2, 33, 4, 2, 8), True, 0, True),    # data x seq x ring, S odd
    ((1, 8, 1), (1, 20, 4, 2, 8), False, 3, False),
]


@pytest.mark.parametrize("mesh_shape,shape,causal,num_segments,sinks",
                         FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_hybrid_matches_dense_reference(mesh_shape, shape, causal, num_segments, sinks):
  mesh = _mesh(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(0, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: ulysses_attention(q, k, v, mesh=mesh, causal=causal,
                                                     segment_ids=segment_ids, sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL, sinks=large_sinks(shape[2]) if sinks else None)


@pytest.mark.parametrize("mesh_shape,shape,causal,num_segments,sinks", [
    ((1, 8, 1), (1, 44, 4, 1, 8), True, 3, True),                           # ring over seq
    pytest.param((2, 4, 1), (2, 27, 2, 2, 8), False, 2, False, marks=pytest.mark.slow),
    pytest.param((1, 2, 4), (1, 40, 4, 2, 8), True, 0, True,                # ring x seq
                 marks=pytest.mark.slow),
])
def test_ring_attention_matches_dense_reference(mesh_shape, shape, causal, num_segments, sinks):
  mesh = _mesh(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(1, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: ring_attention(q, k, v, mesh=mesh, causal=causal,
                                                  segment_ids=segment_ids, sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL, sinks=large_sinks(shape[2], seed=2) if sinks else None)


# The Pallas flash kernel as the ring's local attention (interpret mode on CPU): causal steps
# after the first run as the zigzag layout's chunk tiles. Head dim 16, the kernel's smallest.
@pytest.mark.parametrize("attention,mesh_shape,shape,causal,num_segments,sinks", [
    (ulysses_attention, (1, 1, 8), (1, 64, 4, 2, 16), True, 3, False),  # plain ring, GQA, packed
    (ulysses_attention, (1, 2, 4), (1, 37, 4, 1, 16), True, 4, True),   # hybrid, MQA, padded
    (ring_attention, (1, 4, 1), (1, 44, 4, 1, 16), True, 3, False),     # ring over seq, padded
    pytest.param(ulysses_attention, (1, 2, 2), (2, 40, 4, 2, 16), False, 2, True,
                 marks=pytest.mark.slow),
])
def test_pallas_backend_matches_dense_reference(attention, mesh_shape, shape, causal,
                                                num_segments, sinks):
  mesh = _mesh(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(6, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: attention(q, k, v, mesh=mesh, causal=causal,
                                             segment_ids=segment_ids, backend="pallas",
                                             sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           tol=F32_TOL, sinks=large_sinks(shape[2], seed=3) if sinks else None)


# The Pallas kernels in a windowed ring (W <= S/R, natural layout): the own block under the
# window, and the previous device's tail reversed into a causal attention. Windows of 2 (one
# tail key), across device boundaries, and exactly S/R; padded lengths, packed segments; sinks.
@pytest.mark.parametrize("attention,mesh_shape,shape,num_segments,window,sinks", [
    (ring_attention, (1, 8, 1), (1, 64, 4, 2, 16), 3, 5, True),       # S/R = 8, GQA, packed
    (ulysses_attention, (1, 2, 4), (1, 37, 4, 1, 16), 4, 10, False),  # hybrid, MQA, S/R = W
    (ring_attention, (1, 4, 1), (1, 44, 2, 2, 16), 0, 2, False),      # one key of the tail
])
def test_pallas_backend_in_a_windowed_ring_matches_dense_reference(attention, mesh_shape, shape,
                                                                   num_segments, window, sinks):
  mesh = _mesh(*mesh_shape)
  q, k, v, d_out, segment_ids = random_inputs(8, *shape, num_segments=num_segments)
  fn = lambda q, k, v, sinks=None: attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                                             backend="pallas", sliding_window=window,
                                             sinks=sinks)
  assert f"flash_attention_forward_causal_window{window}" in str(jax.make_jaxpr(fn)(q, k, v))
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=F32_TOL, sliding_window=window,
                           sinks=large_sinks(shape[2], seed=4) if sinks else None)


def test_the_mosaic_backend_runs_its_kernels_in_every_ring_step():
  """The wiring only, as for plain Ulysses (tests/test_flash_attention.py: GPU interpret mode
  deadlocks when eight devices each simulate three warpgroups): each step case of the forward
  and of the backward calls the Mosaic kernels, and no Triton kernel is left. The ring's math
  around any flash kernel is checked against the dense reference with backend="pallas"; the
  Mosaic kernels' own gradients of a key block in test_flash_attention.py."""
  mesh = _mesh(1, 2, 4)
  q, k, v, _, segment_ids = random_inputs(7, 1, 128, 4, 2, 64, dtype=jnp.bfloat16,
                                          num_segments=3)

  def loss(q, k, v, sinks):  # sinks add no kernel: they are applied to the merged output
    out = ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                            backend="pallas_mosaic", sinks=sinks)
    return out.astype(jnp.float32).sum()
  trace = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, large_sinks(4)))
  # Forward: a switch of the 3 step cases in the loop and one for the last step; backward: the
  # same two switches, each case a dq and a dk/dv kernel. The kernels' calls are jitted, so the
  # trace holds each distinct kernel once: forward, dq and dk/dv, causal (the diagonal step)
  # and not; every one a Mosaic kernel (a grid of three warpgroups).
  assert len(re.findall(r"name=_forward\b", trace)) == 2 * 3
  assert len(re.findall(r"name=_backward\b", trace)) == 2 * 3
  assert trace.count("num_threads=3, thread_name='wg'") == 3 * 2
  assert "num_warps" not in trace  # no Triton kernel (backend="pallas" traces 18 of those)


def test_the_mosaic_backend_runs_a_windowed_ring():
  """The wiring of a windowed ring (W <= S/R) with the Mosaic kernels: shift 0 and 1 forward,
  and a dq and a dk/dv kernel for each in the backward, all Mosaic (their math: the
  backend="pallas" test above and the Mosaic window tests of test_flash_attention.py)."""
  mesh = _mesh(1, 2, 4)
  q, k, v, _, segment_ids = random_inputs(7, 1, 128, 4, 2, 64, dtype=jnp.bfloat16,
                                          num_segments=3)

  def loss(q, k, v):
    out = ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                            backend="pallas_mosaic", sliding_window=16)
    return out.astype(jnp.float32).sum()
  trace = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
  assert trace.count("num_threads=3, thread_name='wg'") == 2 + 2 * 2
  assert "num_warps" not in trace


@pytest.mark.parametrize("attention,mesh_shape", [
    (ring_attention, (1, 4, 1)),
    pytest.param(ulysses_attention, (1, 2, 2), marks=pytest.mark.slow),
])
def test_zigzag_layout_on_the_data_side(attention, mesh_shape):
  """Inputs permuted once with to_zigzag, output permuted back: the same attention."""
  mesh = _mesh(*mesh_shape)
  ring_shards = ring_size(mesh) if attention is ulysses_attention else mesh.shape[SEQ]
  q, k, v, d_out, segment_ids = random_inputs(2, 2, 32, 4, 2, 8, num_segments=3)
  zig = lambda x: zigzag.to_zigzag(x, ring_shards)

  def fn(q, k, v):
    out = attention(zig(q), zig(k), zig(v), mesh=mesh, segment_ids=zig(segment_ids),
                    layout="zigzag")
    return zigzag.from_zigzag(out, ring_shards)
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=F32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_bfloat16(backend, sinks):
  mesh = _mesh(1, 2, 4)
  q, k, v, d_out, segment_ids = random_inputs(3, 1, 64, 4, 2, 16, dtype=jnp.bfloat16,
                                              num_segments=3)
  fn = lambda q, k, v, sinks=None: ulysses_attention(q, k, v, mesh=mesh,
                                                     segment_ids=segment_ids, backend=backend,
                                                     sinks=sinks)
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=BF16_TOL, sinks=large_sinks(4, seed=6) if sinks else None)


def test_zigzag_is_an_invertible_permutation():
  x = jnp.arange(2 * 24).reshape(2, 24)
  zig = zigzag.to_zigzag(x, 3)
  assert zigzag.zigzag_order(3).tolist() == [0, 5, 1, 4, 2, 3]
  np.testing.assert_array_equal(zig[0], np.concatenate(
      [np.arange(c * 4, c * 4 + 4) for c in (0, 5, 1, 4, 2, 3)]))
  np.testing.assert_array_equal(zigzag.from_zigzag(zig, 3), x)
  with pytest.raises(ValueError, match=r"divisible by 2\*ring_size = 6, got 20"):
    zigzag.to_zigzag(x[:, :20], 3)


@pytest.mark.parametrize("ring_shards", [2, 4, 8])
def test_zigzag_balances_the_causal_ring(ring_shards):
  """At every step after the first, every device computes exactly half of its block's tiles."""
  chunk = 4
  for device in range(ring_shards):
    q_pos = np.asarray(zigzag.chunk_positions(device, ring_shards, chunk, zigzag=True))
    for step in range(1, ring_shards):
      source = (device - step) % ring_shards
      kv_pos = np.asarray(zigzag.chunk_positions(source, ring_shards, chunk, zigzag=True))
      tile = lambda pos, i: pos[i * chunk:(i + 1) * chunk]
      visible = [[tile(q_pos, i)[:, None] >= tile(kv_pos, j)[None] for j in range(2)]
                 for i in range(2)]
      full = sum(tile.all() for row in visible for tile in row)
      empty = sum(not tile.any() for row in visible for tile in row)
      assert (full, empty) == (2, 2), (device, step)
  covered = np.sort(np.concatenate([np.asarray(zigzag.chunk_positions(d, ring_shards, chunk, True))
                                    for d in range(ring_shards)]))
  np.testing.assert_array_equal(covered, np.arange(2 * ring_shards * chunk))


def test_in_program_exchange_matches_to_zigzag():
  mesh = _mesh(1, 8, 1)
  x = jnp.arange(3 * 64, dtype=jnp.float32).reshape(3, 64)
  spec = jax.sharding.PartitionSpec(None, SEQ)
  exchange = lambda inverse: jax.jit(jax.shard_map(
      lambda x: zigzag.exchange(x, SEQ, 8, inverse=inverse), mesh=mesh, in_specs=spec,
      out_specs=spec))
  zig = exchange(False)(x)
  np.testing.assert_array_equal(zig, zigzag.to_zigzag(x, 8))
  np.testing.assert_array_equal(exchange(True)(zig), x)


def test_forward_moves_kv_around_the_ring_only():
  mesh = _mesh(1, 8, 1)
  q, k, v, _, _ = random_inputs(4, 1, 64, 4, 2, 16)
  fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=False))
  text = fn.lower(q, k, v).compile().as_text()
  # One K and one V block [1, 64/8, 2, 16] per step, in a loop of R-1 = 7 steps (the last
  # step needs no rotation). hlo.collectives lists the loop body once.
  assert [(op, shape.split("{")[0]) for op, shape, _ in hlo.collectives(text)] == [
      ("collective-permute", "f32[1,8,2,16]")] * 2
  assert '"known_trip_count":{"n":"7"}' in text


def test_backward_saves_local_blocks_only():
  """Residuals: q, k, v, out, lse of this device, not one K/V block per ring step."""
  mesh = _mesh(1, 1, 8)
  q, k, v, _, segment_ids = random_inputs(5, 1, 64, 4, 2, 16, num_segments=2)
  _, backward = jax.vjp(
      lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids), q, k, v)
  saved = [x for x in jax.tree.leaves(backward) if x.ndim > 1]  # leaves out scalar flags
  lse_bytes = 4 * 64 * 4
  assert sum(x.nbytes for x in saved) == (
      2 * q.nbytes + k.nbytes + v.nbytes + lse_bytes + segment_ids.nbytes), [
          (x.shape, x.dtype) for x in saved]


def test_inside_a_differentiated_layer_scan_the_ring_keeps_no_block_per_step():
  """A model runs attention inside a differentiated ``lax.scan`` over its layers: there too the
  ring keeps only its own q, k, v, output and lse, never an array per ring step (``[R - 1,
  ...]``: with a fori_loop JAX partial-evaluated the forward's loop, memory growing with R)."""
  mesh = _mesh(1, 1, 8)
  q, kv = jnp.ones((1, 128, 4, 16)), jnp.ones((1, 128, 2, 16))

  def layers(q, k, v):
    body = lambda c, _: (c + ulysses_attention(q + c, k, v, mesh=mesh, backend="xla").sum(),
                         None)
    return jax.lax.scan(body, jnp.zeros(()), None, length=2)[0]

  jaxpr = str(jax.make_jaxpr(jax.grad(layers, argnums=(0, 1, 2)))(q, kv, kv))
  assert not re.findall(r"\b\w+\[7,[0-9,]+\]", jaxpr)  # ring of 8: 7 steps from others


def test_mesh_axes():
  assert make_mesh(data=2, seq=4).axis_names == (DATA, SEQ)
  mesh = make_mesh(seq=2, ring=2)
  assert mesh.axis_names == (DATA, RING, SEQ)
  assert dict(mesh.shape) == {DATA: 2, RING: 2, SEQ: 2}
  assert sequence_axes(mesh) == (RING, SEQ) and ring_size(mesh) == 2
  assert sequence_axes(make_mesh(seq=8)) == (SEQ,) and ring_size(make_mesh(seq=8)) == 1
  with pytest.raises(ValueError, match=r"seq=2 x ring=3 does not divide the 8 available"):
    make_mesh(seq=2, ring=3)
  with pytest.raises(ValueError, match=r"mesh data=1 x seq=2 x ring=2 needs 4 devices"):
    make_mesh(data=1, seq=2, ring=2)
  with pytest.raises(ValueError, match=r"ring must be >= 1, got 0"):
    make_mesh(ring=0)


@pytest.mark.parametrize("call,message", [
    (lambda q, m: ring_attention(q, q, q, mesh=m, backend="cudnn"),
     r"ring attention supports backend 'auto', 'xla', 'pallas' or 'pallas_mosaic', got "
     r"'cudnn': it merges partial results by log-sum-exp"),
    (lambda q, m: ulysses_attention(q, q, q, mesh=m, backend="pallas_mosaic"),
     r"backend='pallas_mosaic' needs float16 or bfloat16 inputs and head dim in \(64, 128\), "
     r"got float32 and"),
    (lambda q, m: ulysses_attention(q, q, q, mesh=m, backend="flash"),
     r"backend must be one of \('auto', 'xla', 'pallas', 'cudnn', 'pallas_mosaic'\), got "
     r"'flash'"),
    (lambda q, m: ulysses_attention(q, q, q, mesh=m, layout="diagonal"),
     r"layout must be one of \('natural', 'zigzag'\)"),
    (lambda q, m: ulysses_attention(q[:, :12], q[:, :12], q[:, :12], mesh=m, layout="zigzag"),
     r"S divisible by 2\*ring \(8\) .* got S=12; pad the sequence to 16 tokens"),
    (lambda q, m: ulysses.ulysses_attention(q, q, q, mesh=m),
     r"is plain Ulysses and takes no ring, got a mesh with ring=4; call "
     r"ulysses_jax.ulysses_attention"),
    (lambda q, m: ulysses_attention(q, q, q, mesh=m, backend="pallas", sliding_window=5),
     r"sliding_window \(5\) inside ring attention needs backend='xla' or 'auto', got "
     r"'pallas': with a window over a ring device's 4 tokens"),
    (lambda q, m: ring_attention(q, q, q, mesh=m, causal=False, sliding_window=4),
     r"sliding_window \(4\) needs causal=True"),
])
def test_bad_input_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call(jnp.zeros((2, 16, 4, 8)), _mesh(2, 1, 4))


def test_padded_length():
  assert zigzag.padded_length(37, 4, 2) == 40          # 8 chunks of 5, halves of 10 split by 2
  assert zigzag.padded_length(37, 2, 4) == 40          # 4 chunks of 10, halves of 20 split by 4
  assert zigzag.padded_length(4000, 2) == 4096         # chunks above 512 tokens are whole blocks
  assert zigzag.padded_length(64, 8) == 64


# (attention, (data, seq, ring), (batch, seq_len, q_heads, kv_heads, head_dim), num_segments,
# sliding_window, layout, sinks); the local length after padding is S/R.
WINDOW_CASES = [
    (ring_attention, (1, 8, 1), (1, 64, 4, 2, 8), 3, 3, "natural", False),   # W < chunk
    (ring_attention, (1, 4, 1), (1, 44, 2, 1, 8), 2, 1, "natural", False),   # W = 1, MQA
    (ulysses_attention, (1, 2, 4), (1, 37, 4, 2, 8), 4, 12, "natural", True),  # W > S/R
    (ring_attention, (1, 4, 1), (1, 32, 2, 2, 8), 3, 5, "zigzag", True),     # zigzag inputs
    (ulysses_attention, (1, 1, 8), (1, 48, 2, 2, 8), 0, 48, "natural", False),  # W = S
]


@pytest.mark.parametrize("attention,mesh_shape,shape,num_segments,window,layout,sinks",
                         WINDOW_CASES)
def test_sliding_window_matches_dense_reference(attention, mesh_shape, shape, num_segments,
                                                window, layout, sinks):
  mesh = _mesh(*mesh_shape)
  ring_shards = ring_size(mesh) if attention is ulysses_attention else mesh.shape[SEQ]
  q, k, v, d_out, segment_ids = random_inputs(7, *shape, num_segments=num_segments)
  zig, unzig = ((lambda x: zigzag.to_zigzag(x, ring_shards), lambda x: zigzag.from_zigzag(
      x, ring_shards)) if layout == "zigzag" else (lambda x: x, lambda x: x))
  seg = None if segment_ids is None else zig(segment_ids)
  fn = lambda q, k, v, sinks=None: unzig(attention(
      zig(q), zig(k), zig(v), mesh=mesh, segment_ids=seg, sliding_window=window, layout=layout,
      sinks=sinks))
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=F32_TOL, sliding_window=window,
                           sinks=large_sinks(shape[2], seed=5) if sinks else None)


def test_window_sources_are_the_ring_distances_a_window_reaches():
  from ulysses_jax.attention.ring import _Ring
  ring = lambda window, zig: _Ring(SEQ, 4, True, None, 4, "xla", window, zig)
  shifts = lambda window, zig: [shift for shift, _ in ring(window, zig).window_sources(8)]
  assert shifts(1, False) == [0]       # a token sees itself only
  assert shifts(8, False) == [0, 1]    # W <= S/R: this device and the one before
  assert shifts(9, False) == [0, 1]    # query 8r sees 8r - 8, the first key before
  assert shifts(10, False) == [0, 1, 2]  # and 8r - 9, the last of device r - 2
  assert shifts(100, False) == [0, 1, 2, 3]
  # Natural order, shift 1: every device but 0 receives from the one before (0 would get 3's).
  assert ring(8, False).window_sources(8)[1][1] == ((0, 1), (1, 2), (2, 3))
  assert shifts(4, True) == [0, 1, 3]  # zigzag: chunks 0|7 1|6 2|5 3|4 neighbour both ways


def test_a_small_window_moves_one_kv_block_per_direction():
  """W <= S/R: one K and one V ppermute forward (no loop of R-1 rotations), and with the
  backward K, V out and dK, dV back: under 1/6 of the full ring's traffic."""
  mesh = _mesh(1, 8, 1)
  q, k, v, _, _ = random_inputs(4, 1, 64, 4, 2, 16)

  def permute_bytes(window, grad):
    attend = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, sliding_window=window)
    fn = jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2)) if grad else attend
    text = jax.jit(fn).lower(q, k, v).compile().as_text()
    return text, hlo.executed_collective_bytes(text)["collective-permute"]

  block = 1 * 8 * 2 * 16 * 4  # one [1, 64/8, 2, 16] float32 K or V block
  text, forward = permute_bytes(4, grad=False)
  assert forward == 2 * block  # executed bytes: no loop of rotations around them
  assert [op for op, _, _ in hlo.collectives(text)] == ["collective-permute"] * 2
  _, full_backward = permute_bytes(None, grad=True)
  _, backward = permute_bytes(4, grad=True)
  # K, V out (fetched again in the backward unless XLA reuses the forward's) and dK, dV back.
  assert 4 * block <= backward <= 6 * block
  assert full_backward > 6 * backward
