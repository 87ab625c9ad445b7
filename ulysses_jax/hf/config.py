"""Hugging Face ``config.json`` <-> ``LlamaConfig``: ``config_from_hf`` and ``config_to_hf``.

Model types: ``llama``; ``mistral`` (a sliding window on every layer); ``ministral``
(sliding windows per ``layer_types``); ``qwen2`` (q/k/v biases) and ``qwen3`` (qk-norm), both
with sliding windows per layer; ``gemma3_text`` (GeGLU, ``(1 + w)`` RMSNorms before and after
attention and MLP, q/k norms, embeddings scaled by sqrt(E), ``query_pre_attn_scalar``,
local and global layers with their own RoPE); the mixtures of experts ``qwen3_moe``,
``mixtral`` and ``gpt_oss`` (``ulysses_jax.hf.moe``). The tensors are ``ulysses_jax.hf.weights``'s.
"""

import json
import pathlib

from ulysses_jax.hf import moe as hf_moe
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.rope import RopeScaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "ministral": "MinistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 **hf_moe.ARCHITECTURES}
_QWEN = ("qwen2", "qwen3", "qwen3_moe")  # sliding windows by use_sliding_window
# The LlamaConfig options that make a decoder Gemma 3's, with their values there.
GEMMA3_OPTIONS = dict(mlp_activation="gelu_tanh", norm_offset_one=True, post_norms=True,
                      embed_scale=True, qk_norm=True)
_GEMMA3_ACTIVATION = "gelu_pytorch_tanh"
# transformers' Gemma3TextConfig defaults, for configs that leave them out.
_GEMMA3_DEFAULTS = dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        sliding_window_pattern=6, tie_word_embeddings=True, rms_norm_eps=1e-6)


def config_from_hf(hf: dict) -> LlamaConfig:
  """The ``LlamaConfig`` of a Hugging Face ``config.json`` dict; errors name what is unsupported.

  Reads both the transformers 5 ``rope_parameters`` (per layer type for Gemma 3) and the older
  ``rope_theta`` / ``rope_scaling`` (/ ``rope_local_base_freq``) fields; rope types
  ``default``, ``linear``, ``llama3`` and ``yarn``.
  """
  model_type = hf.get("model_type")
  if model_type == "gemma3":
    raise ConfigError("unsupported model_type 'gemma3' (the vision-language model); give a "
                      "text-only checkpoint, model_type 'gemma3_text' (Gemma3ForCausalLM).")
  if model_type not in ARCHITECTURES:
    raise ConfigError(f"unsupported model_type {model_type!r}; supported: "
                      f"{sorted(ARCHITECTURES)}.")
  gemma = model_type == "gemma3_text"
  if gemma:
    hf = {**_GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  problems = _unsupported(hf, gemma)
  if model_type in hf_moe.ARCHITECTURES:
    problems += hf_moe.moe_problems(hf)
  try:
    rope = _rope_from_hf(hf)
  except ConfigError as e:
    rope = {}
    problems.append(str(e))
  if problems:
    raise ConfigError(f"unsupported Hugging Face {model_type} config: " + "; ".join(problems)
                      + ".")
  heads = hf["num_attention_heads"]
  family = dict(qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")
  if gemma:
    family = dict(GEMMA3_OPTIONS, qkv_bias=False,
                  attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5)
  if model_type in hf_moe.ARCHITECTURES:
    family.update(hf_moe.moe_from_hf(hf))
  return LlamaConfig(
      vocab_size=hf["vocab_size"], hidden_dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)), **rope, **family,
      **_attention_types_from_hf(hf))


