"""The mixture-of-experts families of Hugging Face: ``qwen3_moe``, ``mixtral`` and
``gpt_oss``; their ``config.json`` fields (``moe_from_hf``, ``moe_to_hf``) and expert tensors
(``read_expert_param``, ``expert_tensors``), for ``hf_config`` and ``hf``.

Expert tensors of layer i, in the layouts read (``X`` experts, width ``I``; ours in
``models.moe``'s docstring, ``[X, E, I]`` gate and up, ``[X, I, E]`` down, router ``[E, X]``):

  qwen3_moe, published  model.layers.i.mlp.gate.weight [X, E];
                        mlp.experts.j.{gate,up}_proj.weight [I, E], down_proj.weight [E, I]
  mixtral, published    block_sparse_moe.gate.weight; block_sparse_moe.experts.j.{w1,w3}.weight
                        (gate, up) [I, E], w2.weight (down) [E, I]
  both, fused           mlp.gate.weight; mlp.experts.gate_up_proj [X, 2I, E] (gate rows, then
                        up rows), mlp.experts.down_proj [X, E, I]  (transformers >= 5 in memory)
  gpt_oss               mlp.router.weight [X, E], mlp.router.bias [X];
                        mlp.experts.gate_up_proj [X, E, 2I] (gate and up interleaved: columns
                        0, 2, ... and 1, 3, ...), gate_up_proj_bias [X, 2I], down_proj [X, I, E],
                        down_proj_bias [X, E]; published checkpoints store the two matrices in
                        MXFP4 instead (``*_blocks``, ``*_scales``: ``dequantize_mxfp4``)

Exports write what transformers' ``save_pretrained`` writes: the published per-expert layout
for qwen3_moe and mixtral, the fused one (not quantised) for gpt_oss.
"""

from collections.abc import Callable

import numpy as np

from ulysses_jax.config_checks import ConfigError
from ulysses_jax.models.config import LlamaConfig, MoeConfig

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gpt_oss": "GptOssForCausalLM"}
# e2m1 values of the 16 nibbles (sign, two exponent bits, one mantissa bit).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_MXFP4_BLOCK = 32  # values per scale


def moe_problems(hf: dict) -> list[str]:
  """What in a MoE family's ``config.json`` the decoder cannot run, one phrase each."""
  problems = []
  if hf.get("router_jitter_noise"):
    problems.append(f"router_jitter_noise={hf['router_jitter_noise']} (training noise on the "
                    "router input; only 0)")
  quantization = hf.get("quantization_config")
  if quantization and not (hf["model_type"] == "gpt_oss"
                           and quantization.get("quant_method") == "mxfp4"):
    problems.append(f"quantization_config {quantization.get('quant_method')!r} (only gpt_oss's "
                    "'mxfp4', dequantized on load)")
  if hf["model_type"] == "gpt_oss" and hf.get("hidden_act", "silu") != "silu":
    problems.append(f"hidden_act={hf['hidden_act']!r} (gpt_oss's experts: only 'silu')")
  return problems


