"""The Hopper kernels under GPU interpret mode's race detector (jax 0.12 on; skipped before).

The detector checks every shared-memory access of the simulated warpgroups and TMA copies
against the barriers, telling the generic proxy from the async one (``hopper_interpret``); it
raises on the first race. Each case streams enough blocks that every kernel's ring of slots
wraps more than twice (checked against the plan's block ranges), and compares with the dense
reference.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_cases import BF16_TOL, output_and_grads, random_inputs, relative_error
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.kernels import flash_hopper, flash_kernels, hopper_interpret, wgmma_forms
from ulysses_jax.kernels.flash_attention import choose_tiles, flash_attention
from ulysses_jax.kernels.flash_kernels import Tile

pytestmark = pytest.mark.skipif(
    not hopper_interpret.has_proxy_aware_race_detector(),
    reason="this JAX's GPU interpret mode has no race detector that models TMA's async proxy "
           "(jax >= 0.12 has)")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  yield
  hopper_interpret.reset_state()  # a race raised inside a kernel leaves the state behind


def _race_checked():
  return plgpu.force_gpu_interpret_mode(hopper_interpret.params(detect_races=True))


def _ring_sum(x_TN, *, fence):
  """Two consumer warpgroups each sum the rows of ``x_TN`` streamed through a 2-slot ring by
  ``flash_hopper.produce``, reading each slot into registers; ``[2, N]``."""
  steps, n = x_TN.shape

  def kernel(x_gmem, out_gmem):
    def body(smem):
      wg = lax.axis_index("wg")

      def consume(w):
        def step(t, total):
          slot = lax.rem(t, 2)
          row = flash_hopper.wait_ready(smem, "x", slot)[...]
          flash_hopper.release(smem, "x", slot, fence=fence)
          return total + row
        total = lax.fori_loop(0, steps, step, jnp.zeros((n,), jnp.float32))
        flash_hopper.store_own([(total, smem["out"].at[w], out_gmem.at[w])])
      for w in range(2):
        pl.when(wg == w)(lambda w=w: consume(w))
      pl.when(wg == 2)(lambda: flash_hopper.produce(
          smem, 2, steps, lambda t: [("x", dict(x=x_gmem.at[t]))]))
    buffers = dict(out=wgmma_forms.smem_tile((2, n), jnp.float32),
                   **flash_hopper.ring_buffers(2, dict(x=((n,), jnp.float32)), ("x",), 2))
    flash_hopper.with_shared_memory(buffers, body)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((2, n), jnp.float32),
                      num_threads=3, thread_name="wg",
                      interpret=hopper_interpret.params(detect_races=True))(x_TN)


def test_detector_reports_a_ring_refill_without_the_proxy_fence():
  """The premise: consumers read a slot into registers, free it, and the producer's TMA
  refills it; only the fence before the release orders the two."""
  x_TN = jnp.arange(6 * 128, dtype=jnp.float32).reshape(6, 128)
  with pytest.raises(Exception, match="RACE DETECTED"):
    jax.block_until_ready(_ring_sum(x_TN, fence=False))
  hopper_interpret.reset_state()
  np.testing.assert_array_equal(_ring_sum(x_TN, fence=True), np.tile(x_TN.sum(0), (2, 1)))


# (S, causal, (query heads, KV heads), head dim, segment ids, sliding window). No S is a multiple
# of a block (64, 128); the least that wraps every ring twice (D = 64 causal: 4 slots in dq and
# dk/dv, D = 128: 2); segment ids are sorted random documents, so they cross tiles. The window of
# 600 starts the later CTAs' streams past block 0 and cuts blocks at its lower edge (masked), yet
# still wraps every ring twice. The tile variants of the sweep: three compute warpgroups in every
# kernel (900 tokens pad to 1152: six 192-row tiles), and the ping-pong schedule of the forward
# and dq.
THREE_WARPGROUPS = (Tile(192, 128, 16, 2), Tile(192, 64, 16, 2), Tile(64, 192, 16, 2))
PINGPONG = (Tile(128, 64, 12, 2, pingpong=True), Tile(128, 64, 12, 3, pingpong=True),
            Tile(64, 128, 12, 3))
CASES = [pytest.param(1050, True, (2, 1), 64, True, None, None, id="causal-gqa-d64-packed"),
         pytest.param(600, False, (2, 1), 128, True, None, None, id="full-gqa-d128-packed"),
         pytest.param(600, True, (2, 2), 128, False, None, None, id="causal-mha-d128"),
         pytest.param(800, True, (2, 1), 128, True, 600, None, id="window600-gqa-d128-packed"),
         pytest.param(900, True, (2, 1), 64, True, None, THREE_WARPGROUPS,
                      id="three-warpgroups-causal-gqa-d64-packed"),
         pytest.param(800, True, (2, 1), 64, True, None, PINGPONG,
                      id="pingpong-causal-gqa-d64-packed")]
# The forward's intra-warpgroup overlap (its slots freed one block later: K after block j's
# QKᵀ, V after its P·V in step j + 1), two compute warpgroups causal and three with the full
# mask; the forward alone (the backward kernels are those of the cases above).
OVERLAP = [pytest.param(800, True, (2, 1), 64, True, None,
                        (Tile(128, 64, 12, 2, overlap=True), *PINGPONG[1:]),
                        id="overlap-causal-gqa-d64-packed"),
           pytest.param(900, False, (2, 1), 64, True, None,
                        (Tile(192, 128, 16, 2, overlap=True), *THREE_WARPGROUPS[1:]),
                        id="overlap-three-warpgroups-full-gqa-d64-packed")]


def _inputs_and_plan(seq_len, causal, heads, head_dim, segments, window, tiles):
  q, k, v, d_out, segment_ids = random_inputs(5, 1, seq_len, *heads, head_dim,
                                              dtype=jnp.bfloat16, num_segments=4)
  plan = choose_tiles(seq_len, head_dim, causal=causal, scale=1.0, interpret=True,
                      forward_kernel="mosaic", backward_kernel="mosaic", sliding_window=window,
                      tiles=tiles)
  groups = heads[0] // heads[1]
  # The most blocks a CTA streams, per kernel: key blocks of a query tile (forward, dq), query
  # blocks of every grouped head for a key tile (dk/dv).
  def most_key_blocks(tile):
    ranges = (flash_kernels.kv_block_ranges(plan, i, tile.block_q, tile.block_kv)
              for i in range(plan.padded_len // tile.block_q))
    return max(int(n_visible) - int(first) for first, _, _, n_visible in ranges)
  dkv = plan.dkv
  most_query_blocks = max(
      int(end) - int(lo) for lo, _, _, end in (
          flash_kernels.q_block_ranges(plan, j * dkv.block_kv, dkv.block_kv, dkv.block_q)
          for j in range(plan.padded_len // dkv.block_kv)))
  streamed = {"forward": (most_key_blocks(plan.forward), plan.forward.num_stages),
              "dq": (most_key_blocks(plan.dq), plan.dq.num_stages),
              "dkv": (groups * most_query_blocks, dkv.num_stages)}
  for kernel, (blocks, stages) in streamed.items():
    assert blocks > 2 * stages, f"{kernel}: {blocks} blocks through {stages} slots"
  return q, k, v, d_out, segment_ids if segments else None


def _attention(causal, segment_ids, window, tiles):
  return lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                         interpret=True, forward_kernel="mosaic",
                                         backward_kernel="mosaic", sliding_window=window,
                                         tiles=tiles)


def _reference(causal, segment_ids, window, *arrays):
  """``dense_attention``'s output (and with ``d_out``, dq, dk, dv) in float32."""
  attention = lambda q, k, v: dense_attention(q, k, v, causal=causal, q_segment_ids=segment_ids,
                                              kv_segment_ids=segment_ids,
                                              sliding_window=window)
  upcast = [x.astype(jnp.float32) for x in arrays]
  return attention(*upcast) if len(arrays) == 3 else output_and_grads(attention, *upcast)


