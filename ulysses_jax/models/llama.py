"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with ``qkv_bias``, Qwen3 with ``qk_norm``,
Gemma 3 with its options in ``LlamaConfig``; sliding windows and RoPE per layer type) in NNX.

Activations are ``[B, S, E]`` sharded ``(data, seq)``; attention is ``UlyssesAttention``;
everything else is token-local. The layers are stacked (every layer parameter has a leading
``[L]`` axis) and run with ``lax.scan``, so compile time does not grow with depth.

Parameter tree (kernels are Hugging Face ``weight``s transposed and reshaped)::

  embedding                       [V, E]        (HF model.embed_tokens.weight)
  layers.attn_norm.scale          [L, E]        (input_layernorm.weight)
  layers.attn.{q,k,v,o}_proj.*    see UlyssesAttention, with a leading [L]
  layers.attn.sinks               [L, Hq]       (with attention_sinks; self_attn.sinks)
  layers.mlp_norm.scale           [L, E]        (post_attention_layernorm.weight)
  layers.mlp.gate_proj.kernel     [L, E, F]     (mlp.gate_proj.weight.T)
  layers.mlp.up_proj.kernel       [L, E, F]
  layers.mlp.down_proj.kernel     [L, F, E]
  layers.{attn,mlp}_post_norm.scale [L, E]      (with post_norms; Gemma's post_attention_ and
                                                post_feedforward_layernorm.weight)
  final_norm.scale                [E]           (model.norm.weight)
  lm_head.kernel                  [E, V]        (lm_head.weight.T; absent when tied)

