"""A decode step's mixture-of-experts MLP over the model's stacked expert weights.

A decode step runs the layers one by one, so each layer's weights are slices of the stacks
``[L, X, ...]``. XLA's GPU compiler copies such a slice when it feeds a custom call: compiled
for H100s, gpt-oss-20b's decode step copied each MoE layer's experts (gate, up, down: 1.48 GiB
of temporaries), every expert's bytes read and written once per token when the Mosaic grouped
matmul then reads only the experts the tokens chose. Here the experts of all layers are one
group axis instead, ``[L·X, ...]`` (a reshape of the stack: no copy), and layer i's tokens go
to groups ``i·X + e``; the kernel reads the weights of the groups that have rows. Routing,
the experts and the weighted sum are ``models.moe``'s own (``route``, ``experts_forward``).

Used where the grouped matmul is the Mosaic kernel (``uses_stacked_experts``): XLA's
``ragged_dot`` computes over every group (a dense product on CPUs and GPUs), L times more
work with the stack; there ``MoE`` runs on the layer's slice as in training.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels import grouped_matmul as grouped_matmul_lib
from ulysses_jax.kernels import target as target_lib
from ulysses_jax.mesh import DATA, sequence_axes, sequence_shards
from ulysses_jax.models import moe as moe_lib

# The stacked expert arrays of ``models.moe.MoE`` (the router and its bias excluded).
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")


def uses_stacked_experts(config, mesh) -> bool:
  """Whether a decode step on ``mesh`` runs ``config``'s experts over the stack: where its
  grouped matmul resolves to the Mosaic kernel."""
  if config.moe is None:
    return False
  target = target_lib.of_mesh(mesh)
  if target is None:
    return False
  e, i = config.hidden_dim, config.moe.expert_mlp_dim
  return all(grouped_matmul_lib.choose_backend(config.expert_backend, jnp.dtype(config.dtype),
                                               k, n, target) == "mosaic"
             for k, n in ((e, i), (i, e)))


def decode_tokens_per_device(layout) -> int:
  """Tokens each device routes in a decode step of ``layout`` (a ``CacheLayout``; its mesh may
  be abstract): the B/data rows of a data shard spread over its seq x ring devices, padded to
  a multiple of them (``steps._decode_block``), ⌈B/(data·seq·ring)⌉; padding rows are routed
  too."""
  rows = layout.batch // layout.mesh.shape[DATA]
  return -(-rows // sequence_shards(layout.mesh))


def decode_experts_read(config, layout) -> int:
  """Experts per MoE layer whose weights a decode step of ``layout`` reads on one device, at
  most: min(X, t·k) for t = ``decode_tokens_per_device`` tokens going to k of the X experts
  each. Assumes the grouped matmul reads only the groups that have rows (the Mosaic kernel on
  Hopper does; XLA's ``ragged_dot`` reads all X) and that no two of the t·k choices share an
  expert (an upper bound). The one formula ``plan.generate`` and ``aot.generate`` predict a
  decode step's weight reads with."""
  moe = config.moe
  return min(moe.num_experts, decode_tokens_per_device(layout) * moe.experts_per_token)


def stacked_experts(model, layer: int, x_dRE, norm):
  """Layer ``layer``'s experts on ``norm(x)``: x ``[data, R, E]`` sharded (data, seq x ring),
  R a multiple of the sequence shards; returns ``[data, R, E]`` in the compute dtype, sharded
  alike. Each device routes and multiplies its own tokens; the weights are replicated."""
  config, mesh = model.config, model.mesh
  moe = config.moe
  stack = model.layers.moe
  dtype = jnp.dtype(config.dtype)
  layers, experts = config.num_layers, moe.num_experts
  weights = {name: getattr(stack, name)[...].astype(dtype).reshape(
      layers * experts, *getattr(stack, name).shape[2:])
             for name in EXPERT_WEIGHTS if getattr(stack, name) is not None}
  router = stack.router[layer].astype(jnp.float32)
  router_bias = (jnp.zeros((experts,), jnp.float32) if stack.router_bias is None
                 else stack.router_bias[layer].astype(jnp.float32))
  all_groups = dataclasses.replace(moe, num_experts=layers * experts)
  act = P(DATA, sequence_axes(mesh), None)

  def local(h_drE, router_EX, bias_X, w):
    d, r, e = h_drE.shape
    h_tE = h_drE.reshape(d * r, e)
    logits_tX = jnp.dot(h_tE.astype(jnp.float32), router_EX,
                        precision=jax.lax.Precision.HIGHEST) + bias_X
    weights_tk, experts_tk, _ = moe_lib.route(logits_tX, moe)
    y_tE = moe_lib.experts_forward(h_tE.astype(dtype), weights_tk,
                                   experts_tk + layer * experts, w, all_groups,
                                   backend=config.expert_backend)
    return y_tE.reshape(d, r, e)

  replicated = jax.tree.map(lambda _: P(), weights)
  # check_vma=False: the Mosaic kernel's outputs carry no varying-axes type (as in MoE).
  return jax.shard_map(local, mesh=mesh, in_specs=(act, P(), P(), replicated),
                       out_specs=act, check_vma=False)(norm(x_dRE), router, router_bias,
                                                       weights)