def _assert_close(name, actual, expected):
  assert np.all(np.isfinite(np.asarray(actual, np.float32))), f"{name} has non-finite values"
  err = relative_error(actual, expected)
  assert err < BF16_TOL, f"{name}: relative error {err:.2e} >= {BF16_TOL:.0e}"


# The dk/dv kernel accumulating dq (its dS^T tile rewritten every block, read by wgmma): causal
# GQA, packed, its ring of two slots wrapped more than twice per head.
ACCUMULATE_DQ = [pytest.param(600, True, (2, 1), 64, True, None,
                              (Tile(128, 128, 12, 2), Tile(128, 64, 12, 2),
                               Tile(64, 128, 12, 2, accumulate_dq=True)),
                              id="accumulate-dq-causal-gqa-d64-packed")]


def _checking(passes, *checked):
  """``(case..., passes)``: which passes of each case run under the race detector. Slow: a
  case's forward and backward take 20 to 36 s on 2 cores (jax 0.12.0.1, -n 2, 2026-11-29), up
  to twice that in CI, which runs them in test-newest-jax beside the other slow Mosaic tests."""
  return [pytest.param(*case.values, passes, id=case.id,
                       marks=(pytest.mark.slow, pytest.mark.mosaic)) for case in checked]


# Every case's forward and backward; the forward alone of OVERLAP (their backward kernels are
# those of CASES) and the backward alone of ACCUMULATE_DQ (its forward tile is the table's).
@pytest.mark.parametrize(
    "seq_len,causal,heads,head_dim,segments,window,tiles,passes",
    _checking(("forward", "backward"), *CASES) + _checking(("forward",), *OVERLAP)
    + _checking(("backward",), *ACCUMULATE_DQ))
def test_kernels_have_no_race(seq_len, causal, heads, head_dim, segments, window, tiles, passes):
  """The forward kernel, then one backward pass from its output (the dq and dk/dv kernels, or
  the one accumulating dq), each under the race detector where ``passes`` names it, and each
  compared with the dense reference; a race names the kernel's source line."""
  q, k, v, d_out, segment_ids = _inputs_and_plan(seq_len, causal, heads, head_dim, segments,
                                                 window, tiles)
  attention = _attention(causal, segment_ids, window, tiles)
  with _race_checked() if "forward" in passes else contextlib.nullcontext():
    out, backward = jax.vjp(attention, q, k, v)
  _assert_close("out", out, _reference(causal, segment_ids, window, q, k, v))
  if "backward" in passes:
    with _race_checked():
      grads = jax.jit(backward)(d_out)
    _, *expected = _reference(causal, segment_ids, window, q, k, v, d_out)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, expected):
      _assert_close(name, actual, wanted)