def _unsupported(hf: dict, gemma: bool) -> list[str]:
  """What in ``hf`` the decoder cannot run, one phrase each."""
  problems = []
  activation_key = "hidden_activation" if gemma else "hidden_act"
  expected = _GEMMA3_ACTIVATION if gemma else "silu"
  if hf.get(activation_key, expected) != expected:
    problems.append(f"{activation_key}={hf[activation_key]!r} (only {expected!r})")
  if hf.get("mlp_bias"):
    problems.append("mlp_bias=true")
  if hf.get("attention_bias") and hf["model_type"] != "gpt_oss":
    problems.append(f"attention_bias=true ({hf['model_type']} puts a bias on o_proj too)")
  if hf["model_type"] not in hf_moe.ARCHITECTURES:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
      if hf.get(key):
        problems.append(f"{key}={hf[key]} (mixture of experts: only in the model types "
                        f"{sorted(hf_moe.ARCHITECTURES)})")
  for key in ("attn_logit_softcapping", "final_logit_softcapping"):
    if hf.get(key) is not None:
      problems.append(f"{key}={hf[key]} (logit softcapping; Gemma 3 checkpoints leave it "
                      "null)")
  if hf.get("use_bidirectional_attention"):
    problems.append("use_bidirectional_attention=true (only causal attention)")
  for rope in _rope_dicts(hf).values():  # transformers 5 moves it into rope_parameters
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
      problems.append(f"partial_rotary_factor={partial} (only 1.0)")
      break
  return problems


def _attention_types_from_hf(hf: dict) -> dict:
  """``sliding_window`` and ``layer_types`` as transformers' configs of each model type set
  them: Mistral slides every layer (it ignores ``layer_types``); Qwen2/3 slide only with
  ``use_sliding_window``, the layers of ``layer_types`` (written by transformers 5) or else
  those from ``max_window_layers`` on (Qwen3-MoE alike); Mixtral like Mistral; Ministral
  slides the layers of ``layer_types`` (default: all); Gemma 3 those of ``layer_types``,
  else all but every ``sliding_window_pattern``-th; gpt-oss those of ``layer_types``, else
  every other layer from the first; Llama never."""
  model_type, window = hf["model_type"], hf.get("sliding_window")
  layers = hf["num_hidden_layers"]
  if model_type == "llama":
    window = None
  if model_type in _QWEN and not hf.get("use_sliding_window"):
    window = None
  types = tuple(hf.get("layer_types") or ())
  if model_type in _QWEN and not types:
    first = hf.get("max_window_layers", 28)
    types = tuple("sliding_attention" if window is not None and i >= first
                  else "full_attention" for i in range(layers))
  if model_type == "gemma3_text" and not types:
    pattern = hf["sliding_window_pattern"]
    types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                  for i in range(layers))
  if model_type == "gpt_oss" and not types:
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
  if model_type in ("llama", "mistral", "mixtral") or window is None:
    types = ()
  return dict(sliding_window=window, layer_types=types)


def _rope_dicts(hf: dict) -> dict[str, dict]:
  """The RoPE fields of each layer type (``"full_attention"``, and ``"sliding_attention"``
  for Gemma 3), from ``rope_parameters`` or the older top-level fields."""
  parameters = hf.get("rope_parameters") or {}
  if hf.get("model_type") != "gemma3_text":
    rope = {**(hf.get("rope_scaling") or {}), **parameters}
    return {"full_attention": {"rope_theta": hf.get("rope_theta", 10_000.0), **rope}}
  if "full_attention" in parameters:
    return {t: dict(parameters.get(t) or {}) for t in ("full_attention", "sliding_attention")}
  return {"full_attention": {"rope_theta": hf["rope_theta"], **(hf.get("rope_scaling") or {})},
          "sliding_attention": {"rope_theta": hf["rope_local_base_freq"]}}


def _rope_from_hf(hf: dict) -> dict:
  """``rope_theta`` and ``rope_scaling`` of ``hf``, and Gemma 3's ``sliding_rope_theta`` and
  ``sliding_rope_scaling``."""
  ropes = _rope_dicts(hf)
  fields = dict(rope_theta=float(ropes["full_attention"]["rope_theta"]),
                rope_scaling=_scaling(ropes["full_attention"], hf))
  if "sliding_attention" in ropes:
    fields.update(sliding_rope_theta=float(ropes["sliding_attention"]["rope_theta"]),
                  sliding_rope_scaling=_scaling(ropes["sliding_attention"], hf))
  return fields


def rope_scaling_from_hf(hf: dict) -> RopeScaling | None:
  """The ``RopeScaling`` of a ``config.json`` dict (of its full-attention layers; None for
  rope type ``default``); ``ConfigError`` naming an unsupported rope type or field."""
  return _scaling(_rope_dicts(hf)["full_attention"], hf)


