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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.kernel_resources import lowering_target
from ulysses_jax import aot
from ulysses_jax.doctor import decode as decode_doctor
from ulysses_jax import generate as gen
from ulysses_jax.generate import attention as gen_attention
from ulysses_jax.generate import cache as cache_lib
from ulysses_jax.generate.attention import partial_attention
from ulysses_jax.kernels import decode_hopper, hopper_interpret, target
from ulysses_jax.mesh import make_mesh


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """GPU interpret mode keeps global state between kernels; on jax 0.12 a kernel run on two
  devices (in shard_map) after one on a single device fails its barrier bookkeeping unless the
  state is cleared in between."""
  hopper_interpret.reset_state()
  yield
  hopper_interpret.reset_state()


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


# --- The kernel in the decode step (generate.attention's decode_backend) --------------------

def test_decode_backend_choice():
  """``auto`` takes the kernel on Hopper where it can take the cache, XLA elsewhere;
  ``mosaic`` raises where the kernel cannot run (off GPUs it runs interpreted, for tests)."""
  h100 = target.Target("gpu", "NVIDIA H100 80GB HBM3", 9.0)
  a100 = target.Target("gpu", "NVIDIA A100-SXM4-80GB", 8.0)
  cpu = target.Target("cpu", "cpu")
  q, k = (1, 1, 4, 1, 128), (1, 1, 1048704, 128)  # Llama-3.1-8B on 8 H100s at 1M tokens
  chosen = lambda backend, on, dtype=jnp.bfloat16, k=k: gen_attention.decode_kernel_chosen(
      backend, on, q, k, dtype, v_layout="CD")
  assert chosen("auto", h100) and chosen("mosaic", h100) and chosen("mosaic", cpu)
  assert not (chosen("auto", cpu) or chosen("auto", a100) or chosen("xla", h100))
  assert not chosen("auto", h100, jnp.float32) and not chosen("auto", h100, k=(1, 1, 1004, 128))
  with pytest.raises(ValueError, match="needs a Hopper GPU .*A100.*use 'xla' or 'auto'"):
    chosen("mosaic", a100)
  with pytest.raises(ValueError, match="1004 cache slots per device; the kernel takes a "
                                       "multiple of 8"):
    chosen("mosaic", h100, k=(1, 1, 1004, 128))
  with pytest.raises(ValueError, match=r"decode_backend must be one of \('auto', 'xla', "
                                       r"'mosaic'\), got 'triton'"):
    chosen("triton", h100)


@pytest.mark.slow
@pytest.mark.mosaic
@pytest.mark.mosaic
def test_decode_step_attention_with_the_kernel_equals_xla():
  """``cache_attention`` of a decode step over layer 1 of a two-layer stack: the kernel
  (interpreted) and XLA's path agree, with the new token's own k and v; row 1 holds 30 tokens
  of 128 slots. One device: GPU interpret mode's bookkeeping of shared-memory barriers fails
  intermittently when two devices run warpgroup kernels at once ("Barrier remains allocated"
  on device 1; flash_hopper's ring in test_hopper_races fails alike under a two-device
  shard_map, jax 0.10 and 0.12), so the combine across devices is checked on XLA's partials
  (tests/test_generate.py), which the kernel's equal (above). The kernel's layout keeps v like
  k (``v_layout``), XLA's slots last. About 5 s on jax 0.10."""
  mesh = make_mesh(1, 1, devices=jax.devices()[:1])
  layout = gen.plan_cache(mesh, batch=2, prompt_len=120, max_new_tokens=9, kv_heads=1,
                          head_dim=64, dtype="bfloat16", layer_windows=(None, None))
  assert layout.full_capacity == 128
  rng = np.random.default_rng(0)
  c, d = layout.full_capacity, layout.head_dim
  k, v = (jnp.asarray(rng.standard_normal((2, 2, 1, c, d)), jnp.bfloat16) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((2, 1, 4, d)), jnp.bfloat16)
  new_kv = tuple(jnp.asarray(rng.standard_normal((2, 1, 1, d)), jnp.bfloat16) for _ in range(2))
  lengths = jnp.asarray([200, 30])
  positions = cache_lib.chunk_positions(layout, None, 0, lengths)
  outputs = {}
  for backend in ("xla", "mosaic"):
    chosen = dataclasses.replace(layout, decode_backend=backend)
    assert chosen.v_layout == {"xla": "DC", "mosaic": "CD"}[backend]
    v_laid_out = v.swapaxes(3, 4) if chosen.v_layout == "DC" else v
    outputs[backend] = np.asarray(jax.jit(lambda *x, chosen=chosen: gen_attention.cache_attention(
        chosen, *x, scale=0.125, window=None, new_kv=new_kv, layer=1))(
            q, k, v_laid_out, lengths[:, None], positions), np.float32)
  np.testing.assert_allclose(outputs["mosaic"], outputs["xla"], atol=2e-2, rtol=0)


