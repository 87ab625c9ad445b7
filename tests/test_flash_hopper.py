"""Our Hopper flash kernels (``forward_kernel="mosaic"``, ``backward_kernel="mosaic"``)
against the dense oracle: forward, lse and dq/dk/dv, windows, and their lowering for Hopper.

They run in Pallas' GPU interpret mode, which simulates the three warpgroups, the slot barriers
and the TMA copies (its buffers start as NaN, so an element a kernel fails to write shows up);
it needs several host devices (conftest sets 8): with one, its simulated warpgroups block XLA's
few CPU threads and a run can hang. Their wgmma forms are checked by lowering for CUDA, and run
in interpret mode where the installed JAX can (``hopper_interpret``); ``test_hopper_races.py``
runs them under the race detector; ``test_flash_attention.py`` runs them on a real GPU.
Tolerances as ``test_flash_attention.py``'s.
"""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (BF16_TOL, check_flash_against_reference, flash_outputs_and_grads,
                             large_sinks, mesh_of, random_inputs, relative_error)
from benchmarks.kernel_resources import lowering_target
from ulysses_jax import ulysses_attention
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.kernels import (flash_hopper, flash_hopper_backward, mosaic_tiles,
                                 wgmma_forms)
from ulysses_jax.kernels.flash_attention import (choose_tiles, flash_attention,
                                                flash_attention_backward)
from ulysses_jax.kernels.flash_kernels import Tile

# Interpret mode is slow: CI runs these after `make test`, on the newest JAX (`mosaic`).
SLOW_MOSAIC = (pytest.mark.slow, pytest.mark.mosaic)


def _assert_every_ring_refills(seq_len, tiles):
  """Even under the causal mask the last query tile (forward, dq) and the first key tile (dk/dv)
  stream every block: more than each ring has slots. None: a kernel that does not run."""
  forward, dq, dkv = tiles
  for name, tile in (("block_kv", forward), ("block_kv", dq), ("block_q", dkv)):
    assert tile is None or -(-seq_len // getattr(tile, name)) > tile.num_stages, (seq_len, tile)


# The Hopper kernels: every length spans several 128-row tiles (the last partly padding) and
# more key and query blocks than each kernel has pipeline slots, so every ring is refilled
# (checked below); segments cross tiles.
# All slow (SLOW_MOSAIC); the full mask meets the Mosaic backward in the test after this one.
@pytest.mark.parametrize("seq_len,causal,heads,head_dim,segments", [
    pytest.param(600, True, (2, 1), 64, True, id="causal-gqa-packed", marks=SLOW_MOSAIC),
    pytest.param(400, False, (2, 1), 64, True, id="full-gqa-packed", marks=SLOW_MOSAIC),
    pytest.param(300, True, (2, 2), 128, False, id="causal-d128", marks=SLOW_MOSAIC)])
def test_mosaic_kernels_match_reference(seq_len, causal, heads, head_dim, segments):
  plan = choose_tiles(seq_len, head_dim, causal=causal, scale=1.0, interpret=True,
                      forward_kernel="mosaic", backward_kernel="mosaic")
  _assert_every_ring_refills(seq_len, (plan.forward, plan.dq, plan.dkv))
  q, k, v, d_out, segment_ids = random_inputs(9, 1, seq_len, *heads, head_dim,
                                              dtype=jnp.bfloat16, num_segments=4)
  check_flash_against_reference(q, k, v, d_out, causal=causal,
                           segment_ids=segment_ids if segments else None, tol=BF16_TOL,
                           forward_kernel="mosaic", backward_kernel="mosaic")


# The tile variants ``benchmarks.attention_kernels --sweep`` times: three compute warpgroups in
# all three kernels (192 query rows for the forward and dq, 192 keys for dk/dv; the padded length
# then a multiple of 384), and the ping-pong schedule of the forward (64-key slots) and dq. 330
# tokens (VARIANT_SEQ_LEN): the last tile is partly padding, every ring refills, packed segments
# cross tiles. Slow (interpret mode): CI runs them after `make test`; the race detector runs both
# (newest JAX).
VARIANT_SEQ_LEN = 330  # 384 padded: two 192-row tiles (three warpgroups), three of 128


@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("tiles", [
    (Tile(192, 128, 16, 2), Tile(192, 64, 16, 2), Tile(64, 192, 16, 2)),
    (Tile(128, 64, 12, 2, pingpong=True), Tile(128, 64, 12, 3, pingpong=True),
     Tile(64, 128, 12, 3))],
    ids=["three-warpgroups", "pingpong"])
def test_mosaic_tile_variants_match_reference(tiles):
  _assert_every_ring_refills(VARIANT_SEQ_LEN, tiles)
  q, k, v, d_out, segment_ids = random_inputs(9, 1, VARIANT_SEQ_LEN, 2, 1, 64,
                                              dtype=jnp.bfloat16, num_segments=4)
  check_flash_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                                tol=BF16_TOL, forward_kernel="mosaic", backward_kernel="mosaic",
                                tiles=tiles, interpret=True)


