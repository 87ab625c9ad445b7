"""Shared benchmark plumbing: environment header, table and JSON output (timing and
tables: ``ulysses_jax.doctor.timing``)."""

import argparse
import ast
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import sys

import jax

from ulysses_jax.doctor.timing import format_table


def environment() -> dict:
  """Device, versions and the exact command, recorded with every result."""
  import flax
  import jaxlib
  device = jax.devices()[0]
  return {
      "device": getattr(device, "device_kind", str(device)),
      "platform": device.platform,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
      "command": command_line(),
  }


def command_line() -> str:
  """How this process was started, as ``python -m module args`` when run as a module."""
  main_spec = getattr(sys.modules["__main__"], "__spec__", None)
  program = ["-m", main_spec.name] if main_spec else [sys.argv[0]]
  return " ".join(shlex.quote(a) for a in ["python", *program, *sys.argv[1:]])


def print_table(rows: list[dict], columns: list[str]) -> None:
  """Prints ``rows`` as a fixed-width text table with the given column order."""
  print(format_table(rows, columns))


def write_json(path: str, rows: list[dict], **extra) -> None:
  """Writes ``{"environment": ..., "rows": rows, **extra}`` to ``path`` (folders created);
  NaN and infinities (a figure that was not measured) become null, so it is strict JSON."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(finite_or_null({"environment": environment(), "rows": rows, **extra}), f,
              indent=2, allow_nan=False)
  print(f"wrote {path}")


def finite_or_null(tree):
  """``tree`` (dicts, lists, scalars) with every non-finite float replaced by None."""
  if isinstance(tree, dict):
    return {key: finite_or_null(value) for key, value in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [finite_or_null(value) for value in tree]
  if isinstance(tree, float) and not math.isfinite(tree):
    return None
  return tree


def check_plotting(parser: argparse.ArgumentParser, plot_path: str) -> None:
  """Stops with a usage error, before any measuring, when ``--plot`` is asked for without
  matplotlib."""
  if plot_path and importlib.util.find_spec("matplotlib") is None:
    parser.error(f"--plot {plot_path} needs matplotlib: pip install -e '.[bench]'")


def save_figure(figure, title: str, path: str) -> None:
  """Titles, lays out and writes a matplotlib figure as a PNG (folders created)."""
  figure.suptitle(title)
  figure.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  figure.savefig(path, dpi=120)
  print(f"wrote {path}")


def search(fits, granularity: int, max_len: int, start: int = 0) -> tuple[int, int]:
  """Largest multiple S of ``granularity`` (<= ``max_len``) with ``fits(S)``, assuming fits
  is monotone; and the smallest multiple tried that did not fit (0 if none failed).

  Doubles from ``start`` (rounded down to a multiple, at least ``granularity``), then
  bisects; returns ``(0, granularity)`` when even the smallest length fails.
  """
  low, high = 0, 0
  top = max_len // granularity * granularity
  length = min(max(granularity, start // granularity * granularity), top)
  while length:  # doubling, the last try at top
    if not fits(length):
      high = length
      break
    low, length = length, min(2 * length, top) if length < top else 0
  while high and high - low > granularity:
    middle = (low + high) // 2 // granularity * granularity
    if fits(middle):
      low = middle
    else:
      high = middle
  return low, high


_BINDING = re.compile(r"^(\w+)\.(\w+)\s*=\s*(.+)$")


def gin_bindings(path: str, class_name: str) -> dict:
  """The literal values a gin file (and the files it includes) binds to ``class_name``'s
  fields, read without gin (the GPU machines lack it): ``{"dtype": "bfloat16", ...}``. A
  ``ValueError`` names a binding of that class that is no Python literal (a macro, a
  reference), which only gin resolves."""
  bindings = {}
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      line = line.split("#", 1)[0].strip()
      if line.startswith("include "):
        included = ast.literal_eval(line.split(None, 1)[1])
        beside = os.path.join(os.path.dirname(path), included)
        bindings.update(gin_bindings(beside if os.path.exists(beside) else included,
                                     class_name))
        continue
      match = _BINDING.match(line)
      if not match or match[1] != class_name:
        continue
      try:
        bindings[match[2]] = ast.literal_eval(match[3])
      except (ValueError, SyntaxError) as e:
        raise ValueError(f"{path}:{number}: {class_name}.{match[2]} = {match[3]} is not a "
                         "literal; only gin reads that (use the flags instead)") from e
  return bindings
