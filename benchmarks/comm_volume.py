"""Per-device communication of one attention forward, read from the compiled HLO.

Question: does Ulysses keep per-device traffic constant when sequence length S and device
count P grow together, while the all-gather (context-parallel) baseline grows with S?

For each scheme and (S, P) the forward pass is compiled (no arrays are allocated) and the
bytes of every collective in the per-device program are summed (``ulysses_jax.hlo``).
Expected values (DESIGN.md), with G = Hq / Hkv and b bytes per element:

  ulysses     all-to-all  (2 + 2/G) * B*S*Hq*D*b / P     (4 * B*S*Hq*D*b / P for MHA)
  all-gather  all-gather  2 * B*S*Hkv*D*b  (+ the [B, S] int32 segment ids when packed)

With P = 1 no collective is needed and both are 0. The default dtype is float32 because the
CPU compiler widens bfloat16 collectives to float32 (GPU compilers keep bfloat16).

  python -m benchmarks.comm_volume [--json benchmarks/results/comm_volume.json]
"""

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from ulysses_jax import hlo, make_mesh, ulysses_attention
from ulysses_jax.attention.baselines import allgather_kv_attention

SCHEMES = {"ulysses": (ulysses_attention, "all-to-all"),
           "allgather": (allgather_kv_attention, "all-gather")}


def expected_bytes(scheme, *, batch, seq_len, q_heads, kv_heads, head_dim, shards, itemsize):
  if shards == 1:
    return 0
  if scheme == "ulysses":
    return (2 * q_heads + 2 * kv_heads) * batch * seq_len * head_dim * itemsize // shards
  return 2 * batch * seq_len * kv_heads * head_dim * itemsize


def measure(scheme, *, batch, seq_len, q_heads, kv_heads, head_dim, shards, dtype):
  attention, collective = SCHEMES[scheme]
  mesh = make_mesh(data=1, seq=shards, devices=jax.devices()[:shards])
  q = jax.ShapeDtypeStruct((batch, seq_len, q_heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), dtype)
  forward = jax.jit(lambda q, k, v: attention(q, k, v, mesh=mesh, causal=True))
  totals = hlo.collective_bytes(forward.lower(q, kv, kv).compile().as_text())
  expected = expected_bytes(scheme, batch=batch, seq_len=seq_len, q_heads=q_heads,
                            kv_heads=kv_heads, head_dim=head_dim, shards=shards,
                            itemsize=jnp.dtype(dtype).itemsize)
  measured = totals[collective]
  return {"scheme": scheme, "S": seq_len, "P": shards, "Hq": q_heads, "Hkv": kv_heads,
          "collective": collective, "MiB_per_device": measured / 2**20,
          "expected_MiB": expected / 2**20,
          "ratio": measured / expected if expected else (1.0 if measured == 0 else float("inf")),
          "other_collective_bytes": sum(totals.values()) - measured}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens-per-device", type=int, default=4096)
  parser.add_argument("--fixed-seq-len", type=int, default=32768)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--json", default="benchmarks/results/comm_volume.json")
  args = parser.parse_args()
  rows = []
  for q_heads, kv_heads in ((32, 32), (32, 8)):
    for shards in (1, 2, 4, 8):
      for seq_len in sorted({args.tokens_per_device * shards, args.fixed_seq_len}):
        for scheme in SCHEMES:
          row = measure(scheme, batch=1, seq_len=seq_len, q_heads=q_heads, kv_heads=kv_heads,
                        head_dim=args.head_dim, shards=shards, dtype=jnp.dtype(args.dtype))
          row["sweep"] = "S/P fixed" if seq_len == args.tokens_per_device * shards else "S fixed"
          rows.append(row)
  print(f"Forward collective bytes per device, B=1, D={args.head_dim}, {args.dtype}, causal")
  print_table(rows, ["sweep", "scheme", "Hq", "Hkv", "S", "P", "collective", "MiB_per_device",
                     "expected_MiB", "ratio", "other_collective_bytes"])
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  write_json(args.json, rows)


if __name__ == "__main__":
  main()