# The forward's intra-warpgroup overlap (``Tile.overlap``), the forward alone (its backward
# kernels are unchanged): block j's softmax beside block j - 1's P·V, the first block's QKᵀ and
# the last block's P·V on their own. 330 tokens: several key blocks per tile, the last tile
# partly padding, packed segments crossing tiles; two and three compute warpgroups, causal and
# full. Where the interpreter cannot run wgmma with a register operand (every JAX so far) the
# two matmuls are stand-ins run one after the other; the hardware form is lowered below. Slow
# (interpret mode); the race detector runs both forms too (newest JAX).
@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("tile,causal", [
    (Tile(128, 64, 12, 2, overlap=True), True), (Tile(192, 128, 16, 2, overlap=True), False)],
    ids=["two-warpgroups-causal", "three-warpgroups-full"])
def test_mosaic_forward_overlap_matches_reference(tile, causal):
  q, k, v, _, segment_ids = random_inputs(9, 1, VARIANT_SEQ_LEN, 2, 1, 64, dtype=jnp.bfloat16,
                                          num_segments=4)
  plan = choose_tiles(VARIANT_SEQ_LEN, 64, causal=causal, scale=1.0, interpret=True,
                      forward_kernel="mosaic", backward_kernel="mosaic")
  out, lse = jax.jit(lambda q, k, v: flash_attention(
      q, k, v, causal=causal, segment_ids=segment_ids, return_lse=True, interpret=True,
      forward_kernel="mosaic", backward_kernel="mosaic", tiles=(tile, plan.dq, plan.dkv)))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want_out, want_lse = dense_attention(*f32, causal=causal, q_segment_ids=segment_ids,
                                       kv_segment_ids=segment_ids, return_lse=True)
  assert relative_error(out, want_out) < BF16_TOL
  np.testing.assert_allclose(lse, want_lse, rtol=BF16_TOL, atol=BF16_TOL)


# The dk/dv kernel accumulating dq (``Tile.accumulate_dq``; jax 0.11 on: on 0.10 it is not
# offered): dq, dk, dv against the reference, every query block streamed through a ring that
# refills; causal GQA with packed segments at head dim 64, the full mask at 128. The dq kernel
# does not run (its lowering below); the race detector runs it too (test_hopper_races).
@pytest.mark.skipif(not flash_hopper_backward.can_accumulate_dq(),
                    reason="a mutable dq accumulator in a Mosaic kernel needs jax >= 0.11")
@pytest.mark.parametrize("seq_len,causal,heads,head_dim,dkv", [
    (VARIANT_SEQ_LEN, True, (2, 1), 64, Tile(64, 128, 12, 3, accumulate_dq=True)),
    (300, False, (2, 2), 128, Tile(64, 128, 12, 2, accumulate_dq=True))],
    ids=["causal-gqa-d64-packed", "full-d128"])
