"""One training step: loss and gradients (accumulated over micro-batches if asked), global
norm, clipping, the optimizer update (``ulysses_jax.optimizer``), non-finite steps skipped;
optionally float32 master weights and the optimizer state and layer parameters in host memory.

    model = init_llama(config, mesh)
    optimizer = make_optimizer(OptimizerConfig(...))      # ulysses_jax.optimizer
    graphdef, state = init_train_state(model, optimizer)
    step = make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=S)
    state, metrics = step(state, batch)     # state is donated: use the returned one

Parameters, gradients and optimizer state are sharded like the parameters (FSDP over every
device, ``ulysses_jax.sharding``); the step is jitted with explicit in/out shardings and
donates the incoming state.

Memory options: ``MemoryOptions`` (one value, checked once, given whole to
``init_train_state``, ``state_shardings`` and ``make_train_step``).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax import sharding
from ulysses_jax.loss import IGNORE_LABEL
from ulysses_jax.mesh import DATA
from ulysses_jax.optimizer import (Optimizer, OptimizerState, apply_update, global_norm,
                                   init_optimizer_state, split_layers)

BATCH_KEYS = ("tokens", "labels", "positions", "segment_ids")


class TrainState(NamedTuple):
  step: jax.Array                # int32 scalar, replicated: steps taken, skipped ones included
  params: nnx.State              # model parameters (nnx.split(model)[1])
  opt_state: OptimizerState
  nonfinite_steps: jax.Array     # int32 scalar: steps skipped for a non-finite loss/gradient
  nonfinite_in_a_row: jax.Array  # int32 scalar: how many of those came last, in a row


def _layers_on_host(param_shardings):
  """Parameter shardings with the stacked layer parameters' in ``pinned_host`` memory."""
  layers, rest = split_layers(param_shardings)
  return nnx.merge_state(sharding.on_host(layers), rest)


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
  """Where the train state lives and in which precision the optimizer updates it.

  * ``master_weights``: parameters stored in a lower precision (``LlamaConfig.param_dtype=
    "bfloat16"``) get a float32 copy that the optimizer updates (its moments are float32
    too); the model's parameters are that copy rounded after every step, so updates smaller
    than a bfloat16 step still accumulate.
  * ``offload_optimizer``: the optimizer state (master weights included) lives in
    ``pinned_host`` memory. The update streams it: one layer's state comes to the device, is
    updated and written back in place before the next (a ``fori_loop``), so the device holds
    one layer's state at a time instead of all of it. The other parameters' state visits the
    device whole.
  * ``offload_params`` (needs ``offload_optimizer``): the stacked layer parameters live in
    ``pinned_host`` memory too, and so do their gradients. The model copies each layer's
    weights to the device when it runs the layer (``models.llama``), the backward writes each
    layer's gradient back to the host as it is made, and the gradient norm and the update
    stream them a layer at a time. The device keeps only the embedding, head and final norm
    of the parameters (ZeRO-Infinity's parameter offload, for one GPU at very long
    sequences). Gradients on the host cannot be summed over micro-batches: no accumulation.
  """
  offload_optimizer: bool = False
  offload_params: bool = False
  master_weights: bool = False

  def __post_init__(self):
    if self.offload_params and not self.offload_optimizer:
      raise ValueError("offload_params=True needs offload_optimizer=True: the parameters' "
                       "optimizer state is larger than they are, so it moves to the host "
                       "first.")

  def check_accum_steps(self, accum_steps: int):
    if self.offload_params and accum_steps != 1:
      raise ValueError(f"offload_params=True keeps the gradients in host memory, where they "
                       f"cannot be summed over micro-batches: use accum_steps=1 (got "
                       f"{accum_steps}) or offload_params=False.")


def state_shardings(state, mesh: Mesh, *, memory: MemoryOptions | None = None,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> TrainState:
  """Shardings of a ``TrainState`` (or its ``eval_shape``): FSDP for parameters and optimizer
  state, the latter in ``pinned_host`` memory with ``memory.offload_optimizer``, and the
  stacked layer parameters too with ``memory.offload_params``."""
  memory = memory or MemoryOptions()
  shardings = sharding.tree_shardings(state, mesh, rules)
  if memory.offload_optimizer:
    shardings = shardings._replace(opt_state=sharding.on_host(shardings.opt_state))
  if memory.offload_params:
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
                     memory: MemoryOptions | None = None) -> tuple[nnx.GraphDef, TrainState]:
  """Splits a (sharded) model into its graphdef and a ``TrainState``.

  The optimizer state (and with ``memory.master_weights`` the float32 copy of the
  parameters) is created directly in the parameters' sharding, in host memory with
  ``memory.offload_optimizer``; with ``memory.offload_params`` the stacked layer parameters
  move to host memory too. ``model`` must have a ``mesh`` attribute (``Llama`` does).
  """
  memory = memory or MemoryOptions()
  graphdef, params = nnx.split(model)
  _check_master_weights(params, memory.master_weights)
  mesh = model.mesh
  init = lambda p: init_optimizer_state(optimizer.tx, p, memory.master_weights)
  opt_shardings = sharding.tree_shardings(jax.eval_shape(init, params), mesh, rules)
  if memory.offload_optimizer:
    opt_shardings = sharding.on_host(opt_shardings)
  opt_state = jax.jit(init, out_shardings=opt_shardings)(params)
  if memory.offload_params:
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


