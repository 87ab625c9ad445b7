"""Per-device communication of one attention forward, read from the compiled HLO.

Question: does Ulysses keep per-device traffic constant when sequence length S and device
count P grow together, while the all-gather (context-parallel) baseline grows with S? And
where do ring attention and the Ulysses x ring hybrid sit?

For each scheme and (S, P) the forward pass is compiled (no arrays are allocated) and the
bytes of every collective in the per-device program are summed (``ulysses_jax.aot.hlo``).
Expected values (DESIGN.md), with G = Hq / Hkv and b bytes per element:

  ulysses     all-to-all          (2 + 2/G) * B*S*Hq*D*b / P     (4 * B*S*Hq*D*b / P for MHA)
  all-gather  all-gather          2 * B*S*Hkv*D*b  (+ the [B, S] int32 segment ids when packed)
  ring        collective-permute  2 * (P-1)/P * B*S*Hkv*D*b   (K and V, P-1 steps)
  hybrid      both                all-to-all over seq = 2 as ulysses with P, plus the ring over
              ring = P/2 on H/2 heads: 2 * (R-1)/R * B*S*(Hkv/2)*D*b

Ring and hybrid run causal in the zigzag layout prepared on the data side
(``layout="zigzag"``); the natural layout adds an exchange of q, k, v and the output. Their
collective-permutes sit in a loop, so bytes are weighted by the loop's trip count
(``hlo.executed_collective_bytes``). With P = 1 no collective is needed and all are 0. The
default dtype is float32 because the CPU compiler widens bfloat16 collectives to float32 (GPU
compilers keep bfloat16). The plot needs matplotlib.

  python -m benchmarks.comm_volume [--json benchmarks/results/comm_volume.json] \\
      [--plot benchmarks/plots/comm_volume.png]
"""

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

from benchmarks.common import check_plotting, print_table, save_figure, write_json
from ulysses_jax import make_mesh, ulysses_attention
from ulysses_jax.aot import hlo
from ulysses_jax.attention.baselines import allgather_kv_attention, ring_attention
from ulysses_jax.attention.ulysses import plan_heads