def test_dkv_kernel_accumulating_dq_matches_reference(seq_len, causal, heads, head_dim, dkv):
  plan = choose_tiles(seq_len, head_dim, causal=causal, scale=1.0, interpret=True,
                      forward_kernel="mosaic", backward_kernel="mosaic")
  _assert_every_ring_refills(seq_len, (plan.forward, None, dkv))
  q, k, v, d_out, segment_ids = random_inputs(9, 1, seq_len, *heads, head_dim,
                                              dtype=jnp.bfloat16, num_segments=4)
  check_flash_against_reference(q, k, v, d_out, causal=causal,
                                segment_ids=segment_ids if causal else None, tol=BF16_TOL,
                                forward_kernel="mosaic", backward_kernel="mosaic",
                                tiles=(plan.forward, plan.dq, dkv), interpret=True)


@pytest.mark.gpu_compile
@pytest.mark.skipif(not flash_hopper_backward.can_accumulate_dq(),
                    reason="a mutable dq accumulator in a Mosaic kernel needs jax >= 0.11")
@pytest.mark.parametrize("head_dim,dkv", [(64, Tile(64, 128, 12, 4, accumulate_dq=True)),
                                          (64, Tile(64, 192, 16, 4, accumulate_dq=True)),
                                          (64, Tile(128, 128, 12, 2, accumulate_dq=True)),
                                          (128, Tile(64, 128, 12, 2, accumulate_dq=True))])
def test_dkv_kernel_accumulating_dq_lowers_for_hopper_as_the_only_backward_kernel(head_dim,
                                                                                  dkv):
  """Its hardware form (dS^T read transposed by wgmma, the TMA reduce-add into the float32
  accumulator) through Mosaic GPU's lowering, on the GPU machines' JAX and the newest: the
  gradient is two Mosaic kernels (forward, dk/dv with dq) where the table's tiles give three
  (``test_mosaic_kernels_lower_for_hopper``). The deepest ring of each swept shape
  (``mosaic_tiles.candidates``: the shared memory is checked)."""
  plan = choose_tiles(1000, head_dim, causal=True, scale=1.0, generation="sm90",
                      forward_kernel="mosaic", backward_kernel="mosaic")
  tiles = (plan.forward, plan.dq, dkv)
  assert _lowered_kernels(head_dim, True, True, None, "mosaic", tiles=tiles) == 2, dkv


@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_swept_mosaic_tile_lowers_for_hopper(head_dim):
  """Each tile of ``mosaic_tiles.candidates`` in its kernel alone, causal, packed, through
  Mosaic GPU's lowering, which also checks the CTA's shared memory against Hopper's 227 KiB: a
  sweep on a GPU times only tiles that lower. Of tiles that differ only in their ring's slots
  the deepest (the most shared memory; the program is the same). About 40 s for the three
  head dims (jax 0.12.0.1, 2 cores), where lowering each tile in the whole gradient took 66."""
  backward = "mosaic" if head_dim in flash_hopper_backward.HEAD_DIMS else "triton"
  plan = choose_tiles(1000, head_dim, causal=True, scale=1.0, generation="sm90",
                      forward_kernel="mosaic", backward_kernel=backward)
  for kernel, tiles in mosaic_tiles.candidates(head_dim).items():
    deepest = {dataclasses.replace(t, num_stages=0): t for t in sorted(
        tiles, key=lambda t: t.num_stages)}
    for tile in deepest.values():
      mosaic_tiles.check(kernel, tile, head_dim)
      chosen = {**dict(zip(mosaic_tiles.KERNELS, (plan.forward, plan.dq, plan.dkv))),
                kernel: tile}
      tiled = choose_tiles(1000, head_dim, causal=True, scale=1.0, tiles=tuple(chosen.values()),
                           forward_kernel="mosaic", backward_kernel="mosaic")
      assert _lowered_kernel(kernel, tiled, head_dim) == 1, (kernel, tile)


