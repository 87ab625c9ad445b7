"""What the hybrid's ring (Ulysses x ring) costs: numerics in bfloat16, and memory on GPUs.

Numerics (the default; CPU). The ring keeps its output and dQ sums in float32 but rounds to the
inputs' dtype where memory demands it: each step's partial output and gradients are written in
bfloat16 by the kernels, and the dK/dV sums travel in bfloat16 (``ulysses_jax.attention.ring``).
Relative L2 error (``tests/attention_cases.relative_error``) of out, dq, dk and dv against a
float32 dense reference, random bfloat16 inputs with packed segments, a data=1 x seq=2 x ring=4
mesh of CPU devices, the Pallas kernels in interpret mode, beside the XLA backend (float32
partials):

  python -m benchmarks.ring_cost [--seq-len 1024] [--seeds 3] [--json PATH]

Memory (``--memory``; JAX's CUDA plugin, ``make gpu-compile-venv``, no GPU). The compiled
temporaries of one attention head chunk of ``configs/llama8b_32gpu_32m.gin`` alone: 32M tokens
over 4x1x8 H100s (seq=8 x ring=4), 8 query and 2 KV heads, bfloat16, causal, packed; the
forward, and the forward with the backward:

  JAX_PLATFORMS=cpu .venv-gpu-compile/bin/python -m benchmarks.ring_cost --memory
"""

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

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


def compiled_memory(seq_len: int = 32 * 2**20) -> list[dict]:
  """Temporaries (GiB per GPU) of one head chunk's attention, forward and forward+backward."""
  from ulysses_jax import aot
  mesh = make_mesh(1, 8, 4, devices=aot.gpu_devices("h100", "4x1x8"))
  tokens = NamedSharding(mesh, P("data", ("ring", "seq")))
  heads = lambda h: jax.ShapeDtypeStruct((1, seq_len, h, 128), jnp.bfloat16, sharding=NamedSharding(
      mesh, P("data", ("ring", "seq"), None, None)))
  ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=tokens)
  loss = lambda q, k, v, ids: ulysses_attention(q, k, v, mesh=mesh, segment_ids=ids).astype(
      jnp.float32).sum()
  rows = []
  for name, fn in (("forward", loss), ("forward+backward", jax.grad(loss, argnums=(0, 1, 2)))):
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).lower(heads(8), heads(2), heads(2), ids).compile()
    rows.append({"pass": name, "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--memory", action="store_true", help="the compiled memory instead")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  if args.memory:
    rows, columns, extra = compiled_memory(), ["pass", "temp_gib"], {}
  else:
    mesh = make_mesh(data=1, seq=2, ring=4, devices=jax.devices()[:8])
    rows = [errors(backend, seed, args.seq_len, mesh) for backend in ("pallas", "xla")
            for seed in range(args.seeds)]
    columns, extra = COLUMNS, {"seq_len": args.seq_len, "mesh": dict(mesh.shape)}
  print_table(rows, columns)
  if args.json:
    write_json(args.json, rows, **extra)


if __name__ == "__main__":
  main()
