"""Llama: architecture against a plain reference, SP equivalence, tiling, remat, presets."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_cases import large_sinks
from child_env import older_cpu_fusion
from model_cases import (MESHES, assert_trees_close, initial_state, loss_and_grads, mesh_of,
                         model_on, packed_batch, relative_error, tree_on_host)
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.models import llama
from ulysses_jax.models.llama import MLP, Llama, LlamaConfig, init_llama, preset
from ulysses_jax.rope import RopeScaling, inverse_frequencies


def _rms(x, scale, eps, offset_one=False):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset_one + scale)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _rope(x_BSHD, positions_BS, inv_freq):
  angles = positions_BS[..., None] * np.asarray(inv_freq, np.float64)
  cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
  x1, x2 = np.split(x_BSHD, 2, axis=-1)
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(config, params, tokens, positions, segment_ids):
  """The Llama forward pass written out layer by layer in float64 NumPy (dense attention)."""
  c = config
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(params))
  norm = lambda x, params: _rms(x, params["scale"], c.norm_eps, c.norm_offset_one)
  post = lambda layer, name, y: norm(y, layer[name]) if c.post_norms else y
  activation = _gelu_tanh if c.mlp_activation == "gelu_tanh" else lambda g: g / (1 + np.exp(-g))
  x = p["embedding"][tokens] * (np.sqrt(c.hidden_dim) if c.embed_scale else 1.0)
  for i, layer_type in enumerate(c.attention_types()):
    kind = c.layer_attention(layer_type)
    inv_freq = inverse_frequencies(c.head_dim, kind["rope_theta"], kind["rope_scaling"])
    layer = jax.tree.map(lambda a, i=i: a[i], p["layers"])
    attn = layer["attn"]
    h = norm(x, layer["attn_norm"])
    q, k, v = (np.einsum("bse,ehd->bshd", h, attn[n]["kernel"]) + attn[n].get("bias", 0.0)
               for n in ("q_proj", "k_proj", "v_proj"))
    if c.qk_norm:
      q, k = norm(q, attn["q_norm"]), norm(k, attn["k_norm"])
    q, k = _rope(q, positions, inv_freq), _rope(k, positions, inv_freq)
    sinks = attn["sinks"] if c.attention_sinks else None
    out = np.asarray(dense_attention(*(jnp.asarray(t, jnp.float32) for t in (q, k, v)),
                                     causal=True, q_segment_ids=segment_ids,
                                     kv_segment_ids=segment_ids, scale=c.attention_scale,
                                     sliding_window=kind["sliding_window"], sinks=sinks),
                     np.float64)
    x = x + post(layer, "attn_post_norm", np.einsum("bshd,hde->bse", out,
                                                    attn["o_proj"]["kernel"]))
    mlp = layer["mlp"]
    h = norm(x, layer["mlp_norm"])
    gated = activation(h @ mlp["gate_proj"]["kernel"]) * (h @ mlp["up_proj"]["kernel"])
    x = x + post(layer, "mlp_post_norm", gated @ mlp["down_proj"]["kernel"])
  x = norm(x, p["final_norm"])
  head = p["embedding"].T if c.tie_embeddings else p["lm_head"]["kernel"]
  return x @ head


ALL_FEATURES = preset("tiny-gqa", tie_embeddings=True, qkv_bias=True, qk_norm=True,
                      rope_scaling=RopeScaling(factor=4.0, original_max_position=16),
                      attention_sinks=True)


def with_large_sinks(config, state):
  """``state`` with attention sinks of magnitude 2 to 4 (they start near zero), when the model
  has sinks."""
  if config.attention_sinks:
    sinks = state["layers"]["attn"]["sinks"]
    sinks.set_value(np.stack([large_sinks(config.num_heads, seed=i)
                              for i in range(config.num_layers)]))
  return state


# Windows of 3 and 6 tokens over documents of up to 20: several windows long.
MIXED_WINDOWS = preset("tiny-gqa", num_layers=3, sliding_window=3,
                       layer_types=("sliding_attention", "full_attention", "sliding_attention"))
# Gemma 3: each layer type with its own RoPE, a score scale other than D ** -0.5.
GEMMA_STYLE = MIXED_WINDOWS.replace(
    tie_embeddings=True, mlp_activation="gelu_tanh", norm_offset_one=True, post_norms=True,
    embed_scale=True, qk_norm=True, attention_scale=0.4, mlp_chunk=3, rope_theta=1e6,
    rope_scaling=RopeScaling(kind="linear", factor=4.0), sliding_rope_theta=100.0)


@pytest.mark.parametrize("config, mesh_shape", [
    (preset("tiny-gqa"), (2, 4)), (ALL_FEATURES, (2, 4)),
    (MIXED_WINDOWS, (1, 8)), (MIXED_WINDOWS.replace(remat_group=3), (2, 4)),
    (preset("tiny", sliding_window=6), (1, 8)),
    (GEMMA_STYLE, (1, 8))],
    ids=["plain", "tied-bias-qknorm-llama3rope", "mixed-windows", "mixed-windows-remat-group",
         "all-sliding", "gemma-style"])
def test_logits_match_reference(config, mesh_shape):
  mesh = mesh_of(*mesh_shape)
  # Perturb every parameter so norm scales and biases are not at their 1/0 init.
  state = initial_state(config)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  state = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])
  model = model_on(config, mesh, with_large_sinks(config, state))
  batch = packed_batch(0, 2, 20, config.vocab_size)
  logits = nnx.jit(lambda m, b: m(b["tokens"], b["positions"], b["segment_ids"]))(model, batch)
  expected = reference_logits(config, tree_on_host(state), batch["tokens"],
                              batch["positions"], batch["segment_ids"])
  assert logits.shape == (2, 20, config.vocab_size) and logits.dtype == jnp.float32
  assert relative_error(logits, expected) < 1e-5


# (preset, seq_len, mesh): S=30 is divisible by neither 4 nor 8; every mesh runs both heads
# layouts in the slow suite. Small loss/MLP chunks force several padded chunks per device.
# Hybrid meshes are (data, seq, ring): all-to-all over seq, K/V ring over ring.
HYBRID_MESHES = ((2, 2, 2), (1, 4, 2))
SP_CASES = [("tiny", 32, m) for m in MESHES + HYBRID_MESHES] + [
    ("tiny-gqa", 30, m) for m in MESHES + HYBRID_MESHES]
FAST_SP_CASES = {("tiny", 32, (1, 8)), ("tiny-gqa", 30, (2, 4)), ("tiny-gqa", 30, (2, 2, 2))}


@pytest.fixture(scope="module")
def sp_reference():
  """Per preset: config, host parameters, batch, and loss + gradients on one device."""
  cache = {}

  def get(name, seq_len):
    if name not in cache:
      # tiny-gqa with attention sinks, each device getting its heads' (replicated KV heads)
      config = preset(name, loss_chunk=3, mlp_chunk=3, attention_sinks=name == "tiny-gqa")
      state = with_large_sinks(config, initial_state(config))
      batch = packed_batch(1, 8, seq_len, config.vocab_size)
      cache[name] = (config, state, batch,
                     loss_and_grads(model_on(config, mesh_of(1, 1), state), batch))
    return cache[name]
  return get


@pytest.mark.parametrize(
    "name,seq_len,mesh_shape",
    [c if c in FAST_SP_CASES else pytest.param(*c, marks=pytest.mark.slow) for c in SP_CASES])
def test_sequence_parallel_loss_and_grads_match_single_device(sp_reference, name, seq_len,
                                                              mesh_shape):
  config, state, batch, (ref_loss, ref_grads) = sp_reference(name, seq_len)
  loss, grads = loss_and_grads(model_on(config, mesh_of(*mesh_shape), state), batch)
  assert relative_error(loss, ref_loss) < 1e-5
  assert_trees_close(grads, ref_grads)


@pytest.mark.slow  # the quick suite has the mixed windows in logits and test_hf
def test_mixed_windows_loss_and_grads_match_single_device():
  """The lax.cond between windowed and full layers, differentiated (and rematerialised), on
  a sequence-sharded mesh."""
  config = MIXED_WINDOWS.replace(num_layers=2, loss_chunk=8,
                                layer_types=("full_attention", "sliding_attention"))
  state = initial_state(config)
  batch = packed_batch(2, 2, 24, config.vocab_size)
  loss, grads = loss_and_grads(model_on(config, mesh_of(1, 8), state), batch)
  ref_loss, ref_grads = loss_and_grads(model_on(config, mesh_of(1, 1), state), batch)
  assert relative_error(loss, ref_loss) < 1e-5
  assert_trees_close(grads, ref_grads)


def test_compile_size_does_not_grow_with_depth():
  def op_counts(num_layers):
    config = preset("tiny", num_layers=num_layers)
    model = nnx.eval_shape(lambda: Llama(config, mesh=mesh_of(1, 1), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    loss = lambda s, t: nnx.merge(graphdef, s).loss(t, t).mean()
    text = jax.jit(jax.grad(loss)).lower(state, tokens).as_text()
    return collections.Counter(re.findall(r"stablehlo\.[a-z_]+", text))
  assert op_counts(2) == op_counts(12)


def test_tiled_mlp_matches_plain_mlp():
  mesh = mesh_of(2, 4)
  plain = nnx.eval_shape(lambda: MLP(preset("tiny"), mesh=mesh, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(plain)
  tiled_graphdef, _ = nnx.split(nnx.eval_shape(
      lambda: MLP(preset("tiny", mlp_chunk=3), mesh=mesh, rngs=nnx.Rngs(0))))
  state = nnx.state(MLP(preset("tiny"), mesh=mesh, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(0), (2, 40, 64))  # 10 local tokens: chunks 3+3+3+1

  def run(graphdef):
    f = lambda s, x: jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(state, x)

  (value, grads), (tiled_value, tiled_grads) = run(graphdef), run(tiled_graphdef)
  assert relative_error(tiled_value, value) < 1e-6
  assert_trees_close(tiled_grads, grads)


def _saved_residuals(model, batch, capsys):
  """The lines ``jax.ad_checkpoint.print_saved_residuals`` prints for the model's loss."""
  graphdef, params = nnx.split(model)
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(
      lambda p: nnx.merge(graphdef, p).loss(batch["tokens"], batch["labels"]).mean(), params)
  return capsys.readouterr().out.splitlines()


