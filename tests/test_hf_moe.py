"""Mixtures of experts in and out of Hugging Face: qwen3_moe, mixtral and gpt_oss (its MXFP4
layout, sinks and experts too) against ``transformers`` with random weights (CPU torch)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from model_cases import relative_error  # noqa: E402
from test_hf import TINY, check_load_and_round_trip, jax_logits, random_hf_model  # noqa: E402
from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.hf import weights as hf  # noqa: E402
from ulysses_jax.config_checks import ConfigError  # noqa: E402
from ulysses_jax.loss import IGNORE_LABEL  # noqa: E402
from ulysses_jax.hf.weights import config_from_hf, config_to_hf, load_llama  # noqa: E402
from ulysses_jax.hf.moe import dequantize_mxfp4, moe_from_hf, read_expert_param  # noqa: E402
from ulysses_jax.models import moe as moe_lib  # noqa: E402
from ulysses_jax.models.config import preset  # noqa: E402

TOL = 1e-4
# Qwen3-MoE with a dense first layer (its own width) and unnormalised top-k weights; Mixtral
# with its sliding window on every layer (5 tokens of 32). 4 experts, 2 per token.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=False)),
    "mixtral": ("MixtralForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, sliding_window=5)),
}
MESHES = {"ulysses": (1, 8), "data_seq": (2, 4), "ulysses_ring": (1, 2, 4)}
# The quick suite loads each family in each layout on one mesh; with the slow cases each
# family runs on all three meshes.
QUICK = {("qwen3_moe", "published", "ulysses"), ("qwen3_moe", "fused", "data_seq"),
         ("mixtral", "published", "ulysses_ring"), ("mixtral", "fused", "ulysses")}
SLOW = {("qwen3_moe", "fused", "ulysses_ring"), ("mixtral", "published", "data_seq")}
GRID = [pytest.param(*case, marks=() if case in QUICK else pytest.mark.slow)
        for case in sorted(QUICK | SLOW)]


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 32))


def save_fused(model, path):
  """``model`` as transformers >= 5 holds it: fused ``experts.gate_up_proj`` / ``down_proj``
  (``save_pretrained`` writes the published per-expert layout instead)."""
  model.config.save_pretrained(path)
  tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
  safetensors_torch.save_file(tensors, str(path / "model.safetensors"),
                              metadata={"format": "pt"})


@pytest.mark.parametrize("family, layout, mesh_name", GRID)
def test_moe_families_load_with_transformers_logits(family, layout, mesh_name, tokens,
                                                    tmp_path):
  cls_name, overrides = FAMILIES[family]
  mesh = make_mesh(*MESHES[mesh_name])
  if layout == "published":  # save_pretrained's layout; exported and loaded back
    model = check_load_and_round_trip(cls_name, overrides, mesh, tokens, tmp_path,
                                      exported_cls=cls_name)
  else:
    reference = random_hf_model(cls_name, **overrides)
    save_fused(reference, tmp_path / "fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in safetensors_torch.load_file(
        tmp_path / "fused" / "model.safetensors")
    model = load_llama(tmp_path / "fused", mesh)
    with torch.no_grad():
      expected = reference(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_array_less(np.abs(jax_logits(model, tokens) - expected), TOL)
  expected_sparse = (False, True, True) if family == "qwen3_moe" else (True, True)
  assert model.config.sparse_layers() == expected_sparse


def test_load_balancing_loss_matches_transformers(tokens, tmp_path):
  """transformers' aux_loss (output_router_logits) on the same tokens: every layer's router
  logits of every token; ours sums router statistics over devices and tiles."""
  cls_name, overrides = FAMILIES["qwen3_moe"]
  reference = random_hf_model(cls_name, **overrides, output_router_logits=True,
                              router_aux_loss_coef=0.5)
  reference.save_pretrained(tmp_path / "hf")
  with torch.no_grad():
    expected = reference(torch.tensor(tokens), labels=torch.tensor(tokens))
  model = load_llama(tmp_path / "hf", make_mesh(2, 4), mlp_chunk=3)
  assert model.config.router_aux_loss_coef == 0.5
  sums = nnx.jit(lambda m, t: m.loss(t, t))(model, jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(sums.router_aux, expected.aux_loss.item(), rtol=1e-5)
  assert sums.expert_counts.shape == (3, 4) and not sums.expert_counts[0].any()
  np.testing.assert_array_equal(sums.expert_counts[1:].sum(-1), 2 * tokens.size)


class _Tensors(dict):
  """A state dict standing in for a checkpoint (``hf_moe.read_expert_param``'s reader)."""

  def get(self, name, shape):
    assert tuple(self[name].shape) == shape, (name, self[name].shape, shape)
    return self[name].detach().numpy()


def test_gpt_oss_experts_match_transformers_mlp():
  """GptOssMLP (router bias, top-k then softmax, interleaved clamped SwiGLU with biases)
  against our layer's math, weights read through our names."""
  config = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4,
                                     num_experts_per_tok=2, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     swiglu_limit=1.0)
  torch.manual_seed(0)
  block = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config).eval()
  with torch.no_grad():
    for p in block.parameters():
      p.normal_(0.0, 0.5)
  ours = preset("tiny", hidden_dim=16, **moe_from_hf(config.to_dict()))
  tensors = _Tensors({f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()})
  w = {name: jnp.asarray(read_expert_param(tensors, ours, "gpt_oss", 0, name))
       for name in ("router", "router_bias", "gate_proj", "up_proj", "down_proj",
                    "gate_bias", "up_bias", "down_bias")}
  x = np.random.default_rng(1).normal(0, 1, (24, 16)).astype(np.float32)
  with torch.no_grad():
    expected = block(torch.tensor(x)[None])[0][0].numpy()
  tile = jax.jit(moe_lib.moe_tile, static_argnums=(3, 4))
  y, _ = tile(jnp.asarray(x), jnp.ones(24, bool), w, ours.moe, jnp.float32)
  np.testing.assert_allclose(y, expected, atol=1e-5)


