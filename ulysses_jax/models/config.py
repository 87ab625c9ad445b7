"""``LlamaConfig`` and the named model shapes (``PRESETS``): one definition of each model.

A config names a preset and overrides what it changes; every field not given comes from the
preset, or from the defaults below when there is none::

    LlamaConfig(preset="llama3.1-8b", remat_policy="full_offload")
    preset("llama3.1-8b", remat_policy="full_offload")          # the same

and in gin, ``LlamaConfig.preset = "llama3.1-8b"`` (``configs/models/*.gin`` do only that).
``to_dict`` / ``from_dict`` round-trip a config through JSON (checkpoints carry it).
"""

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from ulysses_jax.attention.backends import BACKENDS, NO_SINKS_IN_CUDNN
from ulysses_jax.attention.common import check_head_chunks
from ulysses_jax.attention.module import ATTN_OUT, QKV
from ulysses_jax.config_checks import ConfigError, above, at_least, check_fields
from ulysses_jax.kernels.grouped_matmul import GROUPED_MATMUL_BACKENDS
from ulysses_jax.rope import RopeScaling

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# softmax_topk: softmax over the experts, then the top k (Qwen3-MoE, Mixtral);
# topk_softmax: the top k logits, then a softmax over those k (gpt-oss).
ROUTERS = ("softmax_topk", "topk_softmax")
# silu: SwiGLU; clamped_swiglu: gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), clamped.
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
# Where the experts live (``models.moe``): fsdp, sharded like every weight and all-gathered
# per layer; expert, split over the ``seq`` axis with tokens sent to them by all-to-all.
EXPERT_PLACEMENTS = ("fsdp", "expert")
REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch", "save_names", "offload",
                  "full_offload")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The mixture-of-experts MLP of a decoder (``models.moe``): dropless top-k routing.

  ``num_experts`` X experts of width ``expert_mlp_dim`` I; each token goes to
  ``experts_per_token`` k of them (k <= X), weighted by its router. ``router`` (one of
  ``ROUTERS``) is computed in float32: ``"softmax_topk"`` (softmax over the X experts, top k,
  renormalised over the k when ``norm_topk_prob``: Qwen3-MoE; Mixtral always renormalises)
  or ``"topk_softmax"`` (top k logits, softmax over them: gpt-oss; ``norm_topk_prob`` does not
  apply). ``router_bias`` adds a bias to the router logits, ``expert_bias`` biases to the
  experts' three projections (gpt-oss). ``expert_activation`` (one of
  ``EXPERT_ACTIVATIONS``): ``"silu"`` SwiGLU, ``"clamped_swiglu"`` gpt-oss's
  ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit), with
  ``swiglu_limit`` and ``swiglu_alpha``.
  Layer schedule (Qwen3-MoE's): layer i is a mixture of experts unless i is in
  ``mlp_only_layers``, and only when (i + 1) is a multiple of ``decoder_sparse_step``; the
  other layers run the dense MLP of width ``LlamaConfig.mlp_dim``.
  """
  num_experts: int = dataclasses.field(default=8, metadata=at_least(1))
  experts_per_token: int = dataclasses.field(default=2, metadata=at_least(1))
  expert_mlp_dim: int = dataclasses.field(default=128, metadata=at_least(1))
  router: Literal[ROUTERS] = "softmax_topk"
  norm_topk_prob: bool = True
  router_bias: bool = False
  expert_bias: bool = False
  expert_activation: Literal[EXPERT_ACTIVATIONS] = "silu"
  swiglu_limit: float = dataclasses.field(default=7.0, metadata=above(0))
  swiglu_alpha: float = 1.702
  mlp_only_layers: tuple[int, ...] = ()
  decoder_sparse_step: int = dataclasses.field(default=1, metadata=at_least(1))

  def __post_init__(self):
    if isinstance(self.mlp_only_layers, list):  # gin and JSON give lists
      object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
    check_fields(self)
    if self.experts_per_token > self.num_experts:
      raise ConfigError(f"MoeConfig.experts_per_token ({self.experts_per_token}) must be <= "
                        f"num_experts ({self.num_experts}): a token cannot go to more experts "
                        "than there are.")

  def sparse_layers(self, num_layers: int) -> tuple[bool, ...]:
    """Whether each of ``num_layers`` layers is a mixture of experts (else dense)."""
    return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                 for i in range(num_layers))

  def replace(self, **changes) -> "MoeConfig":
    return dataclasses.replace(self, **changes)


class _FromPreset:
  """Default of every field: "take the preset's value" (None is a real value of some)."""

  def __repr__(self):
    return "<from preset>"


_FROM_PRESET = _FromPreset()


def _field(minimum=None):
  return dataclasses.field(default=_FROM_PRESET,
                           metadata={} if minimum is None else at_least(minimum))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture and memory settings of a Llama-family decoder.

  ``preset``: the ``PRESETS`` entry the fields not given come from ("" = the defaults,
  Llama-3.1-8B's shapes with a 32,000-token vocabulary).
  Shapes: ``vocab_size`` V, ``hidden_dim`` E, ``num_layers`` L, ``num_heads`` Hq,
  ``num_kv_heads`` Hkv (GQA when < Hq), ``head_dim`` D, ``mlp_dim`` F.
  ``dtype`` is the compute dtype ("bfloat16" on GPU), ``param_dtype`` the storage dtype.
  Memory: ``remat_policy`` (one of ``REMAT_POLICIES``, applied per layer; ``remat_names``
  are the activations that ``save_names`` keeps and ``offload`` moves to host),
  ``remat_group`` (layers per rematerialised group: the backward keeps one residual-stream
  input per group, in host memory under ``full_offload``, and recomputes the group's forward
  to get its layers' inputs back: L/k + k layer inputs live instead of L, for one more forward
  pass), ``remat_keep_attention`` (the policies that keep on the device, ``"full"`` and the
  ``save_*`` ones, and remat groups without offloading, keep each layer's attention output and
  log-sum-exp for the backward, S·Hq·(D·c + 4) bytes per layer (c bytes of the compute dtype)
  over the devices, so the backward never runs the attention's forward again; False recomputes
  them, as ``"offload"`` and ``"full_offload"`` always do), ``mlp_chunk`` (tokens
  per device per MLP tile; 0 = untiled), ``loss_chunk`` (tokens
  per device per cross-entropy chunk), ``attn_head_chunks`` (attention runs over this many
  chunks of heads, each recomputed in the backward, so q, k, v and the attention output exist
  for 1/n of the heads at a time; it must divide ``num_kv_heads``; 1 = unchunked; see
  ``UlyssesAttention``'s ``head_chunks``).
  Attention types: ``sliding_window`` (W, transformers' definition: a query sees itself and
  the W - 1 tokens before it; None = no window) applies to every layer when ``layer_types``
  is empty (Mistral), else to the layers marked ``"sliding_attention"`` (one of
  ``LAYER_TYPES`` per layer: Gemma 3, Qwen's ``max_window_layers``); ``layer_windows()``
  gives each layer's window. ``sliding_rope_theta`` (None: sliding layers rotate like full
  ones) is the RoPE base of the sliding layers, with ``sliding_rope_scaling`` (Gemma 3: base
  10,000 and no scaling locally, 1,000,000 and linear scaling on full layers);
  ``layer_attention(type)`` gives a layer type's window and RoPE.
  ``attention_scale``: the score scale (None: ``head_dim ** -0.5``; Gemma 3:
  ``query_pre_attn_scalar ** -0.5``).
  Family options (Gemma 3 sets all four, and ``qk_norm``): ``mlp_activation`` (gated MLP's
  activation, one of ``MLP_ACTIVATIONS``: ``"silu"`` SwiGLU, ``"gelu_tanh"`` GeGLU with
  tanh-approximated GELU), ``norm_offset_one`` (every RMSNorm, q/k norms included,
  multiplies by ``1 + scale``, scale stored as such), ``post_norms`` (an RMSNorm on the
  attention output and on the MLP output, before each residual add), ``embed_scale``
  (embeddings multiplied by sqrt(E), rounded to the compute dtype), ``attention_sinks`` (a
  learnable softmax sink logit per query head in every layer, gpt-oss; ``UlyssesAttention``).
  ``attn_out_bias``: a bias on the attention output projection (gpt-oss; ``qkv_bias`` puts
  them on q, k, v).
  Mixture of experts: ``moe`` (a ``MoeConfig``; None = every layer dense) replaces the MLP
  of the layers its schedule names; ``mlp_chunk`` tiles it like the MLP. The load-balancing
  loss (Switch Transformer's, over every token of the step and every MoE layer) is added
  to the objective times ``router_aux_loss_coef`` (0 = logged only). ``expert_backend``: the
  experts' grouped matmul (one of ``kernels.grouped_matmul.GROUPED_MATMUL_BACKENDS``).
  ``expert_placement`` (one of ``EXPERT_PLACEMENTS``; how the run holds the experts, not the
  model's shape, so a fine-tune may change it): ``"fsdp"`` shards the experts like every
  weight and all-gathers them per layer; ``"expert"`` (expert parallelism) gives each device
  of the mesh's ``seq`` axis X/seq of the experts and sends the tokens to them by all-to-all
  (``models.expert_parallel``; X must divide by the ``seq`` size). ``plan.moe.placement``
  says which moves fewer bytes.
  """
  preset: str = ""
  vocab_size: int = _field(1)
  hidden_dim: int = _field(1)
  num_layers: int = _field(1)
  num_heads: int = _field(1)
  num_kv_heads: int = _field(1)
  head_dim: int = _field(1)
  mlp_dim: int = _field(1)
  rope_theta: float = _field()
  rope_scaling: RopeScaling | None = _field()
  norm_eps: float = _field()
  tie_embeddings: bool = _field()
  qkv_bias: bool = _field()
  qk_norm: bool = _field()
  init_std: float = _field()
  dtype: str = _field()
  param_dtype: str = _field()
  attention_backend: Literal[BACKENDS] = _field()
  remat_policy: Literal[REMAT_POLICIES] = _field()
  remat_names: tuple[str, ...] = _field()
  remat_group: int = _field(1)
  remat_keep_attention: bool = _field()
  mlp_chunk: int = _field(0)
  loss_chunk: int = _field(1)
  attn_head_chunks: int = _field(1)
  sliding_window: int | None = _field()
  layer_types: tuple[str, ...] = _field()
  sliding_rope_theta: float | None = _field()
  sliding_rope_scaling: RopeScaling | None = _field()
  attention_scale: float | None = _field()
  mlp_activation: Literal[MLP_ACTIVATIONS] = _field()
  norm_offset_one: bool = _field()
  post_norms: bool = _field()
  embed_scale: bool = _field()
  attn_out_bias: bool = _field()
  moe: MoeConfig | None = _field()
  router_aux_loss_coef: float = _field(0)
  expert_backend: Literal[GROUPED_MATMUL_BACKENDS] = _field()
  expert_placement: Literal[EXPERT_PLACEMENTS] = _field()
  attention_sinks: bool = _field()

  def __post_init__(self):
    if self.preset and self.preset not in PRESETS:
      raise ConfigError(f"LlamaConfig.preset {self.preset!r} is unknown; choose one of "
                        f"{sorted(PRESETS)} or give every shape field.")
    base = PRESETS[self.preset] if self.preset else _DEFAULTS
    for f in dataclasses.fields(self):
      if getattr(self, f.name) is _FROM_PRESET:
        value = getattr(base, f.name) if isinstance(base, LlamaConfig) else base[f.name]
        object.__setattr__(self, f.name, value)
    for name in ("remat_names", "layer_types"):
      if isinstance(getattr(self, name), list):  # gin and JSON give lists
        object.__setattr__(self, name, tuple(getattr(self, name)))
    if isinstance(self.moe, dict):  # JSON gives a dict
      object.__setattr__(self, "moe", MoeConfig(**self.moe))
    check_fields(self)
    self._check_layer_types()
    self._check_moe()
    if self.num_layers % self.remat_group:
      raise ConfigError(f"num_layers ({self.num_layers}) must be a multiple of remat_group "
                        f"({self.remat_group}), the layers per rematerialised group.")
    check_head_chunks(self.attn_head_chunks, self.num_kv_heads, "attn_head_chunks")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                        f"({self.num_kv_heads}).")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}.")
    if self.attention_scale is not None and not self.attention_scale > 0:
      raise ConfigError(f"attention_scale must be > 0, or None for head_dim ** -0.5, got "
                        f"{self.attention_scale}.")
    if self.attention_sinks and self.attention_backend == "cudnn":
      raise ConfigError(f"attention_sinks needs an attention_backend other than 'cudnn': "
                        f"{NO_SINKS_IN_CUDNN}; use 'auto', 'pallas_mosaic', 'pallas' or 'xla'.")
    for name in ("dtype", "param_dtype"):
      try:
        floating = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
      except TypeError:
        floating = False
      if not floating:
        raise ConfigError(f"LlamaConfig.{name} must be a floating dtype name such as "
                          f"'float32' or 'bfloat16', got {getattr(self, name)!r}.")

  def _check_layer_types(self):
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ConfigError(f"sliding_window must be >= 1 (tokens a query sees, itself included) "
                        f"or None, got {self.sliding_window}.")
    if self.layer_types and len(self.layer_types) != self.num_layers:
      raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_layers is "
                        f"{self.num_layers}; give one per layer, or () for all full attention.")
    unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
    if unknown:
      raise ConfigError(f"layer_types {unknown} are unknown; each must be one of {LAYER_TYPES}.")
    if "sliding_attention" in self.layer_types and self.sliding_window is None:
      raise ConfigError("layer_types has 'sliding_attention' layers but sliding_window is "
                        "None; set sliding_window to the window length in tokens.")
    if self.sliding_rope_scaling is not None and self.sliding_rope_theta is None:
      raise ConfigError("sliding_rope_scaling is set but sliding_rope_theta is None; set "
                        "sliding_rope_theta too (the sliding layers' RoPE base), or leave both "
                        "None for one RoPE on every layer.")

  def _check_moe(self):
    if self.moe is None:
      return
    outside = sorted(i for i in self.moe.mlp_only_layers if not 0 <= i < self.num_layers)
    if outside:
      raise ConfigError(f"MoeConfig.mlp_only_layers {outside} are not layers of this "
                        f"{self.num_layers}-layer model; give indices in 0..{self.num_layers - 1}.")
    if not any(self.sparse_layers()):
      raise ConfigError(
          f"MoeConfig's schedule (mlp_only_layers={list(self.moe.mlp_only_layers)}, "
          f"decoder_sparse_step={self.moe.decoder_sparse_step}) leaves none of the "
          f"{self.num_layers} layers a mixture of experts; set moe=None for a dense model.")

  def sparse_layers(self) -> tuple[bool, ...]:
    """Whether each layer is a mixture of experts, ``[num_layers]`` (all False without
    ``moe``)."""
    if self.moe is None:
      return (False,) * self.num_layers
    return self.moe.sparse_layers(self.num_layers)

  def attention_types(self) -> tuple[str, ...]:
    """Each layer's type (one of ``LAYER_TYPES``), ``[num_layers]``."""
    every = "full_attention" if self.sliding_window is None else "sliding_attention"
    return self.layer_types or (every,) * self.num_layers

  def layer_windows(self) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), ``[num_layers]``."""
    return tuple(self.layer_attention(t)["sliding_window"] for t in self.attention_types())

  def layer_attention(self, layer_type: str) -> dict[str, Any]:
    """The ``sliding_window``, ``rope_theta`` and ``rope_scaling`` of layers of type
    ``layer_type`` (``UlyssesAttention``'s per-call arguments)."""
    if layer_type == "full_attention":
      return dict(sliding_window=None, rope_theta=self.rope_theta,
                  rope_scaling=self.rope_scaling)
    if self.sliding_rope_theta is None:
      return dict(sliding_window=self.sliding_window, rope_theta=self.rope_theta,
                  rope_scaling=self.rope_scaling)
    return dict(sliding_window=self.sliding_window, rope_theta=self.sliding_rope_theta,
                rope_scaling=self.sliding_rope_scaling)

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict (``from_dict`` inverts it)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ConfigError(f"unknown LlamaConfig fields {sorted(unknown)} (written by another "
                        "version of ulysses_jax?)")
    d = dict(d)
    for name in ("rope_scaling", "sliding_rope_scaling"):
      if isinstance(d.get(name), dict):
        d[name] = RopeScaling(**d[name])
    if isinstance(d.get("moe"), dict):
      d["moe"] = MoeConfig(**d["moe"])
    return cls(**d)


_DEFAULTS = dict(
    vocab_size=32_000, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, mlp_dim=14_336, rope_theta=500_000.0, rope_scaling=None, norm_eps=1e-5,
    tie_embeddings=False, qkv_bias=False, qk_norm=False, init_std=0.02, dtype="float32",
    param_dtype="float32", attention_backend="auto", remat_policy="full",
    remat_names=(QKV, ATTN_OUT), remat_group=1, remat_keep_attention=True, mlp_chunk=0,
    loss_chunk=1024, attn_head_chunks=1, sliding_window=None, layer_types=(),
    sliding_rope_theta=None, sliding_rope_scaling=None, attention_scale=None, mlp_activation="silu",
    norm_offset_one=False, post_norms=False, embed_scale=False, attn_out_bias=False, moe=None,
    router_aux_loss_coef=0.0, expert_backend="auto", expert_placement="fsdp",
    attention_sinks=False)

_LLAMA3_SCALING = dict(kind="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position=8192)

PRESETS = {}  # filled below: LlamaConfig's __post_init__ reads it
PRESETS.update({
    # Hugging Face meta-llama/Llama-3.2-1B.
    "llama3.2-1b": LlamaConfig(
        vocab_size=128_256, hidden_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, mlp_dim=8192, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_SCALING), norm_eps=1e-5,
        tie_embeddings=True),
    # meta-llama/Llama-3.1-8B.
    "llama3.1-8b": LlamaConfig(
        vocab_size=128_256, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_SCALING), norm_eps=1e-5),
    # meta-llama/Llama-3.1-70B (ArcticTraining's ALST recipes train it on 1 to 8 H100 nodes).
    "llama3.1-70b": LlamaConfig(
        vocab_size=128_256, hidden_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
        head_dim=128, mlp_dim=28_672, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_SCALING), norm_eps=1e-5),
    # Qwen/Qwen3-32B (ALST's other published model): q/k norms, no biases.
    "qwen3-32b": LlamaConfig(
        vocab_size=151_936, hidden_dim=5120, num_layers=64, num_heads=64, num_kv_heads=8,
        head_dim=128, mlp_dim=25_600, rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True),
    # Qwen/Qwen2.5-7B.
    "qwen2.5-7b": LlamaConfig(
        vocab_size=152_064, hidden_dim=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, mlp_dim=18_944, rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True),
    # mistralai/Mistral-7B-v0.1: a 4,096-token sliding window on every layer.
    "mistral-7b-v0.1": LlamaConfig(
        vocab_size=32_000, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, rope_theta=10_000.0, norm_eps=1e-5,
        sliding_window=4096),
    # google/gemma-3-1b-pt: five 512-token sliding layers (RoPE base 10,000) to each full one
    # (base 1,000,000).
    "gemma3-1b": LlamaConfig(
        vocab_size=262_144, hidden_dim=1152, num_layers=26, num_heads=4, num_kv_heads=1,
        head_dim=256, mlp_dim=6912, rope_theta=1_000_000.0, norm_eps=1e-6,
        tie_embeddings=True, qk_norm=True, sliding_window=512,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                          for i in range(26)),
        sliding_rope_theta=10_000.0, attention_scale=256 ** -0.5, mlp_activation="gelu_tanh",
        norm_offset_one=True, post_norms=True, embed_scale=True),
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 per token, renormalised.
    "qwen3-30b-a3b": LlamaConfig(
        vocab_size=151_936, hidden_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, mlp_dim=6144, rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True,
        moe=MoeConfig(num_experts=128, experts_per_token=8, expert_mlp_dim=768)),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14,336, 2 per token.
    "mixtral-8x7b": LlamaConfig(
        vocab_size=32_000, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, rope_theta=1_000_000.0, norm_eps=1e-5,
        moe=MoeConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=14_336)),
    # openai/gpt-oss-20b: 32 experts, 4 per token (top-k logits, then softmax), clamped
    # SwiGLU with biases; 128-token sliding layers alternating with full ones; YaRN x32;
    # q/k/v/o biases and attention sinks.
    "gpt-oss-20b": LlamaConfig(
        vocab_size=201_088, hidden_dim=2880, num_layers=24, num_heads=64, num_kv_heads=8,
        head_dim=64, mlp_dim=2880, rope_theta=150_000.0, norm_eps=1e-5,
        rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_position=4096,
                                 beta_fast=32.0, beta_slow=1.0, truncate=False),
        qkv_bias=True, attn_out_bias=True, attention_sinks=True, sliding_window=128,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(24)),
        moe=MoeConfig(num_experts=32, experts_per_token=4, expert_mlp_dim=2880,
                      router="topk_softmax", router_bias=True, expert_bias=True,
                      expert_activation="clamped_swiglu")),
    # ~25M parameters: CPU benchmarks.
    "small": LlamaConfig(
        vocab_size=8192, hidden_dim=512, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=64, mlp_dim=1536, rope_theta=10_000.0),
    # 0.5M parameters, byte vocabulary: `make train` (configs/tiny_cpu.gin) and the CPU
    # retrieval run.
    "cpu-demo": LlamaConfig(
        vocab_size=256, hidden_dim=128, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=32, mlp_dim=384, rope_theta=10_000.0, loss_chunk=128),
    # Test shapes.
    "tiny": LlamaConfig(
        vocab_size=256, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
        mlp_dim=128, rope_theta=10_000.0, loss_chunk=8),
    "tiny-gqa": LlamaConfig(
        vocab_size=256, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, rope_theta=10_000.0, loss_chunk=8),
})


def preset(name: str, **overrides) -> LlamaConfig:
  """A named config from ``PRESETS``, with fields replaced by ``overrides``."""
  if name not in PRESETS:
    raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
  return LlamaConfig(preset=name, **overrides)
