"""Pallas flash attention against the dense oracle: forward, lse and dq/dk/dv.

On CPU every kernel runs in Pallas interpret mode, which fills output buffers with NaN before
the kernel runs (checked below), so any element a kernel fails to write shows up as NaN.
Shapes are tiny and blocks small so that a sequence spans several query and key blocks, and
most lengths are not a multiple of the block size.

Tolerances: relative L2 error (``attention_cases``) below 1e-5 for float32 and 2e-2 for
bfloat16 / float16 inputs; lse below 1e-5 absolute-or-relative for float32.

The Hopper kernels (``forward_kernel="mosaic"``, ``backward_kernel="mosaic"``) run in Pallas'
GPU interpret mode, which simulates the three warpgroups, the slot barriers and the TMA copies
(its buffers also start as NaN); it needs several host devices (conftest sets 8): with one, its
simulated warpgroups block XLA's few CPU threads and a run can hang. Their wgmma forms are
checked by lowering for CUDA, and run in interpret mode where the installed JAX can
(``hopper_interpret``); ``test_hopper_races.py`` runs them under the race detector.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_cases import (BF16_TOL, F32_TOL, assert_matches_reference, mesh_of,
                             random_inputs, relative_error)
from benchmarks.kernel_resources import lowering_target
from ulysses_jax import ulysses_attention
from ulysses_jax.attention.reference import attention_mask, dense_attention
from ulysses_jax.kernels import flash_hopper, flash_hopper_backward, flash_kernels
from ulysses_jax.kernels.flash_attention import (choose_tiles, flash_attention,
                                                flash_attention_backward)


# Interpret-mode kernels become large XLA programs whose CPU compile dominates the test time;
# skipping LLVM's optimisation passes compiles them ~3x faster and changes no result.
_COMPILER_OPTIONS = ({"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu"
                     else {})


def _outputs_and_grads(attention, q, k, v, d_out, d_lse):
  """(out, lse, dq, dk, dv) of ``attention(q, k, v) -> (out, lse)`` for (d_out, d_lse)."""
  def run(q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(attention, q, k, v)
    return (out, lse, *vjp((d_out, d_lse)))
  args = (q, k, v, d_out, d_lse)
  return jax.jit(run).lower(*args).compile(compiler_options=_COMPILER_OPTIONS)(*args)


def _check_against_reference(q, k, v, d_out, *, causal, segment_ids=None, kv_segment_ids=None,
                             tol=F32_TOL, sliding_window=None, **kernel_args):
  """Compares out, lse and the gradients (with a random lse cotangent) with dense_attention."""
  kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  d_lse = jax.random.normal(jax.random.PRNGKey(7), (q.shape[0], q.shape[2], q.shape[1]))
  ours = _outputs_and_grads(
      lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                      kv_segment_ids=kv_segment_ids, return_lse=True,
                                      sliding_window=sliding_window, **kernel_args),
      q, k, v, d_out, d_lse)
  upcast = lambda x: x.astype(jnp.float32)
  expected = _outputs_and_grads(
      lambda q, k, v: dense_attention(q, k, v, causal=causal, q_segment_ids=segment_ids,
                                      kv_segment_ids=kv_ids, return_lse=True,
                                      sliding_window=sliding_window),
      upcast(q), upcast(k), upcast(v), upcast(d_out), d_lse)
  for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), ours, expected):
    assert actual.shape == wanted.shape, f"{name}: shape {actual.shape} != {wanted.shape}"
    assert actual.dtype == (jnp.float32 if name == "lse" else q.dtype), f"{name}: {actual.dtype}"
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
  _check_against_reference(q, k, v, d_out, causal=causal, block_q=32, block_kv=16)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference_head_dim_128(causal):
  # S a multiple of both blocks, and block_q < block_kv.
  q, k, v, d_out, _ = random_inputs(1, 1, 64, 4, 2, 128)
  _check_against_reference(q, k, v, d_out, causal=causal, block_q=16, block_kv=32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference_packed_segments(causal):
  q, k, v, d_out, segment_ids = random_inputs(2, 2, 90, 4, 2, 64, num_segments=5)
  _check_against_reference(q, k, v, d_out, causal=causal, segment_ids=segment_ids,
                           block_q=32, block_kv=32)


def test_rows_with_no_visible_key_give_zero():
  q, k, v, d_out, _ = random_inputs(3, 1, 48, 2, 1, 64)
  # Queries of segment 1 match no key (the keys use ids 0 and 2); segment 2 follows.
  q_ids = jnp.array([[0] * 10 + [1] * 20 + [2] * 18], jnp.int32)
  kv_ids = jnp.array([[0] * 10 + [3] * 20 + [2] * 18], jnp.int32)
  out, lse, *_ = _check_against_reference(q, k, v, d_out, causal=True, segment_ids=q_ids,
                                          kv_segment_ids=kv_ids, block_q=16, block_kv=16)
  empty = slice(10, 30)
  assert np.all(np.asarray(out[:, empty]) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, empty])))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matches_reference_low_precision(dtype):
  q, k, v, d_out, segment_ids = random_inputs(4, 1, 80, 4, 2, 64, dtype=dtype, num_segments=3)
  _check_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           tol=BF16_TOL, block_q=32, block_kv=16)


def test_default_block_sizes():
  # Default blocks (interpret mode: the "other" table, 128 x 64 forward) capped to 256 rows.
  q, k, v, d_out, _ = random_inputs(5, 1, 200, 2, 1, 64)
  plan = choose_tiles(200, 64, causal=True, scale=0.125, interpret=True)
  assert (plan.forward.block_q, plan.forward.block_kv, plan.padded_len) == (128, 64, 256)
  _check_against_reference(q, k, v, d_out, causal=True)


def test_fully_masked_blocks_are_skipped():
  """Causal blocks that no query sees are never read: NaN there cannot leak into results."""
  q, k, v, d_out, _ = random_inputs(6, 1, 64, 2, 1, 64)
  d_lse = jnp.zeros((1, 2, 64))
  flash = lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=16, block_kv=16,
                                          return_lse=True)
  dense = lambda q, k, v: dense_attention(q, k, v, causal=True, return_lse=True)
  expected = _outputs_and_grads(dense, q, k, v, d_out, d_lse)
  # Keys after the first block: query block 0 (forward, dq) must not touch them.
  poisoned_kv = lambda x: x.at[:, 16:].set(jnp.nan)
  out, lse, dq, _, _ = _outputs_and_grads(flash, q, poisoned_kv(k), poisoned_kv(v), d_out, d_lse)
  for actual, wanted in ((out[:, :16], expected[0][:, :16]),
                         (lse[:, :, :16], expected[1][:, :, :16]),
                         (dq[:, :16], expected[2][:, :16])):
    np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-5)
  # Queries before the last key block: its dk/dv program must not touch them.
  _, _, _, dk, dv = _outputs_and_grads(flash, q.at[:, :48].set(jnp.nan), k, v, d_out, d_lse)
  for actual, wanted in ((dk[:, 48:], expected[3][:, 48:]), (dv[:, 48:], expected[4][:, 48:])):
    np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-5)


# Windows of one key, inside a block, across block edges, longer than a query block, longer
# than the sequence; 200 tokens (ragged) in blocks of 16 queries and 32 keys; GQA, packed.
@pytest.mark.parametrize("window", [1, 7, 33, 90, 500])
def test_sliding_window_matches_reference(window):
  q, k, v, d_out, segment_ids = random_inputs(5, 1, 200, 4, 2, 32, num_segments=3)
  _check_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           sliding_window=window, block_q=16, block_kv=32)


def test_sliding_window_matches_reference_bfloat16():
  q, k, v, d_out, _ = random_inputs(6, 1, 160, 2, 1, 64, dtype=jnp.bfloat16)
  _check_against_reference(q, k, v, d_out, causal=True, sliding_window=40, tol=BF16_TOL,
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


# The Hopper kernels: every length spans several 128-row tiles (the last partly padding) and
# more key and query blocks than each kernel has pipeline slots, so every ring is refilled
# (checked below); segments cross tiles.
# All slow in interpret mode (CI runs them after `make test`); the full mask meets the Mosaic
# backward in the test after this one.
@pytest.mark.parametrize("seq_len,causal,heads,head_dim,segments", [
    pytest.param(456, True, (2, 1), 64, True, id="causal-gqa-packed", marks=pytest.mark.slow),
    pytest.param(400, False, (2, 1), 64, True, id="full-gqa-packed", marks=pytest.mark.slow),
    pytest.param(300, True, (2, 2), 128, False, id="causal-d128", marks=pytest.mark.slow)])
def test_mosaic_kernels_match_reference(seq_len, causal, heads, head_dim, segments):
  plan = choose_tiles(seq_len, head_dim, causal=causal, scale=1.0, interpret=True,
                      forward_kernel="mosaic", backward_kernel="mosaic")
  # Even under the causal mask the last query tile (forward, dq) and the first key tile (dk/dv)
  # stream every block.
  for block, tile in ((plan.forward.block_kv, plan.forward), (plan.dq.block_kv, plan.dq),
                      (plan.dkv.block_q, plan.dkv)):
    assert -(-seq_len // block) > tile.num_stages, (seq_len, tile)
  q, k, v, d_out, segment_ids = random_inputs(9, 1, seq_len, *heads, head_dim,
                                              dtype=jnp.bfloat16, num_segments=4)
  _check_against_reference(q, k, v, d_out, causal=causal,
                           segment_ids=segment_ids if segments else None, tol=BF16_TOL,
                           forward_kernel="mosaic", backward_kernel="mosaic")


# The Hopper kernels with a sliding window, against the dense reference: 400 tokens (four
# 128-row tiles, the last partly padding), GQA, packed segments crossing tiles; windows of one
# key, inside a key block (50), across block edges and not a block multiple (200), and longer
# than the sequence (as causal). Forward blocks: 128 keys; dq: 64 keys; dk/dv: 64 queries.
# Slow like the Mosaic tests above (about 10 s each on jax 0.12, 60 s on jax 0.10).
@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 50, 200, 1000])
def test_mosaic_kernels_with_a_sliding_window_match_reference(window):
  q, k, v, d_out, segment_ids = random_inputs(13, 1, 400, 2, 1, 64, dtype=jnp.bfloat16,
                                              num_segments=3)
  _check_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           sliding_window=window, tol=BF16_TOL, forward_kernel="mosaic",
                           backward_kernel="mosaic")


@pytest.mark.slow
def test_mosaic_kernels_skip_the_blocks_outside_the_window():
  """Blocks no query of a CTA sees through the window are neither copied nor computed: NaN
  there (where 0 * NaN would poison the result) cannot leak into that CTA's rows."""
  q, k, v, d_out, _ = random_inputs(14, 1, 512, 1, 1, 64, dtype=jnp.bfloat16)
  d_lse = jnp.zeros((1, 1, 512))
  window = 64
  flash = lambda q, k, v: flash_attention(q, k, v, causal=True, sliding_window=window,
                                          return_lse=True, forward_kernel="mosaic",
                                          backward_kernel="mosaic")
  f32 = lambda x: x.astype(jnp.float32)
  dense = lambda q, k, v: dense_attention(q, k, v, causal=True, sliding_window=window,
                                          return_lse=True)
  expected = _outputs_and_grads(dense, f32(q), f32(k), f32(v), f32(d_out), d_lse)
  # Query rows from 384 on (the last 128-row tile) see keys from 321 on: the forward (blocks of
  # 128 keys) and dq (blocks of 64) must not touch keys before 256.
  poisoned = lambda x: x.at[:, :256].set(jnp.nan)
  out, lse, dq, _, _ = _outputs_and_grads(flash, q, poisoned(k), poisoned(v), d_out, d_lse)
  for name, actual, wanted in (("out", out[:, 384:], expected[0][:, 384:]),
                               ("lse", lse[:, :, 384:], expected[1][:, :, 384:]),
                               ("dq", dq[:, 384:], expected[2][:, 384:])):
    assert relative_error(actual, wanted) < BF16_TOL, name
  # Keys 0-127 (the first dk/dv CTA) are seen by queries up to 190 only: query blocks of 64
  # rows from 192 on must not be streamed.
  _, _, _, dk, dv = _outputs_and_grads(flash, q.at[:, 192:].set(jnp.nan), k, v, d_out, d_lse)
  for name, actual, wanted in (("dk", dk[:, :128], expected[3][:, :128]),
                               ("dv", dv[:, :128], expected[4][:, :128])):
    assert relative_error(actual, wanted) < BF16_TOL, name


