"""The gin edge of the command lines: gin files and ``--gin_param``s -> a ``RunConfig``.

Gin binds only config dataclasses (the t5x rule), under the names users write in the
``configs/*.gin`` files: ``TrainConfig``, ``LlamaConfig``, ``RopeScaling``, ``DataConfig``,
``RetrievalTask``, ``OptimizerConfig``, ``CheckpointConfig`` (module ``ulysses_jax``). This is
the only module that imports gin (``tests/test_imports.py`` checks it): ``train.train``,
``aot`` and the rest of the library take the ``RunConfig`` it builds.

    run = gin_config.read(["configs/tiny_cpu.gin"], ["TrainConfig.steps=50"])

``read(..., workdir)`` resolves the model as ``step_builder.resolve`` does, with the
``LlamaConfig`` fields bound in gin as the ones given.

A relative path in ``--gin_file`` or an ``include`` is looked for next to the including file,
then in the working directory, then in the repository (so ``include 'configs/...'`` works from
any directory).
"""

import contextlib
import dataclasses
import difflib
import os
import re

import gin

from ulysses_jax import step_builder
from ulysses_jax.checkpoint import CheckpointConfig
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.pipeline import DataConfig, RetrievalTask
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.optimizer import OptimizerConfig
from ulysses_jax.rope import RopeScaling
from ulysses_jax.run_config import RunConfig, TrainConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_CLASSES = (TrainConfig, LlamaConfig, RopeScaling, DataConfig, RetrievalTask,
                  OptimizerConfig, CheckpointConfig)
# Gin's wrapper of each class: calling it applies the parsed bindings. The wrappers are
# subclasses; ``_plain`` turns what they build back into the classes themselves.
_BOUND = {cls: gin.external_configurable(cls, module="ulysses_jax") for cls in CONFIG_CLASSES}
_including = []  # the gin files being read, the innermost last


def _search_dirs() -> list[str]:
  """Where a relative gin path is looked for, in order: the directory of the file that
  includes it, the working directory, the repository (``include 'configs/...'``)."""
  return list(dict.fromkeys([*map(os.path.dirname, _including[-1:]), os.getcwd(), REPO_ROOT]))


def _find(path: str) -> str:
  for directory in [""] if os.path.isabs(path) else _search_dirs():
    if os.path.isfile(os.path.join(directory, path)):
      return os.path.join(directory, path)
  where = "" if os.path.isabs(path) else f" (looked in {', '.join(_search_dirs())})"
  by = f", included by {_including[-1]}," if _including else ""
  raise FileNotFoundError(f"gin file {path!r}{by} not found{where}; the experiments are in "
                          f"{REPO_ROOT}/configs")


@contextlib.contextmanager
def _open(path: str):
  """Gin's reader of every gin file: nested includes resolve from this file's directory."""
  with open(_find(path), encoding="utf-8") as f:
    _including.append(os.path.abspath(f.name))
    try:
      yield f
    finally:
      _including.pop()


# Ours goes before gin's own readers (gin 0.5 has no public way to order them): gin would try
# the working directory first, and its package-path reader logs an ERROR for every miss.
gin.config._FILE_READERS.insert(0, (_open, lambda path: True))  # pylint: disable=protected-access


def parse(files: list[str], params: list[str]):
  """Loads gin files in order, then ``params``; unknown names raise ``ValueError``."""
  if not files:
    raise ConfigError("give at least one --gin_file (e.g. --gin_file=configs/tiny_cpu.gin)")
  for f in files:
    _find(f)
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(files, params)
  except FileNotFoundError as e:  # a missing include; gin appends where, which ours names
    raise FileNotFoundError(str(e).splitlines()[0]) from None
  except SyntaxError as e:  # gin's parser: most often a string value without quotes
    where = f"{e.filename}, line {e.lineno}" if e.filename else "--gin_param"
    raise ConfigError(f"gin cannot parse {(e.text or '').strip()!r} ({where}): values are "
                      "Python literals, so strings need quotes, e.g. "
                      "--gin_param='LlamaConfig.remat_policy=\"full\"'") from e
  except ValueError as e:  # gin: a configurable or parameter it does not know
    raise ConfigError(_nearest_name(str(e))) from e


def _nearest_name(message: str) -> str:
  """Gin's message of an unknown configurable or parameter, its first line ending with the
  nearest name it knows (as a typo most often is)."""
  first, *rest = message.splitlines()
  if unknown := re.match(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", first):
    config = {cls.__name__: cls for cls in CONFIG_CLASSES}.get(unknown[1])
    known, name = [f.name for f in dataclasses.fields(config)] if config else [], unknown[2]
  elif unknown := re.match(r"No configurable matching '([\w.]+)'", first):
    known, name = [cls.__name__ for cls in CONFIG_CLASSES], unknown[1]
  else:
    return message
  if nearest := difflib.get_close_matches(name, known, n=1):
    first += f" Did you mean '{nearest[0]}'?"
  return "\n".join([first, *rest])


def build(cls):
  """An instance of config class ``cls`` with the parsed bindings applied."""
  return _plain(_BOUND[cls]())


def run_config(workdir: str | None = None) -> RunConfig:
  """The ``RunConfig`` of the parsed bindings, with the operative config text, its model
  resolved as ``step_builder.resolve`` does (``init_from``'s shapes, or the newest checkpoint's
  in ``workdir``), the ``LlamaConfig`` fields bound in gin applied on top."""
  configs = {name: build(cls) for name, cls in (
      ("train", TrainConfig), ("model", LlamaConfig), ("data", DataConfig),
      ("optimizer", OptimizerConfig), ("checkpoint", CheckpointConfig))}
  config = RunConfig(**configs, gin=gin.operative_config_str())
  return step_builder.resolve(config, workdir, given=bound_fields(LlamaConfig))


def read(files: list[str], params: list[str], workdir: str | None = None) -> RunConfig:
  """``parse`` then ``run_config``."""
  parse(files, params)
  return run_config(workdir)


def bound_fields(cls) -> dict:
  """The fields of ``cls`` that the parsed gin files and params set explicitly."""
  names = [f.name for f in dataclasses.fields(cls)]
  bound = {}
  for name in names:
    try:
      bound[name] = gin.query_parameter(f"ulysses_jax.{cls.__name__}.{name}")
    except ValueError:
      continue
  return {k: getattr(build(cls), k) for k in bound}


def _plain(value):
  """Rebuilds gin's subclass instances (nested ones too) as instances of the classes."""
  for cls in CONFIG_CLASSES:
    if isinstance(value, cls):
      return cls(**{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(cls)})
  return value
