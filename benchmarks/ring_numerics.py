"""How far the bfloat16 hybrid (Ulysses x ring) is from exact attention, forward and backward.

Question: the ring keeps its output and dQ sums in float32 but rounds to the inputs' dtype
where memory demands it: each step's partial output and gradients are written in bfloat16 by
the kernels, and the dK/dV sums travel in bfloat16 (``ulysses_jax.attention.ring``). What does
that cost against a float32 dense reference, beside the XLA backend (float32 partials)?

Relative L2 error (``tests/attention_cases.relative_error``) of out, dq, dk and dv for random
bfloat16 inputs with packed segments, on a data=1 x seq=2 x ring=4 mesh of CPU devices, the
Pallas kernels in interpret mode:

  python -m benchmarks.ring_numerics [--seq-len 1024] [--seeds 3] [--json PATH]
"""

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from tests.attention_cases import output_and_grads, random_inputs, relative_error
from ulysses_jax import make_mesh, ulysses_attention
from ulysses_jax.attention.reference import dense_attention

COLUMNS = ["backend", "seed", "out", "dq", "dk", "dv"]


def errors(backend, seed, seq_len, mesh):
  q, k, v, d_out, segment_ids = random_inputs(seed, 1, seq_len, 4, 2, 64, dtype=jnp.bfloat16,
                                              num_segments=3)
  hybrid = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                                             backend=backend)
  exact = lambda q, k, v: dense_attention(q, k, v, causal=True, q_segment_ids=segment_ids,
                                          kv_segment_ids=segment_ids)
  f32 = lambda x: x.astype(jnp.float32)
  expected = output_and_grads(exact, f32(q), f32(k), f32(v), f32(d_out))
  actual = output_and_grads(hybrid, q, k, v, d_out)
  return {"backend": backend, "seed": seed,
          **{n: relative_error(a, e) for n, a, e in zip(COLUMNS[2:], actual, expected)}}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  mesh = make_mesh(data=1, seq=2, ring=4, devices=jax.devices()[:8])
  rows = [errors(backend, seed, args.seq_len, mesh) for backend in ("pallas", "xla")
          for seed in range(args.seeds)]
  print_table(rows, COLUMNS)
  if args.json:
    write_json(args.json, rows, seq_len=args.seq_len, mesh=dict(mesh.shape))


if __name__ == "__main__":
  main()
