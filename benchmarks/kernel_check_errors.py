"""What the first-contact check measures, per tensor: each backend's output and q/k/v gradients
on the check's problem (``ulysses_jax.kernel_check``) against its float32 XLA reference without
the mesh, as the largest absolute difference and as the check's error (``|difference| /
max(1, |reference|)``), with the largest |reference| value. On a ring the dK/dV sums grow with the
tokens a key serves, and bf16 rounding with them: the error is what the tolerances bound.

  python -m benchmarks.kernel_check_errors [--mesh_seq 1] [--mesh_ring 8] [--backends xla]
      [--heads 32] [--kv_heads 8] [--head_dim 128] [--dtype bfloat16] [--json PATH]

Runs on this machine's devices (on CPU: 8 virtual devices, ``--cpu_devices``); the problem has
``kernel_check.RING_CHECK_LEN`` tokens per ring device (``CHECK_LEN`` without a ring).
"""

import argparse
import os

COLUMNS = ["backend", "tensor", "max_abs_diff", "max_abs_reference", "error", "tolerance"]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mesh_seq", type=int, default=1)
  parser.add_argument("--mesh_ring", type=int, default=8)
  parser.add_argument("--backends", nargs="+", default=["xla"])
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv_heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--cpu_devices", type=int, default=8,
                      help="virtual CPU devices where there is no GPU")
  parser.add_argument("--json", default="", help="also write the rows here")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={args.cpu_devices}").strip()
  import jax  # after the device count is set
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.common import print_table, write_json
  from ulysses_jax import make_mesh, ulysses_attention
  from ulysses_jax.kernel_check import AttentionKind, compare, make_case

  mesh = make_mesh(data=-1, seq=args.mesh_seq, ring=args.mesh_ring)
  shapes = dict(dtype=args.dtype, head_dim=args.head_dim, num_q_heads=args.heads,
                num_kv_heads=args.kv_heads, causal=True, segment_ids_given=True)
  problem = make_case(AttentionKind(None), shapes, mesh, "auto", seq_len=2**20).problem
  (q, k, v, d_out, segment_ids), expected = compare.prepare(problem)
  rows = []
  for backend in args.backends:
    def outputs(q, k, v, d_out, segment_ids, backend=backend):
      attend = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, segment_ids=segment_ids,
                                                 backend=backend)
      out, vjp = jax.vjp(attend, q, k, v)
      return tuple(x.astype(jnp.float32) for x in (out, *vjp(d_out)))
    got = jax.device_get(jax.jit(outputs)(q, k, v, d_out, segment_ids))
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, jax.device_get(expected)):
      diff = np.abs(g - want)
      rows.append({"backend": backend, "tensor": name, "max_abs_diff": float(diff.max()),
                   "max_abs_reference": float(np.abs(want).max()),
                   "error": float((diff / np.maximum(1.0, np.abs(want))).max()),
                   "tolerance": problem.tolerance})
  print(f"{dict(mesh.shape)} on {jax.devices()[0].device_kind}, {problem.seq_len} tokens "
        f"({problem.seq_len // args.mesh_ring} per ring device), {args.dtype}, "
        f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, packed documents")
  print_table(rows, COLUMNS)
  if args.json:
    write_json(args.json, rows, mesh=dict(mesh.shape))


if __name__ == "__main__":
  main()
