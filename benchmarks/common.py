"""Shared benchmark plumbing: environment header, timing, table and JSON output."""

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

import jax


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


def time_fn(fn, *args, warmup: int = 2, iters: int = 10) -> dict:
  """Median and spread of wall time of ``fn(*args)``, blocking on its outputs each call."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "iters": iters}


def print_table(rows: list[dict], columns: list[str]) -> None:
  """Prints ``rows`` as a fixed-width text table with the given column order."""
  def fmt(value):
    if isinstance(value, float):
      return f"{value:.4g}"
    return str(value)
  cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in cells:
    print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


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