@pytest.mark.slow  # 11 to 20 s
@pytest.mark.gpu_compile
@pytest.mark.skipif(not aot.cuda_plugin_installed(), reason="needs JAX's CUDA plugin (make "
                    "test-gpu-compile builds .venv-gpu-compile)")
def test_decode_step_compiled_for_h100_reads_each_layer_with_the_kernel():
  """Llama-3.1-8B's shapes (two layers) at 1M tokens on 8 H100s: ``auto`` puts one kernel per
  layer in the decode step, reading each layer's k and v where they lie in the stack (its
  temporaries stay below one layer's k: no copy), where XLA's fusions broadcast each layer's
  k and v over the 4 query heads of its group (``benchmarks/decode_compiled.py``)."""
  from benchmarks.decode_compiled import compile_decode
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.models.config import preset
  config = preset("llama3.1-8b", dtype="bfloat16", param_dtype="bfloat16", remat_policy="none",
                  attn_head_chunks=1, num_layers=2)
  reports = {backend: compile_decode(config, aot_generate.GenerationSetup(
      prompt_len=1 << 20, max_new_tokens=129, mesh_seq=8, decode_backend=backend))
      for backend in ("auto", "xla")}
  one_layer_k_gib = ((1 << 20) + 128) * 128 * 2 / 2**30
  assert reports["auto"]["mosaic_kernels"] == 2
  assert reports["auto"]["temporaries_gib"] < one_layer_k_gib
  assert reports["auto"]["cache_reads_of_fusions"] == []
  assert reports["xla"]["mosaic_kernels"] == 0
  assert reports["xla"]["cache_reads_of_fusions"] == [4]
  assert reports["xla"]["fusions_broadcasting_a_cache_layer"] == 4  # k and v of 2 layers


@pytest.mark.gpu_compile
@pytest.mark.skipif(not aot.cuda_plugin_installed(), reason="needs JAX's CUDA plugin (make "
                    "test-gpu-compile builds .venv-gpu-compile)")
def test_on_hopper_the_cache_keeps_v_like_k_where_every_decode_runs_the_kernel():
  """On an H100 mesh (compile-only devices), ``auto``: v like k where every kind's decode runs
  the kernel (a 104-slot rolling buffer), slots last where one kind's cannot (60 slots: fewer
  than a block) or with ``xla``."""
  h100 = make_mesh(1, 1, devices=aot.gpu_devices("h100", "1x1x1"))
  for window, backend, v_layout in ((100, "auto", "CD"), (60, "auto", "DC"), (100, "xla", "DC")):
    layout = gen.plan_cache(h100, batch=1, prompt_len=512, max_new_tokens=4, kv_heads=2,
                            head_dim=64, dtype="bfloat16", layer_windows=(None, window))
    assert dataclasses.replace(layout, decode_backend=backend).v_layout == v_layout


def test_doctor_decode_check_needs_a_hopper_gpu():
  row, = decode_doctor.decode_rows(jax.devices()[0])
  assert row["passed"] is None and row["status"] == "needs a Hopper GPU (sm90)"
  assert decode_doctor.check(row) == {"name": "decode kernel vs XLA", "passed": None,
                                      "detail": "needs a Hopper GPU (sm90)"}


@pytest.mark.slow
def test_doctor_decode_check_runs_the_kernel_interpreted():
  """What the doctor runs on a Hopper GPU (the kernel and XLA's path against float32, then
  timed), on a 256-slot cache with the kernel interpreted, and two variants (one given the
  values slots last: checked against the same reference, so timed); and a row at head dim 256.
  About 20 s on jax 0.10."""
  variants = {name: decode_doctor.VARIANTS[name] for name in ("2 waves", "values slots last")}
  printed = []
  row, wide = decode_doctor.decode_rows(jax.devices()[0], slot_counts=(256,), warmup=0, iters=1,
                                        burst=1, interpret=True, copy_bytes=1 << 20,
                                        variants=variants, wide_rows=((256, 128),),
                                        on_row=printed.append)
  assert printed == [row, wide]
  assert row["passed"] is True and row["error"] < 1e-2 and row["xla_error"] < 1e-2, row
  assert wide["passed"] is True and wide["head_dim"] == 256 and wide["variant_ms"] == {}, wide
  assert decode_doctor.check(wide)["name"] == "decode kernel vs XLA, 128 slots, head dim 256"
  assert row["variant_ms"]["2 waves"] > 0 and row["variant_ms"]["values slots last"] > 0
  assert row["kernel_ms"] > 0 and row["xla_ms"] > 0 and row["copy_gb_per_s"] > 0
  assert row["kernel_pct_of_copy"] == pytest.approx(
      100 * row["kernel_gb_per_s"] / row["copy_gb_per_s"])
  check = decode_doctor.check(row)
  assert check["name"] == "decode kernel vs XLA, 256 slots"
  assert "256 slots: kernel" in check["detail"] and "% of the copy's" in check["detail"]
  assert any(f"fastest variant: {name}," in check["detail"] for name in variants)


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


