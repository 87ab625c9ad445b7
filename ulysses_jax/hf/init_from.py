"""Starting a run from trained weights: a Hugging Face checkpoint or a checkpoint of ours.

``TrainConfig.init_from`` names either

* a Hugging Face checkpoint directory (``config.json`` + safetensors; Llama, Mistral,
  Ministral, Qwen2, Qwen3, Gemma 3 text): loaded with ``hf.load_llama``, tensor by tensor
  into the FSDP layout; or
* a workdir of ours, its ``checkpoints/`` directory, or one step ``checkpoints/<step>``
  (default: the newest step): the parameters of the orbax ``state`` item only (the run
  starts with a fresh optimizer), read slice by slice (``SavedParams``) straight into the
  shards of any mesh.

The model's shapes come from the checkpoint (``config.json``, or the run config saved with
the step). The ``LlamaConfig`` fields the user set are applied on top (``model_config``): the
architecture fields (``ARCHITECTURE_FIELDS``) must agree with the checkpoint, or the run stops
with a ``ConfigError`` naming both values; every other field applies (dtypes, remat, tiling,
attention backend, and RoPE: ``rope_theta`` and ``rope_scaling`` for context extension,
written back on export).

``step_builder.resolve`` applies this to a ``RunConfig`` (the fields set: those bound in gin
on the command line, those that differ from ``LlamaConfig()``'s from Python; a resumed run
reads the shapes from its own checkpoints, never from ``init_from``), and
``step_builder.initial_state`` loads the weights (``load_model``).
"""

import dataclasses
import json
import os
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh

from ulysses_jax import sharding
from ulysses_jax.hf import weights as hf
from ulysses_jax.checkpoint import read_run_config, saved_arrays
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.models.llama import PRESETS, Llama, LlamaConfig

# Fields that define the trained function: a gin value must equal the checkpoint's.
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_dim", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "mlp_dim", "norm_eps", "tie_embeddings", "qkv_bias",
                       "qk_norm", "attention_scale", "mlp_activation", "norm_offset_one",
                       "post_norms", "embed_scale", "attn_out_bias", "moe", "attention_sinks")


def is_hf_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "config.json"))