@pytest.fixture(scope="module")
def remat_reference():
  """Config, parameters, batch, and loss + gradients without remat, on a (1, 2) mesh."""
  config = preset("tiny-gqa", remat_policy="none")
  state = initial_state(config)
  batch = packed_batch(2, 2, 16, config.vocab_size)
  return config, state, batch, loss_and_grads(model_on(config, mesh_of(1, 2), state), batch)


@pytest.mark.parametrize("policy", [
    "offload", "full_offload",
    *(pytest.param(p, marks=pytest.mark.slow)
      for p in llama.REMAT_POLICIES if p not in ("none", "offload", "full_offload"))])
def test_remat_policy_gives_same_gradients(remat_reference, policy, capsys):
  config, state, batch, (loss, grads) = remat_reference
  model = model_on(config.replace(remat_policy=policy), mesh_of(1, 2), state)
  remat_loss, remat_grads = loss_and_grads(model, batch)
  assert relative_error(remat_loss, loss) < 1e-6
  assert_trees_close(remat_grads, grads)
  saved = _saved_residuals(model, batch, capsys)
  on_host = [line for line in saved if "<host>" in line]
  # offload: q, k, v and the attention output of every layer live in pinned host memory;
  # full_offload: the layers' inputs do (both recompute the attention kernel's output and lse).
  assert len(on_host) == {"offload": 4, "full_offload": 1}.get(policy, 0), on_host
  if policy in ("full", "full_offload"):  # one residual per layer, its input [L, B, S, E]
    [layer_inputs] = [line for line in saved
                      if f"[{config.num_layers},2,16,{config.hidden_dim}]" in line]
    assert ("<host>" in layer_inputs) == (policy == "full_offload"), saved


