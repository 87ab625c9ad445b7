"""A model named on a command line: a preset, a checkpoint directory, a Hugging Face
``config.json``, or a gin file.

``load(spec)`` returns the ``RunConfig`` of the model (what ``ulysses-plan --verify`` compiles,
with its layout put in) and the run settings a tool may take as defaults: from a gin file
those it binds (``DataConfig.seq_len``, ``DataConfig.batch_size``, ``TrainConfig.accum_steps``,
``master_weights``, ``init_from``); from a checkpoint directory (a Hugging Face one, or a
ulysses_jax workdir) ``init_from``, the directory itself, which a fine-tune names as
``TrainConfig.init_from``. Every failure is a ``ValueError`` whose message fits one line.
"""

import json
import pathlib

from ulysses_jax.models.llama import PRESETS, LlamaConfig
from ulysses_jax.run_config import RunConfig, TrainConfig


def load(spec: str, init_from: str | None = None) -> tuple[RunConfig, dict]:
  """``(config, run settings)`` of a preset name, a checkpoint directory, a ``config.json``
  or a ``.gin`` file (with its includes, as the trainer reads it; ``init_from`` binds its
  ``TrainConfig.init_from``)."""
  path = pathlib.Path(spec)
  if init_from is not None and path.suffix != ".gin":
    raise ValueError(f"init_from ({init_from!r}) goes with a fine-tuning gin file, got the "
                     f"model {spec!r}: give the checkpoint directory itself as the model.")
  if spec in PRESETS:
    return RunConfig(model=PRESETS[spec]), {}
  if path.is_dir():
    from ulysses_jax.hf import init_from as finetune
    return (RunConfig(train=TrainConfig(init_from=str(path)),
                      model=finetune.model_config(str(path))), {"init_from": str(path)})
  if path.suffix == ".gin" and path.is_file():
    return _from_gin(path, init_from)
  if path.suffix == ".json" and path.is_file():
    return RunConfig(model=_from_hf(path)), {}
  raise ValueError(f"unknown model {spec!r}: give a preset ({', '.join(sorted(PRESETS))}), a "
                   "checkpoint directory, a Hugging Face config.json or a .gin file.")


def _from_hf(path: pathlib.Path) -> LlamaConfig:
  from ulysses_jax.hf import weights as hf
  try:
    return hf.config_from_hf(json.loads(path.read_text()))
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    what = f"lacks {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
    raise ValueError(f"{path}: not a usable Hugging Face config.json ({what}).") from e


def _from_gin(path: pathlib.Path, init_from: str | None) -> tuple[RunConfig, dict]:
  import gin

  from ulysses_jax.cli import gin_config  # pylint: disable=import-outside-toplevel
  params = [] if init_from is None else [f'TrainConfig.init_from = "{init_from}"']
  try:
    config = gin_config.read([str(path)], params)
  except Exception as e:  # gin reports parse and binding errors as many exception types
    hint = (" (a fine-tuning config: give the checkpoint it starts from, --init_from=DIR)"
            if "init_from" in str(e) and "REQUIRED" in str(e) else "")
    raise ValueError(f"{path}: {str(e).splitlines()[0]}{hint}") from e
  finally:
    gin.clear_config()
  run = {"seq_len": config.data.seq_len, "batch": config.data.batch_size,
         "accum_steps": config.train.accum_steps,
         "master_weights": config.train.master_weights}
  if config.train.init_from:
    run["init_from"] = config.train.init_from
  return config, run
