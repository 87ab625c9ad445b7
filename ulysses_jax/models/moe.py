"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): dropless top-k routing, tokens
sorted by expert and multiplied by their experts only (a grouped matmul).

Every token reaches its k experts: no capacity, nothing dropped. Per device, on its own
tokens (a ``shard_map`` over every mesh axis), for each tile of ``c`` local tokens per batch
row (``LlamaConfig.mlp_chunk``, each tile recomputed in the backward; 0 = one tile)::

  logits_tX   float32 x @ router (+ bias)
  softmax_topk  w, e = top_k(softmax(logits), k), w renormalised over the k if asked
  topk_softmax  l, e = top_k(logits, k); w = softmax(l)
  the t·k (token, expert) pairs sorted by expert: x_PE = x[token of pair p]   P = t·k
  h_PI = act(x_PE @ gate[e_p], x_PE @ up[e_p])   grouped matmuls (``kernels.grouped_matmul``)
  y_PE = h_PI @ down[e_p];  y_tE = sum over its k pairs of w · y_PE

so the router logits, the k copies of each token and the expert intermediates exist for one
tile at a time. FLOPs of the expert matmuls are 6·t·k·E·I, a k/X share of running every
expert on every token, where the grouped matmul is one (``kernels.grouped_matmul``: the
Mosaic kernels on Hopper; ``jax.lax.ragged_dot`` elsewhere, which XLA:CPU computes densely).

Where the experts live (``LlamaConfig.expert_placement``): ``"fsdp"``, the experts'
weights all-gathered per layer like every FSDP weight, the pairs multiplied on their own
device; ``"expert"``, each device of the ``seq`` axis holds X/seq whole experts (their width
sharded over ``data`` and ``ring``, gathered over those), and the sorted pairs go to their
experts' devices and back (``models.expert_parallel``, which states what that costs). The
router and the statistics are the same in both.

