"""One optimizer step: AdamW, warmup + cosine schedule, global-norm clipping, accumulation.

    model = init_llama(config, mesh)
    tx = make_optimizer(OptimizerConfig(...))
    graphdef, state = init_train_state(model, tx)
    step = make_train_step(graphdef, state, tx, mesh=mesh, seq_len=S)
    state, metrics = step(state, batch)     # state is donated: use the returned one

The state is a ``TrainState`` pytree (step counter, parameters, optax state); parameters,
gradients and Adam moments are all sharded like the parameters (``ulysses_jax.sharding``:
FSDP over every device), the step is jitted with explicit in/out shardings, and the
incoming state's buffers are donated.

With ``offload_optimizer=True`` the optax state (Adam's two moments: twice the parameter
bytes) lives in ``pinned_host`` memory between steps; each step copies it to the device for
the update and back. That trades two host<->device transfers of the moments per step for
their device memory.
"""

import dataclasses
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


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                      eps=config.eps, weight_decay=config.weight_decay, mask=_decay_mask)
  if not config.clip_norm:
    return adamw
  return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)


class TrainState(NamedTuple):
  step: jax.Array           # int32 scalar, replicated
  params: nnx.State         # model parameters (nnx.split(model)[1])
  opt_state: optax.OptState


def _on_host(shardings):
  return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)


def state_shardings(state, mesh: Mesh, *, offload_optimizer: bool = False,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> TrainState:
  """Shardings of a ``TrainState`` (or its ``eval_shape``): FSDP for parameters and optimizer
  state, the latter in ``pinned_host`` memory with ``offload_optimizer``."""
  shardings = sharding.tree_shardings(state, mesh, rules)
  if offload_optimizer:
    shardings = shardings._replace(opt_state=_on_host(shardings.opt_state))
  return shardings


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation,
                     rules: sharding.Rules = sharding.DEFAULT_RULES, *,
                     offload_optimizer: bool = False) -> tuple[nnx.GraphDef, TrainState]:
  """Splits a (sharded) model into its graphdef and a ``TrainState``.

  The optimizer state is created directly in the parameters' sharding (in host memory with
  ``offload_optimizer``). ``model`` must have a ``mesh`` attribute (``Llama`` does).
  """
  graphdef, params = nnx.split(model)
  mesh = model.mesh
  opt_shardings = sharding.tree_shardings(jax.eval_shape(tx.init, params), mesh, rules)
  if offload_optimizer:
    opt_shardings = _on_host(opt_shardings)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
  return graphdef, TrainState(step, params, opt_state)


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


def _schedule_count(opt_state, *, default):
  """The step the optimizer's learning-rate schedule is at: ``optax.apply_if_finite`` keeps
  it (with the whole inner state) on skipped steps, so it can trail the step counter.
  ``default`` for an optimizer without a schedule."""
  in_schedule = lambda path, _: getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"
  return optax.tree_utils.tree_get(opt_state, "count", default, filtering=in_schedule)


def make_train_step(graphdef: nnx.GraphDef, state: TrainState,
                    tx: optax.GradientTransformation, *, mesh: Mesh, seq_len: int,
                    accum_steps: int = 1, z_loss_weight: float = 0.0,
                    schedule: optax.Schedule | None = None,
                    rules: sharding.Rules = sharding.DEFAULT_RULES,
                    offload_optimizer: bool = False):
  """The jitted ``step(state, batch) -> (state, metrics)``.

  Args:
    graphdef: from ``init_train_state``; the model must have a
      ``loss(tokens, labels, positions, segment_ids, z_loss_weight=...)`` method returning
      ``CrossEntropySums`` (``Llama`` does).
    state: a ``TrainState`` (or its ``jax.eval_shape``) fixing the tree structure and so
      the shardings of the state argument and result.
    tx: the optimizer.
    mesh, seq_len: the batch is a dict of int32 ``[B, seq_len]`` arrays (``tokens``,
      ``labels`` and optionally ``positions``, ``segment_ids``; see ``ulysses_jax.data``),
      sharded ``sharding.batch_spec(mesh, seq_len)``.
    accum_steps: gradient accumulation: the B rows are split into ``accum_steps``
      micro-batches run one after another; the update uses the token-weighted mean over all
      of them, exactly as one big batch would.
    z_loss_weight: weight of the z-loss term added to the objective.
    schedule: learning-rate schedule, only to report it in the metrics.
    offload_optimizer: the optax state lives in host memory (``init_train_state`` with the
      same flag); it visits the device only for the update.

  A step whose loss is non-finite hands ``tx`` all-NaN gradients (wrap ``tx`` in
  ``optax.apply_if_finite`` to skip such steps, as ``ulysses_jax.train`` does).

  Metrics (replicated float32 scalars): ``loss`` (mean cross-entropy over valid tokens),
  ``z_loss``, ``grad_norm`` (before clipping; NaN when the loss is non-finite), ``tokens``
  (valid labels), and ``learning_rate`` when ``schedule`` is given.
  """
  if accum_steps < 1:
    raise ValueError(f"accum_steps must be >= 1, got {accum_steps}.")
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

      def accumulate(carry, micro):
        grads, sums = grad_fn(current.params, micro, total_count)
        return jax.tree.map(jnp.add, carry, (grads, sums)), None

      zero_grads = jax.lax.with_sharding_constraint(
          jax.tree.map(jnp.zeros_like, current.params), param_shardings)
      zero_sums = CrossEntropySums(*(jnp.zeros((), jnp.float32) for _ in range(3)))
      (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), micros)
    # The gradient of a non-finite loss means nothing even where it is finite: make it NaN,
    # so the one finiteness check on gradients (``optax.apply_if_finite`` in
    # ``ulysses_jax.train``) skips and counts both kinds of bad step.
    loss_finite = jnp.isfinite(sums.loss + sums.z_loss)
    grads = jax.tree.map(lambda g: jnp.where(loss_finite, g, jnp.nan), grads)
    opt_state = current.opt_state
    if offload_optimizer:
      opt_state = jax.device_put(opt_state, device_opt_shardings)
    schedule_step = _schedule_count(opt_state, default=current.step)
    updates, opt_state = tx.update(grads, opt_state, current.params)
    if offload_optimizer:
      opt_state = jax.device_put(opt_state, shardings.opt_state)
    params = optax.apply_updates(current.params, updates)
    count = jnp.maximum(sums.count, 1.0)
    metrics = {"loss": sums.loss / count, "z_loss": sums.z_loss / count,
               "grad_norm": optax.tree.norm(grads), "tokens": sums.count}
    if schedule is not None:
      metrics["learning_rate"] = jnp.asarray(schedule(schedule_step), jnp.float32)
    return TrainState(current.step + 1, params, opt_state), metrics

  shardings = state_shardings(state, mesh, offload_optimizer=offload_optimizer, rules=rules)
  device_opt_shardings = sharding.tree_shardings(state.opt_state, mesh, rules)
  return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, batch_spec)),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