def _lowered_kernel(kernel, plan, head_dim):
  """Mosaic GPU calls in one kernel of ``plan`` (``mosaic_tiles.KERNELS``) lowered alone for
  Hopper, on padded packed inputs (batch 2, GQA 4:2): the other two are not lowered."""
  sp = plan.padded_len
  q = jax.ShapeDtypeStruct((2, sp, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, sp, 2, head_dim), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((2, 4, sp), jnp.float32)  # lse2 and delta
  ids = jax.ShapeDtypeStruct((2, sp), jnp.int32)
  if kernel == "forward":
    call = lambda q, k, v, ids: flash_hopper.forward(plan, q, k, v, ids, ids)
    args = (q, kv, kv, ids)
  else:
    backward = {"dq": flash_hopper_backward.backward_dq,
                "dkv": flash_hopper_backward.backward_dkv}[kernel]
    call = lambda q, k, v, rows, ids: backward(plan, q, k, v, q, rows, rows, ids, ids, q.dtype)
    args = (q, kv, kv, rows, ids)
  with lowering_target(90):
    lowered = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text().count("custom_call @mosaic_gpu")


# The Hopper kernels with a sliding window, against the dense reference, packed segments
# crossing tiles; windows of one key, inside a key block (50), across block edges and not a block
# multiple (200), and longer than the sequence (as causal). Forward blocks: 128 keys; dq: 64
# keys; dk/dv: 64 queries. The window of 200 runs on 400 tokens (four 128-row tiles, the last
# partly padding: the last tile's window skips two dq blocks) with GQA and large attention sinks,
# applied through the kernels' lse (out, lse, dq, dk, dv and d(sinks) compared), and refills the
# dq and dk/dv rings. The others need neither: on 300 tokens (three tiles) one head skips the
# blocks below windows of 1 and 50 in all three kernels (the third tile's forward, the second's
# dq, the first dk/dv CTA's query blocks from 192 on), and the window of 1000 streams every
# block; GQA's dk/dv over a window's block range is the 200 case's, the refilled rings under a
# causal mask ``test_mosaic_kernels_match_reference``'s. Slow like the Mosaic tests above.
@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("window,seq_len,heads,sinks", [
    (1, 300, (1, 1), False), (50, 300, (1, 1), False), (200, 400, (2, 1), True),
    (1000, 300, (1, 1), False)], ids=["1", "50", "200-gqa-sinks", "1000"])
def test_mosaic_kernels_with_a_sliding_window_match_reference(window, seq_len, heads, sinks):
  q, k, v, d_out, segment_ids = random_inputs(13, 1, seq_len, *heads, 64, dtype=jnp.bfloat16,
                                              num_segments=3)
  check_flash_against_reference(q, k, v, d_out, causal=True, segment_ids=segment_ids,
                           sliding_window=window, tol=BF16_TOL, forward_kernel="mosaic",
                           backward_kernel="mosaic", sinks=large_sinks(heads[0]) if sinks else None)


@pytest.mark.slow
@pytest.mark.mosaic
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
  expected = flash_outputs_and_grads(dense, f32(q), f32(k), f32(v), f32(d_out), d_lse)
  # Query rows from 384 on (the last 128-row tile) see keys from 321 on: the forward and dq
  # (blocks of 64 or 128 keys) must not touch keys before 256.
  poisoned = lambda x: x.at[:, :256].set(jnp.nan)
  out, lse, dq, _, _ = flash_outputs_and_grads(flash, q, poisoned(k), poisoned(v), d_out, d_lse)
  for name, actual, wanted in (("out", out[:, 384:], expected[0][:, 384:]),
                               ("lse", lse[:, :, 384:], expected[1][:, :, 384:]),
                               ("dq", dq[:, 384:], expected[2][:, 384:])):
    assert relative_error(actual, wanted) < BF16_TOL, name
  # The first dk/dv CTA's keys (0-127) are seen by queries up to 190 only: the query blocks
  # after the one holding row 190 must not be streamed (0 * NaN in dk's dS^T q). The backward
  # alone, given the dense output and lse.
  dkv = choose_tiles(512, 64, causal=True, scale=1.0, generation="sm90", forward_kernel="mosaic",
                     backward_kernel="mosaic").dkv
  keys = dkv.block_kv
  unseen = -(-(keys + window - 1) // dkv.block_q) * dkv.block_q
  assert unseen < 512, dkv  # some query block is poisoned
  backward = jax.jit(lambda q: flash_attention_backward(
      q, k, v, expected[0].astype(q.dtype), expected[1], d_out, causal=True,
      sliding_window=window, grad_dtype=q.dtype, kernel="mosaic"))
  _, dk, dv = backward(q.at[:, unseen:].set(jnp.nan))
  for name, actual, wanted in (("dk", dk[:, :keys], expected[3][:, :keys]),
                               ("dv", dv[:, :keys], expected[4][:, :keys])):
    assert relative_error(actual, wanted) < BF16_TOL, name


# Rows that see no key (lse -inf) through either backward after the Mosaic forward.
@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("backward_kernel", ["triton", "mosaic"])
def test_mosaic_forward_rows_with_no_visible_key_give_zero(backward_kernel):
  q, k, v, d_out, _ = random_inputs(3, 1, 200, 2, 1, 64, dtype=jnp.bfloat16)
  q_ids = jnp.array([[0] * 50 + [1] * 100 + [2] * 50], jnp.int32)
  kv_ids = jnp.array([[0] * 50 + [3] * 100 + [2] * 50], jnp.int32)
  out, lse, dq, _, _ = check_flash_against_reference(
      q, k, v, d_out, causal=False, segment_ids=q_ids, kv_segment_ids=kv_ids, tol=BF16_TOL,
      forward_kernel="mosaic", backward_kernel=backward_kernel)
  assert np.all(np.asarray(out[:, 50:150], np.float32) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, 50:150])))
  assert np.all(np.asarray(dq[:, 50:150], np.float32) == 0.0)


