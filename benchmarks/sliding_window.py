"""What a sliding window saves: attention time against the window W at a fixed length S.

One device, the XLA chunked attention (``ulysses_jax.attention.chunked``: the backend that runs
everywhere), causal, float32, batch 1, 4 query / 2 KV heads of dim 64. For each W, and for
full causal attention: the median wall time of the forward and of forward+backward (warm-up
first, each call blocked on), their ratio to full causal, and the ratio the FLOP count predicts
(``reference.mean_visible_keys``: S/2 keys per query in full, W - W²/2S under the window).
A time ratio near the FLOP ratio means the blocks the window hides are skipped, not masked.

  python -m benchmarks.sliding_window [--seq_len 16384] [--windows 256 1024 4096] [--json PATH]

XLA's own ``cost_analysis()`` is not used: it counts a while loop's body once, so it cannot see
how many key blocks each query block visits.
"""

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.attention.reference import mean_visible_keys
from ulysses_jax.benchmarking import time_fn

COLUMNS = ["window", "forward_s", "fwd_bwd_s", "forward_ratio", "fwd_bwd_ratio", "flop_ratio"]


def attention_fns(window):
  """Jitted forward and forward+backward (gradients of q, k, v) of causal chunked attention."""
  def forward(q, k, v):
    return chunked_attention(q, k, v, causal=True, sliding_window=window)

  def grads(q, k, v):
    return jax.grad(lambda q, k, v: forward(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)

  return jax.jit(forward), jax.jit(grads)


def measure(seq_len: int, windows: list[int | None], iters: int) -> list[dict]:
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (1, seq_len, 4, 64), jnp.float32)
  k, v = (jax.random.normal(key, (1, seq_len, 2, 64), jnp.float32) for key in keys[1:])
  rows = []
  for window in windows:
    forward, grads = attention_fns(window)
    rows.append({
        "window": "full" if window is None else window,
        "forward_s": time_fn(forward, q, k, v, warmup=1, iters=iters)["median_s"],
        "fwd_bwd_s": time_fn(grads, q, k, v, warmup=1, iters=iters)["median_s"],
        "flop_ratio": mean_visible_keys(seq_len, window) / mean_visible_keys(seq_len)})
  full = rows[-1]
  for row in rows:
    row["forward_ratio"] = row["forward_s"] / full["forward_s"]
    row["fwd_bwd_ratio"] = row["fwd_bwd_s"] / full["fwd_bwd_s"]
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq_len", type=int, default=16384)
  parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--json", default="", help="write the rows here")
  args = parser.parse_args(argv)
  rows = measure(args.seq_len, [*args.windows, None], args.iters)
  print(f"S = {args.seq_len}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print_table(rows, COLUMNS)
  if args.json:
    write_json(args.json, rows, seq_len=args.seq_len)
  return rows


if __name__ == "__main__":
  main()
