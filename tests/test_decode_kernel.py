"""The split-K decode kernel (``kernels.decode_hopper``) against XLA's ``partial_attention`` and
a float64 NumPy reference, in Pallas' GPU interpret mode (which simulates the two warpgroups,
the ring's barriers and the TMA copies; its buffers start as NaN, so an element the kernel
fails to write shows up), under the race detector where the installed JAX has one, and lowered
for Hopper (compiling and running it needs an H100).

Every case has a slot count that is not a multiple of the block (the last block starts early
and masks what the block before it took), empty slots (-1), slots out of position order (a
rolling window buffer), a batch row whose query sees nothing, and more splits than some
(batch, KV head) has blocks for (empty splits).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.kernel_resources import lowering_target
from ulysses_jax.doctor import decode as decode_doctor
from ulysses_jax.generate.attention import partial_attention
from ulysses_jax.kernels import decode_hopper, hopper_interpret


# GPU interpret mode's state cleared before and after each test (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_gpu_interpreter")


def _inputs(seed, b, kv_heads, g, t, c, d, dtype):
  """Random q, k, v in the cache's layout, shuffled slot positions with empty slots, and query
  positions: row 0 sees most slots, row 1 (if any) none."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, kv_heads, g, t, d)).astype(np.float32)
  k = rng.standard_normal((b, kv_heads, c, d)).astype(np.float32)
  v = rng.standard_normal((b, kv_heads, d, c)).astype(np.float32)
  k_pos = np.stack([rng.permutation(c) for _ in range(b)]).astype(np.int32)
  k_pos[rng.random((b, c)) < 0.1] = -1
  q_pos = np.tile(np.arange(t, dtype=np.int32) + c - t - 20, (b, 1))
  if b > 1:
    q_pos[1] = -1 - np.arange(t)  # before every slot: sees nothing
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), jnp.asarray(q_pos), jnp.asarray(k_pos)


