"""The split-K decode kernel (``kernels.decode_hopper``) in the decode step: which backend
``generate.attention`` chooses, the step's attention with the kernel (interpreted) against XLA's
path, the step compiled for H100s, the kernel's cache layout, the doctor's decode check, and the
counts ``benchmarks/decode_compiled.py`` reads from the compiled step. The kernel's own
numerics, races and lowering: ``test_decode_kernel.py``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulysses_jax import aot
from ulysses_jax.doctor import decode as decode_doctor
from ulysses_jax import generate as gen
from ulysses_jax.generate import attention as gen_attention
from ulysses_jax.generate import cache as cache_lib
from ulysses_jax.kernels import target
from ulysses_jax.mesh import make_mesh


# GPU interpret mode's state cleared before and after each test (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_gpu_interpreter")


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
