"""One optimizer step: AdamW, warmup + cosine schedule, global-norm clipping, accumulation,
non-finite steps skipped; optionally float32 master weights and the optimizer state in host
memory, updated one layer at a time.

    model = init_llama(config, mesh)
    optimizer = make_optimizer(OptimizerConfig(...))
    graphdef, state = init_train_state(model, optimizer)
    step = make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=S)
    state, metrics = step(state, batch)     # state is donated: use the returned one

Parameters, gradients and optimizer state are sharded like the parameters (FSDP over every
device, ``ulysses_jax.sharding``); the step is jitted with explicit in/out shardings and
donates the incoming state.

The optimizer state comes in two groups (``OptimizerState``): the stacked layer parameters
(leading ``[L]`` axis, logical name ``"layers"``), whose optax state is made by ``vmap`` over
that axis, and the rest (embedding, head, final norm). So the update can run over all layers
at once (``vmap``) or one layer at a time (a loop) with the same state and arithmetic.

Memory options (``init_train_state`` and ``make_train_step`` take the same flags):

* ``master_weights``: parameters stored in a lower precision (``LlamaConfig.param_dtype=
  "bfloat16"``) get a float32 copy that the optimizer updates (its moments are float32 too);
  the model's parameters are that copy rounded after every step, so updates smaller than a
  bfloat16 step still accumulate.
* ``offload_optimizer``: the optimizer state (master weights included) lives in
  ``pinned_host`` memory. The update streams it: one layer's state comes to the device, is
  updated and written back in place before the next (a ``fori_loop``), so the device holds
  one layer's state at a time instead of all of it. The other parameters' state visits the
  device whole.
* ``offload_params`` (with ``offload_optimizer``): the stacked layer parameters live in
  ``pinned_host`` memory too, and so do their gradients. The model copies each layer's
  weights to the device when it runs the layer (``models.llama``), the backward writes each
  layer's gradient back to the host as it is made, and the gradient norm and the update
  stream them a layer at a time. The device keeps only the embedding, head and final norm of
  the parameters (ZeRO-Infinity's parameter offload, for one GPU at very long sequences).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax import sharding
from ulysses_jax.loss import IGNORE_LABEL, CrossEntropySums
from ulysses_jax.mesh import DATA

BATCH_KEYS = ("tokens", "labels", "positions", "segment_ids")
_NO_DECAY = ("scale", "bias")
LAYER_AXIS = "layers"  # logical name of the stacked-layer axis (models.llama)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup to ``learning_rate`` then cosine decay to
  ``learning_rate * final_lr_fraction`` at ``total_steps``; gradients clipped to global norm
  ``clip_norm`` (0 = no clipping). Norm scales and biases get no weight decay."""
  learning_rate: float = 3e-4
  warmup_steps: int = 100
  total_steps: int = 10_000
  final_lr_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0

  def __post_init__(self):
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
  """True for every parameter except norm scales and biases."""
  return jax.tree_util.tree_map_with_path(
      lambda path, v: v.replace(path[-1].key not in _NO_DECAY), params,
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
  """AdamW as ``config`` says; norm scales and biases get no weight decay."""
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


class TrainState(NamedTuple):
  step: jax.Array                # int32 scalar, replicated: steps taken, skipped ones included
  params: nnx.State              # model parameters (nnx.split(model)[1])
  opt_state: OptimizerState
  nonfinite_steps: jax.Array     # int32 scalar: steps skipped for a non-finite loss/gradient
  nonfinite_in_a_row: jax.Array  # int32 scalar: how many of those came last, in a row


def _is_layer_param(_, x) -> bool:
  return (x.get_metadata().get("logical_axes") or (None,))[0] == LAYER_AXIS


def split_layers(tree: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(stacked layer parameters, the rest) of a parameter (or gradient) state."""
  return nnx.split_state(tree, _is_layer_param, ...)


def _new_group(tx, params, master_weights) -> ParamGroup:
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params) if master_weights else None
  return ParamGroup(tx.init(params if master is None else master), master)


def _init_optimizer_state(tx, params, master_weights) -> OptimizerState:
  layers, rest = split_layers(params)
  return OptimizerState(jax.vmap(lambda p: _new_group(tx, p, master_weights))(layers),
                        _new_group(tx, rest, master_weights))


def _on_host(shardings):
  return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)


def _layers_on_host(param_shardings):
  """Parameter shardings with the stacked layer parameters' in ``pinned_host`` memory."""
  layers, rest = split_layers(param_shardings)
  return nnx.merge_state(_on_host(layers), rest)


def _check_offload(offload_optimizer, offload_params):
  if offload_params and not offload_optimizer:
    raise ValueError("offload_params=True needs offload_optimizer=True: the parameters' "
                     "optimizer state is larger than they are, so it moves to the host first.")


def state_shardings(state, mesh: Mesh, *, offload_optimizer: bool = False,
                    offload_params: bool = False,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> TrainState:
  """Shardings of a ``TrainState`` (or its ``eval_shape``): FSDP for parameters and optimizer
  state, the latter in ``pinned_host`` memory with ``offload_optimizer``, and the stacked
  layer parameters too with ``offload_params``."""
  _check_offload(offload_optimizer, offload_params)
  shardings = sharding.tree_shardings(state, mesh, rules)
  if offload_optimizer:
    shardings = shardings._replace(opt_state=_on_host(shardings.opt_state))
  if offload_params:
    shardings = shardings._replace(params=_layers_on_host(shardings.params))
  return shardings


def _check_master_weights(params, master_weights):
  dtypes = {x.dtype.name for x in jax.tree.leaves(params)}
  if master_weights and dtypes == {"float32"}:
    raise ValueError("master_weights=True keeps a float32 copy of lower-precision "
                     "parameters, but the parameters are float32 already; set "
                     "LlamaConfig.param_dtype='bfloat16' or drop master_weights.")


def init_train_state(model: nnx.Module, optimizer: Optimizer,
                     rules: sharding.Rules = sharding.DEFAULT_RULES, *,
                     offload_optimizer: bool = False, offload_params: bool = False,
                     master_weights: bool = False) -> tuple[nnx.GraphDef, TrainState]:
  """Splits a (sharded) model into its graphdef and a ``TrainState``.

  The optimizer state (and with ``master_weights`` the float32 copy of the parameters) is
  created directly in the parameters' sharding, in host memory with ``offload_optimizer``;
  with ``offload_params`` the stacked layer parameters move to host memory too.
  ``model`` must have a ``mesh`` attribute (``Llama`` does).
  """
  _check_offload(offload_optimizer, offload_params)
  graphdef, params = nnx.split(model)
  _check_master_weights(params, master_weights)
  mesh = model.mesh
  init = lambda p: _init_optimizer_state(optimizer.tx, p, master_weights)
  opt_shardings = sharding.tree_shardings(jax.eval_shape(init, params), mesh, rules)
  if offload_optimizer:
    opt_shardings = _on_host(opt_shardings)
  opt_state = jax.jit(init, out_shardings=opt_shardings)(params)
  if offload_params:
    params = jax.device_put(params, _layers_on_host(sharding.tree_shardings(params, mesh,
                                                                            rules)))
  zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
  return graphdef, TrainState(zero(), params, opt_state, zero(), zero())


def _check_batch(batch, *, mesh, seq_len, accum_steps):
  missing = [k for k in ("tokens", "labels") if k not in batch]
  unknown = [k for k in batch if k not in BATCH_KEYS]
  if missing or unknown:
    raise ValueError(f"batch needs keys tokens, labels (optional: positions, segment_ids); "
                     f"missing {missing}, unknown {unknown}.")
  shapes = {k: tuple(v.shape) for k, v in batch.items()}
  b = shapes["tokens"][0]
  if len(set(shapes.values())) != 1 or shapes["tokens"] != (b, seq_len):
    raise ValueError(f"every batch array must be [batch, seq_len={seq_len}], got {shapes}.")
  if b % (accum_steps * mesh.shape[DATA]):
    raise ValueError(f"batch size {b} must be divisible by accum_steps ({accum_steps}) x the "
                     f"data axis ({mesh.shape[DATA]}); change one of them.")


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


def _float32_norm(grads, *, layer_shardings=None):
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


def _update(tx, grads, params, opt_state: OptimizerState, *, scale, apply, shardings: TrainState,
            offload_optimizer, offload_params):
  """Updated (params, opt_state). On the device: all layers at once (``vmap``). Offloaded:
  one layer at a time, each layer's state (and with ``offload_params`` its parameters and
  gradient) copied to the device and back. ``shardings``: the state's, all on the device."""
  update = functools.partial(_update_group, tx, scale=scale, apply=apply)
  (grads_layers, grads_rest), (params_layers, params_rest) = map(split_layers, (grads, params))
  layers, rest = opt_state
  if not offload_optimizer:
    params_layers, layers = jax.vmap(update)(grads_layers, params_layers, layers)
    params_rest, rest = update(grads_rest, params_rest, rest)
    return nnx.merge_state(params_layers, params_rest), OptimizerState(layers, rest)

  opt_shardings = shardings.opt_state.layers
  param_shardings = split_layers(shardings.params)[0]
  params_kind = "pinned_host" if offload_params else "device"

  # A loop that carries the stacked arrays and writes each layer back in place (a
  # ``lax.map`` would build new stacked outputs beside the old ones).
  def one_layer(i, carry):
    params_layers, layers = carry
    on_device = lambda tree, shardings: jax.device_put(_take_layer(tree, i),
                                                       sharding.layer_slice(shardings))
    p, group = update(on_device(grads_layers, param_shardings),
                      on_device(params_layers, param_shardings),
                      on_device(layers, opt_shardings))
    p = jax.device_put(p, sharding.layer_slice(param_shardings, params_kind))
    group = jax.device_put(group, sharding.layer_slice(opt_shardings, "pinned_host"))
    return _put_layer(params_layers, p, i), _put_layer(layers, group, i)

  # The loop's carry starts in host memory also when the step is traced from abstract shapes.
  layers = jax.device_put(layers, _on_host(opt_shardings))
  if offload_params:
    params_layers = jax.device_put(params_layers, _on_host(param_shardings))
  params_layers, layers = jax.lax.fori_loop(0, _num_layers(params_layers), one_layer,
                                            (params_layers, layers))
  params_rest, rest = update(grads_rest, params_rest,
                             jax.device_put(rest, shardings.opt_state.rest))
  rest = jax.device_put(rest, _on_host(shardings.opt_state.rest))
  return nnx.merge_state(params_layers, params_rest), OptimizerState(layers, rest)


def make_train_step(graphdef: nnx.GraphDef, state: TrainState, optimizer: Optimizer, *,
                    mesh: Mesh, seq_len: int, accum_steps: int = 1, z_loss_weight: float = 0.0,
                    rules: sharding.Rules = sharding.DEFAULT_RULES,
                    offload_optimizer: bool = False, offload_params: bool = False):
  """The jitted ``step(state, batch) -> (state, metrics)``.

  Args:
    graphdef: from ``init_train_state``; the model must have a
      ``loss(tokens, labels, positions, segment_ids, z_loss_weight=...)`` method returning
      ``CrossEntropySums`` (``Llama`` does).
    state: a ``TrainState`` (or its ``jax.eval_shape``) fixing the tree structure and so
      the shardings of the state argument and result (master weights or not).
    optimizer: from ``make_optimizer`` (the one ``init_train_state`` was given).
    mesh, seq_len: the batch is a dict of int32 ``[B, seq_len]`` arrays (``tokens``,
      ``labels`` and optionally ``positions``, ``segment_ids``; see ``ulysses_jax.data``),
      sharded ``sharding.batch_spec(mesh, seq_len)``.
    accum_steps: gradient accumulation: the B rows are split into ``accum_steps``
      micro-batches run one after another; the update uses the token-weighted mean over all
      of them, exactly as one big batch would, their gradients summed in float32.
    z_loss_weight: weight of the z-loss term added to the objective.
    offload_optimizer: the optimizer state lives in host memory (``init_train_state`` with
      the same flag) and is updated one layer at a time.
    offload_params: the stacked layer parameters and their gradients live in host memory
      too (``init_train_state`` with the same flag; needs ``accum_steps=1``).

  A step whose loss or gradient norm is not finite changes neither parameters nor optimizer
  state; it counts in ``TrainState.nonfinite_steps`` (and ``nonfinite_in_a_row``) and does
  not advance the learning-rate schedule.

  Metrics (replicated float32 scalars): ``loss`` (mean cross-entropy over valid tokens),
  ``z_loss``, ``grad_norm`` (before clipping), ``tokens`` (valid labels), and
  ``learning_rate`` when the optimizer has a schedule.
  """
  if accum_steps < 1:
    raise ValueError(f"accum_steps must be >= 1, got {accum_steps}.")
  if offload_params and accum_steps > 1:
    raise ValueError(f"offload_params=True keeps the gradients in host memory, where they "
                     f"cannot be summed over micro-batches: use accum_steps=1 (got "
                     f"{accum_steps}) or offload_params=False.")
  batch_spec = sharding.batch_spec(mesh, seq_len)

  def objective(params, micro, total_count):
    sums = nnx.merge(graphdef, params).loss(
        micro["tokens"], micro["labels"], micro.get("positions"), micro.get("segment_ids"),
        z_loss_weight=z_loss_weight)
    return (sums.loss + sums.z_loss) / jnp.maximum(total_count, 1.0), sums

  grad_fn = jax.grad(objective, has_aux=True)

  def step(current: TrainState, batch):
    _check_batch(batch, mesh=mesh, seq_len=seq_len, accum_steps=accum_steps)
    total_count = jnp.sum(batch["labels"] != IGNORE_LABEL, dtype=jnp.float32)
    if accum_steps == 1:
      grads, sums = grad_fn(current.params, batch, total_count)
    else:
      # Micro-batch i takes rows i, i + A, ...: every data shard contributes to each.
      b = batch["tokens"].shape[0]
      micro_spec = NamedSharding(mesh, P(None, *batch_spec))
      micros = {k: jax.lax.with_sharding_constraint(
          v.reshape(b // accum_steps, accum_steps, seq_len).swapaxes(0, 1), micro_spec)
                for k, v in batch.items()}
      param_shardings = sharding.tree_shardings(current.params, mesh, rules)

      # The sum is float32 whatever the parameter dtype: a bfloat16 sum would round at every
      # micro-batch, and the optimizer takes float32 gradients (master weights) or rounds once.
      def accumulate(carry, micro):
        grads, sums = grad_fn(current.params, micro, total_count)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return jax.tree.map(jnp.add, carry, (grads, sums)), None

      zero_grads = jax.lax.with_sharding_constraint(
          jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), current.params),
          param_shardings)
      zero_sums = CrossEntropySums(*(jnp.zeros((), jnp.float32) for _ in range(3)))
      (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), micros)
    grad_norm = _float32_norm(grads, layer_shardings=(
        split_layers(device_shardings.params)[0] if offload_params else None))
    finite = jnp.isfinite(sums.loss + sums.z_loss) & jnp.isfinite(grad_norm)
    scale = (jnp.minimum(1.0, optimizer.clip_norm / grad_norm) if optimizer.clip_norm
             else jnp.ones((), jnp.float32))
    params, opt_state = _update(optimizer.tx, grads, current.params, current.opt_state,
                                scale=scale, apply=finite, shardings=device_shardings,
                                offload_optimizer=offload_optimizer,
                                offload_params=offload_params)
    count = jnp.maximum(sums.count, 1.0)
    metrics = {"loss": sums.loss / count, "z_loss": sums.z_loss / count,
               "grad_norm": grad_norm, "tokens": sums.count}
    if optimizer.schedule is not None:  # skipped steps did not advance it
      updates_done = current.step - current.nonfinite_steps
      metrics["learning_rate"] = jnp.asarray(optimizer.schedule(updates_done), jnp.float32)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    return TrainState(current.step + 1, params, opt_state, current.nonfinite_steps + skipped,
                      (current.nonfinite_in_a_row + 1) * skipped), metrics

  shardings = state_shardings(state, mesh, offload_optimizer=offload_optimizer,
                              offload_params=offload_params, rules=rules)
  device_shardings = sharding.tree_shardings(state, mesh, rules)
  return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, batch_spec)),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
