"""What the benchmarks and ``python -m ulysses_jax.doctor`` share: wall time of JAX work
measured honestly (warm-up calls first, for compilation and autotuning; then each timed call
blocks on its outputs), and fixed-width tables of the results."""

import statistics
import time

import jax
import jax.numpy as jnp


MIN_SAMPLES = 3  # what ``time_fn``'s ``max_s`` leaves at least


def time_fn(fn, *args, warmup: int = 2, iters: int = 10, burst: int = 1,
            max_s: float | None = None) -> dict:
  """Median and spread of wall time of ``fn(*args)``, blocking on its outputs each call.

  ``max_s``: fewer than ``iters`` samples where the timed ones already took this long (at least
  ``MIN_SAMPLES``): a call of seconds varies little, and ten of them cost a GPU session
  minutes (XLA's attention at 65,536 tokens took 2.4 s a call on an H100). ``iters`` in the
  result says how many ran.

  ``burst`` > 1: each sample dispatches ``burst`` calls back to back and blocks on the last,
  giving the time per call. A short program's host-side dispatch then overlaps the device
  running the ones before it instead of adding to each sample (the device time of a call,
  where it is longer than its dispatch): a 1 GiB copy timed one call at a time read 2,637 GB/s
  on an H200 (2026-11-27), dispatch and synchronisation included."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    for _ in range(burst - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) / burst)
    if max_s is not None and len(times) >= MIN_SAMPLES and sum(times) * burst >= max_s:
      break
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
          "iters": len(times), "burst": burst}


def copy_bandwidth(device, nbytes: int, *, warmup: int = 2, iters: int = 10,
                   burst: int = 10) -> float:
  """Bytes per second a device-to-device copy moves on ``device``, read and written both
  counted (as copy bandwidth is quoted): ``x ^ 1`` over ``nbytes`` of uint32 into a new
  buffer, which XLA can neither drop nor alias away (a plain copy it may); ``burst`` copies
  per sample (``time_fn``)."""
  x = jax.device_put(jnp.zeros(nbytes // 4, jnp.uint32), device)
  flip = jax.jit(lambda a: a ^ jnp.uint32(1))
  return 2 * x.nbytes / time_fn(flip, x, warmup=warmup, iters=iters, burst=burst)["median_s"]


def format_table(rows: list[dict], columns: list[str]) -> str:
  """``rows`` as a fixed-width text table with the given column order (floats to 4 digits)."""
  def fmt(value):
    if isinstance(value, float):
      return f"{value:.4g}"
    return "" if value is None else str(value)
  cells = [[fmt(r.get(c)) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
  return "\n".join(lines)