# Rows that see no key (lse -inf) through either backward after the Mosaic forward.
@pytest.mark.parametrize("backward_kernel", [pytest.param("triton", marks=pytest.mark.slow),
                                             pytest.param("mosaic", marks=pytest.mark.slow)])
def test_mosaic_forward_rows_with_no_visible_key_give_zero(backward_kernel):
  q, k, v, d_out, _ = random_inputs(3, 1, 200, 2, 1, 64, dtype=jnp.bfloat16)
  q_ids = jnp.array([[0] * 50 + [1] * 100 + [2] * 50], jnp.int32)
  kv_ids = jnp.array([[0] * 50 + [3] * 100 + [2] * 50], jnp.int32)
  out, lse, dq, _, _ = _check_against_reference(
      q, k, v, d_out, causal=False, segment_ids=q_ids, kv_segment_ids=kv_ids, tol=BF16_TOL,
      forward_kernel="mosaic", backward_kernel=backward_kernel)
  assert np.all(np.asarray(out[:, 50:150], np.float32) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, 50:150])))
  assert np.all(np.asarray(dq[:, 50:150], np.float32) == 0.0)


# flash_attention_backward as a ring step uses it: the gradients of one block of keys, given the
# output and lse of the attention over all of them (two blocks here, packed segments crossing
# from one to the other), written in the inputs' dtype; the two blocks' dq add up to the whole.
@pytest.mark.parametrize("kernel", ["triton", pytest.param("mosaic", marks=pytest.mark.slow)])
def test_backward_of_key_blocks_adds_up_to_the_whole_gradient(kernel):
  q, k, v, d_out, segment_ids = random_inputs(12, 1, 512, 2, 1, 64, dtype=jnp.bfloat16,
                                              num_segments=4)
  q, d_out, q_ids = q[:, 256:], d_out[:, 256:], segment_ids[:, 256:]  # the later queries
  f32 = lambda x: x.astype(jnp.float32)
  whole = lambda q, k, v: dense_attention(q, k, v, causal=False, q_segment_ids=q_ids,
                                          kv_segment_ids=segment_ids, return_lse=True)
  (out, lse), vjp = jax.vjp(whole, f32(q), f32(k), f32(v))
  dq, dk, dv = vjp((f32(d_out), jnp.zeros_like(lse)))
  blocks = [jax.jit(lambda q, k, v, out, lse, d_out, ids: flash_attention_backward(
      q, k, v, out, lse, d_out, causal=False, segment_ids=q_ids, kv_segment_ids=ids,
      grad_dtype=jnp.bfloat16, kernel=kernel))(
          q, k[:, i:i + 256], v[:, i:i + 256], out.astype(q.dtype), lse, d_out,
          segment_ids[:, i:i + 256]) for i in (0, 256)]
  assert all(g.dtype == jnp.bfloat16 for block in blocks for g in block)
  assert relative_error(f32(blocks[0][0]) + f32(blocks[1][0]), dq) < BF16_TOL
  for i, name, wanted in ((1, "dk", dk), (2, "dv", dv)):
    got = jnp.concatenate([blocks[0][i], blocks[1][i]], axis=1)
    assert relative_error(got, wanted) < BF16_TOL, name


