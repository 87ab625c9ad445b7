"""The layout planner's description of a ``Model`` in a ``Layout``: its shapes per device
(tokens, heads as the all-to-all exchanges them, ring steps). ``plan.memory`` gives its memory
per device, ``plan.comm`` and ``plan.step`` its collectives and step time, the hardware is
``plan.hardware``'s; ``ulysses_jax.plan.search`` searches the layouts, ``ulysses_jax.cli.plan``
is the command line.
"""

import dataclasses
import functools
import math

from ulysses_jax.attention.common import check_head_chunks
from ulysses_jax.attention.ulysses import plan_heads
from ulysses_jax.plan import moe
from ulysses_jax.train_step import MemoryOptions

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ATTENTIONS = ("ulysses", "allgather_kv")


@dataclasses.dataclass(frozen=True)
class Model:
  """The shape of a Llama-family decoder (``models.llama.LlamaConfig`` fields)."""
  vocab_size: int
  hidden_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  tie_embeddings: bool = False
  mlp_chunk: int = 0
  loss_chunk: int = 1024
  layer_windows: tuple[int | None, ...] = ()  # per layer; () = every layer full attention
  attention_sinks: bool = False
  # Mixture of experts (``plan.moe``): how many layers have experts (0: a dense model).
  moe_layers: int = 0
  num_experts: int = 0
  experts_per_token: int = 0
  expert_mlp_dim: int = 0
  expert_bias: bool = False
  # ``LlamaConfig.expert_placement`` the planner models, or "auto": the one ``plan.moe``
  # recommends for each layout (``from_config`` leaves it to the planner).
  expert_placement: str = "auto"

  @classmethod
  def from_config(cls, config):
    experts = ("num_experts", "experts_per_token", "expert_mlp_dim", "expert_bias")
    fields = {f.name for f in dataclasses.fields(cls)} - {"layer_windows", "moe_layers",
                                                          "expert_placement", *experts}
    moe_fields = {} if config.moe is None else {
        name: getattr(config.moe, name) for name in experts}
    return cls(**{name: getattr(config, name) for name in fields},
               layer_windows=config.layer_windows(), moe_layers=sum(config.sparse_layers()),
               **moe_fields)

  def windows(self) -> tuple[int | None, ...]:
    return self.layer_windows or (None,) * self.num_layers

  @property
  def layer_params(self):
    """Parameters each layer of the stack holds (a model mixing dense and MoE layers holds
    both MLPs in every layer)."""
    e, d = self.hidden_dim, self.head_dim
    dense = 3 * e * self.mlp_dim if self.moe_layers < self.num_layers else 0
    experts = moe.layer_params(self) if self.moe_layers else 0
    return (e * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * e
            + dense + experts + 2 * e)

  @property
  def params(self):
    vocab = self.vocab_size * self.hidden_dim * (1 if self.tie_embeddings else 2)
    return self.num_layers * self.layer_params + vocab + self.hidden_dim

  @property
  def compute_params(self):
    """The parameters a token runs (2 FLOPs each forward): all of a dense model's; of a
    mixture of experts not the X - k other experts, nor a layer's MLP it does not run."""
    if not self.moe_layers:
      return self.params
    dense_layers = self.num_layers - self.moe_layers
    unused = (self.moe_layers * 3 * self.hidden_dim * self.mlp_dim if dense_layers else 0)
    unused += dense_layers * moe.layer_params(self)
    return self.params - unused - self.moe_layers * moe.inactive_params(self)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh (``make_mesh(data, seq, ring)``), ``LlamaConfig.remat_policy`` and the state's
  placement (``memory``: the ``train_step.MemoryOptions`` the trainer would be given).

  ``remat="offload"`` is ``save_names`` with the named activations (q, k, v, attention
  output) kept on the host instead of the device; ``"full_offload"`` is ``full`` with each
  layer's input kept on the host. ``remat_group`` (``LlamaConfig.remat_group``, with
  ``full`` and ``full_offload``) keeps one input per group of that many layers.
  ``offload_params`` (with ``offload_optimizer``) keeps the layer parameters and their
  gradients on the host too. ``attn_head_chunks`` (``LlamaConfig.attn_head_chunks``; it
  must divide the model's ``num_kv_heads``) runs attention over that many chunks of heads,
  each recomputed in the backward. ``attention``: ``"ulysses"`` (the trainer's attention:
  all-to-all over ``seq``, a ring over ``ring``) or ``"allgather_kv"`` (the Llama 3 /
  Megatron baseline, modelled for comparison only: K and V gathered over ``seq``, no ring).
  ``keep_attention`` (``LlamaConfig.remat_keep_attention``): with a rematerialising policy,
  every layer keeps attention's output and log-sum-exp on the device for the backward (the
  offloading policies recompute them), so the backward does not run attention's forward
  again; False recomputes them (the planner's fallback when keeping them does not fit).
  """
  data: int
  seq: int
  ring: int
  remat: str = "full"
  offload_optimizer: bool = False
  remat_group: int = 1
  offload_params: bool = False
  attn_head_chunks: int = 1
  attention: str = "ulysses"
  keep_attention: bool = True

  def __post_init__(self):
    _ = self.memory  # the trainer's rules, checked in one place (MemoryOptions)
    if self.attn_head_chunks < 1:
      raise ValueError(f"attn_head_chunks must be >= 1 (1 = unchunked), got "
                       f"{self.attn_head_chunks}.")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}.")
    if self.attention == "allgather_kv" and self.ring > 1:
      raise ValueError(f"the all-gather-KV baseline gathers over seq and has no ring, got "
                       f"ring={self.ring}; put its devices on seq.")

  @classmethod
  def from_config(cls, train, model, devices: int) -> "Layout":
    """The layout a ``TrainConfig`` and ``LlamaConfig`` train with on ``devices`` devices."""
    sequence = train.mesh_seq * train.mesh_ring
    data = devices // sequence if train.mesh_data == -1 else train.mesh_data
    return cls(data, train.mesh_seq, train.mesh_ring, model.remat_policy, train.offload_optimizer,
               model.remat_group, train.offload_params, model.attn_head_chunks,
               keep_attention=model.remat_keep_attention)

  @property
  def keeps_attention(self) -> bool:
    """Whether the layers keep attention's residuals: ``keep_attention`` under a
    rematerialising policy that keeps on the device (without remat everything is kept anyway;
    the offloading policies recompute them, ``models.llama.remat_policy``)."""
    return self.keep_attention and self.remat not in ("none", *_ON_HOST)

  @property
  def mesh(self) -> tuple[int, int, int]:
    """``(data, seq, ring)``."""
    return self.data, self.seq, self.ring

  @property
  def memory(self) -> MemoryOptions:
    """The placement as the trainer takes it."""
    return MemoryOptions(offload_optimizer=self.offload_optimizer,
                         offload_params=self.offload_params)


def ring_steps(ring: int, seq_len: int, window: int | None) -> int:
  """Steps a ring of ``ring`` devices takes from other devices for a causal layer over
  ``seq_len`` tokens: all ``ring - 1``, or with a sliding window W only the devices holding
  the W - 1 keys before some query (``attention.ring``): with W <= S/R the ring keeps the
  natural layout and needs the one device before; with more, the zigzag layout
  (``S / 2R``-token halves, device r holding halves r and 2R-1-r) the k = ceil((W-1) / half)
  nearest on each side."""
  if window is None or ring == 1:
    return ring - 1
  if ring_keeps_natural_layout(ring, seq_len, window):
    return min(1, window - 1)
  half = seq_len / (2 * ring)
  return min(ring - 1, 2 * math.ceil((window - 1) / half))


def ring_keeps_natural_layout(ring: int, seq_len: int, window: int | None) -> bool:
  """Whether a causal ring runs in the natural order (no zigzag exchange): with a window of
  at most one device's tokens, which balances the work already."""
  return window is not None and window <= seq_len / ring


def tokens(layout, batch, seq_len):
  """Per-device (sequences, tokens per sequence, tokens) before attention."""
  seqs = batch // layout.data
  per_seq = -(-seq_len // (layout.seq * layout.ring))
  return seqs, per_seq, seqs * per_seq


def chunk_heads(model, layout):
  """``plan_heads`` for one chunk of heads: Hq/n query and Hkv/n KV heads over ``seq``."""
  n = layout.attn_head_chunks
  check_head_chunks(n, model.num_kv_heads, "attn_head_chunks")
  if n > 1 and layout.remat not in ("full", "full_offload"):
    raise ValueError(f"the planner models attn_head_chunks > 1 (got {n}) with remat 'full' or "
                     f"'full_offload' only (each chunk is recomputed whole), got "
                     f"{layout.remat!r}; use attn_head_chunks=1 with it.")
  exchanged_over = layout.seq if layout.attention == "ulysses" else 1  # no all-to-all
  return _plan_heads(model.num_heads // n, model.num_kv_heads // n, exchanged_over)


_plan_heads = functools.cache(plan_heads)  # a search asks for the same few plans often


def attention_per_token(heads, head_dim):
  """Elements per token of one head chunk's q, k, v and attention output, heads as the
  all-to-all exchanges them (``heads``: its ``HeadPlan``; padded, KV heads replicated where
  ``seq`` exceeds them)."""
  return (2 * heads.exchanged_q_heads + 2 * heads.exchanged_kv_heads) * head_dim


_ON_HOST = ("offload", "full_offload")  # the policies that keep their residuals on the host;
# they recompute attention's (models.llama.remat_policy)