Sequences that the seq axis does not divide are padded at the end inside the model (the
padding is invisible to real tokens under the causal mask and carries no loss).
"""

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax import loss as loss_lib
from ulysses_jax import sharding
from ulysses_jax.attention.module import ATTN_OUT, QKV, UlyssesAttention
from ulysses_jax.attention.common import PAD_SEGMENT
from ulysses_jax.kernels.variants import KERNEL_RESIDUALS
from ulysses_jax.layers import Dense, RMSNorm, contract, param
from ulysses_jax.mesh import make_mesh, sequence_shards
from ulysses_jax.models.config import (  # noqa: F401  (public here too)
    PRESETS, REMAT_POLICIES, LlamaConfig, MoeConfig, preset)
from ulysses_jax.models.moe import MoE, RouterStats, load_balancing_loss

_ACT_BSE = ("act_batch", "act_seq", "act_embed")
_ACT_BS = ("act_batch", "act_seq")
_HEAD = ("embed", "vocab")  # the [E, V] head's logical axes (a tied table's, transposed)

LAYER_INPUT = "layer_input"  # the residual stream entering a layer: what "full" remat keeps
GROUP_INPUT = "group_input"  # the residual stream entering a group of remat_group layers
OFFLOADING_POLICIES = ("offload", "full_offload")  # residuals in pinned host memory


def remat_policy(name: str, names: tuple[str, ...] = (QKV, ATTN_OUT), *,
                 keep_attention: bool = True):
  """The ``jax.checkpoint`` policy of a ``REMAT_POLICIES`` name (None for ``"none"``).

  ``save_names`` keeps the activations tagged ``names`` (``QKV``, ``ATTN_OUT``) on device;
  ``offload`` moves them to ``pinned_host`` memory in the forward pass and back in the
  backward pass; everything else is recomputed. ``full_offload`` recomputes like ``full``
  but moves each layer's input (``LAYER_INPUT``, ``[B, S/P, E]`` per device, the one thing
  ``full`` keeps per layer) to ``pinned_host``: no activation memory per layer on the device,
  L·B·S/P·E in the compute dtype on the host, one transfer each way per layer.

  ``keep_attention`` (``LlamaConfig.remat_keep_attention``): the policies that keep what they
  keep on the device also keep the attention's output and log-sum-exp as its backward reads
  them (``KERNEL_RESIDUALS``: ``[B, S, Hq/P, D]`` in the compute dtype and ``[B, Hq/P, S]``
  float32 per device after the all-to-all), so the backward runs only the attention's backward
  kernels, never its forward again. The offloading policies (``OFFLOADING_POLICIES``) recompute
  them: they exist to leave the device nearly empty, and XLA's GPU compiler (jax 0.10.2) fails
  on these residuals offloaded from inside the layer scan ("Expected instruction to have shape
  equal to ..." after layout assignment).
  """
  policies = jax.checkpoint_policies
  kept = list(KERNEL_RESIDUALS) if keep_attention and name not in OFFLOADING_POLICIES else []
  offloaded = lambda offload: policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(offload),
      offload_src="device", offload_dst="pinned_host")
  with_kept = lambda policy: (policies.save_from_both_policies(
      policy, policies.save_only_these_names(*kept)) if kept else policy)
  table = {
      "none": None,
      "full": with_kept(policies.nothing_saveable),
      "save_dots": with_kept(policies.dots_saveable),
      "save_dots_no_batch": with_kept(policies.dots_with_no_batch_dims_saveable),
      "save_names": policies.save_only_these_names(*names, *kept),
      "offload": offloaded(names),
      "full_offload": offloaded([LAYER_INPUT]),
  }
  if name not in table:
    raise ValueError(f"remat policy must be one of {REMAT_POLICIES}, got {name!r}.")
  return table[name]


def _group_policy(layer_policy: str, keep_attention: bool):
  """What a group of layers keeps for the backward: its input (recomputing the rest), in host
  memory when the layers keep theirs there (``full_offload``), else on the device with, given
  ``keep_attention``, its layers' attention residuals (``remat_policy``)."""
  if layer_policy == "full_offload":
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[GROUP_INPUT],
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(
      *(KERNEL_RESIDUALS if keep_attention else ()))


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _gated_mlp(activation, x_BSE, gate_EF, up_EF, down_FE):
  hidden_BSF = activation(contract(x_BSE, gate_EF, 1)) * contract(x_BSE, up_EF, 1)
  return contract(hidden_BSF, down_FE, 1)


class MLP(nnx.Module):
  """Gated MLP ``down(act(gate(x)) * up(x))`` (act: ``config.mlp_activation``, SwiGLU for
  silu); optionally tiled along the sequence.

  With ``chunk > 0`` the MLP runs as a scan over chunks of ``chunk`` local tokens per
  device, each recomputed in the backward pass, so the ``[B, S, F]`` intermediate never
  exists: at most ``[B, P*chunk, F]`` (ALST's TiledMLP).
  """

  def __init__(self, config: LlamaConfig, *, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES, rngs: nnx.Rngs):
    e, f = config.hidden_dim, config.mlp_dim
    dense = dict(mesh=mesh, dtype=config.dtype, param_dtype=config.param_dtype,
                 init_std=config.init_std, rules=rules, rngs=rngs)
    self.gate_proj = Dense((e,), (f,), axes=("embed", "mlp"), **dense)
    self.up_proj = Dense((e,), (f,), axes=("embed", "mlp"), **dense)
    self.down_proj = Dense((f,), (e,), axes=("mlp", "embed"), **dense)
    self.chunk = config.mlp_chunk
    self.activation = config.mlp_activation
    self.mesh = mesh

  def __call__(self, x_BSE: jax.Array, norm=None) -> jax.Array:
    """``mlp(norm(x))``; ``norm`` (e.g. the pre-norm, default none) runs inside each tile, so
    the normalised ``[B, S, E]`` input and its gradient never exist whole."""
    kernels = [p.compute_kernel() for p in (self.gate_proj, self.up_proj, self.down_proj)]
    norm = norm or (lambda x: x)
    block = lambda x: _gated_mlp(ACTIVATIONS[self.activation],
                                 norm(x).astype(kernels[0].dtype), *kernels)
    # A sequence the shards do not divide (a decode step's one token) has nothing to tile.
    if not self.chunk or x_BSE.shape[1] % sequence_shards(self.mesh):
      return block(x_BSE)
    x_NBPcE = sharding.to_local_chunks(x_BSE, mesh=self.mesh, chunk=self.chunk)
    tile = jax.checkpoint(block, prevent_cse=False)
    _, y_NBPcE = jax.lax.scan(lambda _, x: (None, tile(x)), None, x_NBPcE)
    return sharding.from_local_chunks(y_NBPcE, x_BSE.shape[1], mesh=self.mesh)


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with
  ``config.post_norms``, ``x + post_norm(attn(norm(x)))`` and likewise for the MLP (Gemma).
  The MLP is the mixture of experts (``models.moe``) on the layers ``config.sparse_layers()``
  marks, the dense one on the others.

  One module serves every layer of the scan, so the layer's kind comes in as data:
  ``sliding``, a bool scalar (the layer's entry of ``config.attention_types()`` is
  ``"sliding_attention"``), and ``sparse`` (its entry of ``config.sparse_layers()``). A
  model that mixes dense and MoE layers holds both MLPs in every layer (one stack: the
  optimizer streams it a layer at a time, remat groups and host offload slice it alike); a
  layer runs one of them (``lax.cond``), the other stays zero: its gradient is zero, and
  neither loading nor export touches it.
  """

  def __init__(self, config: LlamaConfig, *, mesh: Mesh, rules: sharding.Rules,
               rngs: nnx.Rngs):
    c = config
    norm = dict(mesh=mesh, eps=c.norm_eps, offset_one=c.norm_offset_one, dtype=c.dtype,
                param_dtype=c.param_dtype, rules=rules)
    self.attn_norm = RMSNorm(c.hidden_dim, **norm)
    self.attn = UlyssesAttention(
        c.hidden_dim, c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        mesh=mesh, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, qk_norm=c.qk_norm,
        norm_offset_one=c.norm_offset_one, attention_scale=c.attention_scale,
        qkv_bias=c.qkv_bias, out_bias=c.attn_out_bias, attention_sinks=c.attention_sinks,
        norm_eps=c.norm_eps, backend=c.attention_backend, head_chunks=c.attn_head_chunks,
        dtype=c.dtype,
        param_dtype=c.param_dtype, init_std=c.init_std, rules=rules, rngs=rngs)
    self.mlp_norm = RMSNorm(c.hidden_dim, **norm)
    sparse = c.sparse_layers()
    self.mlp = None if all(sparse) else MLP(c, mesh=mesh, rules=rules, rngs=rngs)
    self.moe = MoE(c, mesh=mesh, rules=rules, rngs=rngs) if any(sparse) else None
    self.attn_post_norm = RMSNorm(c.hidden_dim, **norm) if c.post_norms else None
    self.mlp_post_norm = RMSNorm(c.hidden_dim, **norm) if c.post_norms else None
    self.config = c
    self.mesh = mesh
    self.rules = rules

  def __call__(self, x_BSE, positions_BS, segment_ids_BS, valid_BS, sliding, sparse):
    """(the layer's output ``[B, S, E]``, its ``RouterStats``, None without experts)."""
    x_BSE = checkpoint_name(x_BSE, LAYER_INPUT)
    return self.block(x_BSE, lambda x: self._attention(x, positions_BS, segment_ids_BS,
                                                       sliding), valid_BS, sparse)

  def block(self, x_BSE, attention, valid_BS=None, sparse=False, feed_forward=None):
    """The layer around ``attention(x_BSE) -> [B, S, E]``, the attention sublayer with its
    pre-norm (``attn_norm``): (output ``[B, S, E]``, ``RouterStats`` or None), as
    ``__call__``; ``ulysses_jax.generate`` passes one that reads and writes a KV cache.
    ``valid_BS`` and ``sparse`` are the MoE MLP's (the tokens its statistics count; whether
    this layer runs it). ``feed_forward(x) -> [B, S, E]``: another MLP sublayer with its
    pre-norm, no stats (a decode step's experts over the stack, ``generate.experts``)."""
    constrain = lambda x: sharding.constrain(x, _ACT_BSE, self.mesh, self.rules)
    post = lambda norm, y: y if norm is None else norm(y)
    x_BSE = constrain(x_BSE + post(self.attn_post_norm, attention(x_BSE)))
    y_BSE, stats = (self._feed_forward(x_BSE, valid_BS, sparse) if feed_forward is None
                    else (feed_forward(x_BSE), None))
    return constrain(x_BSE + post(self.mlp_post_norm, y_BSE)), stats

  def _feed_forward(self, x_BSE, valid_BS, sparse):
    """(``mlp(norm(x))`` or ``moe(norm(x))`` as ``sparse`` says, the router's stats)."""
    if self.moe is None:
      return self.mlp(x_BSE, norm=self.mlp_norm), None
    experts = lambda: self.moe(x_BSE, valid_BS, norm=self.mlp_norm)
    if self.mlp is None:
      return experts()
    dense = lambda: (self.mlp(x_BSE, norm=self.mlp_norm),
                     RouterStats.zeros(self.config.moe.num_experts))
    return jax.lax.cond(sparse, experts, dense)

  def _attention(self, x_BSE, positions_BS, segment_ids_BS, sliding):
    """``attn(norm(x))`` with this layer type's window and RoPE: both are static in the
    compiled attention, so mixed layers choose between the sliding and the full call with
    ``lax.cond`` (both compiled once, one run per layer) and the layers stay one scan."""
    attend = lambda layer_type: self.attn(x_BSE, positions_BS, segment_ids_BS,
                                          norm=self.attn_norm,
                                          **self.config.layer_attention(layer_type))
    types = set(self.config.attention_types())
    if len(types) == 1:
      return attend(types.pop())
    return jax.lax.cond(sliding, lambda: attend("sliding_attention"),
                        lambda: attend("full_attention"))


class Llama(nnx.Module):
  """The decoder. Build it sharded with ``init_llama``; see the module docstring for params."""

  def __init__(self, config: LlamaConfig, *, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES, rngs: nnx.Rngs):
    c = config
    self.embedding = param(
        c.init_std * jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_dim),
                                       c.param_dtype), ("vocab", "embed"), mesh=mesh, rules=rules)

    @nnx.split_rngs(splits=c.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers",
                                                         "logical_axes": "layers"})
    def make_layers(rngs):
      return DecoderLayer(c, mesh=mesh, rules=rules, rngs=rngs)

    self.layers = make_layers(rngs)
    self.final_norm = RMSNorm(c.hidden_dim, mesh=mesh, eps=c.norm_eps,
                              offset_one=c.norm_offset_one, dtype=c.dtype,
                              param_dtype=c.param_dtype, rules=rules)
    self.lm_head = None if c.tie_embeddings else Dense(
        (c.hidden_dim,), (c.vocab_size,), axes=_HEAD, mesh=mesh, dtype=c.dtype,
        param_dtype=c.param_dtype, init_std=c.init_std, rules=rules, rngs=rngs)
    self.config = c
    self.mesh = mesh
    self.rules = rules

  def lm_head_kernel(self) -> jax.Array:
    """``[E, V]`` output projection in the compute dtype, all-gathered (replicated). An untied
    head's gradient, which the loss reduces to its shards, stays in them
    (``sharding.gather``'s ``gradient_in_shards``)."""
    if self.lm_head is not None:
      return sharding.gather(self.lm_head.kernel[...], self.config.dtype, self.mesh,
                             axes=_HEAD, rules=self.rules, gradient_in_shards=True)
    return self._compute_table().T

  def _head_sharding(self) -> NamedSharding:
    """The FSDP shards of the ``[E, V]`` head parameter (a tied table's, transposed)."""
    c = self.config
    return sharding.logical_sharding((c.hidden_dim, c.vocab_size), _HEAD, self.mesh,
                                     self.rules)

  def _compute_table(self) -> jax.Array:
    """The embedding ``[V, E]`` in the compute dtype, all-gathered (replicated)."""
    return sharding.gather(self.embedding[...], self.config.dtype, self.mesh,
                           axes=("vocab", "embed"), rules=self.rules)

  def _check_inputs(self, tokens, positions, segment_ids):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an int [batch, seq] array, got {tokens.dtype} "
                       f"{tuple(tokens.shape)}.")
    for name, x in (("positions", positions), ("segment_ids", segment_ids)):
      if x is not None and tuple(x.shape) != tuple(tokens.shape):
        raise ValueError(f"{name} must have the tokens' shape {tuple(tokens.shape)}, got "
                         f"{tuple(x.shape)}.")

  def _padded_hidden_states(self, tokens_BS, positions_BS, segment_ids_BS):
    """(final-normed hidden states ``[B, S', E]``, S' = S rounded up to a multiple of seq;
    the layers' ``RouterStats`` stacked ``[L, ...]``, None without experts)."""
    self._check_inputs(tokens_BS, positions_BS, segment_ids_BS)
    b, s = tokens_BS.shape
    if positions_BS is None:
      positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    pad = -s % sequence_shards(self.mesh)
    pad_BS = lambda x, value: jnp.pad(x, [(0, 0), (0, pad)], constant_values=value)
    tokens_BS, positions_BS = pad_BS(tokens_BS, 0), pad_BS(positions_BS, 0)
    valid_BS = pad_BS(jnp.ones((b, s), bool), False)
    if segment_ids_BS is not None:
      segment_ids_BS = pad_BS(segment_ids_BS, PAD_SEGMENT)
    constrain = lambda x: None if x is None else sharding.constrain(x, _ACT_BS, self.mesh,
                                                                    self.rules)
    tokens_BS, positions_BS, segment_ids_BS, valid_BS = map(
        constrain, (tokens_BS, positions_BS, segment_ids_BS, valid_BS))
    x_BSE = self.embed(tokens_BS)

    graphdef, layer_states = nnx.split(self.layers)
    # The stacked layer weights may live in host memory (``MemoryOptions(offload_params=
    # True)``): each layer (or group of layers) copies its own slice to the device when it
    # runs (a no-op for device arrays), and the transpose of that copy writes the slice's
    # gradient back to the host.
    slice_shardings = sharding.layer_slice(
        sharding.tree_shardings(layer_states, self.mesh, self.rules))
    c = self.config
    remat = lambda f: f if c.remat_policy == "none" else jax.checkpoint(
        f, prevent_cse=False, policy=remat_policy(c.remat_policy, c.remat_names,
                                                  keep_attention=c.remat_keep_attention))
    run = lambda x_BSE, layer: nnx.merge(graphdef, layer["state"])(
        x_BSE, positions_BS, segment_ids_BS, valid_BS, layer["sliding"], layer["sparse"])
    kinds = dict(state=layer_states,
                 sliding=jnp.array([t == "sliding_attention" for t in c.attention_types()]),
                 sparse=jnp.array(c.sparse_layers()))

    if c.remat_group == 1:
      layer = remat(lambda x, layer: run(x, dict(
          layer, state=jax.device_put(layer["state"], slice_shardings))))
      x_BSE, stats = jax.lax.scan(layer, x_BSE, kinds)
      return self.final_norm(x_BSE), stats

    # A group copies its layers' weights to the device at once, so only the outer loop moves
    # weights and gradients between host and device: XLA's GPU compiler cannot place
    # gradients that nested loops stack into host memory.
    group_shardings = jax.tree.map(
        lambda s: sharding.in_memory(s.mesh, P(None, *s.spec), "device"), slice_shardings)
    layer = remat(run)

    def group(x_BSE, group):
      group = dict(group, state=jax.device_put(group["state"], group_shardings))
      return jax.lax.scan(layer, checkpoint_name(x_BSE, GROUP_INPUT), group)

    group = jax.checkpoint(group, prevent_cse=False, policy=_group_policy(c.remat_policy,
                                                                   c.remat_keep_attention))
    groups = jax.tree.map(lambda s: s.reshape(-1, c.remat_group, *s.shape[1:]), kinds)
    x_BSE, stats = jax.lax.scan(group, x_BSE, groups)
    stats = jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), stats)
    return self.final_norm(x_BSE), stats

  def embed(self, tokens_BS) -> jax.Array:
    """The embeddings of int ``[B, S]`` tokens: ``[B, S, E]`` in the compute dtype (times
    sqrt(E) with ``embed_scale``), sharded (data, seq)."""
    # Gathering the table first keeps the lookup local to each (data, seq) shard.
    table_VE = self._compute_table()
    x_BSE = jnp.take(table_VE, tokens_BS, axis=0)
    if self.config.embed_scale:
      x_BSE = x_BSE * jnp.asarray(self.config.hidden_dim ** 0.5, self.config.dtype)
    return sharding.constrain(x_BSE, _ACT_BSE, self.mesh, self.rules)

  def layer(self, index: int) -> DecoderLayer:
    """Layer ``index`` (a Python int) as a module of its own, its parameters sliced from the
    stack: for callers that run the layers one by one (``ulysses_jax.generate``, whose layers
    each keep a cache of their own shape)."""
    graphdef, layer_states = nnx.split(self.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[index], layer_states))

  def hidden_states(self, tokens_BS, positions_BS=None, segment_ids_BS=None) -> jax.Array:
    """Final-normed hidden states ``[B, S, E]`` in the compute dtype, sharded (data, seq).

    tokens, positions, segment_ids: int ``[B, S]``; positions default to ``arange(S)``
    (restart them at each packed document); segment_ids None means one document per row.
    """
    return self._padded_hidden_states(tokens_BS, positions_BS,
                                      segment_ids_BS)[0][:, :tokens_BS.shape[1]]

  def __call__(self, tokens_BS, positions_BS=None, segment_ids_BS=None) -> jax.Array:
    """Float32 logits ``[B, S, V]``. Materialises all of them: for training use ``loss``."""
    hidden_BSE = self.hidden_states(tokens_BS, positions_BS, segment_ids_BS)
    return jnp.einsum("bse,ev->bsv", hidden_BSE, self.lm_head_kernel(),
                      preferred_element_type=jnp.float32)

  def loss(self, tokens_BS, labels_BS, positions_BS=None, segment_ids_BS=None, *,
           z_loss_weight: float = 0.0) -> loss_lib.CrossEntropySums:
    """Next-token cross-entropy sums over valid labels; never builds ``[B, S, V]`` logits.

    labels: int ``[B, S]``, already shifted (``labels[t]`` is the target after
    ``tokens[t]``), ``IGNORE_LABEL`` where there is none. See ``loss.chunked_cross_entropy``.
    With experts, the sums carry the load-balancing loss over every token of the batch
    and every MoE layer (``router_aux``, unweighted) and ``expert_counts`` ``[L, X]``.
    """
    if tuple(labels_BS.shape) != tuple(tokens_BS.shape):
      raise ValueError(f"labels must have the tokens' shape {tuple(tokens_BS.shape)}, got "
                       f"{tuple(labels_BS.shape)}.")
    hidden_BSE, stats = self._padded_hidden_states(tokens_BS, positions_BS, segment_ids_BS)
    pad = hidden_BSE.shape[1] - labels_BS.shape[1]
    labels_BS = jnp.pad(labels_BS, [(0, 0), (0, pad)], constant_values=loss_lib.IGNORE_LABEL)
    labels_BS = sharding.constrain(labels_BS, _ACT_BS, self.mesh, self.rules)
    sums = loss_lib.chunked_cross_entropy(hidden_BSE, self.lm_head_kernel(), labels_BS,
                                          mesh=self.mesh, chunk=self.config.loss_chunk,
                                          z_loss_weight=z_loss_weight,
                                          head_sharding=self._head_sharding())
    if stats is None:
      return sums
    return sums._replace(router_aux=load_balancing_loss(stats), expert_counts=stats.counts)