def test_mosaic_backward_writes_the_inputs_dtype_only():
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 128), jnp.float32)
  with pytest.raises(ValueError, match=r"kernel='mosaic' writes the inputs' dtype \(bfloat16\), "
                     r"got grad_dtype=float32; pass grad_dtype=bfloat16 or kernel='triton'"):
    flash_attention_backward(q, q, q, q, lse, q, kernel="mosaic")


def test_pallas_mosaic_backend_runs_the_mosaic_kernels_in_ulysses_attention():
  """The wiring only: in GPU interpret mode, eight devices that each simulate three
  warpgroups outnumber the CPU threads XLA runs callbacks on, and the run deadlocks, so the
  8-device check is of the trace. The Ulysses wrapper around any backend is checked against
  the dense reference with backend="pallas" and "xla"; the kernels themselves above."""
  mesh = mesh_of(2, 4)
  q, k, v, _, segment_ids = random_inputs(10, 2, 256, 4, 2, 64, dtype=jnp.bfloat16,
                                          num_segments=3)

  def loss(q, k, v):
    out = ulysses_attention(q, k, v, mesh=mesh, causal=True, segment_ids=segment_ids,
                            backend="pallas_mosaic")
    return out.astype(jnp.float32).sum()
  trace = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
  # Each Mosaic kernel is a grid of three warpgroups: the forward, dq and dk/dv.
  assert trace.count("num_threads=3, thread_name='wg'") == 3


