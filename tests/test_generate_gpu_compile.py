"""Generation compiled for H100s on a machine without a GPU (marked ``gpu_compile``, as
``tests/test_gpu_compile.py``): a mixture-of-experts decode step reads its experts from the
whole stack, holding no copy of a layer's experts; a bfloat16 prefill attends with our Mosaic
kernel."""

import math
import re

import pytest
from test_gpu_compile import MOSAIC, pytestmark  # noqa: F401  (the marks apply here too)
from ulysses_jax import aot, make_mesh


@pytest.mark.slow  # 38 s on 2 busy cores
def test_moe_decode_step_hands_the_kernel_the_whole_stack_and_copies_no_layer():
  """4 layers of 32 experts (width 512, model width 1024, bfloat16) on 1 x 8: every Mosaic
  grouped matmul of the decode step takes all 4 x 32 groups, and the step's temporaries stay
  far below one layer's experts (a slice of the stack copied per layer, as XLA does for a
  custom call's operand, would hold them)."""
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.models.config import MoeConfig, preset
  config = preset("tiny", hidden_dim=1024, num_layers=4, dtype="bfloat16",
                  param_dtype="bfloat16", remat_policy="none",
                  moe=MoeConfig(num_experts=32, experts_per_token=4, expert_mlp_dim=512))
  mesh = make_mesh(1, 8, devices=aot.gpu_devices("h100", "1x1x8"))
  generator, layout, cache = aot_generate.abstract_generator(
      config, mesh, aot_generate.GenerationSetup(prompt_len=4096))
  compiled = aot_generate.lower_steps(generator, layout, cache)["decode"].compile()
  kernels = [line for line in compiled.as_text().splitlines() if MOSAIC in line]
  assert len(kernels) == 3 * config.num_layers  # gate, up, down per layer
  assert all(re.search(r"bf16\[128,(1024,512|512,1024)\]", line) for line in kernels)
  one_layer_experts = 3 * 32 * 1024 * 512 * 2
  assert compiled.memory_analysis().temp_size_in_bytes < one_layer_experts / 8


def test_bfloat16_prefill_runs_the_mosaic_attention_kernel_and_no_triton_one():
  """Issue 49, item 4: a bfloat16 model's one-pass prefill on H100s (1 x 8, 8,192 tokens,
  head dim 64) attends with our Mosaic forward kernel on bfloat16 operands, never the Triton
  kernels (the float32 path generation took before it followed the checkpoint's dtype)."""
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.models.config import preset
  config = preset("tiny", hidden_dim=512, num_heads=8, num_kv_heads=8, head_dim=64,
                  num_layers=2, dtype="bfloat16", param_dtype="bfloat16", remat_policy="none")
  mesh = make_mesh(1, 8, devices=aot.gpu_devices("h100", "1x1x8"))
  generator, layout, cache = aot_generate.abstract_generator(
      config, mesh, aot_generate.GenerationSetup(prompt_len=8192))
  text = aot_generate.lower_steps(generator, layout, cache)["prefill"].compile().as_text()
  kernels = [line for line in text.splitlines() if MOSAIC in line]
  assert kernels and all("bf16[" in line for line in kernels), kernels
  assert "__gpu$xla.gpu.triton" not in text


# Llama-3.2-1B (its q and o kernels, 4M elements); a Qwen3-0.6B-sized MLP (1024 x 3072).
@pytest.mark.parametrize("overrides", [{}, dict(hidden_dim=1024, mlp_dim=3072, num_heads=16)],
                         ids=["llama1b", "small-mlp"])
def test_one_sequence_decode_step_writes_no_projection_sized_product(overrides):
  """Batch 1, one token: the projections and the MLP (``layers.contract``) compile for an H100
  to GEMMs; no kernel writes a multiply's product as large as a projection's kernel, as XLA's
  multiply-and-reduce form of a one-row dot with a kernel under 10M elements does (Llama-3.2-1B's
  q and o: 8 MiB a layer each, before ``contract`` gave the dot a second row). Each layer's
  decode kernel hands its splits' partials to one fusion (``decode_hopper.combine_splits``;
  three before)."""
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.models.config import preset
  config = preset("llama3.2-1b", num_layers=2, dtype="bfloat16", param_dtype="bfloat16",
                  remat_policy="none", attn_head_chunks=1, **overrides)
  mesh = make_mesh(1, 1, devices=aot.gpu_devices("h100", "1x1x1"))
  generator, layout, cache = aot_generate.abstract_generator(
      config, mesh, aot_generate.GenerationSetup(prompt_len=1024, max_new_tokens=64))
  text = aot_generate.lower_steps(generator, layout, cache)["decode"].compile().as_text()
  products = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(
      r"%\w*multiply\w* = \w+\[([\d,]*)\]\S* fusion\(", text)]
  smallest_kernel = config.hidden_dim * config.num_kv_heads * config.head_dim  # k's
  assert max(products, default=0) < smallest_kernel / 64, (products, smallest_kernel)
  assert _fusions_reading_each_kernel(text) == [1] * config.num_layers


def _fusions_reading_each_kernel(hlo_text):
  """For each Mosaic kernel of the entry computation, how many fusions read its outputs."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  counts = []
  for kernel in re.findall(r"%(\S+) = .* custom-call\(.*" + MOSAIC, entry):
    outputs = [kernel, *re.findall(rf"%(\S+) = \S+ get-tuple-element\(%{re.escape(kernel)}\)",
                                   entry)]
    read = re.compile("|".join(rf"%{re.escape(name)}[,)]" for name in outputs))
    counts.append(sum(bool(read.search(line)) for line in entry.splitlines()
                      if re.search(r" fusion\(", line)))
  return counts


def test_gemma3_decode_step_reads_every_layer_with_the_kernel_at_head_dim_256():
  """Issue 49, item 5: Gemma-3-1B's shapes (head dim 256, one KV head, five 512-token
  sliding layers to each full one; six layers) at 8,192 prompt tokens on an H100: the cache
  keeps v like k and the decode step runs our kernel in every layer (the rolling buffers
  too), each split writing its 8 rows (4 real) of output, not the kernel's 64, and the step's
  temporaries stay below half a full layer's keys (no layer copied for the kernel; 129 splits
  of 64 rows would write twice that layer's k)."""
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.models.config import preset
  layer_types = ("sliding_attention",) * 5 + ("full_attention",)
  config = preset("gemma3-1b", num_layers=6, layer_types=layer_types, dtype="bfloat16",
                  param_dtype="bfloat16", remat_policy="none", attn_head_chunks=1)
  mesh = make_mesh(1, 1, devices=aot.gpu_devices("h100", "1x1x1"))
  generator, layout, cache = aot_generate.abstract_generator(
      config, mesh, aot_generate.GenerationSetup(prompt_len=8192, max_new_tokens=64))
  assert layout.v_layout == "CD" and layout.kinds == (None, 512)
  compiled = aot_generate.lower_steps(generator, layout, cache)["decode"].compile()
  kernels = [line for line in compiled.as_text().splitlines() if MOSAIC in line]
  assert len(kernels) == config.num_layers, kernels
  assert all(re.search(r"f32\[1,1,\d+,8,256\]", line) for line in kernels), kernels
  one_full_layer_k = layout.full_capacity * 256 * 2
  assert compiled.memory_analysis().temp_size_in_bytes < one_full_layer_k / 2