def test_cache_reads_counts_a_layer_broadcast_over_the_heads():
  """``benchmarks.decode_compiled.cache_reads`` on a fused computation as XLA's GPU compiler
  writes it for q . k (a layer's k [C, D] broadcast over 4 heads) and on one without."""
  from benchmarks.decode_compiled import cache_reads
  hlo = """%fused_reduce.7 (param_0.5: bf16[1,1,1,96,8], param_1.5: bf16[1,1,4,8]) -> f32[4,96] {
  %param_0.5 = bf16[1,1,1,96,8]{4,3,2,1,0} parameter(0)
  %bitcast.21 = bf16[96,8]{1,0} bitcast(%param_0.5)
  %convert.41 = f32[96,8]{1,0} convert(%bitcast.21)
  %mul.263 = f32[1,1,4,1,96,8]{5,4,3,2,1,0} broadcast(%convert.41), dimensions={4,5}
  ROOT %reduce.36 = f32[4,96]{1,0} reduce(%mul.263, %c), dimensions={2}, to_apply=%add
}

%fused_copy (param_0.6: bf16[96,8]) -> bf16[96,8] {
  ROOT %param_0.6 = bf16[96,8]{1,0} parameter(0)
}
"""
  assert cache_reads(hlo, 96 * 8) == [4]
  assert cache_reads(hlo, 97 * 8) == []


def test_entry_launches_counts_the_entry_computations_fusions_and_custom_calls():
  """A fusion called inside another computation is not a launch of the entry's."""
  from benchmarks.decode_compiled import entry_launches
  hlo = """%fused_inner (p: f32[4]) -> f32[4] {
  ROOT %n = f32[4]{0} negate(%p)
}

%fused_outer (p: f32[4]) -> f32[4] {
  ROOT %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_inner
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %f.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_outer
  %k = f32[4]{0} custom-call(%f.1), custom_call_target="mosaic_gpu_v2"
  ROOT %f.2 = f32[4]{0} fusion(%k), kind=kLoop, calls=%fused_inner
}
"""
  assert entry_launches(hlo) == 3



@pytest.mark.slow
@pytest.mark.mosaic
def test_the_kernels_cache_layout_holds_the_same_values_laid_out_like_the_keys():
  """Where the decode steps run the kernel (``decode_backend="mosaic"``, interpreted here) the
  cache keeps v like k (``v_layout == "CD"``): after a prefill in two chunks (the second
  attends the first through XLA's path over that layout) and one decode step, it holds what
  XLA's layout ("DC", slots last) holds, v transposed, in a full layer and in a windowed
  layer's rolling buffer (64 + 65 - 1 slots). One device (see above). About 15 s on jax 0.10."""
  from flax import nnx
  from ulysses_jax.models.llama import Llama, preset
  config = preset("tiny-gqa", head_dim=64, dtype="bfloat16", sliding_window=64,
                  layer_types=("full_attention", "sliding_attention"))
  model = Llama(config, mesh=make_mesh(1, 1, devices=jax.devices()[:1]), rngs=nnx.Rngs(0))
  layout = gen.plan_cache(model.mesh, batch=2, prompt_len=130, max_new_tokens=3, kv_heads=2,
                          head_dim=64, dtype="bfloat16", layer_windows=config.layer_windows(),
                          chunk_len=65)
  assert layout.kinds == (None, 64) and layout.capacity(64) == 128
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 130))
  caches = {}
  for backend in ("mosaic", "xla"):
    generator = gen.Generator(model, dataclasses.replace(layout, decode_backend=backend))
    generator.prefill(tokens, np.array([130, 70]))
    generator.decode()
    caches[generator.layout.v_layout] = jax.device_get(generator.cache)
  # Layer 0 (the full kind) comes from the embeddings alone: equal. Layer 1's inputs went
  # through layer 0's attention of the second chunk over the first, whose values product XLA
  # computes in another order per layout: within one bfloat16 rounding (2**-8 relative).
  cd, dc = caches["CD"], caches["DC"]
  np.testing.assert_array_equal(cd.k[0], dc.k[0])
  np.testing.assert_array_equal(cd.v[0], dc.v[0].swapaxes(3, 4))
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(cd.k[1]), f32(dc.k[1]), rtol=2**-8, atol=2**-8)
  np.testing.assert_allclose(f32(cd.v[1]), f32(dc.v[1]).swapaxes(3, 4), rtol=2**-8, atol=2**-8)
  for kind in range(2):
    np.testing.assert_array_equal(cd.positions[kind], dc.positions[kind])