def _float64_reference(q, k, v, q_pos, k_pos, scale, window):
  """``(o, lse)`` in float64, (0, -inf) for a query that sees nothing."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
  scores = np.einsum("bkgtd,bkcd->bkgtc", q, k) * scale
  distance = q_pos[:, :, None] - k_pos[:, None, :]  # [b, t, c]
  visible = (k_pos[:, None, :] >= 0) & (distance >= 0)
  if window is not None:
    visible &= distance < window
  scores = np.where(visible[:, None, None], scores, -np.inf)
  top = scores.max(-1, keepdims=True)
  weights = np.where(np.isfinite(scores), np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
  total = weights.sum(-1)
  o = np.einsum("bkgtc,bkdc->bkgtd", weights, v) / np.where(total > 0, total, 1)[..., None]
  with np.errstate(divide="ignore"):
    lse = np.where(total > 0, top[..., 0] + np.log(np.where(total > 0, total, 1)), -np.inf)
  return o, lse


def _check(case, dtype, tol, **kernel_options):
  b, kv_heads, g, t, c, d, window = case
  q, k, v, q_pos, k_pos = _inputs(sum(case[:6]), b, kv_heads, g, t, c, d, dtype)
  scale = d ** -0.5
  v_kernel = v if kernel_options.get("v_layout") == "DC" else v.swapaxes(2, 3)
  o, lse = jax.jit(lambda *x: decode_hopper.decode_attention(
      *x, scale=scale, window=window, interpret=True, **kernel_options))(q, k, v_kernel, q_pos,
                                                                          k_pos)
  o_xla, lse_xla = partial_attention(q, k, v, q_pos, k_pos, scale=scale, window=window)
  o_64, lse_64 = _float64_reference(q, k, v, q_pos, k_pos, scale, window)
  assert np.isfinite(lse_64[0]).all() and (lse_64[1:] == -np.inf).all()  # the premise
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_64))
  np.testing.assert_array_equal(np.asarray(o)[1:], 0.0)  # the neutral state
  np.testing.assert_allclose(lse, lse_64, atol=tol, rtol=0)
  np.testing.assert_allclose(o, o_64, atol=tol, rtol=0)
  # The kernel against XLA's path: the same inputs, each off the float64 truth by what its
  # bfloat16 probabilities cost.
  np.testing.assert_allclose(lse, lse_xla, atol=tol, rtol=0)
  np.testing.assert_allclose(o, o_xla, atol=2 * tol, rtol=0)


# (b, Hkv, G, T, C, D, window), dtype, kernel options. GPU interpret mode takes seconds per CTA
# on a CPU, so the grids are small and the cases slow (about 5 to 15 s each on jax 0.10).
# "gqa-empty-split": C = 256 slots are four 64-slot blocks in three splits of two blocks, the
# third empty; batch row 1 sees nothing. "mha-window-f16": G = 1, float16, a window, the default
# block (128: two blocks, the second from slot 64, its first 64 slots masked as the first
# block's) and splits (one CTA per SM: here one per block). "d128-two-tokens": a chunk of two
# new tokens, D = 128, three blocks through a two-slot ring in one split. (Slot counts are
# multiples of 64, as the kernel takes: ``unsupported_reason``.) "d64-default-ring": ten blocks
# through the default ring (``default_stages``: four slots at D = 64), which wraps twice.
# "two-consumers": two compute warpgroups take the ten blocks in turn through four slots (each
# its two slots, wrapped twice). "two-consumers-idle": five blocks in three splits of two, so
# the last split's second warpgroup has none (its partial stays neutral); row 1 sees nothing.
# (v is given in the kernel's default layout, "CD", like k.) "values-slots-last": v in XLA's
# "DC" layout ([D, C]), ten blocks in two splits through the four-slot ring, a window;
# "values-slots-last-two-consumers": the same layout at D = 128, two compute warpgroups, two
# tokens. "slots-multiple-of-8": 200 slots (what the "CD" layout takes), the last of four
# 64-slot blocks starting at slot 136, in two splits. "d256": head dim 256 (Gemma 3), its
# default 64-slot blocks through two slots, a window, the output leaving in two column chunks.
CASES = {
    "gqa-empty-split": ((2, 1, 4, 1, 256, 64, None), jnp.bfloat16, dict(num_splits=3, block=64)),
    "mha-window-f16": ((1, 1, 1, 1, 192, 128, 90), jnp.float16, {}),
    "d128-two-tokens": ((1, 2, 2, 2, 192, 128, 50), jnp.bfloat16,
                        dict(num_splits=1, block=64, num_stages=2)),
    "d64-default-ring": ((1, 1, 4, 1, 640, 64, None), jnp.bfloat16, dict(num_splits=1, block=64)),
    "two-consumers": ((1, 1, 4, 1, 640, 64, None), jnp.bfloat16,
                      dict(num_splits=1, block=64, num_stages=4, consumers=2)),
    "two-consumers-idle": ((2, 1, 4, 1, 320, 128, 200), jnp.bfloat16,
                           dict(num_splits=3, block=64, num_stages=2, consumers=2)),
    "slots-multiple-of-8": ((1, 1, 4, 1, 200, 64, None), jnp.bfloat16,
                            dict(num_splits=2, block=64)),
    "d256": ((2, 1, 2, 1, 328, 256, 150), jnp.bfloat16, dict(num_splits=2)),
    "values-slots-last": ((2, 1, 4, 1, 640, 64, 300), jnp.bfloat16,
                          dict(num_splits=2, block=64, v_layout="DC")),
    "values-slots-last-two-consumers": ((1, 2, 2, 2, 192, 128, 50), jnp.bfloat16,
                                        dict(num_splits=1, block=64, num_stages=2, consumers=2,
                                             v_layout="DC")),
}
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}  # 16-bit probabilities; float32 sums and combine


@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("name", CASES)
def test_decode_kernel_matches_references(name):
  case, dtype, options = CASES[name]
  _check(case, dtype, TOL[dtype], **options)


def test_splits_combine_exactly_over_far_apart_and_empty_partials():
  """``combine_splits`` (one variadic reduce) against float64 NumPy: log-sum-exps 600 apart
  (exp of their differences would overflow float32), empty partials (0, -inf) among seen
  ones, and a row no split saw, which stays (0, -inf)."""
  rng = np.random.default_rng(0)
  o = rng.normal(size=(2, 3, 5, 4, 8)).astype(np.float32)
  lse = rng.uniform(-300, 300, size=(2, 3, 5, 4)).astype(np.float32)
  lse[0, 1, 2] = -np.inf
  lse[1, 2, :, 3] = -np.inf
  o[np.isneginf(lse)] = 0.0
  got_o, got_lse = jax.jit(decode_hopper.combine_splits)(o, lse)
  top = lse.max(axis=2, keepdims=True)
  weight = np.exp(lse.astype(np.float64) - np.where(np.isfinite(top), top, 0.0))
  total = weight.sum(axis=2)
  seen = total > 0
  want_o = (weight[..., None] * o).sum(axis=2) / np.where(seen, total, 1.0)[..., None]
  want_lse = np.where(seen, top[:, :, 0] + np.log(np.where(seen, total, 1.0)), -np.inf)
  np.testing.assert_allclose(got_o, want_o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
  assert np.all(np.asarray(got_o)[1, 2, 3] == 0) and np.all(np.isneginf(got_lse[1, 2, 3]))


def test_decode_kernel_refuses_what_it_cannot_take():
  q, k, v, q_pos, k_pos = _inputs(0, 1, 1, 1, 1, 128, 128, jnp.float32)
  with pytest.raises(ValueError, match="float32; the kernel takes bfloat16 or float16.*'xla'"):
    decode_hopper.decode_attention(q, k, v, q_pos, k_pos, scale=1.0, window=None)
  reason = lambda c, *v_layout: decode_hopper.unsupported_reason(
      (1, 1, 1, 1, 64), (1, 1, c, 64), jnp.bfloat16, *v_layout)
  assert reason(40) == "40 cache slots per device; the kernel takes a multiple of 8, at least 64"
  assert "100 cache slots per device; the kernel takes a multiple of 8" in reason(100)
  assert reason(200) is None
  assert reason(200, "DC") == ("200 cache slots per device; the kernel takes a multiple of 64, "
                               "at least 64 (v slots last)")
  assert "96 rows" in decode_hopper.unsupported_reason((1, 1, 48, 2, 64), (1, 1, 128, 64),
                                                       jnp.bfloat16)
  bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  for options, message in [
      (dict(block=96), "block 96 must be a multiple of 64"),
      (dict(consumers=3), "consumers 3: 1 or 2 compute warpgroups"),
      (dict(consumers=2, num_stages=3), "num_stages 3 must be a multiple of consumers 2"),
      (dict(consumers=2, num_stages=4), r"need 2\d\d KiB of shared memory, over 200"),
      (dict(v_layout="CT"), r"v_layout 'CT': one of \('DC', 'CD'\)")]:
    with pytest.raises(ValueError, match=message):
      decode_hopper.decode_attention(*bf16, q_pos, k_pos, scale=1.0, window=None, **options)
  with pytest.raises(ValueError, match=r"v \(CD layout\) \(1, 1, 128, 128\); got .* and "
                                       r"\(1, 1, 128, 64\)"):
    decode_hopper.decode_attention(*bf16[:2], bf16[2][..., :64], q_pos, k_pos, scale=1.0,
                                   window=None, v_layout="CD")


def test_two_consumers_default_to_an_even_ring_that_fits():
  for d in (64, 128):
    block = decode_hopper.default_block(1 << 20, d, consumers=2)
    stages = decode_hopper.default_stages(block, d, consumers=2)
    assert stages % 2 == 0 and (block, stages) == ((128, 4) if d == 64 else (64, 2))
  # The doctor's variant: two warpgroups, with the waves option resolved to splits.
  options = decode_doctor._kernel_options(dict(consumers=2, waves=2), 1 << 20, jax.devices()[0])
  assert options == dict(consumers=2, num_splits=2 * 132)


@pytest.mark.skipif(not hopper_interpret.has_proxy_aware_race_detector(),
                    reason="this JAX's GPU interpret mode has no race detector that models "
                           "TMA's async proxy (jax >= 0.12 has)")
@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.parametrize("slots,d,stages,consumers,v_layout", [
    (256, 64, 2, 1, "CD"), (640, 64, None, 1, "CD"), (640, 64, 4, 2, "CD"),
    (640, 64, None, 1, "DC"), (320, 256, None, 1, "CD")],
    ids=["two", "default-four", "two-consumers", "values-slots-last", "d256"])
def test_decode_kernel_has_no_races(slots, d, stages, consumers, v_layout):
  """Four blocks through a two-slot ring, and ten through the default four (each wraps twice),
  and ten through four slots taken in turn by two compute warpgroups, under the race
  detector; ten with v slots last ("DC"); five at head dim 256 through its two slots, the
  output leaving in two chunks through one buffer."""
  try:
    with plgpu.force_gpu_interpret_mode(hopper_interpret.params(detect_races=True)):
      _check((1, 1, 4, 1, slots, d, None), jnp.bfloat16, TOL[jnp.bfloat16], num_splits=1,
             block=64, num_stages=stages, consumers=consumers, v_layout=v_layout)
  finally:
    hopper_interpret.reset_state()


@pytest.mark.parametrize("d,window,consumers,v_layout,slots", [
    (64, None, 1, "DC", 4160), (128, 1000, 1, "DC", 4160), (64, None, 2, "DC", 4160),
    (128, 1000, 2, "DC", 4160), (64, None, 1, "CD", 4104), (128, 1000, 2, "CD", 4104),
    (256, 1000, 1, "CD", 4104)])
def test_decode_kernel_lowers_for_hopper(d, window, consumers, v_layout, slots):
  """The hardware path (wgmma with a register A and a B read transposed, "DC", or not, "CD";
  register layouts) through Mosaic GPU's lowering, which rejects layouts it cannot realise.
  Slot counts ``unsupported_reason`` accepts that are not a multiple of the 128-slot block:
  4,160 with v slots last (it rejects 4,104 there: the lowering does too, as it did 1,048,608
  slots, a 4M-token cache on 32 GPUs); 4,104 with v like k (where the lowering rejects 4,100,
  not a multiple of 8)."""
  assert decode_hopper.unsupported_reason((1, 2, 4, 1, d), (1, 2, slots, d), jnp.bfloat16,
                                          v_layout) is None
  q = jax.ShapeDtypeStruct((1, 2, 4, 1, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2, slots, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 2, *((d, slots) if v_layout == "DC" else (slots, d))),
                           jnp.bfloat16)
  positions = jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1, slots), jnp.int32)
  with lowering_target(90):
    lowered = jax.jit(lambda *x: decode_hopper.decode_attention(
        *x, scale=0.1, window=window, consumers=consumers, v_layout=v_layout)).trace(
            q, k, v, *positions).lower(
            lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu") >= 1


def test_default_splits_fill_one_wave_of_the_gpus_sms_and_the_ring_what_fits():
  """Llama-3.1-8B's 8 KV heads on an H100: 16 splits (128 CTAs, one wave), not 17 (136: a
  second wave for 4 CTAs); an H100 PCIe's 114 SMs take 14; more heads than SMs, one split."""
  assert decode_hopper.default_splits(1, 8, 8192) == 16
  assert decode_hopper.default_splits(1, 8, 8192, sms=114) == 14
  assert decode_hopper.default_splits(1, 1, 8192) == 132
  assert decode_hopper.default_splits(2, 100, 8192) == 1
  assert decode_hopper.default_splits(1, 1, 5) == 5  # never more splits than blocks
  assert [decode_hopper.default_stages(block, d) for block, d in
          ((128, 128), (64, 128), (128, 64))] == [2, 4, 4]