def _scaling(rope: dict, hf: dict) -> RopeScaling | None:
  """The ``RopeScaling`` of one layer type's RoPE fields ``rope`` of config ``hf``."""
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return None
  if rope_type == "linear":
    return RopeScaling(kind="linear", factor=float(rope["factor"]))
  if rope_type == "llama3":
    return RopeScaling(kind="llama3", factor=float(rope["factor"]),
                       low_freq_factor=float(rope["low_freq_factor"]),
                       high_freq_factor=float(rope["high_freq_factor"]),
                       original_max_position=int(rope["original_max_position_embeddings"]))
  if rope_type != "yarn":
    raise ConfigError(f"rope type {rope_type!r} (supported: 'default', 'linear', 'llama3', "
                      "'yarn')")
  if rope.get("mscale") or rope.get("mscale_all_dim"):
    raise ConfigError("yarn mscale / mscale_all_dim (DeepSeek's attention factor)")
  if rope.get("factor") is None:
    raise ConfigError("yarn without factor")
  # transformers takes the original context from the top level first.
  original = hf.get("original_max_position_embeddings") or rope.get(
      "original_max_position_embeddings") or hf["max_position_embeddings"]
  attention_factor = rope.get("attention_factor")
  return RopeScaling(
      kind="yarn", factor=float(rope["factor"]), original_max_position=int(original),
      beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
      attention_factor=None if attention_factor is None else float(attention_factor),
      truncate=bool(rope.get("truncate", True)))


def read_config(path) -> LlamaConfig:
  """The ``LlamaConfig`` of the Hugging Face checkpoint directory ``path`` (its
  ``config.json``); ``ConfigError`` when there is none or it is unsupported."""
  file = pathlib.Path(path) / "config.json"
  if not file.is_file():
    raise ConfigError(f"{path} is not a Hugging Face checkpoint directory: it has no "
                      "config.json (give the directory that holds config.json and the "
                      "*.safetensors files)")
  try:
    return config_from_hf(json.loads(file.read_text()))
  except ConfigError as e:
    raise ConfigError(f"{file}: {e}") from None


def model_type_of(config: LlamaConfig) -> str:
  """The Hugging Face model type ``config`` exports as: gemma3_text (Gemma 3's options),
  qwen2 (qkv_bias), qwen3 (qk_norm), else llama, or with sliding windows mistral (every
  layer) / ministral (some layers); with experts qwen3_moe, mixtral or gpt_oss
  (``hf_moe.moe_model_type``); ``ConfigError`` for combinations no architecture has."""
  if config.moe is not None:
    return _moe_model_type(config)
  if config.attn_out_bias:
    raise ConfigError("only gpt_oss (a mixture of experts) has a bias on the attention output "
                      "projection; set attn_out_bias=False to export this model.")
  gemma = {name: getattr(config, name) for name in GEMMA3_OPTIONS}
  if gemma == GEMMA3_OPTIONS and not config.qkv_bias:
    return "gemma3_text"
  partial = [f"{name}={value!r}" for name, value in gemma.items()
             if name != "qk_norm" and value == GEMMA3_OPTIONS[name]]
  if partial or config.attention_scale is not None:
    raise ConfigError(
        f"no Hugging Face architecture has {', '.join(partial) or 'attention_scale'} without "
        f"the rest of Gemma 3's options ({GEMMA3_OPTIONS}, no qkv_bias); set all of them to "
        "export a gemma3_text checkpoint.")
  if config.sliding_rope_theta is not None:
    raise ConfigError("only gemma3_text has a RoPE of its own for sliding layers "
                      "(sliding_rope_theta); set it to None to export this model.")
  if config.qkv_bias and config.qk_norm:
    raise ConfigError("no Hugging Face architecture has both qkv_bias and qk_norm.")
  if config.attention_sinks:
    raise ConfigError("attention_sinks: of the Hugging Face architectures only gpt_oss has "
                      "them, which this exporter does not write; set attention_sinks=False to "
                      "export a model without them.")
  model_type = "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
  windows = config.layer_windows()
  if model_type == "llama" and any(windows):
    model_type = "mistral" if all(windows) else "ministral"
  return model_type