def test_mxfp4_dequantizes_bit_exactly_as_transformers():
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
  scales = rng.integers(100, 140, (3, 5, 2), dtype=np.uint8)
  for dtype in (torch.float32, torch.bfloat16):
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=dtype)
    ours = torch.tensor(dequantize_mxfp4(blocks, scales).transpose(0, 2, 1)).to(dtype)
    assert torch.equal(ours, theirs), dtype


def test_moe_configs_round_trip_and_bad_ones_are_rejected():
  for family, (_, overrides) in FAMILIES.items():
    hf = transformers.AutoConfig.for_model(family, **{**TINY, **overrides}).to_dict()
    config = config_from_hf(hf)
    assert config_from_hf(config_to_hf(config)) == config
  mixtral = transformers.MixtralConfig(**TINY, num_local_experts=4).to_dict()
  with pytest.raises(ConfigError, match=r"router_jitter_noise=0.1 \(training noise"):
    config_from_hf(dict(mixtral, router_jitter_noise=0.1))
  with pytest.raises(ConfigError, match=r"experts_per_token \(5\) must be <= num_experts \(4\)"):
    config_from_hf(dict(mixtral, num_experts_per_tok=5))
  with pytest.raises(ConfigError, match=r"quantization_config 'fp8'"):
    config_from_hf(dict(mixtral, quantization_config={"quant_method": "fp8"}))


@pytest.mark.parametrize("family", ["qwen3_moe",
                                    pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_whole_model_gradient_matches_float64_transformers(family, tokens, tmp_path):
  """Loss (cross-entropy + coefficient x load-balancing loss) and the gradient of every
  parameter, router included, on a sequence-sharded mesh with tiled experts, against
  transformers in float64 (its gradients read into our layout by the loader's own name
  mapping): Qwen3-MoE with a dense first layer; gpt-oss with its large sinks, biases and
  clamped experts."""
  aux = dict(output_router_logits=True, router_aux_loss_coef=0.3)
  if family == "gpt_oss":
    reference = random_gpt_oss(**aux)
  else:
    cls_name, overrides = FAMILIES[family]
    reference = random_hf_model(cls_name, **overrides, **aux)
  reference.save_pretrained(tmp_path / "hf")
  reference = reference.double()
  reference.set_experts_implementation("eager")  # torch's grouped matmul has no float64
  output = reference(torch.tensor(tokens), labels=torch.tensor(tokens))
  output.loss.backward()
  grads = _Tensors({name: p.grad for name, p in reference.named_parameters()})

  model = load_llama(tmp_path / "hf", make_mesh(2, 4), mlp_chunk=3, loss_chunk=8)
  labels = np.concatenate([tokens[:, 1:], np.full((2, 1), IGNORE_LABEL)], axis=1)
  graphdef, state = nnx.split(model)

  def objective(state):
    sums = nnx.merge(graphdef, state).loss(jnp.asarray(tokens, jnp.int32),
                                           jnp.asarray(labels, jnp.int32))
    return sums.mean() + model.config.router_aux_loss_coef * sums.router_aux

  loss, ours = jax.jit(jax.value_and_grad(objective))(state)
  np.testing.assert_allclose(loss, output.loss.item(), rtol=1e-6)
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(ours))
  expected_params = ({("layers", "attn", "sinks"), ("layers", "moe", "router_bias")}
                     if family == "gpt_oss" else {("layers", "moe", "router"),
                                                  ("layers", "mlp", "gate_proj")})
  assert expected_params <= {k[:3] for k in flat}
  for path, grad in flat.items():
    expected = hf._read_param(grads, model.config, path, grad.shape, np.float64)
    assert relative_error(grad, expected) < 1e-5, path


# gpt-oss with every feature active: large attention sinks of both signs, q/k/v/o biases,
# alternating sliding (5 tokens of 32) and full layers, YaRN without truncation, 4 experts
# (2 per token) with a router bias, the clamped SwiGLU (limit 1: it clamps) and biases.
GPT_OSS = dict(num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, intermediate_size=32, sliding_window=5, swiglu_limit=1.0,
               layer_types=["sliding_attention", "full_attention"],
               rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                    truncate=False, original_max_position_embeddings=64,
                                    rope_theta=10_000.0))


