"""The model families' programs compiled for H100s on a machine without a GPU: generation's
decode step and the mixture-of-experts layer (marked ``gpu_compile``, as
``tests/test_gpu_compile.py``)."""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from test_gpu_compile import MOSAIC, pytestmark  # noqa: F401  (the marks apply here too)
from ulysses_jax import aot, make_mesh


def test_generation_decode_step_updates_the_donated_cache_in_place():
  """The decode step compiled for H100s aliases the whole cache (k, v and positions) to its
  output and holds no copy of it: its temporaries stay below one layer's k (a copy per step is
  the trap of tpu-inference issue 3459). A 1M-token cache dwarfs the tiny model's weights."""
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.models.config import preset
  config = preset("tiny-gqa", dtype="bfloat16", param_dtype="bfloat16", remat_policy="none")
  mesh = make_mesh(1, 8, devices=aot.gpu_devices("h100", "1x1x8"))
  generator, layout, cache = aot_generate.abstract_generator(
      config, mesh, aot_generate.GenerationSetup(prompt_len=1 << 20))
  memory = aot_generate.lower_steps(generator, layout, cache)["decode"].compile(
  ).memory_analysis()
  assert memory.alias_size_in_bytes >= (layout.bytes_per_device()
                                        + layout.positions_bytes_per_device())
  one_layer_k = layout.bytes_per_device() // (2 * config.num_layers)
  # 2 KV heads, 1/8 of the slots; 127 new ones, each device's slots a multiple of 64
  assert one_layer_k == 2 * ((1 << 20) + 8 * 64) // 8 * 16 * 2
  assert memory.temp_size_in_bytes < one_layer_k, memory.temp_size_in_bytes


def _compile_moe_layer(backend, tokens=2048):
  """A mixture-of-experts layer's forward and backward (32 experts of width 512, 4 per token,
  model width 1024, bfloat16, tiles of 1024 tokens) compiled for one H100."""
  from benchmarks.moe_layer import compile_moe_layer
  from ulysses_jax.models.config import MoeConfig, preset
  config = preset("tiny", hidden_dim=1024, dtype="bfloat16", param_dtype="bfloat16",
                  mlp_chunk=1024, expert_backend=backend,
                  moe=MoeConfig(num_experts=32, experts_per_token=4, expert_mlp_dim=512))
  return compile_moe_layer(config, make_mesh(1, 1, devices=aot.gpu_devices("h100", "1x1x1")),
                           tokens)


def test_experts_compile_to_grouped_mosaic_kernels_not_a_dense_product():
  """XLA:GPU rewrites ragged_dot into a dense product over the experts (X times the FLOPs and
  a [rows, X·width] temporary); the default backend on Hopper runs the Mosaic grouped kernels:
  9 per tile (3 forward, 6 backward) whose FLOPs (aot.cost) are those of the k experts only."""
  from ulysses_jax.aot import cost
  tokens, k, e, i = 2048, 4, 1024, 512
  grouped = 3 * 2 * (tokens * k) * e * i * 3  # three matmuls, forward + two gradients
  compiled = _compile_moe_layer("auto", tokens)
  text = compiled.as_text()
  assert text.count(MOSAIC) >= 9 and "grouped_matmul_mosaic/" in text
  flops = sum(op.count * op.flops for op in cost.operations(text))
  assert grouped <= flops < 1.05 * grouped
  dense = _compile_moe_layer("ragged_dot", tokens)
  assert MOSAIC not in dense.as_text()
  assert sum(op.count * op.flops for op in cost.operations(dense.as_text())) > 20 * grouped
  assert (dense.memory_analysis().temp_size_in_bytes
          > 10 * compiled.memory_analysis().temp_size_in_bytes)


def _collective_shapes(text, kind):
  """The result shapes (``"bf16[512,64]"``, ...) of every ``kind`` collective in an HLO text,
  sync or async (an async start's result lists its operands' shapes too)."""
  return [shape for line in text.splitlines() if f" {kind}(" in line or f" {kind}-start(" in line
          for shape in re.findall(r"\w+\[[\d,]*\]", line.split(f" {kind}")[0])]


def test_fsdp_gathers_move_bfloat16_parameters():
  """The FSDP all-gathers of a bfloat16 train step on 8 H100s move bfloat16 parameters, not
  float32 ones cast after the gather, and the gradients go back by a reduce-scatter. A tied
  table is cast twice (lookup and head): with only the replicated constraint after the casts
  XLA gathered it in float32 and all-reduced its gradient (``sharding.gather`` now pins the
  table's casts to its shards). The head's float32 gradient goes back to the table's shards by
  a reduce-scatter (``chunked_cross_entropy``'s ``head_sharding``), not an all-reduce."""
  from ulysses_jax import sharding
  from ulysses_jax.models.llama import Llama, preset
  config = preset("tiny", tie_embeddings=True, dtype="bfloat16", vocab_size=512, hidden_dim=64)
  mesh = make_mesh(1, 8, devices=aot.gpu_devices("h100", "1x1x8"))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, mesh=mesh,
                                                           rngs=nnx.Rngs(0))))
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       state, sharding.tree_shardings(state, mesh))
  tokens = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  loss = lambda s, t: nnx.merge(graphdef, s).loss(t, t).mean()
  text = jax.jit(jax.grad(loss)).lower(state, tokens).compile().as_text()
  gathered = _collective_shapes(text, "all-gather")
  table_shard = {"bf16[512,8]", "bf16[8,512]"}  # [V, E/8], or as the head's [E/8, V]
  assert table_shard & set(gathered), gathered
  assert not [s for s in gathered if s.startswith("f32")], gathered
  assert "f32[8,512]" in _collective_shapes(text, "reduce-scatter")  # its gradient
  all_reduced = _collective_shapes(text, "all-reduce")
  assert not [s for s in all_reduced if s.startswith("f32[") and
              math.prod(int(d) for d in s[4:-1].split(",") if d) >= 512 * 64], all_reduced