Load balancing (Switch Transformer, arXiv 2101.03961, eqs. 4-6, over all MoE layers as
transformers' ``load_balancing_loss_func`` concatenates them): each layer returns
``RouterStats``, sums over its valid tokens of every device and tile: ``counts`` (pairs
routed to each expert), ``probs`` (softmax(logits) over the X experts; gpt-oss's include the
router bias) and ``tokens``. ``load_balancing_loss`` turns the stack over layers into
``X · sum_e f_e · P_e``, f_e = counts_e / N and P_e = probs_e / N, N the tokens summed over
MoE layers: sums, so exact however the tokens are split into tiles and devices.

Parameters (one layer; stacked with a leading [L] by the decoder; with the expert placement
the experts' X dimension is sharded over ``seq``, their E over ``data`` and ``ring``)::

  router.kernel  [E, X]       float32 at use     router.bias [X]    (router_bias)
  gate_proj, up_proj  [X, E, I]                  gate_bias, up_bias [X, I]  (expert_bias)
  down_proj      [X, I, E]                       down_bias [X, E]           (expert_bias)
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax import sharding
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.kernels import grouped_matmul as grouped_matmul_lib
from ulysses_jax.layers import param
from ulysses_jax.mesh import DATA, RING, SEQ, sequence_axes
from ulysses_jax.models import expert_parallel
from ulysses_jax.models.config import LlamaConfig, MoeConfig


class RouterStats(NamedTuple):
  """Float32 sums over the valid tokens of one layer (or a stack ``[L, ...]`` of layers)."""
  counts: jax.Array  # [X] (token, expert) pairs routed to each expert (no gradient)
  probs: jax.Array   # [X] the router's softmax over all experts, summed over tokens
  tokens: jax.Array  # [] tokens routed

  @classmethod
  def zeros(cls, num_experts: int) -> "RouterStats":
    return cls(jnp.zeros(num_experts), jnp.zeros(num_experts), jnp.zeros(()))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
  """Switch Transformer's loss ``X · sum_e f_e · P_e`` of stacked ``[L, X]`` stats (dense
  layers count zeros); 1.0 for perfectly even routing with probabilities to match."""
  tokens = jnp.maximum(jnp.sum(stats.tokens), 1.0)
  counts, probs = (jnp.sum(x, axis=0) / tokens for x in (stats.counts, stats.probs))
  return counts.shape[-1] * jnp.sum(counts * probs)


def route(logits_tX: jax.Array, moe: MoeConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(weights ``[t, k]``, experts ``[t, k]`` int32, probabilities over all experts ``[t, X]``)
  of float32 router logits (bias included), as ``moe.router`` defines them."""
  k = moe.experts_per_token
  probs_tX = jax.nn.softmax(logits_tX, axis=-1)
  if moe.router == "topk_softmax":
    top_logits, experts = jax.lax.top_k(logits_tX, k)
    return jax.nn.softmax(top_logits, axis=-1), experts, probs_tX
  weights, experts = jax.lax.top_k(probs_tX, k)
  if moe.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts, probs_tX


def expert_activation(gate: jax.Array, up: jax.Array, moe: MoeConfig) -> jax.Array:
  """``act(gate) * up`` (SwiGLU), or gpt-oss's clamped form (see ``MoeConfig``)."""
  if moe.expert_activation == "silu":
    return jax.nn.silu(gate) * up
  limit = jnp.asarray(moe.swiglu_limit, gate.dtype)
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * gate * jax.nn.sigmoid(gate * jnp.asarray(moe.swiglu_alpha, gate.dtype))


def expert_mlp(x_RE, expert_R, sizes_X, w: dict, moe: MoeConfig, *, backend: str = "auto",
               valid_R=None) -> jax.Array:
  """The experts ``w`` on rows ``x_RE`` sorted by expert: ``expert_R`` each row's, ``sizes_X``
  the rows of each (a grouped matmul, ``kernels.grouped_matmul``). ``valid_R`` (expert
  placement): False for the rows after the groups, which the Mosaic kernels leave unwritten;
  they are set to zero after each matmul, so no stale value reaches a gradient."""
  keep = (lambda a: a) if valid_R is None else (lambda a: jnp.where(valid_R[:, None], a, 0))
  bias = lambda name: w[name][expert_R] if name in w else 0
  grouped_matmul = functools.partial(grouped_matmul_lib.grouped_matmul, backend=backend)
  gate = keep(grouped_matmul(x_RE, w["gate_proj"], sizes_X) + bias("gate_bias"))
  up = keep(grouped_matmul(x_RE, w["up_proj"], sizes_X) + bias("up_bias"))
  y_RE = grouped_matmul(expert_activation(gate, up, moe), w["down_proj"], sizes_X)
  return keep(y_RE + bias("down_bias"))


def experts_forward(x_tE, weights_tk, experts_tk, w: dict, moe: MoeConfig, *,
                    backend: str = "auto") -> jax.Array:
  """``sum_k weights · expert_k(x)`` ``[t, E]`` of the tokens ``x_tE`` (compute dtype) by
  sorting their t·k pairs by expert; ``w``: the gathered expert weights (and biases);
  ``backend``: the grouped matmul's (``kernels.grouped_matmul``)."""
  t, k = experts_tk.shape
  experts_P = experts_tk.reshape(-1)
  order_P = jnp.argsort(experts_P, stable=True)
  sizes_X = jnp.bincount(experts_P, length=moe.num_experts).astype(jnp.int32)
  y_PE = expert_mlp(x_tE[order_P // k], experts_P[order_P], sizes_X, w, moe, backend=backend)
  unsort_P = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(t * k, dtype=order_P.dtype))
  y_tkE = y_PE[unsort_P].reshape(t, k, -1)
  return jnp.einsum("tke,tk->te", y_tkE, weights_tk.astype(y_tkE.dtype))


def moe_tile(x_tE, valid_t, w: dict, moe: MoeConfig, dtype, backend: str = "auto",
             expert_axis_size: int = 0) -> tuple[jax.Array, RouterStats]:
  """One tile of tokens on one device: (output ``[t, E]``, its ``RouterStats``).
  ``expert_axis_size`` (expert placement): the size of the ``seq`` axis whose devices hold
  the experts; ``w`` then holds this device's X/``expert_axis_size`` experts."""
  logits_tX = jnp.dot(x_tE.astype(jnp.float32), w["router"],
                      precision=jax.lax.Precision.HIGHEST)
  if "router_bias" in w:
    logits_tX = logits_tX + w["router_bias"]
  weights_tk, experts_tk, probs_tX = route(logits_tX, moe)
  if expert_axis_size:
    local = lambda x, expert, sizes, valid: expert_mlp(x, expert, sizes, w, moe,
                                                       backend=backend, valid_R=valid)
    y_tE = expert_parallel.exchange(x_tE.astype(dtype), weights_tk, experts_tk, local,
                                    num_experts=moe.num_experts, axis=SEQ,
                                    axis_size=expert_axis_size)
  else:
    y_tE = experts_forward(x_tE.astype(dtype), weights_tk, experts_tk, w, moe,
                           backend=backend)
  valid = valid_t.astype(jnp.float32)
  counts = jnp.zeros(moe.num_experts).at[experts_tk].add(
      jnp.broadcast_to(valid[:, None], experts_tk.shape))
  stats = RouterStats(jax.lax.stop_gradient(counts), valid @ probs_tX, jnp.sum(valid))
  return y_tE, stats


def check_expert_axis(moe: MoeConfig, mesh: Mesh) -> None:
  """Raises unless the ``seq`` axis of ``mesh`` divides the experts (``expert_placement=
  "expert"``)."""
  shards = mesh.shape[SEQ]
  if moe.num_experts % shards:
    raise ConfigError(
        f"LlamaConfig.expert_placement='expert' splits the {moe.num_experts} experts over the "
        f"mesh's seq axis of {shards} devices, which does not divide them; choose seq among "
        f"the divisors of {moe.num_experts}, or expert_placement='fsdp'.")


class MoE(nnx.Module):
  """The mixture-of-experts MLP of ``config.moe`` (see the module docstring)."""

  def __init__(self, config: LlamaConfig, *, mesh: Mesh,
               rules: sharding.Rules = sharding.DEFAULT_RULES, rngs: nnx.Rngs):
    moe = config.moe
    e, x, i = config.hidden_dim, moe.num_experts, moe.expert_mlp_dim
    place = dict(mesh=mesh, rules=rules)
    normal = lambda shape: config.init_std * jax.random.normal(rngs.params(), shape,
                                                               config.param_dtype)
    zeros = lambda shape: jnp.zeros(shape, config.param_dtype)
    # fsdp: the experts sharded along the model width over every axis, like every weight;
    # expert: split over ``seq`` (X/seq each), the width over the other axes (data, ring).
    self.split = config.expert_placement == "expert"
    if self.split:
      check_expert_axis(moe, mesh)
    experts, embed = (SEQ, (DATA, RING)) if self.split else ("experts", "embed")
    self.router = param(normal((e, x)), ("embed", "experts"), **place)
    self.router_bias = param(zeros((x,)), ("experts",), **place) if moe.router_bias else None
    self.gate_proj = param(normal((x, e, i)), (experts, embed, "expert_mlp"), **place)
    self.up_proj = param(normal((x, e, i)), (experts, embed, "expert_mlp"), **place)
    self.down_proj = param(normal((x, i, e)), (experts, "expert_mlp", embed), **place)
    biases = moe.expert_bias
    self.gate_bias = param(zeros((x, i)), (experts, "expert_mlp"), **place) if biases else None
    self.up_bias = param(zeros((x, i)), (experts, "expert_mlp"), **place) if biases else None
    self.down_bias = param(zeros((x, e)), (experts, embed), **place) if biases else None
    self.moe = moe
    self.backend = config.expert_backend
    self.chunk = config.mlp_chunk
    self.dtype = jnp.dtype(config.dtype)
    self.mesh = mesh

  def _gathered(self) -> dict:
    """Every weight all-gathered for the layer (the router in float32, the experts in the
    compute dtype): replicated, or with the expert placement the experts split over ``seq``
    (gathered over the other axes). Returns (weights, their specs inside the shard_map)."""
    dtypes = dict(router=jnp.float32, router_bias=jnp.float32, gate_proj=self.dtype,
                  up_proj=self.dtype, down_proj=self.dtype, gate_bias=self.dtype,
                  up_bias=self.dtype, down_bias=self.dtype)
    specs = {name: P(SEQ) if self.split and not name.startswith("router") else P()
             for name in dtypes if getattr(self, name) is not None}
    weights = {name: jax.lax.with_sharding_constraint(
        getattr(self, name)[...].astype(dtypes[name]), NamedSharding(self.mesh, spec))
        for name, spec in specs.items()}
    return weights, specs

  def __call__(self, x_BSE: jax.Array, valid_BS: jax.Array,
               norm=None) -> tuple[jax.Array, RouterStats]:
    """``(moe(norm(x)), RouterStats)``: x ``[B, S, E]`` sharded ``(data, seq)``; ``valid_BS``
    bool, False for tokens that count in no statistic (the model's padding). ``norm`` runs
    inside each tile, so the normalised input never exists whole. The stats are summed over
    every device."""
    # The pre-norm (an nnx module) enters the shard_map as an argument: closed over, its
    # parameter's gradient would be built with the outer (Auto) mesh's sharding inside it.
    norm_graph, norm_state = nnx.split(norm or nnx.Module())
    moe, chunk, dtype, backend = self.moe, self.chunk, self.dtype, self.backend
    expert_axis_size = self.mesh.shape[SEQ] if self.split else 0
    axes = (DATA, *sequence_axes(self.mesh))

    def local(x_bsE, valid_bs, w, norm_state):
      norm_module = nnx.merge(norm_graph, norm_state)
      norm = norm_module if callable(norm_module) else (lambda x: x)
      b, s, e = x_bsE.shape
      c = min(chunk, s) if chunk else s
      pad = -s % c
      x_bsE = jnp.pad(x_bsE, [(0, 0), (0, pad), (0, 0)])
      valid_bs = jnp.pad(valid_bs, [(0, 0), (0, pad)])
      n = (s + pad) // c
      x_NtE = jnp.moveaxis(x_bsE.reshape(b, n, c, e), 1, 0).reshape(n, b * c, e)
      valid_Nt = jnp.moveaxis(valid_bs.reshape(b, n, c), 1, 0).reshape(n, b * c)
      tile = lambda x, valid: moe_tile(norm(x), valid, w, moe, dtype, backend,
                                       expert_axis_size)
      if n > 1:
        tile = jax.checkpoint(tile, prevent_cse=False)
      y_NtE, stats_N = jax.lax.map(lambda xs: tile(*xs), (x_NtE, valid_Nt))
      y_bsE = jnp.moveaxis(y_NtE.reshape(n, b, c, e), 0, 1).reshape(b, n * c, e)[:, :s]
      stats = jax.tree.map(lambda v: jax.lax.psum(jnp.sum(v, axis=0), axes), stats_N)
      return y_bsE, stats

    act = P(DATA, sequence_axes(self.mesh))
    w, w_specs = self._gathered()
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
    # check_vma=False: the Mosaic grouped matmul's outputs carry no varying-axes type. The
    # gradients of the inputs replicated over some axes (weights, norm) are then summed over
    # those axes (shard_map's transpose), as they must be.
    y_BSE, stats = jax.shard_map(
        local, mesh=self.mesh, in_specs=(P(*act, None), act, w_specs,
                                         replicated(norm_state)),
        out_specs=(P(*act, None), RouterStats(P(), P(), P())),
        check_vma=False)(x_BSE, valid_BS, w, norm_state)
    return y_BSE, stats