def random_gpt_oss(mxfp4_path=None, **overrides):
  """A random GptOssForCausalLM with sinks of |s| in [2, 4]; with ``mxfp4_path``, its experts'
  matrices are random MXFP4 values (transformers' own dequantisation of them) and the
  checkpoint written there stores them as published checkpoints do (blocks and scales)."""
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  reference = random_hf_model("GptOssForCausalLM", **GPT_OSS, **overrides)
  rng = np.random.default_rng(1)
  with torch.no_grad():
    for layer in reference.model.layers:
      heads = layer.self_attn.sinks.shape[0]
      sinks = rng.uniform(2, 4, heads) * rng.choice([-1, 1], heads)
      layer.self_attn.sinks.copy_(torch.tensor(sinks))
  if mxfp4_path is None:
    return reference
  quantized = {}
  with torch.no_grad():
    for i, layer in enumerate(reference.model.layers):
      for name in ("gate_up_proj", "down_proj"):
        weight = getattr(layer.mlp.experts, name)  # [X, in, out]; stored [X, out, in / 32, 16]
        x, n_in, n_out = weight.shape
        blocks = rng.integers(0, 256, (x, n_out, n_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 126, (x, n_out, n_in // 32), dtype=np.uint8)
        weight.copy_(convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                dtype=torch.float32))
        prefix = f"model.layers.{i}.mlp.experts.{name}"
        quantized[prefix + "_blocks"], quantized[prefix + "_scales"] = map(
            torch.tensor, (blocks, scales))
  reference.config.save_pretrained(mxfp4_path)
  config = json.loads((mxfp4_path / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "mxfp4"}
  (mxfp4_path / "config.json").write_text(json.dumps(config))
  tensors = {k: v.contiguous() for k, v in reference.state_dict().items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
  safetensors_torch.save_file({**tensors, **quantized}, str(mxfp4_path / "model.safetensors"),
                              metadata={"format": "pt"})
  return reference


@pytest.mark.parametrize("layout, mesh_name", [
    ("mxfp4", "ulysses"), ("fused", "ulysses_ring"),
    pytest.param("mxfp4", "data_seq", marks=pytest.mark.slow),
    pytest.param("fused", "ulysses", marks=pytest.mark.slow)])
def test_gpt_oss_loads_with_transformers_logits(layout, mesh_name, tokens, tmp_path):
  """gpt-oss (large sinks, biases, sliding and full layers, YaRN) from the MXFP4 layout of
  published checkpoints and from transformers' own (fused, unquantized); the export loads
  back into transformers with the same logits."""
  mesh = make_mesh(*MESHES[mesh_name])
  if layout == "fused":
    reference = random_gpt_oss()
    reference.save_pretrained(tmp_path / "hf")
  else:
    reference = random_gpt_oss(tmp_path / "hf")
  expected = reference(torch.tensor(tokens)).logits.detach().numpy()
  model = load_llama(tmp_path / "hf", mesh)
  assert model.config.attention_sinks and model.config.attn_out_bias
  assert np.abs(model.layers.attn.sinks[...]).min() >= 2
  np.testing.assert_array_less(np.abs(jax_logits(model, tokens) - expected), TOL)
  hf.save_llama(model, tmp_path / "ours")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
  assert type(exported).__name__ == "GptOssForCausalLM"
  with torch.no_grad():
    np.testing.assert_array_less(np.abs(exported(torch.tensor(tokens)).logits.numpy()
                                        - expected), TOL)
