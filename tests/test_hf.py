"""Hugging Face import/export against ``transformers`` models with random weights (CPU torch)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.hf.weights import config_from_hf, config_to_hf, load_llama, save_llama  # noqa: E402

TOL = 1e-4  # max abs logit difference, float32
SEQ_LEN = 32
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=16, intermediate_size=128, rope_theta=10_000.0,
            rms_norm_eps=1e-5)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # all three wavelength regimes at D=16


# Gemma 3's decoder-only class has its own config class (Gemma3Config is the vision model's).
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
# Gemma 3 (text) with every feature active: alternating sliding and full layers, each type
# with its RoPE (linear scaling on full layers only), a score scale other than D ** -0.5.
GEMMA3 = dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              query_pre_attn_scalar=24, rope_parameters={
                  "sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
                  "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6)})


def random_hf_model(cls_name, seed=0, **overrides):
  """A tiny ``transformers`` causal LM with every weight random (norms around 1, biases too)."""
  config_cls = getattr(transformers, CONFIG_CLASSES.get(
      cls_name, cls_name.replace("ForCausalLM", "Config")))
  torch.manual_seed(seed)
  model = getattr(transformers, cls_name)(config_cls(**{**TINY, **overrides})).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.15)
  return model


def torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def jax_logits(model, tokens):
  return np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(data=1, seq=8)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, SEQ_LEN))


CASES = {
    "llama_mha": ("LlamaForCausalLM", {}, None),
    "llama_gqa_llama3_rope_sharded": (
        "LlamaForCausalLM", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE), "20KB"),
    "llama_tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True), None),
    "qwen2_bias_gqa": ("Qwen2ForCausalLM", dict(num_key_value_heads=2), None),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", dict(num_key_value_heads=2), None),
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None), None),
    # All three YaRN regimes at D=16; attention_factor 1: UlyssesAttention cannot apply others.
    "qwen3_yarn": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
        rope_theta=10_000.0)), None),
}


@pytest.mark.parametrize("case", CASES)
def test_load_matches_transformers_and_save_round_trips(case, mesh, tokens, tmp_path):
  cls_name, overrides, max_shard_size = CASES[case]
  exported_cls = "LlamaForCausalLM" if case == "mistral" else cls_name
  check_load_and_round_trip(cls_name, overrides, mesh, tokens, tmp_path,
                            exported_cls=exported_cls, max_shard_size=max_shard_size)


def check_load_and_round_trip(cls_name, overrides, mesh, tokens, tmp_path, *, exported_cls,
                              max_shard_size=None):
  """A random transformers model of ``cls_name`` loads with its logits, and saves back as
  an ``exported_cls`` with the same logits and tensors."""
  reference = random_hf_model(cls_name, **overrides)
  kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
  reference.save_pretrained(tmp_path / "hf", **kwargs)
  sharded = (tmp_path / "hf" / "model.safetensors.index.json").exists()
  assert sharded == (max_shard_size is not None)
  expected = torch_logits(reference, tokens)
  assert np.abs(expected).max() > 1.0  # weights large enough for the tolerance to bite

  model = load_llama(tmp_path / "hf", mesh)
  assert model.embedding[...].sharding.spec == jax.sharding.PartitionSpec(None, mesh.axis_names)
  np.testing.assert_array_less(np.abs(jax_logits(model, tokens) - expected), TOL)

  save_llama(model, tmp_path / "ours", max_shard_bytes=20_000 if sharded else 5 * 2**30)
  assert (tmp_path / "ours" / "model.safetensors.index.json").exists() == sharded
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
  assert type(exported).__name__ == exported_cls
  np.testing.assert_array_less(np.abs(torch_logits(exported, tokens) - expected), TOL)
  exported_params = dict(exported.state_dict())
  for name, value in reference.state_dict().items():
    np.testing.assert_array_equal(exported_params[name].numpy(), value.numpy(), err_msg=name)
  return model


# Windows of 5 tokens over 32: several windows long. (name: class, overrides, the layers'
# windows we must read, the mesh): Ulysses over 8 devices, data x seq, and Ulysses x ring
# (seq 2, ring 4: 4-token ring chunks, so a 5-token window reaches into the previous ring
# device's keys), each mesh under two families' windows.
SLIDING_CASES = {
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5), (5, 5),
                (1, 8)),
    "qwen2_max_window_layers": (
        "Qwen2ForCausalLM", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                 max_window_layers=1), (None, 5, 5), (2, 4)),
    "qwen3_layer_types": (
        "Qwen3ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=True,
                                 sliding_window=5,
                                 layer_types=["sliding_attention", "full_attention"]), (5, None),
        (1, 2, 4)),
    "qwen2_window_off": ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=5),
                         (None, None), (1, 8)),
    "ministral": ("MinistralForCausalLM", dict(
        sliding_window=5, layer_types=["full_attention", "sliding_attention"]), (None, 5),
        (2, 4)),
    "gemma3": ("Gemma3ForCausalLM", GEMMA3, (5, None, 5), (1, 2, 4)),
}


@pytest.mark.parametrize("case", SLIDING_CASES)
def test_sliding_windows_load_and_round_trip(case, tokens, tmp_path):
  cls_name, overrides, windows, mesh_shape = SLIDING_CASES[case]
  model = check_load_and_round_trip(cls_name, overrides, make_mesh(*mesh_shape), tokens,
                                    tmp_path, exported_cls=cls_name)
  assert model.config.layer_windows() == windows


def test_bfloat16_checkpoint_loads_exactly_and_saves_back(mesh, tokens, tmp_path):
  reference = random_hf_model("LlamaForCausalLM").to(torch.bfloat16)
  reference.save_pretrained(tmp_path / "hf")
  model = load_llama(tmp_path / "hf", mesh)
  assert model.embedding[...].dtype == jnp.float32
  upcast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
  expected = torch_logits(upcast.eval(), tokens)
  np.testing.assert_array_less(np.abs(jax_logits(model, tokens) - expected), TOL)

  save_llama(model, tmp_path / "ours", dtype="bfloat16")
  assert json.loads((tmp_path / "ours" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  theirs = safetensors_numpy.load_file(tmp_path / "hf" / "model.safetensors")
  ours = safetensors_numpy.load_file(tmp_path / "ours" / "model.safetensors")
  assert sorted(ours) == sorted(theirs)
  for name in theirs:
    assert ours[name].dtype == theirs[name].dtype
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf")
  random_hf_model("LlamaForCausalLM").save_pretrained(path)
  return path


def _copy_with(src, dst, *, config=None, tensors=None):
  """A copy of checkpoint ``src`` at ``dst`` with config fields and tensors replaced
  (a tensor value of None removes it)."""
  dst.mkdir()
  hf_config = {**json.loads((src / "config.json").read_text()), **(config or {})}
  (dst / "config.json").write_text(json.dumps(hf_config))
  weights = {**safetensors_numpy.load_file(src / "model.safetensors"), **(tensors or {})}
  safetensors_numpy.save_file({k: v for k, v in weights.items() if v is not None},
                              dst / "model.safetensors", metadata={"format": "pt"})
  return dst


def test_checkpoint_errors_name_expected_and_actual(checkpoint, mesh, tmp_path):
  missing = _copy_with(checkpoint, tmp_path / "missing",
                       tensors={"model.layers.1.mlp.up_proj.weight": None})
  with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_llama(missing, mesh)
  wrong = _copy_with(checkpoint, tmp_path / "wrong", config={"intermediate_size": 96})
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: config\.json "
                     r"implies shape \(64, 96\), the checkpoint has \(64, 128\)"):
    load_llama(wrong, mesh)
  extra = _copy_with(checkpoint, tmp_path / "extra", tensors={
      "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
  with pytest.raises(ValueError, match=r"no place for: \['model\.layers\.0\.self_attn\.o_proj"):
    load_llama(extra, mesh)
  (tmp_path / "no_weights").mkdir()
  shutil.copy(checkpoint / "config.json", tmp_path / "no_weights")
  with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
    load_llama(tmp_path / "no_weights", mesh)


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="gpt2"),
     r"unsupported model_type 'gpt2'; supported: \['gemma3_text', 'gpt_oss', 'llama', "
     r"'ministral', 'mistral', 'mixtral'"),
    (dict(model_type="qwen2_moe"), r"unsupported model_type 'qwen2_moe'"),
    (dict(model_type="gemma3"), r"'gemma3' \(the vision-language model\); give a text-only "
                                r"checkpoint, model_type 'gemma3_text'"),
    (dict(model_type="gemma3_text", hidden_activation="gelu"),
     r"hidden_activation='gelu' \(only 'gelu_pytorch_tanh'\)"),
    (dict(model_type="gemma3_text", final_logit_softcapping=30.0),
     r"final_logit_softcapping=30.0 \(logit softcapping"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0),
     r"attn_logit_softcapping=50.0 \(logit softcapping"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True),
     r"use_bidirectional_attention=true \(only causal attention\)"),
    (dict(model_type="gemma3_text", rope_parameters={
        "full_attention": dict(rope_type="default", rope_theta=1e6),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4,
                                  partial_rotary_factor=0.5)}),
     r"partial_rotary_factor=0.5 \(only 1.0\)"),
    (dict(num_local_experts=8), r"num_local_experts=8 \(mixture of experts: only in the model "
                                r"types \[.gpt_oss., .mixtral., .qwen3_moe.\]\)"),
    (dict(model_type="qwen3", num_experts=4), r"num_experts=4 \(mixture of experts: "),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 \(only 1.0\)"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     r"partial_rotary_factor=0.5 \(only 1.0\)"),
    (dict(attention_bias=True), r"attention_bias=true \(llama puts a bias on o_proj too\)"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' \(only 'silu'\)"),
    (dict(rope_parameters=dict(rope_type="longrope", factor=4.0, rope_theta=1e4)),
     r"rope type 'longrope' \(supported: 'default', 'linear', 'llama3', 'yarn'\)"),
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling=dict(type="dynamic", factor=2.0)),
     r"rope type 'dynamic'"),
])
def test_unsupported_configs_are_rejected(checkpoint, fields, message):
  hf_config = {**json.loads((checkpoint / "config.json").read_text()), **fields}
  with pytest.raises(ValueError, match=message):
    config_from_hf(hf_config)


def test_reads_both_rope_config_styles():
  legacy = dict(model_type="llama", **TINY, rope_scaling={"type": "linear", "factor": 2.0})
  v5 = dict(model_type="llama", **{k: v for k, v in TINY.items() if k != "rope_theta"},
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
  assert config_from_hf(legacy) == config_from_hf(v5)
  assert config_from_hf(v5).rope_scaling.kind == "linear"


def test_imports_without_torch_and_transformers():
  code = ("import sys; import ulysses_jax.hf.weights; "
          "bad = {'torch', 'transformers', 'safetensors'} & set(sys.modules); assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_missing_safetensors_says_what_to_install(checkpoint, mesh, monkeypatch):
  monkeypatch.setitem(sys.modules, "safetensors", None)
  monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
  with pytest.raises(ImportError, match=r"pip install 'ulysses_jax\[hf\]'"):
    load_llama(checkpoint, mesh)


def test_gemma3_reads_older_configs_and_pattern_defaults():
  """Hub configs written before transformers 5: ``rope_local_base_freq`` and ``rope_scaling``
  (full layers only), ``sliding_window_pattern`` instead of ``layer_types``."""
  old = dict(model_type="gemma3_text", **{**TINY, "num_hidden_layers": 7, "rope_theta": 1e6},
             sliding_window=5, rope_local_base_freq=1e4, query_pre_attn_scalar=24,
             rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=3)
  config = config_from_hf(old)
  assert config.layer_windows() == (5, 5, None, 5, 5, None, 5)
  assert (config.rope_theta, config.rope_scaling.kind, config.rope_scaling.factor) == (
      1e6, "linear", 8.0)
  assert (config.sliding_rope_theta, config.sliding_rope_scaling) == (1e4, None)
  assert config.attention_scale == 24 ** -0.5 and config.tie_embeddings
  assert config_from_hf(config_to_hf(config)) == config


@pytest.mark.parametrize("overrides, message", [
    (dict(norm_offset_one=True, post_norms=True),
     r"no Hugging Face architecture has norm_offset_one=True, post_norms=True without the rest "
     r"of Gemma 3's options"),
    (dict(attention_scale=0.3), r"no Hugging Face architecture has attention_scale without"),
    (dict(sliding_rope_theta=1e4), r"only gemma3_text has a RoPE of its own for sliding layers"),
])
def test_configs_no_architecture_has_are_not_exported(overrides, message):
  from ulysses_jax.models.config import preset
  with pytest.raises(ValueError, match=message):
    config_to_hf(preset("tiny", **overrides))
