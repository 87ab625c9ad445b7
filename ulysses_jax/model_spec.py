"""A model named on a command line: a preset, a Hugging Face ``config.json``, or a gin file.

``load(spec)`` returns the ``LlamaConfig`` and, from a gin file, the run settings it binds
that a tool may take as defaults (``DataConfig.seq_len``, ``DataConfig.batch_size``,
``TrainConfig.accum_steps``). Every failure is a ``ValueError`` whose message fits one line.
"""

import json
import pathlib

from ulysses_jax.models.llama import PRESETS, LlamaConfig


def load(spec: str) -> tuple[LlamaConfig, dict]:
  """``(config, run settings)`` of a preset name, a ``config.json`` (or a directory holding
  one) or a ``.gin`` file (with its includes, as the trainer reads it)."""
  if spec in PRESETS:
    return PRESETS[spec], {}
  path = pathlib.Path(spec)
  if path.is_dir():
    path = path / "config.json"
  if path.suffix == ".gin" and path.is_file():
    return _from_gin(path)
  if path.suffix == ".json" and path.is_file():
    return _from_hf(path), {}
  raise ValueError(f"unknown model {spec!r}: give a preset ({', '.join(sorted(PRESETS))}), a "
                   "Hugging Face config.json (or its directory) or a .gin file.")


def _from_hf(path: pathlib.Path) -> LlamaConfig:
  from ulysses_jax import hf
  try:
    return hf.config_from_hf(json.loads(path.read_text()))
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    what = f"lacks {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
    raise ValueError(f"{path}: not a usable Hugging Face config.json ({what}).") from e


def _from_gin(path: pathlib.Path) -> tuple[LlamaConfig, dict]:
  import gin
  from ulysses_jax import gin_config  # pylint: disable=import-outside-toplevel
  try:
    config = gin_config.read([str(path)], [])
  except Exception as e:  # gin reports parse and binding errors as many exception types
    raise ValueError(f"{path}: {str(e).splitlines()[0]}") from e
  finally:
    gin.clear_config()
  return config.model, {"seq_len": config.data.seq_len, "batch": config.data.batch_size,
                        "accum_steps": config.train.accum_steps}