def _moe_model_type(config: LlamaConfig) -> str:
  gemma = [name for name, value in GEMMA3_OPTIONS.items()
           if name != "qk_norm" and getattr(config, name) == value]
  if gemma or config.attention_scale is not None or config.sliding_rope_theta is not None:
    raise ConfigError(f"no Hugging Face mixture of experts has Gemma 3's options "
                      f"({', '.join(gemma) or 'attention_scale, sliding_rope_theta'}); drop "
                      "them to export this model.")
  model_type = hf_moe.moe_model_type(config)
  windows = config.layer_windows()
  if model_type == "mixtral" and any(windows) and not all(windows):
    raise ConfigError("mixtral slides every layer or none (sliding_window without "
                      "layer_types); export this model with one window on every layer.")
  return model_type


def config_to_hf(config: LlamaConfig, dtype: str = "float32") -> dict:
  """The ``config.json`` dict of ``config`` (model type: ``model_type_of``). Rope fields are
  written in the pre-v5 ``rope_theta`` / ``rope_scaling`` (/ ``rope_local_base_freq``)
  form, which transformers 5 reads too."""
  model_type = model_type_of(config)
  gemma = model_type == "gemma3_text"
  hf = dict(
      architectures=[ARCHITECTURES[model_type]], model_type=model_type,
      vocab_size=config.vocab_size, hidden_size=config.hidden_dim,
      intermediate_size=config.mlp_dim, num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
      head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
      tie_word_embeddings=config.tie_embeddings, initializer_range=config.init_std,
      torch_dtype=str(dtype))
  hf.update(_rope_to_hf(config, gemma))
  if model_type != "qwen2":
    hf["attention_bias"] = False  # qwen2 has fixed q/k/v biases and no such field
  if model_type in ("llama", "mistral", "ministral"):
    hf["mlp_bias"] = False
  if model_type in hf_moe.ARCHITECTURES:
    hf.update(hf_moe.moe_to_hf(config, model_type))
  if gemma:
    scalar = (config.attention_scale or config.head_dim ** -0.5) ** -2
    if abs(scalar - round(scalar)) < 1e-9 * scalar:  # written as an integer, as Gemma's are
      scalar = round(scalar)
    hf.update(hidden_activation=_GEMMA3_ACTIVATION, query_pre_attn_scalar=scalar,
              attn_logit_softcapping=None, final_logit_softcapping=None)
  else:
    hf["hidden_act"] = "silu"
  hf.update(_attention_types_to_hf(config, model_type))
  return hf


def _rope_to_hf(config: LlamaConfig, gemma: bool) -> dict:
  fields = dict(rope_theta=config.rope_theta, rope_scaling=_scaling_to_hf(config.rope_scaling))
  s = config.rope_scaling
  if s is not None and s.kind != "linear":
    fields["max_position_embeddings"] = int(s.original_max_position * s.factor)
  if gemma:
    sliding = config.layer_attention("sliding_attention")
    if sliding["rope_scaling"] is not None:
      raise ConfigError("gemma3_text's config.json has no RoPE scaling for sliding layers in "
                        "the rope_local_base_freq form; set sliding_rope_scaling=None (and "
                        "sliding_rope_theta, when rope_scaling is set) to export.")
    fields["rope_local_base_freq"] = sliding["rope_theta"]
  return fields


def _scaling_to_hf(s: RopeScaling | None) -> dict | None:
  if s is None:
    return None
  rope = dict(rope_type=s.kind, factor=s.factor)
  if s.kind == "llama3":
    rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
  if s.kind == "yarn":
    rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
    if s.attention_factor is not None:
      rope["attention_factor"] = s.attention_factor
  if s.kind != "linear":
    rope["original_max_position_embeddings"] = s.original_max_position
  return rope


def _attention_types_to_hf(config: LlamaConfig, model_type: str) -> dict:
  """The sliding-window fields of ``model_type`` that make transformers slide the layers of
  ``config.layer_windows()``."""
  windows = config.layer_windows()
  if model_type == "llama":
    return {}
  types = ["full_attention" if w is None else "sliding_attention" for w in windows]
  if model_type in ("gemma3_text", "gpt_oss"):
    return dict(sliding_window=config.sliding_window, layer_types=types)
  if not any(windows):
    return (dict(sliding_window=None) if model_type == "mixtral" else
            dict(use_sliding_window=False, sliding_window=None))  # qwen2, qwen3, qwen3_moe
  fields = dict(sliding_window=config.sliding_window)
  if model_type not in ("mistral", "mixtral"):
    fields["layer_types"] = types
  if model_type in _QWEN:
    fields.update(use_sliding_window=True, max_window_layers=types.index("sliding_attention"))
  return fields