def init_llama(config: LlamaConfig, mesh: Mesh, *, seed: int = 0,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> Llama:
  """A ``Llama`` whose parameters are created directly in their sharded layout."""
  return sharding.init_sharded(
      lambda: Llama(config, mesh=mesh, rules=rules, rngs=nnx.Rngs(seed)), mesh, rules)


def count_params(model_or_config, *, include_embedding: bool = True,
                 active: bool = False) -> int:
  """Number of parameters of a model or config (from shapes alone). A layer's MLP that the
  layer does not run (a model mixing dense and MoE layers holds both in every layer) does
  not count; ``active=True`` counts the parameters one token runs: of each MoE layer's X
  experts only its k (the router whole)."""
  config = model_or_config if isinstance(model_or_config, LlamaConfig) else (
      model_or_config.config)
  if isinstance(model_or_config, LlamaConfig):
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    model_or_config = nnx.eval_shape(lambda: Llama(model_or_config, mesh=mesh,
                                                   rngs=nnx.Rngs(0)))
  state = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model_or_config, nnx.Param)))
  sparse = sum(config.sparse_layers())
  used_layers = {"mlp": config.num_layers - sparse, "moe": sparse}
  total = 0
  for path, x in state.items():
    size = x.size
    if path[0] == "layers" and path[1] in used_layers:
      size = size // config.num_layers * used_layers[path[1]]
      if active and path[1] == "moe" and path[2] not in ("router", "router_bias"):
        size = size // config.moe.num_experts * config.moe.experts_per_token
    total += size
  if not include_embedding:
    total -= model_or_config.embedding.size
  return total