def make_train_step(graphdef: nnx.GraphDef, state: TrainState, optimizer: Optimizer, *,
                    mesh: Mesh, seq_len: int, accum_steps: int = 1, z_loss_weight: float = 0.0,
                    rules: sharding.Rules = sharding.DEFAULT_RULES,
                    memory: MemoryOptions | None = None):
  """The jitted ``step(state, batch) -> (state, metrics)``.

  Args:
    graphdef: from ``init_train_state``; the model must have a
      ``loss(tokens, labels, positions, segment_ids, z_loss_weight=...)`` method returning
      ``CrossEntropySums`` (``Llama`` does).
    state: a ``TrainState`` (or its ``jax.eval_shape``) fixing the tree structure and so
      the shardings of the state argument and result (master weights or not).
    optimizer: from ``make_optimizer`` (the one ``init_train_state`` was given).
    mesh, seq_len: the batch is a dict of int32 ``[B, seq_len]`` arrays (``tokens``,
      ``labels`` and optionally ``positions``, ``segment_ids``; see ``ulysses_jax.data.pipeline``),
      sharded ``sharding.batch_spec(mesh, seq_len)``.
    accum_steps: gradient accumulation: the B rows are split into ``accum_steps``
      micro-batches run one after another; the update uses the token-weighted mean over all
      of them, exactly as one big batch would, their gradients summed in float32.
    z_loss_weight: weight of the z-loss term added to the objective.
    memory: the ``MemoryOptions`` ``init_train_state`` was given (where the state lives:
      the update streams offloaded state a layer at a time).

  A step whose loss or gradient norm is not finite changes neither parameters nor optimizer
  state; it counts in ``TrainState.nonfinite_steps`` (and ``nonfinite_in_a_row``) and does
  not advance the learning-rate schedule.

  Metrics (replicated float32 scalars): ``loss`` (mean cross-entropy over valid tokens),
  ``z_loss``, ``grad_norm`` (before clipping), ``tokens`` (valid labels), and
  ``learning_rate`` when the optimizer has a schedule. A mixture of experts adds
  ``router_aux_loss`` (the load-balancing loss, unweighted; the objective adds it times
  ``LlamaConfig.router_aux_loss_coef``, per micro-batch) and, for each MoE layer i,
  ``expert_share_min/layer_i`` and ``expert_share_max/layer_i``: the share of its routed
  (token, expert) pairs that its idlest and busiest expert got (1/X when balanced).
  """
  if accum_steps < 1:
    raise ValueError(f"accum_steps must be >= 1, got {accum_steps}.")
  memory = memory or MemoryOptions()
  memory.check_accum_steps(accum_steps)
  batch_spec = sharding.batch_spec(mesh, seq_len)

  model_config = getattr(nnx.merge(graphdef, state.params), "config", None)
  aux_weight = getattr(model_config, "router_aux_loss_coef", 0.0) / accum_steps
  sparse_layers = [i for i, sparse in enumerate(getattr(model_config, "sparse_layers",
                                                        lambda: ())()) if sparse]

  def objective(params, micro, total_count):
    sums = nnx.merge(graphdef, params).loss(
        micro["tokens"], micro["labels"], micro.get("positions"), micro.get("segment_ids"),
        z_loss_weight=z_loss_weight)
    return ((sums.loss + sums.z_loss) / jnp.maximum(total_count, 1.0)
            + aux_weight * sums.router_aux), sums

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
      zero_sums = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
          lambda: grad_fn(current.params, jax.tree.map(lambda v: v[0], micros), total_count)[1]))
      (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), micros)
    grad_norm = global_norm(grads, layer_shardings=(
        split_layers(device_shardings.params)[0] if memory.offload_params else None))
    finite = jnp.isfinite(sums.loss + sums.z_loss) & jnp.isfinite(grad_norm)
    scale = (jnp.minimum(1.0, optimizer.clip_norm / grad_norm) if optimizer.clip_norm
             else jnp.ones((), jnp.float32))
    params, opt_state = apply_update(
        optimizer.tx, grads, current.params, current.opt_state, scale=scale, apply=finite,
        param_shardings=device_shardings.params, opt_shardings=device_shardings.opt_state,
        offload_optimizer=memory.offload_optimizer, offload_params=memory.offload_params)
    count = jnp.maximum(sums.count, 1.0)
    metrics = {"loss": sums.loss / count, "z_loss": sums.z_loss / count,
               "grad_norm": grad_norm, "tokens": sums.count}
    if sparse_layers:  # each MoE layer's busiest and idlest expert's share of its tokens
      counts = sums.expert_counts[jnp.array(sparse_layers)]
      share = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
      metrics["router_aux_loss"] = sums.router_aux / accum_steps
      for j, layer in enumerate(sparse_layers):
        metrics[f"expert_share_min/layer_{layer:02d}"] = share[j].min()
        metrics[f"expert_share_max/layer_{layer:02d}"] = share[j].max()
    if optimizer.schedule is not None:  # skipped steps did not advance it
      updates_done = current.step - current.nonfinite_steps
      metrics["learning_rate"] = jnp.asarray(optimizer.schedule(updates_done), jnp.float32)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    return TrainState(current.step + 1, params, opt_state, current.nonfinite_steps + skipped,
                      (current.nonfinite_in_a_row + 1) * skipped), metrics

  shardings = state_shardings(state, mesh, memory=memory, rules=rules)
  device_shardings = sharding.tree_shardings(state, mesh, rules)
  return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, batch_spec)),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