HYBRID_SEQ = 2  # the hybrid's all-to-all degree; its ring takes the other P / 2 devices
# scheme: (attention, extra kwargs, mesh (seq, ring) for P devices, collectives it uses)
SCHEMES = {
    "ulysses": (ulysses_attention, {}, lambda p: (p, 1), ("all-to-all",)),
    "allgather": (allgather_kv_attention, {}, lambda p: (p, 1), ("all-gather",)),
    "ring": (ring_attention, {"layout": "zigzag"}, lambda p: (p, 1), ("collective-permute",)),
    "hybrid": (ulysses_attention, {"layout": "zigzag"}, lambda p: (HYBRID_SEQ, p // HYBRID_SEQ),
               ("all-to-all", "collective-permute")),
}


def expected_bytes(scheme, *, batch, seq_len, q_heads, kv_heads, head_dim, shards, itemsize):
  if shards == 1:
    return 0
  tokens = batch * seq_len * head_dim * itemsize  # bytes of one head over the sequence
  if scheme == "allgather":
    return 2 * kv_heads * tokens
  if scheme == "ring":
    return 2 * (shards - 1) * kv_heads * tokens // shards
  seq, ring = SCHEMES[scheme][2](shards)
  heads = plan_heads(q_heads, kv_heads, seq)
  all_to_all = (2 * heads.exchanged_q_heads + 2 * heads.exchanged_kv_heads) * tokens // shards
  return all_to_all + 2 * (ring - 1) * heads.exchanged_kv_heads * tokens // (ring * seq)


def measure(scheme, *, batch, seq_len, q_heads, kv_heads, head_dim, shards, dtype):
  attention, kwargs, mesh_shape, used = SCHEMES[scheme]
  seq, ring = mesh_shape(shards)
  mesh = make_mesh(data=1, seq=seq, ring=ring, devices=jax.devices()[:shards])
  q = jax.ShapeDtypeStruct((batch, seq_len, q_heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), dtype)
  forward = jax.jit(lambda q, k, v: attention(q, k, v, mesh=mesh, causal=True, **kwargs))
  totals = hlo.executed_collective_bytes(forward.lower(q, kv, kv).compile().as_text())
  expected = expected_bytes(scheme, batch=batch, seq_len=seq_len, q_heads=q_heads,
                            kv_heads=kv_heads, head_dim=head_dim, shards=shards,
                            itemsize=jnp.dtype(dtype).itemsize)
  measured = sum(totals[c] for c in used)
  return {"scheme": scheme, "S": seq_len, "P": shards, "seq": seq, "ring": ring,
          "Hq": q_heads, "Hkv": kv_heads, "collective": "+".join(c for c in used if totals[c]),
          "MiB_per_device": measured / 2**20, "expected_MiB": expected / 2**20,
          "ratio": measured / expected if expected else (1.0 if measured == 0 else float("inf")),
          "other_collective_bytes": sum(totals.values()) - measured}


def plot(rows, path, *, tokens_per_device, fixed_seq_len):
  """Per-device MiB against P: one panel per (head config, sweep); dashed = formula."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  heads = sorted({(r["Hq"], r["Hkv"]) for r in rows}, reverse=True)
  sweeps = {f"S/P = {tokens_per_device} fixed": lambda r: r["S"] == tokens_per_device * r["P"],
            f"S = {fixed_seq_len} fixed": lambda r: r["S"] == fixed_seq_len}
  fig, axes = plt.subplots(len(heads), 2, figsize=(11, 4.2 * len(heads)), squeeze=False)
  for (hq, hkv), row_axes in zip(heads, axes):
    for (sweep, in_sweep), ax in zip(sweeps.items(), row_axes):
      for i, scheme in enumerate(SCHEMES):
        pts = sorted((r["P"], r["MiB_per_device"], r["expected_MiB"]) for r in rows
                     if (r["Hq"], r["Hkv"], r["scheme"]) == (hq, hkv, scheme) and in_sweep(r)
                     and r["P"] > 1)
        if pts:
          p, measured, expected = zip(*pts)
          ax.plot(p, measured, "o-", color=f"C{i}", label=scheme)
          ax.plot(p, expected, "--", color=f"C{i}", alpha=0.5)
      ax.set(xticks=[2, 4, 8], xlabel="devices P",
             ylabel="MiB per device (forward)", title=f"Hq={hq}, Hkv={hkv}, {sweep}")
      ax.legend()
  save_figure(fig, "Attention forward collective bytes per device (markers: compiled HLO; "
              "dashed: formula)", path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens-per-device", type=int, default=4096)
  parser.add_argument("--fixed-seq-len", type=int, default=32768)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--heads", default="32:32,32:8", help="Hq:Hkv pairs")
  parser.add_argument("--shards", default="1,2,4,8", help="sequence shard counts P")
  parser.add_argument("--json", default="", help="write the rows here as JSON "
                      "(nothing is written without it)")
  parser.add_argument("--plot", default="", help="PNG path (needs matplotlib: the bench extra)")
  args = parser.parse_args(argv)
  check_plotting(parser, args.plot)
  rows = []
  heads = [tuple(map(int, pair.split(":"))) for pair in args.heads.split(",")]
  for q_heads, kv_heads in heads:
    for shards in map(int, args.shards.split(",")):
      for seq_len in sorted({args.tokens_per_device * shards, args.fixed_seq_len}):
        for scheme in SCHEMES:
          if scheme == "hybrid" and shards < 2 * HYBRID_SEQ:
            continue  # seq=2, ring=1 is plain Ulysses
          row = measure(scheme, batch=1, seq_len=seq_len, q_heads=q_heads, kv_heads=kv_heads,
                        head_dim=args.head_dim, shards=shards, dtype=jnp.dtype(args.dtype))
          row["sweep"] = "S/P fixed" if seq_len == args.tokens_per_device * shards else "S fixed"
          rows.append(row)
  print(f"Forward collective bytes per device, B=1, D={args.head_dim}, {args.dtype}, causal")
  print_table(rows, ["sweep", "scheme", "Hq", "Hkv", "S", "P", "seq", "ring", "collective",
                     "MiB_per_device", "expected_MiB", "ratio", "other_collective_bytes"])
  if args.json:
    write_json(args.json, rows)
  if args.plot:
    plot(rows, args.plot, tokens_per_device=args.tokens_per_device,
         fixed_seq_len=args.fixed_seq_len)
  return rows


if __name__ == "__main__":
  main()