# flash_attention_backward as a ring step uses it: the gradients of one block of keys, given the
# output and lse of the attention over all of them (two blocks here, packed segments crossing
# from one to the other), written in the inputs' dtype; the two blocks' dq add up to the whole.
@pytest.mark.parametrize("kernel", ["triton", pytest.param("mosaic", marks=SLOW_MOSAIC)])
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
  assert ("wgmma" in trace) == wgmma_forms.interpreter_runs("a_times_bt")
  assert ("layout_cast" in trace) == wgmma_forms.interpreter_runs("layout_cast")


@pytest.mark.parametrize("head_dim,causal,segments,window", [
    (64, True, True, None), (128, True, False, None), (128, False, True, None),
    (256, False, False, None), (128, True, True, 300)])
def test_mosaic_kernels_lower_for_hopper(head_dim, causal, segments, window):
  """The hardware path (wgmma from registers, register layouts) of the forward and (head dims
  64, 128) both backward kernels through Mosaic GPU's lowering, which rejects layouts it cannot
  realise; compiling and running it needs an H100/H200. With a window the block ranges and
  the masks are traced values too."""
  backward = "mosaic" if head_dim in flash_hopper_backward.HEAD_DIMS else "triton"
  kernels = _lowered_kernels(head_dim, causal, segments, window, backward)
  assert kernels == (3 if backward == "mosaic" else 1), kernels


def _lowered_kernels(head_dim, causal, segments, window, backward, tiles=None):
  """Mosaic GPU calls in the gradient of our attention lowered for Hopper (batch 2, 1000
  tokens, GQA 4:2)."""
  q = jax.ShapeDtypeStruct((2, 1000, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, 1000), jnp.int32) if segments else None

  def loss(q, k, v, ids):
    out = flash_attention(q, k, v, causal=causal, segment_ids=ids, interpret=False,
                          forward_kernel="mosaic", backward_kernel=backward,
                          sliding_window=window, tiles=tiles)
    return out.astype(jnp.float32).sum()
  with lowering_target(90):
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    lowered = jitted.trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",))
  return lowered.as_text().count("custom_call @mosaic_gpu")