def moe_from_hf(hf: dict) -> dict:
  """The ``LlamaConfig`` fields of a MoE family's ``config.json`` (its MoE and the family's
  other options)."""
  model_type = hf["model_type"]
  coef = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
  experts = dict(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                 experts_per_token=hf["num_experts_per_tok"])
  if model_type == "qwen3_moe":
    moe = MoeConfig(**experts, expert_mlp_dim=hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                    decoder_sparse_step=hf.get("decoder_sparse_step", 1))
    return dict(moe=moe, qk_norm=True, router_aux_loss_coef=coef)
  if model_type == "mixtral":
    return dict(moe=MoeConfig(**experts, expert_mlp_dim=hf["intermediate_size"]),
                router_aux_loss_coef=coef)
  moe = MoeConfig(**experts, expert_mlp_dim=hf["intermediate_size"], router="topk_softmax",
                  router_bias=True, expert_bias=True, expert_activation="clamped_swiglu",
                  swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                  swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
  bias = bool(hf.get("attention_bias", True))
  return dict(moe=moe, qkv_bias=bias, attn_out_bias=bias, attention_sinks=True,
              router_aux_loss_coef=coef)


def moe_model_type(config: LlamaConfig) -> str:
  """The MoE family ``config`` exports as; ``ConfigError`` for combinations none has."""
  moe = config.moe
  gpt_oss = MoeConfig(num_experts=moe.num_experts, experts_per_token=moe.experts_per_token,
                      expert_mlp_dim=moe.expert_mlp_dim, router="topk_softmax",
                      router_bias=True, expert_bias=True, expert_activation="clamped_swiglu",
                      swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
                      norm_topk_prob=moe.norm_topk_prob)
  plain = (moe.router == "softmax_topk" and not moe.router_bias and not moe.expert_bias
           and moe.expert_activation == "silu" and not config.attn_out_bias
           and not config.qkv_bias)
  every_layer = not moe.mlp_only_layers and moe.decoder_sparse_step == 1
  if (moe == gpt_oss and config.qkv_bias == config.attn_out_bias and not config.qk_norm
      and config.attention_sinks):
    return "gpt_oss"
  plain = plain and not config.attention_sinks
  if plain and config.qk_norm:
    return "qwen3_moe"
  if plain and moe.norm_topk_prob and every_layer:
    return "mixtral"
  raise ConfigError(
      f"no Hugging Face mixture-of-experts architecture has this combination ({moe}, "
      f"qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias}, attn_out_bias="
      f"{config.attn_out_bias}, attention_sinks={config.attention_sinks}): qwen3_moe "
      "(softmax_topk, SwiGLU, qk_norm), mixtral (softmax_topk renormalised, SwiGLU, every "
      "layer), both without sinks, or gpt_oss (topk_softmax with biases, clamped SwiGLU, "
      "q/k/v/o biases, attention sinks).")


def moe_to_hf(config: LlamaConfig, model_type: str) -> dict:
  """The MoE fields of ``config``'s ``config.json`` (family ``model_type``)."""
  moe = config.moe
  hf = dict(num_experts_per_tok=moe.experts_per_token,
            router_aux_loss_coef=config.router_aux_loss_coef,
            output_router_logits=config.router_aux_loss_coef > 0)
  if model_type == "qwen3_moe":
    return dict(hf, num_experts=moe.num_experts, moe_intermediate_size=moe.expert_mlp_dim,
                norm_topk_prob=moe.norm_topk_prob, mlp_only_layers=list(moe.mlp_only_layers),
                decoder_sparse_step=moe.decoder_sparse_step)
  hf.update(num_local_experts=moe.num_experts, intermediate_size=moe.expert_mlp_dim)
  if model_type == "mixtral":
    return dict(hf, router_jitter_noise=0.0)
  return dict(hf, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
              attention_bias=config.attn_out_bias)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 values of MXFP4 ``blocks`` ``[..., G, 16]`` (uint8, two e2m1 values a byte, the
  low nibble first) with ``scales`` ``[..., G]`` (E8M0: 2 ** (s - 127)): ``[..., G * 32]``.
  Exact in any float dtype with float32's exponent range (bfloat16 too), so casting gives
  what transformers' ``convert_moe_packed_tensors`` computes in that dtype."""
  if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != _MXFP4_BLOCK:
    raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected "
                     f"[..., G, {_MXFP4_BLOCK // 2}] and [..., G].")
  nibbles = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, -1)
  exponents = scales.astype(np.int32)[..., None] - 127
  values = np.ldexp(FP4_VALUES[nibbles], exponents).astype(np.float32)
  return values.reshape(*scales.shape[:-1], -1)