def test_gpu_interpret_mode_runs_the_hardware_forms_the_interpreter_can():
  """The wgmma of ``a_times_bt`` and the layout casts are traced as on hardware exactly where
  the installed JAX's interpreter runs them (jax 0.12 does, 0.10 does not)."""
  x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  trace = str(jax.make_jaxpr(lambda q, k, v: flash_attention(
      q, k, v, interpret=True, forward_kernel="mosaic", backward_kernel="mosaic"))(x, x, x))
  assert ("wgmma" in trace) == flash_hopper.interpreter_runs("a_times_bt")
  assert ("layout_cast" in trace) == flash_hopper.interpreter_runs("layout_cast")


@pytest.mark.parametrize("head_dim,causal,segments,window", [
    (64, True, True, None), (128, True, False, None), (128, False, True, None),
    (256, False, False, None), (128, True, True, 300)])
def test_mosaic_kernels_lower_for_hopper(head_dim, causal, segments, window):
  """The hardware path (wgmma from registers, register layouts) of the forward and (head dims
  64, 128) both backward kernels through Mosaic GPU's lowering, which rejects layouts it cannot
  realise; compiling and running it needs an H100/H200. With a window the block ranges and
  the masks are traced values too."""
  backward = "mosaic" if head_dim in flash_hopper_backward.HEAD_DIMS else "triton"
  q = jax.ShapeDtypeStruct((2, 1000, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 1000), jnp.int32) if segments else None

  def loss(q, k, v, ids):
    out = flash_attention(q, k, v, causal=causal, segment_ids=ids, interpret=False,
                          forward_kernel="mosaic", backward_kernel=backward,
                          sliding_window=window)
    return out.astype(jnp.float32).sum()
  with lowering_target(90):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, ids).lower(
        lowering_platforms=("cuda",))
  kernels = lowered.as_text().count("mosaic_gpu")
  assert kernels >= (3 if backward == "mosaic" else 1), kernels