def resolve_checkpoint(path: str, step: int | None = None) -> tuple[str, int | None]:
  """(checkpoints directory, step or None for the newest) of a workdir, its ``checkpoints/``
  or a ``checkpoints/<step>`` directory of ours."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), step
  name = os.path.basename(path)
  if name.isdigit() and os.path.isdir(os.path.join(path, "state")):
    if step is not None and step != int(name):
      raise ConfigError(f"{path} is the checkpoint of step {name}, but step {step} was asked")
    return os.path.dirname(path), int(name)
  return path, step


class SavedParams:
  """The parameters of one checkpoint of ours, read slice by slice, without devices or mesh.

  ``directory``: a workdir, its ``checkpoints/`` or one ``checkpoints/<step>``. The run
  config saved with the step (``read_run_config``) gives ``config`` (its ``LlamaConfig``)
  and ``run`` (the whole dict). ``slice(path, index)`` reads ``index`` of parameter ``path``
  (e.g. ``("layers", "mlp", "up_proj", "kernel")``, index ``(3,)`` for layer 3) from the
  orbax ``state`` item through TensorStore: only the chunks that hold the slice are read,
  and nothing else of the train state (optimizer moments) is touched.
  """

  def __init__(self, directory: str, step: int | None = None, *, copy_concurrency: int = 4):
    checkpoints, step = resolve_checkpoint(directory, step)
    try:
      self.step, self.run = read_run_config(checkpoints, step)
    except FileNotFoundError as e:  # its message names the directory (and the steps there)
      raise ConfigError(str(e)) from None
    self.config = LlamaConfig.from_dict(self.run["model"])
    self.state_dir = os.path.join(checkpoints, str(self.step), "state")
    self._specs = {keys[1:-1] if keys[-1] == "value" else keys[1:]: spec
                   for keys, spec in saved_arrays(self.state_dir).items()
                   if keys[0] == "params"}
    self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                "data_copy_concurrency": {"limit": copy_concurrency}})
    self._open = {}

  def _store(self, path: tuple[str, ...]):
    if path not in self._specs:
      raise ConfigError(f"{self.state_dir} holds no parameter {'.'.join(path)}; it has "
                        f"{sorted('.'.join(k) for k in self._specs)}")
    if path not in self._open:
      self._open[path] = ts.open(self._specs[path], open=True, context=self._context).result()
    return self._open[path]

  def shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(self._store(path).shape)

  def slice(self, path: tuple[str, ...], index=()) -> np.ndarray:
    return np.asarray(self._store(path)[index].read().result())


def model_config(init_from: str, bound: Mapping[str, object] | None = None) -> LlamaConfig:
  """The ``LlamaConfig`` of a run starting from ``init_from`` (no weights are read).

  ``bound``: the ``LlamaConfig`` fields bound explicitly in gin (name -> value). Raises
  ``ConfigError`` for a path that is neither kind of checkpoint, a missing or unsupported
  ``config.json``, or an architecture field (``ARCHITECTURE_FIELDS``, also those of a bound
  ``preset``) that contradicts the checkpoint.
  """
  base = _checkpoint_config(init_from)
  bound = dict(bound or {})
  problems = []
  preset = bound.pop("preset", "")
  if preset:
    if preset not in PRESETS:
      raise ConfigError(f"LlamaConfig.preset {preset!r} is unknown; choose one of "
                        f"{sorted(PRESETS)}.")
    problems += [f"LlamaConfig.preset={preset!r} gives {k}={getattr(PRESETS[preset], k)!r}"
                 f" but the checkpoint has {k}={getattr(base, k)!r}"
                 for k in ARCHITECTURE_FIELDS
                 if k not in bound and getattr(PRESETS[preset], k) != getattr(base, k)]
  problems += [f"LlamaConfig.{k}={bound[k]!r} but the checkpoint has {k}={getattr(base, k)!r}"
               for k in ARCHITECTURE_FIELDS if k in bound and bound[k] != getattr(base, k)]
  if problems:
    raise ConfigError(f"the model shapes come from the checkpoint {init_from!r}, which gin "
                      f"contradicts: {'; '.join(problems)}. Remove these bindings (and any "
                      "model gin file include) or start from a matching checkpoint.")
  return base.replace(**{k: v for k, v in bound.items() if k not in ARCHITECTURE_FIELDS})


COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


def compute_dtype(source: str, asked: str | None = None) -> tuple[str, str]:
  """The dtype to compute (and cache) in with the checkpoint ``source``, and why: ``asked``
  (a ``--dtype``) if given, else the checkpoint's own: a workdir's ``LlamaConfig.dtype``, a
  Hugging Face ``config.json``'s ``dtype`` (newer transformers) or ``torch_dtype`` (float32 when
  it names none of ``COMPUTE_DTYPES``)."""
  if asked:
    return asked, "--dtype"
  if not is_hf_checkpoint(source):
    return _checkpoint_config(source).dtype, "the run's LlamaConfig.dtype"
  with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
    hf_config = json.load(f)
  for key in ("dtype", "torch_dtype"):
    if hf_config.get(key) in COMPUTE_DTYPES:
      return hf_config[key], f"the checkpoint's {key} in config.json"
  return "float32", "config.json names no dtype or torch_dtype"


def _checkpoint_config(init_from: str) -> LlamaConfig:
  if not os.path.isdir(init_from):
    raise ConfigError(f"checkpoint {init_from!r} does not exist (give a Hugging Face "
                      "checkpoint directory or a ulysses_jax workdir)")
  if is_hf_checkpoint(init_from):
    return hf.read_config(init_from)
  try:
    return SavedParams(init_from).config
  except ConfigError as e:
    raise ConfigError(f"{init_from!r} is neither a Hugging Face checkpoint directory (it "
                      f"has no config.json) nor a ulysses_jax workdir or checkpoint ({e}); "
                      "give the directory holding config.json and the *.safetensors files, "
                      "or a training workdir") from None


def load_model(init_from: str, config: LlamaConfig, mesh: Mesh, *,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> Llama:
  """A ``Llama`` of ``config`` (from ``model_config``) on ``mesh`` holding ``init_from``'s
  weights, converted to ``config.param_dtype``; every parameter is sharded FSDP as
  ``init_llama`` would place it. Every process must call it (each reads its own shards)."""
  if is_hf_checkpoint(init_from):
    applied = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.name not in ("preset", "dtype", "param_dtype", *ARCHITECTURE_FIELDS)}
    return hf.load_llama(init_from, mesh, dtype=config.dtype, param_dtype=config.param_dtype,
                         rules=rules, **applied)
  saved = SavedParams(init_from)
  dtype = jnp.dtype(config.param_dtype)

  def read(path, shape) -> Callable:
    if saved.shape(path) != tuple(shape):
      raise ConfigError(f"{saved.state_dir}: parameter {'.'.join(path)} has shape "
                        f"{saved.shape(path)}, the model needs {tuple(shape)}")
    return lambda index: saved.slice(path, index).astype(dtype)

  return hf.build_llama(config, mesh, read, rules=rules)