@pytest.mark.parametrize("policy", [pytest.param("full", marks=pytest.mark.slow),
                                    "full_offload"])
def test_remat_groups_give_same_gradients_and_keep_one_input_per_group(policy, capsys):
  config = preset("tiny-gqa", num_layers=4, remat_policy="none")
  state, mesh = initial_state(config), mesh_of(1, 2)
  batch = packed_batch(2, 2, 16, config.vocab_size)
  loss, grads = loss_and_grads(model_on(config, mesh, state), batch)
  model = model_on(config.replace(remat_policy=policy, remat_group=2), mesh, state)
  group_loss, group_grads = loss_and_grads(model, batch)
  assert relative_error(group_loss, loss) < 1e-6
  assert_trees_close(group_grads, grads)
  saved = _saved_residuals(model, batch, capsys)
  # The residual stream is kept once per group of 2 layers, [L/2, B, S, E], not per layer.
  [group_inputs] = [line for line in saved if f"[2,2,16,{config.hidden_dim}]" in line]
  assert ("<host>" in group_inputs) == (policy == "full_offload"), saved
  assert not [line for line in saved if f"[4,2,16,{config.hidden_dim}]" in line], saved


@pytest.mark.parametrize("policy,group", [pytest.param("full", 1, marks=pytest.mark.slow),
                                          ("full", 2), ("full_offload", 2)])
