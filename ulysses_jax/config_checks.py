"""One way to validate every config dataclass: types from its annotations, ranges from metadata.

Each config dataclass calls ``check_fields(self)`` first thing in ``__post_init__``:

* the value must match the field's annotation: ``int`` (not a bool), ``float`` (an int is
  accepted and kept), ``bool``, ``str``, ``Literal[...]`` (one of the listed values), unions
  such as ``int | None``, ``tuple[str, ...]`` / ``Sequence[str]`` (a list or tuple of those)
  and nested config dataclasses;
* numbers must lie within ``dataclasses.field(metadata=at_least(n))`` (or ``above(n)``).

All problems of one config are reported together in one ``ConfigError`` (a ``ValueError``)
that names the class, each field, what it must be and what it got, e.g.
``DataConfig.seq_len must be an int, got 256.0``. Checks that relate fields to each other
stay in the class's own ``__post_init__`` after this call.
"""

import dataclasses
import types
import typing
from collections.abc import Sequence


class ConfigError(ValueError):
  """A config value, or the data, devices or checkpoint it names, cannot work."""


def at_least(low) -> dict:
  """Field metadata: the value must be >= ``low``."""
  return {"min": low}


def above(low) -> dict:
  """Field metadata: the value must be > ``low``."""
  return {"above": low}


def check_fields(config) -> None:
  """Raises ``ConfigError`` listing every field of ``config`` whose value does not fit."""
  hints = typing.get_type_hints(type(config))
  name = type(config).__name__
  problems = []
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    expected = hints[f.name]
    if not _matches(value, expected):
      problems.append(f"{name}.{f.name} must be {_describe(expected)}, got {value!r}")
    elif "min" in f.metadata and value < f.metadata["min"]:
      problems.append(f"{name}.{f.name} must be >= {f.metadata['min']}, got {value!r}")
    elif "above" in f.metadata and not value > f.metadata["above"]:
      problems.append(f"{name}.{f.name} must be > {f.metadata['above']}, got {value!r}")
  if problems:
    raise ConfigError("; ".join(problems))


def _matches(value, expected) -> bool:
  origin, args = typing.get_origin(expected), typing.get_args(expected)
  if expected is typing.Any:
    return True
  if expected is type(None):
    return value is None
  if expected is bool:
    return isinstance(value, bool)
  if expected is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if expected is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if origin is typing.Literal:
    return any(value == a and type(value) is type(a) for a in args)
  if origin in (typing.Union, types.UnionType):
    return any(_matches(value, a) for a in args)
  if origin in (tuple, Sequence):
    if not isinstance(value, (tuple, list)):
      return False
    items = args[:1] if origin is Sequence or (len(args) == 2 and args[1] is Ellipsis) else args
    if origin is tuple and items is args and len(value) != len(args):
      return False
    return all(_matches(v, items[min(i, len(items) - 1)]) for i, v in enumerate(value))
  if isinstance(expected, type):
    return isinstance(value, expected)
  return True  # an annotation this checker does not know: trust it


def _describe(expected) -> str:
  origin, args = typing.get_origin(expected), typing.get_args(expected)
  if expected is type(None):
    return "None"
  if origin is typing.Literal:
    return "one of " + ", ".join(repr(a) for a in args)
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in args)
  if origin in (tuple, Sequence):
    return f"a list of {_describe(args[0])}"
  article = "an" if expected.__name__[0] in "aeiou" else "a"
  return f"{article} {expected.__name__}"