@pytest.mark.parametrize("reduced_to_shards", [True, False])
def test_the_heads_gradient_is_reduce_scattered_once_after_the_loss_chunks(reduced_to_shards):
  """The head's float32 gradient, summed over 4 loss chunks per device on 8 H100s, leaves the
  loss by one reduce-scatter to the parameter's shards (``chunked_cross_entropy``'s
  ``head_sharding``), and no whole head moves but the forward's gather (the gradient stays in
  the shards: ``sharding.gather``'s ``gradient_in_shards``). Without ``head_sharding`` the
  shards' constraint of the gather's transpose reaches into the scan: a reduce-scatter per
  chunk."""
  from ulysses_jax import loss as loss_lib
  from ulysses_jax import sharding
  from ulysses_jax.aot import hlo
  embed, vocab, tokens, chunk = 64, 512, 1024, 32
  mesh = make_mesh(1, 8, devices=aot.gpu_devices("h100", "1x1x8"))
  shards = sharding.logical_sharding((embed, vocab), ("embed", "vocab"), mesh)

  def loss(head_EV, hidden_BSE, labels_BS):
    head_EV = sharding.gather(head_EV, jnp.bfloat16, mesh, axes=("embed", "vocab"),
                              gradient_in_shards=True)
    return loss_lib.chunked_cross_entropy(
        hidden_BSE, head_EV, labels_BS, mesh=mesh, chunk=chunk,
        head_sharding=shards if reduced_to_shards else None).mean()

  act = lambda shape, axes: sharding.logical_sharding(shape, axes, mesh)
  args = (jax.ShapeDtypeStruct((embed, vocab), jnp.float32, sharding=shards),
          jax.ShapeDtypeStruct((1, tokens, embed), jnp.bfloat16,
                               sharding=act((1, tokens, embed), ("act_batch", "act_seq", None))),
          jax.ShapeDtypeStruct((1, tokens), jnp.int32,
                               sharding=act((1, tokens), ("act_batch", "act_seq"))))
  text = jax.jit(jax.grad(loss), out_shardings=shards).lower(*args).compile().as_text()
  moved = hlo.executed_collective_bytes(text)
  gradient_shard = embed * vocab * 4 // 8
  assert moved["all-gather"] == embed * vocab * 2, moved  # the bfloat16 head, forward
  assert moved["all-reduce"] < gradient_shard, moved
  chunks = tokens // 8 // chunk
  assert moved["reduce-scatter"] == gradient_shard * (1 if reduced_to_shards else chunks), moved


def test_the_layers_backward_starts_after_the_heads_gradient_is_reduce_scattered():
  """A train step on 8 H100s (a small model, vocabulary 131,072): the reduce-scatter of the
  head's float32 gradient to its shards completes before the layers' backward loop starts,
  so the replicated sum ([128, 131072] here; 3.91 GiB for Llama-3.1-70B) is not live during
  it (``loss._to_head_shards``' barrier). XLA left alone moved it after that loop (jax
  0.12.0.1): Llama-3.1-70B at 4,702,208 tokens on 8 H100s compiled 2.7 GiB larger."""
  from ulysses_jax import step_builder
  from ulysses_jax.cli import gin_config
  config = gin_config.read(["configs/tiny_cpu.gin"], [
      "TrainConfig.mesh_data = 1", "TrainConfig.mesh_seq = 8", "DataConfig.batch_size = 1",
      "DataConfig.seq_len = 262144", "LlamaConfig.vocab_size = 131072",
      "TrainConfig.platform = ''", "TrainConfig.cpu_devices = 0"])
  built = step_builder.build_train_step(
      config, step_builder.run_mesh(config.train, aot.gpu_devices("h100", "1x1x8")))
  text = built.step.lower(built.state, built.batch).compile().as_text()
  schedule = text[text.index("\nENTRY"):].splitlines()
  hidden = re.escape(f"f32[1,{262144 // 8},{config.model.hidden_dim}]")
  layer_loops = [i for i, line in enumerate(schedule)
                 if " while(" in line and re.search(hidden, line.split(" while(")[0])]
  head_shard = f"f32[{config.model.hidden_dim // 8},131072]"
  head_reduced = [i for i, line in enumerate(schedule)
                  if re.search(r" reduce-scatter(-done)?\(", line)
                  and head_shard in line.split(" reduce-scatter")[0]]
  assert len(layer_loops) == 2 and len(head_reduced) == 1, (layer_loops, head_reduced)
  forward, backward = layer_loops
  assert forward < head_reduced[0] < backward
