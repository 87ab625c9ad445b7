"""What a sliding window saves: attention time against the window W at a fixed length S.

One device, causal, float32, batch 1, 4 query / 2 KV heads of dim 64. For each W, and for full
causal attention, the ratio to full causal that the FLOP count predicts
(``reference.mean_visible_keys``: S/2 keys per query in full, W - W²/2S under the window) and:

* on this machine's device, the XLA chunked attention (``ulysses_jax.attention.chunked``: the
  backend that runs everywhere): the median wall time of the forward and of forward+backward
  (warm-up first, each call blocked on) and their ratio to full causal. A time ratio near the
  FLOP ratio means the blocks the window hides are skipped, not masked. XLA's own
  ``cost_analysis()`` is not used: it counts a while loop's body once, so it cannot see how
  many key blocks each query block visits.
* with ``--gpu=h100`` (or another ``ulysses_jax.aot`` GPU; needs JAX's CUDA plugin and
  ``JAX_PLATFORMS=cpu``), compiled for one such GPU, not run: the backend ``"auto"`` picks
  there for the window (``choose_backend``; our Triton kernels for float32), and the FLOPs of
  the compiled forward and forward+backward by ``ulysses_jax.aot.cost``, with the attention
  kernels the program launches (``kernels``: their names, which carry the window). The walk
  reads a kernel's FLOPs from its name and shapes by the same formula as ``flop_ratio``: the
  figures say which kernels the compiled program runs, and what the rest of it adds, not how
  much work a kernel does inside (for that, time it on a GPU: ``benchmarks.attention_kernels``).

  python -m benchmarks.sliding_window [--seq_len 16384] [--windows 256 1024 4096] [--json PATH]
  JAX_PLATFORMS=cpu .venv-gpu-compile/bin/python -m benchmarks.sliding_window --gpu=h100 \\
      --json=benchmarks/results/sliding_window_gpu_h100.json
"""

import argparse
import re

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from ulysses_jax.attention import backends
from ulysses_jax.attention.reference import mean_visible_keys
from ulysses_jax.doctor.timing import time_fn

COLUMNS = ["window", "forward_s", "fwd_bwd_s", "forward_ratio", "fwd_bwd_ratio", "flop_ratio"]
GPU_COLUMNS = ["window", "backend", "kernels", "forward_gflop", "fwd_bwd_gflop",
               "forward_ratio", "fwd_bwd_ratio", "flop_ratio"]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def attention_fns(window, backend="xla"):
  """Jitted forward and forward+backward (gradients of q, k, v) of causal attention by
  ``backend`` (``attention.backends``) on q ``[1, S, 4, 64]``, k and v ``[1, S, 2, 64]``."""
  def forward(q, k, v):
    # A scope around the kernels, as a model's layers give them: under jax.grad the outermost
    # scope is renamed jvp(...), which would hide a kernel's name from ulysses_jax.aot.cost.
    with jax.named_scope("attention"):
      return backends.local_attention(backend, q, k, v, causal=True, segment_ids=None,
                                      scale=None, sliding_window=window)

  def grads(q, k, v):
    return jax.grad(lambda q, k, v: forward(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)

  return jax.jit(forward), jax.jit(grads)


def with_ratios(rows: list[dict], fields: dict) -> list[dict]:
  """Adds each ``fields`` key's ratio to the last row's (full causal) as the value's name."""
  for row in rows:
    for field, ratio in fields.items():
      row[ratio] = row[field] / rows[-1][field]
  return rows


def measure(seq_len: int, windows: list[int | None], iters: int) -> list[dict]:
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (1, seq_len, HEADS, HEAD_DIM), jnp.float32)
  k, v = (jax.random.normal(key, (1, seq_len, KV_HEADS, HEAD_DIM), jnp.float32)
          for key in keys[1:])
  rows = []
  for window in windows:
    forward, grads = attention_fns(window)
    rows.append({
        "window": "full" if window is None else window,
        "forward_s": time_fn(forward, q, k, v, warmup=1, iters=iters)["median_s"],
        "fwd_bwd_s": time_fn(grads, q, k, v, warmup=1, iters=iters)["median_s"],
        "flop_ratio": mean_visible_keys(seq_len, window) / mean_visible_keys(seq_len)})
  return with_ratios(rows, {"forward_s": "forward_ratio", "fwd_bwd_s": "fwd_bwd_ratio"})


def compiled_flops(seq_len: int, windows: list[int | None], gpu: str) -> list[dict]:
  """Per window: compiled for one ``gpu`` (compile-only, not run), the backend ``"auto"``
  picks, the attention kernels in the program and ``ulysses_jax.aot.cost``'s GFLOP of the
  forward and of forward+backward."""
  from jax.sharding import NamedSharding, PartitionSpec
  from ulysses_jax import aot, make_mesh
  from ulysses_jax.aot import cost
  mesh = make_mesh(seq=1, devices=aot.gpu_devices(gpu, "1x1x1"))
  one_gpu = NamedSharding(mesh, PartitionSpec())
  q = jax.ShapeDtypeStruct((1, seq_len, HEADS, HEAD_DIM), jnp.float32, sharding=one_gpu)
  kv = jax.ShapeDtypeStruct((1, seq_len, KV_HEADS, HEAD_DIM), jnp.float32, sharding=one_gpu)
  rows = []
  for window in windows:
    backend = backends.choose_backend(dtype=jnp.float32, head_dim=HEAD_DIM, num_q_heads=HEADS,
                                      num_kv_heads=KV_HEADS, causal=True,
                                      segment_ids_given=False, mesh=mesh,
                                      sliding_window=window).backend
    row = {"window": "full" if window is None else window, "backend": backend,
           "flop_ratio": mean_visible_keys(seq_len, window) / mean_visible_keys(seq_len)}
    for name, fn in zip(("forward", "fwd_bwd"), attention_fns(window, backend)):
      with jax.set_mesh(mesh):  # JAX 0.11's Triton lowering reads the GPU from it
        text = fn.lower(q, kv, kv).compile().as_text()
      row[f"{name}_gflop"] = sum(op.count * op.flops for op in cost.operations(text)) / 1e9
      kernels = sorted(set(re.findall(r"flash_attention_\w+", text)))
    row["kernels"] = " ".join(kernels)  # those of forward+backward
    rows.append(row)
  return with_ratios(rows, {"forward_gflop": "forward_ratio", "fwd_bwd_gflop": "fwd_bwd_ratio"})


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq_len", type=int, default=16384)
  parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--gpu", default="", help="compile for one GPU of this kind instead "
                      "(ulysses_jax.aot: h100, h200, ...) and count the compiled FLOPs")
  parser.add_argument("--json", default="", help="write the rows here")
  args = parser.parse_args(argv)
  windows = [*args.windows, None]
  if args.gpu:
    rows = compiled_flops(args.seq_len, windows, args.gpu)
    print(f"S = {args.seq_len}, compiled for one {args.gpu.upper()} (not run), jax "
          f"{jax.__version__}; GFLOP by ulysses_jax.aot.cost (kernels' FLOPs from their names)")
  else:
    rows = measure(args.seq_len, windows, args.iters)
    print(f"S = {args.seq_len}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print_table(rows, GPU_COLUMNS if args.gpu else COLUMNS)
  if args.json:
    write_json(args.json, rows, seq_len=args.seq_len, **({"gpu": args.gpu} if args.gpu else {}))
  return rows


if __name__ == "__main__":
  main()