def test_mosaic_plan():
  plan = choose_tiles(16384, 128, causal=True, scale=1.0, generation="sm90",
                      forward_kernel="mosaic", backward_kernel="mosaic")
  assert (plan.forward.block_q, plan.forward.block_kv, plan.forward.num_stages) == (128, 128, 2)
  assert (plan.dq.block_q, plan.dq.block_kv, plan.dkv.block_q, plan.dkv.block_kv) == (
      128, 64, 64, 128)
  short = choose_tiles(20, 64, causal=True, scale=1.0, generation="sm90",
                       forward_kernel="mosaic", backward_kernel="mosaic")
  assert (short.forward.block_q, short.forward.block_kv, short.padded_len) == (128, 64, 128)
  assert (short.dq.block_q, short.dq.block_kv, short.dkv.block_q, short.dkv.block_kv) == (
      128, 64, 64, 128)


# (forward, backward) kernels on the GPU; the Mosaic ones need Hopper, the Mosaic backward head
# dims 64 or 128.
GPU_KERNELS = [("triton", "triton"), ("mosaic", "triton"), ("mosaic", "mosaic")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", GPU_KERNELS, ids=["+".join(k) for k in GPU_KERNELS])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_compiled_gpu_kernels_match_reference(kernels, head_dim, causal):
  """The kernels compiled for the GPU, default blocks, ragged length, GQA, with and without
  segments."""
  forward_kernel, backward_kernel = kernels
  if backward_kernel == "mosaic" and head_dim not in flash_hopper_backward.HEAD_DIMS:
    pytest.skip(f"the Mosaic backward takes head dims {flash_hopper_backward.HEAD_DIMS}")
  q, k, v, d_out, segment_ids = random_inputs(8, 2, 1000, 8, 2, head_dim,
                                              dtype=jnp.bfloat16, num_segments=4)
  for ids in (None, segment_ids):
    _check_against_reference(q, k, v, d_out, causal=causal, segment_ids=ids, tol=BF16_TOL,
                             interpret=False, forward_kernel=forward_kernel,
                             backward_kernel=backward_kernel)
