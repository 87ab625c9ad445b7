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
from ulysses_jax.mesh import DATA, sequence_axes
from ulysses_jax.models import moe as moe_lib

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")


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
             for name in _EXPERT_WEIGHTS if getattr(stack, name) is not None}
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
