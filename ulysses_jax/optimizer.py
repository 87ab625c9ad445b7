"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, and its
update, either on the device or streamed one layer at a time from host memory.

    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-4, ...))

The state comes in two groups (``OptimizerState``): the stacked layer parameters (leading
``[L]`` axis, logical name ``"layers"``), whose optax state is made by ``vmap`` over that axis,
and the rest (embedding, head, final norm). So the update can run over all layers at once
(``vmap``) or one layer at a time (a loop) with the same state and arithmetic; which one, and
where the state lives, is ``ulysses_jax.train_step``'s choice (its memory options).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ulysses_jax import sharding
from ulysses_jax.config_checks import above, at_least, check_fields

_NO_DECAY = ("scale", "bias", "sinks")  # attention sinks: a logit per head, like a bias
LAYER_AXIS = "layers"  # logical name of the stacked-layer axis (models.llama)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup to ``learning_rate`` then cosine decay to
  ``learning_rate * final_lr_fraction`` at ``total_steps``; gradients clipped to global norm
  ``clip_norm`` (0 = no clipping). Norm scales, biases and attention sinks get no weight
  decay."""
  learning_rate: float = dataclasses.field(default=3e-4, metadata=above(0))
  warmup_steps: int = dataclasses.field(default=100, metadata=at_least(0))
  total_steps: int = dataclasses.field(default=10_000, metadata=at_least(1))
  final_lr_fraction: float = dataclasses.field(default=0.1, metadata=at_least(0))
  b1: float = dataclasses.field(default=0.9, metadata=at_least(0))
  b2: float = dataclasses.field(default=0.95, metadata=at_least(0))
  eps: float = dataclasses.field(default=1e-8, metadata=above(0))
  weight_decay: float = dataclasses.field(default=0.1, metadata=at_least(0))
  clip_norm: float = dataclasses.field(default=1.0, metadata=at_least(0))

  def __post_init__(self):
    check_fields(self)
    if not 0 <= self.warmup_steps < self.total_steps:
      raise ValueError(f"need 0 <= warmup_steps < total_steps, got warmup_steps="
                       f"{self.warmup_steps}, total_steps={self.total_steps}.")
    if self.clip_norm < 0:
      raise ValueError(f"clip_norm must be >= 0 (0 = off), got {self.clip_norm}.")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=config.total_steps,
      end_value=config.learning_rate * config.final_lr_fraction)


def _decay_mask(params):
  """True for every parameter except norm scales, biases (the experts' ``*_bias`` too) and
  attention sinks."""
  decays = lambda key: key not in _NO_DECAY and not key.endswith("_bias")
  return jax.tree_util.tree_map_with_path(
      lambda path, v: v.replace(decays(path[-1].key)), params,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """What the train step applies, in this order: gradients scaled down to global L2 norm
  ``clip_norm`` when they exceed it (0 = no clipping), then ``tx``.

  ``tx`` must be elementwise (each element's update depends on its own gradient, state and
  parameter only, as in Adam): the step applies it to parameter groups and to single layers
  separately. ``schedule`` (the learning rate by update count) is only reported.
  """
  tx: optax.GradientTransformation
  clip_norm: float = 0.0
  schedule: optax.Schedule | None = None


def make_optimizer(config: OptimizerConfig) -> Optimizer:
  """AdamW as ``config`` says; norm scales, biases and attention sinks get no weight decay."""
  schedule = learning_rate_schedule(config)
  tx = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                   weight_decay=config.weight_decay, mask=_decay_mask)
  return Optimizer(tx, config.clip_norm, schedule)


class ParamGroup(NamedTuple):
  """The optimizer state of one group of parameters."""
  tx_state: optax.OptState
  master: nnx.State | None  # float32 copy of the parameters (``master_weights``), else None


class OptimizerState(NamedTuple):
  layers: ParamGroup  # the stacked layer parameters; every leaf has a leading [L] axis
  rest: ParamGroup    # the other parameters


def _is_layer_param(_, x) -> bool:
  return (x.get_metadata().get("logical_axes") or (None,))[0] == LAYER_AXIS


def split_layers(tree: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(stacked layer parameters, the rest) of a parameter (or gradient) state."""
  return nnx.split_state(tree, _is_layer_param, ...)


def _new_group(tx, params, master_weights) -> ParamGroup:
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params) if master_weights else None
  return ParamGroup(tx.init(params if master is None else master), master)


def init_optimizer_state(tx, params, master_weights: bool) -> OptimizerState:
  """The optimizer state of ``params`` (with a float32 master copy if ``master_weights``)."""
  layers, rest = split_layers(params)
  return OptimizerState(jax.vmap(lambda p: _new_group(tx, p, master_weights))(layers),
                        _new_group(tx, rest, master_weights))


