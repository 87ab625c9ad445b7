"""Pallas flash attention against the dense oracle: forward, lse and dq/dk/dv.

On CPU every kernel runs in Pallas interpret mode, which fills output buffers with NaN before
the kernel runs (checked below), so any element a kernel fails to write shows up as NaN.
Shapes are tiny and blocks small so that a sequence spans several query and key blocks, and
most lengths are not a multiple of the block size.

Tolerances: relative L2 error (``attention_cases``) below 1e-5 for float32 and 2e-2 for
bfloat16 / float16 inputs; lse below 1e-5 absolute-or-relative for float32.

The Hopper (Mosaic GPU) kernels: ``test_flash_hopper.py``; both run on a real GPU at the end.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_cases import (BF16_TOL, F32_TOL, assert_matches_reference,
                             check_flash_against_reference, flash_outputs_and_grads, large_sinks,
                             mesh_of, random_inputs)
from ulysses_jax import ulysses_attention
from ulysses_jax.attention.reference import attention_mask, dense_attention
from ulysses_jax.kernels import flash_hopper, flash_hopper_backward, flash_kernels
from ulysses_jax.kernels.flash_attention import choose_tiles, flash_attention


def test_interpret_mode_poisons_unwritten_outputs():
  """The premise of every check here: an element no kernel writes comes back NaN."""
  def writes_first_half(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]
  x = jnp.ones((32, 16), jnp.float32)
  out = pl.pallas_call(writes_first_half, grid=(2,),
                       in_specs=[pl.BlockSpec((16, 16), lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((16, 16), lambda i: (i, 0)),
                       out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
  assert np.all(np.asarray(out[:16]) == 1.0)
  assert np.all(np.isnan(np.asarray(out[16:])))


def test_gpu_interpret_mode_poisons_unwritten_outputs():
  """The same premise for the Mosaic kernel: a TMA copy writes half, the rest comes back NaN."""
  def writes_first_half(x_ref, o_ref):
    def scoped(buffer, barrier):
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, 64)], buffer, barrier.at[0])
      plgpu.barrier_wait(barrier.at[0])
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buffer, o_ref.at[pl.ds(0, 64)])
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped, plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_barriers=1))
  x = jnp.ones((128, 64), jnp.float32)
  out = plgpu.kernel(writes_first_half, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                     interpret=flash_hopper.interpret_params())(x)
  assert np.all(np.asarray(out[:64]) == 1.0)
  assert np.all(np.isnan(np.asarray(out[64:])))


# (q_heads, kv_heads): GQA ratios 1, 2, 4, 8 and MQA.
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 2), (16, 2), (4, 1)],
                         ids=["mha", "gqa2", "gqa4", "gqa8", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference_gqa(heads, causal):
  # S = 72: the last key block of 16 is half padding, and one more block is padding only.
  q, k, v, d_out, _ = random_inputs(0, 2, 72, *heads, 64)
  check_flash_against_reference(q, k, v, d_out, causal=causal, block_q=32, block_kv=16)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference_head_dim_128(causal):
  # S a multiple of both blocks, and block_q < block_kv.
  q, k, v, d_out, _ = random_inputs(1, 1, 64, 4, 2, 128)
  check_flash_against_reference(q, k, v, d_out, causal=causal, block_q=16, block_kv=32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference_packed_segments(causal):
  q, k, v, d_out, segment_ids = random_inputs(2, 2, 90, 4, 2, 64, num_segments=5)
  check_flash_against_reference(q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           block_q=32, block_kv=32)


def test_rows_with_no_visible_key_give_zero():
  q, k, v, d_out, _ = random_inputs(3, 1, 48, 2, 1, 64)
  # Queries of segment 1 match no key (the keys use ids 0 and 2); segment 2 follows.
  q_ids = jnp.array([[0] * 10 + [1] * 20 + [2] * 18], jnp.int32)
  kv_ids = jnp.array([[0] * 10 + [3] * 20 + [2] * 18], jnp.int32)
  out, lse, *_ = check_flash_against_reference(q, k, v, d_out, causal=True, segment_ids=q_ids,
                                          kv_segment_ids=kv_ids, block_q=16, block_kv=16)
  empty = slice(10, 30)
  assert np.all(np.asarray(out[:, empty]) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, empty])))


def test_sinks_match_reference():
  """Large sinks applied through the kernels' lse: GQA, a window, packed segments with rows
  that see no key (their output 0, their lse the sink); out, lse, dq, dk, dv and d(sinks)."""
  q, k, v, d_out, _ = random_inputs(3, 1, 48, 4, 2, 64)
  q_ids = jnp.array([[0] * 10 + [1] * 20 + [2] * 18], jnp.int32)
  kv_ids = jnp.array([[0] * 10 + [3] * 20 + [2] * 18], jnp.int32)
  sinks = large_sinks(4)
  out, lse, *_ = check_flash_against_reference(q, k, v, d_out, causal=True, segment_ids=q_ids,
                                               kv_segment_ids=kv_ids, sliding_window=12,
                                               sinks=sinks, block_q=16, block_kv=16)
  empty = slice(10, 30)
  assert np.all(np.asarray(out[:, empty]) == 0.0)
  np.testing.assert_allclose(np.asarray(lse[0, :, empty]),
                             np.broadcast_to(np.asarray(sinks)[:, None], (4, 20)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matches_reference_low_precision(dtype):
  q, k, v, d_out, segment_ids = random_inputs(4, 1, 80, 4, 2, 64, dtype=dtype, num_segments=3)
  check_flash_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=BF16_TOL, block_q=32, block_kv=16)


def test_default_block_sizes():
  # Default blocks (interpret mode: the "other" table, 128 x 64 forward) capped to 256 rows.
  q, k, v, d_out, _ = random_inputs(5, 1, 200, 2, 1, 64)
  plan = choose_tiles(200, 64, causal=True, scale=0.125, interpret=True)
  assert (plan.forward.block_q, plan.forward.block_kv, plan.padded_len) == (128, 64, 256)
  check_flash_against_reference(q, k, v, d_out, causal=True)


def test_fully_masked_blocks_are_skipped():
  """Causal blocks that no query sees are never read: NaN there cannot leak into results."""
  q, k, v, d_out, _ = random_inputs(6, 1, 64, 2, 1, 64)
  d_lse = jnp.zeros((1, 2, 64))
  flash = lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=16, block_kv=16,
                                          return_lse=True)
  dense = lambda q, k, v: dense_attention(q, k, v, causal=True, return_lse=True)
  expected = flash_outputs_and_grads(dense, q, k, v, d_out, d_lse)
  # Keys after the first block: query block 0 (forward, dq) must not touch them.
  poisoned_kv = lambda x: x.at[:, 16:].set(jnp.nan)
  out, lse, dq, _, _ = flash_outputs_and_grads(flash, q, poisoned_kv(k), poisoned_kv(v), d_out,
                                               d_lse)
  for actual, wanted in ((out[:, :16], expected[0][:, :16]),
                         (lse[:, :, :16], expected[1][:, :, :16]),
                         (dq[:, :16], expected[2][:, :16])):
    np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-5)
  # Queries before the last key block: its dk/dv program must not touch them.
  _, _, _, dk, dv = flash_outputs_and_grads(flash, q.at[:, :48].set(jnp.nan), k, v, d_out, d_lse)
  for actual, wanted in ((dk[:, 48:], expected[3][:, 48:]), (dv[:, 48:], expected[4][:, 48:])):
    np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-5)


# Windows of one key, inside a block, across block edges, longer than a query block, longer
# than the sequence; 200 tokens (ragged) in blocks of 16 queries and 32 keys; GQA, packed.
@pytest.mark.parametrize("window", [1, 7, 33, 90, 500])
def test_sliding_window_matches_reference(window):
  q, k, v, d_out, segment_ids = random_inputs(5, 1, 200, 4, 2, 32, num_segments=3)
  check_flash_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           sliding_window=window, block_q=16, block_kv=32)


def test_sliding_window_matches_reference_bfloat16():
  q, k, v, d_out, _ = random_inputs(6, 1, 160, 2, 1, 64, dtype=jnp.bfloat16)
  check_flash_against_reference(q, k, v, d_out, causal=True, sliding_window=40, tol=BF16_TOL,
                           block_q=32, block_kv=16)


@pytest.mark.parametrize("seq_len,block_q,block_kv,window",
                         [(200, 16, 32, 7), (200, 32, 16, 40), (256, 64, 64, 1),
                          (100, 16, 16, 300)])
def test_sliding_window_ranges_skip_only_hidden_blocks(seq_len, block_q, block_kv, window):
  """Per query block: blocks outside [first, n_visible) are hidden from all its queries, and
  blocks in [plain_from, n_plain) visible to all of them (so they need no mask)."""
  plan = choose_tiles(seq_len, 64, causal=True, scale=1.0, interpret=True, block_q=block_q,
                      block_kv=block_kv, sliding_window=window)
  mask = np.array(attention_mask(plan.padded_len, plan.padded_len, causal=True,
                                  sliding_window=window))[0]
  mask[:, seq_len:] = False  # padded keys
  for qb in range(plan.padded_len // block_q):
    n_plain, n_visible = flash_kernels.kv_ranges(plan, qb, block_q, block_kv,
                                                 plan.padded_len // block_kv)
    first, plain_from = flash_kernels.window_kv_ranges(plan, qb, block_q, block_kv, n_plain)
    rows = mask[qb * block_q:(qb + 1) * block_q]
    tiles = rows.reshape(block_q, -1, block_kv)
    seen = tiles.any(axis=(0, 2)).nonzero()[0]
    if seen.size:
      assert int(first) <= seen.min() and seen.max() < int(n_visible), qb
    assert tiles[:, int(plain_from):int(n_plain)].all(), qb
    if qb * block_q < seq_len:  # a query block of real tokens visits about W keys, not all
      assert int(n_visible) - int(first) <= -(-(block_q + window) // block_kv) + 1, qb


@pytest.mark.parametrize("seq_len,block_q,block_kv,window",
                         [(200, 16, 32, 7), (200, 32, 16, 40), (256, 64, 64, 1),
                          (100, 16, 16, 300), (456, 64, 128, 130), (200, 16, 32, None)])
def test_query_block_ranges_skip_only_hidden_blocks(seq_len, block_q, block_kv, window):
  """The dk/dv kernels' ranges (Triton and Mosaic), per key block: query blocks outside [lo,
  end) see none of its keys (or are padding), those in [mid, plain_end) all of them; with a
  window a key block is seen by about (block_kv + W) / block_q query blocks, not all after it."""
  plan = choose_tiles(seq_len, 64, causal=True, scale=1.0, interpret=True, block_q=block_q,
                      block_kv=block_kv, sliding_window=window)
  mask = np.array(attention_mask(plan.padded_len, plan.padded_len, causal=True,
                                  sliding_window=window))[0]
  mask[seq_len:] = False  # padded queries add nothing
  for kb in range(plan.padded_len // block_kv):
    lo, mid, plain_end, end = (int(x) for x in flash_kernels.q_block_ranges(
        plan, kb * block_kv, block_kv, block_q))
    assert lo <= mid <= plain_end <= end, (kb, lo, mid, plain_end, end)
    tiles = mask[:, kb * block_kv:(kb + 1) * block_kv].reshape(-1, block_q, block_kv)
    seen = tiles.any(axis=(1, 2)).nonzero()[0]
    if seen.size:
      assert lo <= seen.min() and seen.max() < end, kb
    real = (np.arange(len(tiles)) + 1) * block_q <= seq_len  # query blocks without padding
    assert tiles[mid:plain_end][real[mid:plain_end]].all(), kb
    if window is not None:
      assert end - lo <= -(-(block_kv + window) // block_q) + 1, kb


# A window of 11 crosses the 16-token shards and the kernels' blocks.
@pytest.mark.parametrize("window", [None, 11])
def test_through_ulysses_attention_on_8_devices(window):
  mesh = mesh_of(2, 4)
  q, k, v, d_out, segment_ids = random_inputs(7, 2, 64, 8, 4, 32, num_segments=3)
  fn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True,
                                         segment_ids=segment_ids, backend="pallas",
                                         sliding_window=window)
  assert_matches_reference(fn, q, k, v, d_out, causal=True, segment_ids=segment_ids, tol=F32_TOL,
                           sliding_window=window)


def test_block_plan_per_head_dim_and_generation():
  hopper = choose_tiles(16384, 128, causal=True, scale=1.0, generation="sm90")
  assert (hopper.forward.block_q, hopper.forward.block_kv) == (128, 128)
  assert hopper.forward.num_warps == 8
  assert hopper.padded_len == 16384 and not hopper.ragged
  other = choose_tiles(16384, 256, causal=True, scale=1.0, generation="other")
  assert (other.forward.block_q, other.forward.block_kv) == (64, 32)
  overridden = choose_tiles(1000, 64, causal=False, scale=1.0, block_q=256, block_kv=32,
                            generation="sm90")
  assert {t.block_q for t in (overridden.forward, overridden.dq, overridden.dkv)} == {256}
  assert {t.block_kv for t in (overridden.forward, overridden.dq, overridden.dkv)} == {32}
  assert overridden.padded_len == 1024 and overridden.ragged
  short = choose_tiles(20, 64, causal=True, scale=1.0, generation="sm90")
  assert (short.forward.block_q, short.forward.block_kv, short.padded_len) == (32, 32, 32)


@pytest.mark.parametrize("change,message", [
    (dict(q=jnp.zeros((4, 2, 64))), r"q must be \[B, S, H, D\] \(rank 4\)"),
    (dict(q=jnp.zeros((1, 8, 3, 64))), r"query heads \(3\) must be a multiple of KV heads \(2\)"),
    (dict(q=jnp.zeros((1, 8, 2, 48)), k=jnp.zeros((1, 8, 2, 48)), v=jnp.zeros((1, 8, 2, 48))),
     r"head dim 48 is not supported"),
    (dict(k=jnp.zeros((1, 9, 2, 64))), r"expected k and v of shape"),
    (dict(v=jnp.zeros((1, 8, 2, 64), jnp.bfloat16)), r"must share a dtype"),
    (dict(q=jnp.zeros((1, 8, 2, 64), jnp.int32)), r"q.dtype must be one of"),
    (dict(segment_ids=jnp.zeros((1, 7), jnp.int32)), r"segment_ids must be integers of shape"),
    (dict(segment_ids=jnp.zeros((1, 8), jnp.float32)), r"segment_ids must be integers of shape"),
    (dict(kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), r"kv_segment_ids needs segment_ids"),
    (dict(block_q=48), r"block_q must be a power of two >= 16, got 48"),
    (dict(block_kv=8), r"block_kv must be a power of two >= 16, got 8"),
    (dict(forward_kernel="cutlass"), r"forward_kernel must be one of \('triton', 'mosaic'\)"),
    (dict(backward_kernel="cuda"), r"backward_kernel must be one of \('triton', 'mosaic'\)"),
    (dict(forward_kernel="mosaic"), r"'mosaic' needs bfloat16 or float16 inputs .* float32"),
    (dict(q=jnp.zeros((1, 8, 2, 64), jnp.bfloat16), k=jnp.zeros((1, 8, 2, 64), jnp.bfloat16),
          v=jnp.zeros((1, 8, 2, 64), jnp.bfloat16), forward_kernel="mosaic", block_q=64),
     r"'mosaic' needs block_q a multiple of 128 and block_kv a multiple of 64, got 64"),
    (dict(q=jnp.zeros((1, 8, 2, 256), jnp.bfloat16), k=jnp.zeros((1, 8, 2, 256), jnp.bfloat16),
          v=jnp.zeros((1, 8, 2, 256), jnp.bfloat16), backward_kernel="mosaic"),
     r"backward_kernel='mosaic' needs .* head dim in \(64, 128\), got bfloat16 and 256; use "
     r"backward_kernel='triton'"),
    (dict(q=jnp.zeros((1, 8, 2, 64), jnp.bfloat16), k=jnp.zeros((1, 8, 2, 64), jnp.bfloat16),
          v=jnp.zeros((1, 8, 2, 64), jnp.bfloat16), backward_kernel="mosaic", block_kv=64),
     r"backward_kernel='mosaic' needs block_q a multiple of 128 and block_kv a multiple of 128, "
     r"got None and 64"),
    (dict(sliding_window=4, causal=False), r"sliding_window \(4\) needs causal=True"),
    (dict(sliding_window=0), "sliding_window must be a positive int"),
])
def test_invalid_inputs_raise_clear_errors(change, message):
  args = dict(q=jnp.zeros((1, 8, 2, 64)), k=jnp.zeros((1, 8, 2, 64)), v=jnp.zeros((1, 8, 2, 64)))
  args.update(change)
  with pytest.raises(ValueError, match=message):
    flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


# (forward, backward) kernels on the GPU; the Mosaic ones need Hopper, the Mosaic backward head
# dims 64 or 128.
GPU_KERNELS = [("triton", "triton"), ("mosaic", "triton"), ("mosaic", "mosaic")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", GPU_KERNELS, ids=["+".join(k) for k in GPU_KERNELS])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_compiled_gpu_kernels_match_reference(kernels, head_dim, causal):
  """The kernels compiled for the GPU, default blocks, ragged length, GQA, with and without
  segments, and with large sinks."""
  forward_kernel, backward_kernel = kernels
  if backward_kernel == "mosaic" and head_dim not in flash_hopper_backward.HEAD_DIMS:
    pytest.skip(f"the Mosaic backward takes head dims {flash_hopper_backward.HEAD_DIMS}")
  q, k, v, d_out, segment_ids = random_inputs(8, 2, 1000, 8, 2, head_dim,
                                              dtype=jnp.bfloat16, num_segments=4)
  for ids, sinks in ((None, None), (segment_ids, None), (segment_ids, large_sinks(8))):
    check_flash_against_reference(q, k, v, d_out, causal=causal, segment_ids=ids, tol=BF16_TOL,
                                  sinks=sinks, interpret=False, forward_kernel=forward_kernel,
                                  backward_kernel=backward_kernel)