def test_remat_keeps_the_attention_residuals_for_identical_gradients(policy, group, capsys):
  """Rematerialised layers (and groups) keep attention's output and lse on the device, so the
  backward runs only attention's backward; under full_offload they are recomputed. Either way
  the loss and gradients are bit for bit those of recomputing them (mesh 2x4, packed
  documents); with XLA's older CPU code generators (the tests' flag on jax 0.10) within float32
  rounding, as they round the forward and its recompute differently (here up to 2e-8 apart)."""
  config = preset("tiny-gqa", num_layers=2, remat_policy=policy, remat_group=group)
  state, mesh = initial_state(config), mesh_of(2, 4)
  batch = packed_batch(5, 2, 32, config.vocab_size)
  model = model_on(config, mesh, state)
  (loss, grads), (recomputed_loss, recomputed_grads) = (
      loss_and_grads(m, batch) for m in (
          model, model_on(config.replace(remat_keep_attention=False), mesh, state)))
  if older_cpu_fusion():
    assert relative_error(loss, recomputed_loss) < 1e-6
    assert_trees_close(grads, recomputed_grads, rtol=1e-6)
  else:
    assert loss == recomputed_loss
    jax.tree.map(np.testing.assert_array_equal, grads, recomputed_grads)
  saved = _saved_residuals(model, batch, capsys)
  # Per layer (per group and layer with groups) the kernel's output [B/data, S, Hq/seq, D]
  # and lse [B/data, Hq/seq, S] of each of the 8 devices (shard_map's residuals).
  kept = [line for shape in (r"8,32,1,16\]", r"8,1,32\]") for line in saved
          if re.match(r"f32(<host>)?\[[0-9,]*," + shape, line)]
  assert len(kept) == (0 if policy == "full_offload" else 2), saved
  assert not any("<host>" in line for line in kept), saved


def test_attention_head_chunks_give_the_plain_models_loss_and_gradients():
  """attn_head_chunks=2 (one KV head per chunk, replicated over seq=4) inside remat groups
  with the layer inputs on the host: the loss and gradients of the plain model."""
  config = preset("tiny-gqa", num_layers=4, remat_policy="none")
  state, mesh = initial_state(config), mesh_of(2, 4)
  batch = packed_batch(4, 2, 24, config.vocab_size)
  loss, grads = loss_and_grads(model_on(config, mesh, state), batch)
  chunked = config.replace(attn_head_chunks=2, remat_policy="full_offload", remat_group=2)
  chunked_loss, chunked_grads = loss_and_grads(model_on(chunked, mesh, state), batch)
  assert relative_error(chunked_loss, loss) < 1e-6
  assert_trees_close(chunked_grads, grads)
  with pytest.raises(ValueError, match=r"attn_head_chunks \(3\) must divide num_kv_heads"):
    config.replace(attn_head_chunks=3)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["offload", "full_offload"])
def test_offload_policies_use_host_memory_on_gpu(policy):
  """Compiled for the GPU, the offloading policies put buffers in host memory space (S(5))
  and give the gradients of the step without remat."""
  config = preset("tiny-gqa", remat_policy="none")
  state, mesh = initial_state(config), mesh_of(1, 1)
  batch = packed_batch(2, 2, 16, config.vocab_size)
  loss, grads = loss_and_grads(model_on(config, mesh, state), batch)
  model = model_on(config.replace(remat_policy=policy), mesh, state)
  offload_loss, offload_grads = loss_and_grads(model, batch)
  assert relative_error(offload_loss, loss) < 1e-6
  assert_trees_close(offload_grads, grads)
  graphdef, params = nnx.split(model)
  gradient = jax.jit(jax.grad(
      lambda p: nnx.merge(graphdef, p).loss(batch["tokens"], batch["labels"]).mean()))
  assert "S(5)" in gradient.lower(params).compile().as_text()


def test_presets_have_published_parameter_counts():
  # Hugging Face model cards / safetensors totals.
  assert llama.count_params(preset("llama3.2-1b")) == 1_235_814_400
  assert llama.count_params(preset("llama3.1-8b")) == 8_030_261_248
  assert llama.count_params(preset("qwen2.5-7b")) == 7_615_616_512
  # The shapes ALST and ArcticTraining train (transformers builds the same counts from
  # hf.config_to_hf of these presets).
  assert llama.count_params(preset("llama3.1-70b")) == 70_553_706_496
  assert llama.count_params(preset("qwen3-32b")) == 32_762_123_264
  assert llama.count_params(preset("gemma3-1b")) == 999_885_952


def test_config_errors_name_expected_and_actual():
  with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads "
                                       r"\(4\)"):
    LlamaConfig(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="remat_policy must be one of"):
    LlamaConfig(remat_policy="some")
  with pytest.raises(ValueError, match=r"num_layers \(32\) must be a multiple of remat_group "
                                       r"\(5\)"):
    LlamaConfig(remat_group=5)
  with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
    preset("gpt5")
  with pytest.raises(ValueError, match="divisible by the 8 shards"):
    init_llama(preset("tiny", hidden_dim=36, head_dim=8, num_heads=4, num_kv_heads=4),
               mesh_of(2, 4))
  model = nnx.eval_shape(lambda: Llama(preset("tiny"), mesh=mesh_of(1, 1), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"labels must have the tokens' shape \(2, 8\)"):
    model.loss(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 7), jnp.int32))
