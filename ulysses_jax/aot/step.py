"""The train step ``python -m ulysses_jax.train`` would run for a config, built on any devices.

All knowledge of how the trainer turns a config into a step lives in ``build_train_step``:
the same gin files and overrides, the same model, mesh, state layout, offload and
accumulation, through the trainer's own public functions. Nothing is allocated: the state and
batch are ``ShapeDtypeStruct``s carrying their shardings, ready for ``step.lower(...)``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ulysses_jax import sharding as sharding_lib
from ulysses_jax.mesh import make_mesh
from ulysses_jax.train_step import BATCH_KEYS


class TrainStep(NamedTuple):
  """A jitted step and abstract arguments to lower it with, plus what the report needs."""
  step: object              # jit(step)(state, batch) -> (state, metrics)
  state: object             # TrainState of ShapeDtypeStructs with shardings
  batch: dict               # int32 [B, S] ShapeDtypeStructs, sharded like the trainer's
  mesh: jax.sharding.Mesh
  model_config: object      # LlamaConfig
  tokens_per_step: int
  seq_len: int


def build_train_step(gin_files: list[str], gin_params: list[str],
                     devices: list[jax.Device]) -> TrainStep:
  """The trainer's step for the gin config, on a mesh of ``devices`` (``make_mesh`` with the
  config's ``mesh_data``/``mesh_seq``/``mesh_ring``): ``train.build_train_step``, the function
  the trainer itself runs. Raises ``ValueError`` and friends for a config that the trainer
  would refuse."""
  from ulysses_jax import gin_config, train  # pylint: disable=import-outside-toplevel

  config = gin_config.read(gin_files, gin_params)
  cfg, data_cfg = config.train, config.data
  sequence = cfg.mesh_seq * cfg.mesh_ring
  if cfg.mesh_data == -1:
    wanted, matches = f"a multiple of {sequence}", len(devices) % sequence == 0
  else:
    wanted, matches = str(cfg.mesh_data * sequence), len(devices) == cfg.mesh_data * sequence
  if not matches:
    raise ValueError(f"the config's mesh (TrainConfig.mesh_data={cfg.mesh_data}, mesh_seq="
                     f"{cfg.mesh_seq}, mesh_ring={cfg.mesh_ring}) needs {wanted} GPUs, the "
                     f"topology has {len(devices)}: pick another --topology or override the "
                     f"mesh (--gin_param=TrainConfig.mesh_seq=...)")
  mesh = make_mesh(cfg.mesh_data, cfg.mesh_seq, cfg.mesh_ring, devices=devices)
  _, _, state, step = train.build_train_step(config, mesh)
  batch_sharding = NamedSharding(mesh, sharding_lib.batch_spec(mesh, data_cfg.seq_len))
  batch = {k: jax.ShapeDtypeStruct((data_cfg.batch_size, data_cfg.seq_len), jnp.int32,
                                   sharding=batch_sharding) for k in BATCH_KEYS}
  return TrainStep(step, state, batch, mesh, config.model,
                   data_cfg.batch_size * data_cfg.seq_len, data_cfg.seq_len)