def _update_group(tx, grads, params, group: ParamGroup, *, scale, apply):
  """One optimizer update of a parameter group (or of one layer of one): gradients times
  ``scale`` (the clipping factor), then ``tx`` on the master weights if there are any, else on
  the parameters. When ``apply`` is False, parameters and state come back unchanged."""
  def update(grads, params, group):
    weights = params if group.master is None else group.master
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype) * scale.astype(w.dtype), grads, weights)
    updates, tx_state = tx.update(grads, group.tx_state, weights)
    weights = optax.apply_updates(weights, updates)
    if group.master is None:
      return weights, ParamGroup(tx_state, None)
    rounded = jax.tree.map(lambda w, p: w.astype(p.dtype), weights, params)
    return rounded, ParamGroup(tx_state, weights)

  # A conditional, not a select of new and old values: those would both be live at once.
  return jax.lax.cond(apply, update, lambda _, params, group: (params, group), grads, params,
                      group)


def _take_layer(tree, i):
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), tree)


def _put_layer(tree, new, i):
  return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0), tree, new)


def _num_layers(tree) -> int:
  return jax.tree.leaves(tree)[0].shape[0]


def global_norm(grads, *, layer_shardings=None):
  """Global L2 norm of the gradients in float32. With ``layer_shardings`` (the stacked layer
  gradients are in host memory) they come to the device one layer at a time."""
  if layer_shardings is None:
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
  squares = lambda tree: sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                             for g in jax.tree.leaves(tree))
  layers, rest = split_layers(grads)
  to_device = sharding.layer_slice(layer_shardings)
  total = jax.lax.fori_loop(
      0, _num_layers(layers),
      lambda i, total: total + squares(jax.device_put(_take_layer(layers, i), to_device)),
      squares(rest))
  return jnp.sqrt(total)


def apply_update(tx, grads, params, opt_state: OptimizerState, *, scale, apply,
                 param_shardings, opt_shardings: OptimizerState, offload_optimizer: bool,
                 offload_params: bool):
  """Updated (params, opt_state). On the device: all layers at once (``vmap``). Offloaded:
  one layer at a time, each layer's state (and with ``offload_params`` its parameters and
  gradient) copied to the device and back. ``param_shardings``, ``opt_shardings``: those of
  ``params`` and ``opt_state``, all in device memory."""
  update = functools.partial(_update_group, tx, scale=scale, apply=apply)
  (grads_layers, grads_rest), (params_layers, params_rest) = map(split_layers, (grads, params))
  layers, rest = opt_state
  if not offload_optimizer:
    params_layers, layers = jax.vmap(update)(grads_layers, params_layers, layers)
    params_rest, rest = update(grads_rest, params_rest, rest)
    return nnx.merge_state(params_layers, params_rest), OptimizerState(layers, rest)

  layer_opt_shardings = opt_shardings.layers
  layer_param_shardings = split_layers(param_shardings)[0]
  params_kind = "pinned_host" if offload_params else "device"

  # A loop that carries the stacked arrays and writes each layer back in place (a
  # ``lax.map`` would build new stacked outputs beside the old ones).
  def one_layer(i, carry):
    params_layers, layers = carry
    on_device = lambda tree, shardings: jax.device_put(_take_layer(tree, i),
                                                       sharding.layer_slice(shardings))
    p, group = update(on_device(grads_layers, layer_param_shardings),
                      on_device(params_layers, layer_param_shardings),
                      on_device(layers, layer_opt_shardings))
    p = jax.device_put(p, sharding.layer_slice(layer_param_shardings, params_kind))
    group = jax.device_put(group, sharding.layer_slice(layer_opt_shardings, "pinned_host"))
    return _put_layer(params_layers, p, i), _put_layer(layers, group, i)

  # The loop's carry starts in host memory also when the step is traced from abstract shapes.
  layers = jax.device_put(layers, sharding.on_host(layer_opt_shardings))
  if offload_params:
    params_layers = jax.device_put(params_layers, sharding.on_host(layer_param_shardings))
  params_layers, layers = jax.lax.fori_loop(0, _num_layers(params_layers), one_layer,
                                            (params_layers, layers))
  params_rest, rest = update(grads_rest, params_rest,
                             jax.device_put(rest, sharding.on_device(opt_shardings.rest)))
  rest = jax.device_put(rest, sharding.on_host(opt_shardings.rest))
  return nnx.merge_state(params_layers, params_rest), OptimizerState(layers, rest)
