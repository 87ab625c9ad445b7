"""From a ``RunConfig`` to the train step it runs: the one builder that the trainer, ``aot``,
``evaluate``, the doctor and the benchmarks share. No gin here: callers hand over a
``RunConfig`` (the command lines read theirs from gin files, ``ulysses_jax.cli.gin_config``).

* ``resolve(config, workdir)``: the config with the model the run builds. With
  ``TrainConfig.init_from`` the model's shapes come from that checkpoint or, when ``workdir``
  holds checkpoints of the run, from the newest of them (a resumed run never reads
  ``init_from``, which may since have moved). What ``config.model`` sets applies on top
  (``finetune.model_config``: the architecture fields must agree with the checkpoint). So
  ``train.train(workdir, RunConfig(train=TrainConfig(init_from=DIR)))`` from Python builds the
  checkpoint's model, as the command line does.
* ``run_mesh(train_config, devices)``: the run's mesh, and the one check that it fits the
  devices.
* ``build_train_step(config, mesh)``: a ``TrainStep``: the jitted step with its abstract state
  and batch (``ShapeDtypeStruct``s carrying their shardings, ready for ``step.lower``), what
  ``train`` runs and ``aot`` compiles for GPUs it does not have.
* ``initial_state(built)``: the state the first step starts from (``init_from``'s weights or
  a random init).
"""

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ulysses_jax.hf import init_from as finetune
from ulysses_jax import sharding as sharding_lib
from ulysses_jax.checkpoint import read_run_config
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.models.llama import init_llama
from ulysses_jax.optimizer import make_optimizer
from ulysses_jax.run_config import RunConfig, TrainConfig
from ulysses_jax.train_step import (BATCH_KEYS, TrainState, init_train_state, make_train_step,
                                    state_shardings)


def resolve(config: RunConfig, workdir: str | None = None, *,
            given: Mapping[str, object] | None = None) -> RunConfig:
  """``config`` with the model its run builds (see the module docstring).

  ``given``: the ``LlamaConfig`` fields the user set, name -> value (the command line passes
  those bound in gin). Default: the fields of ``config.model`` that differ from
  ``LlamaConfig()``'s, unless ``config.model`` has the checkpoint's architecture already
  (resolved before, or written out in full), which is then taken as it is. Raises
  ``ConfigError`` for a missing checkpoint or a field that contradicts it.
  """
  init_from = config.train.init_from
  if not init_from:
    return config
  source = workdir if workdir and _has_run_config(workdir) else init_from
  if given is None:
    if _architecture(config.model) == _architecture(finetune.model_config(source)):
      return config
    default = LlamaConfig()
    given = {f.name: getattr(config.model, f.name) for f in dataclasses.fields(LlamaConfig)
             if getattr(config.model, f.name) != getattr(default, f.name)}
  return dataclasses.replace(config, model=finetune.model_config(source, given))


def _architecture(model: LlamaConfig) -> tuple:
  return tuple(getattr(model, name) for name in finetune.ARCHITECTURE_FIELDS)


def _has_run_config(workdir: str) -> bool:
  checkpoints = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(checkpoints):
    return False
  try:
    read_run_config(checkpoints)
  except Exception:  # pylint: disable=broad-except  # no step yet, or one saved without it
    return False
  return True


def run_mesh(train: TrainConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """``make_mesh(mesh_data, mesh_seq, mesh_ring)`` over ``devices`` (default: all of JAX's).
  Raises ``ConfigError`` naming the config's fields when the devices do not make that mesh."""
  devices = list(jax.devices() if devices is None else devices)
  sequence = train.mesh_seq * train.mesh_ring
  mesh = f"mesh data={train.mesh_data} x seq={train.mesh_seq}" + (
      f" x ring={train.mesh_ring}" if train.mesh_ring > 1 else "")
  if train.mesh_data == -1 and len(devices) % sequence:
    raise ConfigError(f"{mesh} needs a multiple of {sequence} devices but {len(devices)} are "
                      f"available: pick TrainConfig.mesh_seq (x mesh_ring) from the divisors "
                      f"of {len(devices)}, or other devices")
  if train.mesh_data != -1 and train.mesh_data * sequence != len(devices):
    raise ConfigError(f"{mesh} needs {train.mesh_data * sequence} devices but {len(devices)} "
                      f"are available: set TrainConfig.mesh_data=-1 to take the devices that "
                      f"mesh_seq x mesh_ring leave, or change the mesh or the devices")
  return make_mesh(train.mesh_data, train.mesh_seq, train.mesh_ring, devices=devices)


class TrainStep(NamedTuple):
  """A jitted step and the abstract arguments to lower it with, and what made them."""
  step: object              # jit(step)(state, batch) -> (state, metrics); donates the state
  state: TrainState         # of ShapeDtypeStructs with their shardings
  batch: dict               # int32 [B, S] ShapeDtypeStructs, sharded as the trainer's batches
  mesh: Mesh
  config: RunConfig         # resolved: the model is the one built
  optimizer: object         # optimizer.Optimizer
  graphdef: nnx.GraphDef

  @property
  def model_config(self) -> LlamaConfig:
    return self.config.model

  @property
  def seq_len(self) -> int:
    return self.config.data.seq_len

  @property
  def tokens_per_step(self) -> int:
    return self.config.data.batch_size * self.config.data.seq_len


def abstract_train_state(model_config: LlamaConfig, mesh: Mesh, optimizer, seed: int = 0,
                         memory=None) -> tuple[nnx.GraphDef, TrainState]:
  """(graphdef, train state as ShapeDtypeStructs carrying their target shardings)."""
  graphdef, shapes = jax.eval_shape(lambda: init_train_state(
      init_llama(model_config, mesh, seed=seed), optimizer, memory=memory))
  shardings = state_shardings(shapes, mesh, memory=memory)
  return graphdef, jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def build_train_step(config: RunConfig, mesh: Mesh, *, workdir: str | None = None) -> TrainStep:
  """The train step of ``config`` (``resolve``d with ``workdir``) on ``mesh``: the same
  model, state layout, offload and accumulation whoever builds it. Nothing is allocated."""
  config = resolve(config, workdir)
  cfg, data = config.train, config.data
  optimizer = make_optimizer(config.optimizer)
  graphdef, state = abstract_train_state(config.model, mesh, optimizer, cfg.seed, cfg.memory)
  step = make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=data.seq_len,
                         accum_steps=cfg.accum_steps, z_loss_weight=cfg.z_loss_weight,
                         memory=cfg.memory)
  batch_sharding = NamedSharding(mesh, sharding_lib.batch_spec(mesh, data.seq_len))
  batch = {k: jax.ShapeDtypeStruct((data.batch_size, data.seq_len), jnp.int32,
                                   sharding=batch_sharding) for k in BATCH_KEYS}
  return TrainStep(step, state, batch, mesh, config, optimizer, graphdef)


def initial_state(built: TrainStep) -> TrainState:
  """The state of step 0, sharded as ``built.state``: ``init_from``'s weights with a fresh
  optimizer, or a random init from ``TrainConfig.seed``."""
  cfg, model_config = built.config.train, built.config.model
  model = (finetune.load_model(cfg.init_from, model_config, built.mesh) if cfg.init_from
           else init_llama(model_config, built.mesh, seed=cfg.seed))
  return init_train_state(model, built.optimizer, memory=cfg.memory)[1]