def _gpt_oss_matrix(checkpoint, prefix: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
  """gpt_oss's fused ``name`` (``gate_up_proj`` or ``down_proj``, transformers' layout
  ``shape``), from its tensor or its MXFP4 blocks and scales."""
  if prefix + name in checkpoint:
    return checkpoint.get(prefix + name, shape)
  x, rows, out = shape[0], shape[2], shape[1]  # stored transposed: [X, out dim, in dim]
  groups = out // _MXFP4_BLOCK
  blocks = checkpoint.get(f"{prefix}{name}_blocks", (x, rows, groups, _MXFP4_BLOCK // 2))
  scales = checkpoint.get(f"{prefix}{name}_scales", (x, rows, groups))
  return dequantize_mxfp4(blocks, scales).transpose(0, 2, 1)


def read_expert_param(checkpoint, config: LlamaConfig, model_type: str, layer: int,
                      name: str) -> np.ndarray:
  """Our MoE parameter ``name`` (``models.moe``) of layer ``layer``, from ``checkpoint``
  (``get(name, shape)``, ``name in checkpoint``) of family ``model_type``."""
  moe, e = config.moe, config.hidden_dim
  x, i = moe.num_experts, moe.expert_mlp_dim
  layer_prefix = f"model.layers.{layer}."
  if model_type == "gpt_oss":
    prefix = layer_prefix + "mlp.experts."
    if name == "router":
      return checkpoint.get(layer_prefix + "mlp.router.weight", (x, e)).T
    if name == "router_bias":
      return checkpoint.get(layer_prefix + "mlp.router.bias", (x,))
    if name in ("gate_proj", "up_proj"):
      gate_up = _gpt_oss_matrix(checkpoint, prefix, "gate_up_proj", (x, e, 2 * i))
      return gate_up[..., name == "up_proj"::2]
    if name in ("gate_bias", "up_bias"):
      return checkpoint.get(prefix + "gate_up_proj_bias", (x, 2 * i))[:, name == "up_bias"::2]
    if name == "down_proj":
      return _gpt_oss_matrix(checkpoint, prefix, "down_proj", (x, i, e))
    return checkpoint.get(prefix + "down_proj_bias", (x, e))
  fused = layer_prefix + "mlp.experts.gate_up_proj"
  if fused in checkpoint:  # transformers >= 5's layout
    if name == "router":
      return checkpoint.get(layer_prefix + "mlp.gate.weight", (x, e)).T
    if name == "down_proj":
      return checkpoint.get(layer_prefix + "mlp.experts.down_proj", (x, e, i)).transpose(0, 2, 1)
    gate_up = checkpoint.get(fused, (x, 2 * i, e))
    return gate_up[:, (name == "up_proj") * i:][:, :i].transpose(0, 2, 1)
  names = _per_expert_names(model_type, layer)
  if name == "router":
    return checkpoint.get(names["router"], (x, e)).T
  shape = (e, i) if name == "down_proj" else (i, e)
  return np.stack([checkpoint.get(names[name].format(j), shape).T for j in range(x)])


def _per_expert_names(model_type: str, layer: int) -> dict[str, str]:
  """Names of the published per-expert layout (``{}``: the expert) of qwen3_moe or mixtral."""
  if model_type == "mixtral":
    block = f"model.layers.{layer}.block_sparse_moe."
    return dict(router=block + "gate.weight", gate_proj=block + "experts.{}.w1.weight",
                up_proj=block + "experts.{}.w3.weight", down_proj=block + "experts.{}.w2.weight")
  block = f"model.layers.{layer}.mlp."
  return dict(router=block + "gate.weight",
              **{p: block + "experts.{}." + p + ".weight"
                 for p in ("gate_proj", "up_proj", "down_proj")})


def expert_tensors(config: LlamaConfig, model_type: str, layer: int, name: str,
                   read: Callable[[str], np.ndarray]) -> list[tuple[str, tuple, Callable]]:
  """The Hugging Face tensors ``(name, shape, value thunk)`` that our MoE parameter ``name``
  of layer ``layer`` becomes (``read(our name)``: that layer's value); gpt_oss's fused
  tensors come with the gate's parameters, none with the up ones."""
  moe, e = config.moe, config.hidden_dim
  x, i = moe.num_experts, moe.expert_mlp_dim
  if model_type == "gpt_oss":
    prefix = f"model.layers.{layer}.mlp."

    def interleave(gate, up):
      gate, up = read(gate), read(up)
      return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)

    table = {
        "router": ("router.weight", (x, e), lambda: read("router").T),
        "router_bias": ("router.bias", (x,), lambda: read("router_bias")),
        "gate_proj": ("experts.gate_up_proj", (x, e, 2 * i),
                      lambda: interleave("gate_proj", "up_proj")),
        "gate_bias": ("experts.gate_up_proj_bias", (x, 2 * i),
                      lambda: interleave("gate_bias", "up_bias")),
        "down_proj": ("experts.down_proj", (x, i, e), lambda: read("down_proj")),
        "down_bias": ("experts.down_proj_bias", (x, e), lambda: read("down_bias")),
    }
    return [(prefix + table[name][0], *table[name][1:])] if name in table else []
  names = _per_expert_names(model_type, layer)
  if name == "router":
    return [(names["router"], (x, e), lambda: read("router").T)]
  shape = (e, i) if name == "down_proj" else (i, e)
  return [(names[name].format(j), shape, lambda j=j: read(name)[j].T) for j in range(x)]
