"""How long the trainer's first-contact check takes to compile on a GPU cluster's mesh.

The check (``ulysses_jax.kernel_check``) runs tiny problems, so on GPUs its time is almost all
compilation. This compiles its programs for compile-only GPUs (``ulysses_jax.aot``: XLA's GPU
compiler, no GPU attached, not run): the reference (XLA chunked attention, float32, replicated)
and each backend's check program (forward and backward of ``ulysses_attention`` on the mesh and
the comparison), for the shapes of Llama-3.1-8B's attention (bf16, 32 query / 8 KV heads, head
dim 128, packed documents), full attention and a window of 4,096 decided for a run of 128K
tokens per ring device (where it fits one ring step, the kernels' windowed ring), on each mesh.
Wall seconds of ``lower`` and ``compile`` on this machine, each from cold caches, so a lower
bound of the check's time on a machine as fast: Mosaic GPU kernels are built when loaded (not
here), nothing is autotuned, and the check also runs the programs and, per process, gathers one
scalar.

  JAX_PLATFORMS=cpu .venv-gpu-compile/bin/python -m benchmarks.kernel_check_compile \\
      [--gpu=h100] [--meshes 2x4 8x4] [--json=benchmarks/results/kernel_check_compile_h100.json]
"""

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from ulysses_jax import make_mesh
from ulysses_jax.kernel_check import AttentionKind, compare, make_case

COLUMNS = ["mesh", "gpus", "attention", "backend", "lower_s", "compile_s", "total_s"]
SHAPES = dict(dtype=jnp.bfloat16, head_dim=128, num_q_heads=32, num_kv_heads=8, causal=True,
              segment_ids_given=True)
KINDS = (AttentionKind(None), AttentionKind(4096))
RUN_TOKENS_PER_RING_DEVICE = 131_072
BACKENDS = ("reference", "pallas_mosaic", "pallas", "xla")


def compile_seconds(program, *args) -> tuple[float, float]:
  """(lower, compile) wall seconds of a jitted ``program`` on abstract ``args``, JAX's caches
  cleared first (the trainer's check compiles cold)."""
  jax.clear_caches()
  start = time.perf_counter()
  lowered = program.lower(*args)
  lowered_at = time.perf_counter()
  lowered.compile()
  return lowered_at - start, time.perf_counter() - lowered_at


def mesh_rows(gpu: str, seq: int, ring: int) -> list[dict]:
  from ulysses_jax import aot  # pylint: disable=import-outside-toplevel  (needs the plugin)
  devices = aot.gpu_devices(gpu, f"1x{max(1, seq * ring // 8)}x{min(8, seq * ring)}")
  mesh = make_mesh(data=1, seq=seq, ring=ring, devices=devices)
  rows = []
  for kind in KINDS:
    case = make_case(kind, SHAPES, mesh, "auto", seq_len=ring * RUN_TOKENS_PER_RING_DEVICE)
    inputs = case.problem.input_specs()
    with jax.default_matmul_precision("highest"):
      expected = jax.eval_shape(compare.reference_program(case.problem), *inputs)
    for backend in BACKENDS:
      if backend == "reference":
        with jax.default_matmul_precision("highest"):
          lower_s, compile_s = compile_seconds(compare.reference_program(case.problem), *inputs)
      else:
        lower_s, compile_s = compile_seconds(compare.error_program(backend, case.problem),
                                             *inputs, expected)
      rows.append({"mesh": f"seq {seq} x ring {ring}", "gpus": seq * ring,
                   "attention": case.label, "backend": backend, "lower_s": lower_s,
                   "compile_s": compile_s, "total_s": lower_s + compile_s})
      print_table(rows[-1:], COLUMNS)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gpu", default="h100", help="an ulysses_jax.aot GPU: h100, h200, ...")
  parser.add_argument("--meshes", nargs="+", default=["2x4", "8x4"],
                      help="seq x ring of each mesh (GPUs = seq * ring; 8 per node)")
  parser.add_argument("--json", default="", help="also write the rows here")
  args = parser.parse_args()
  rows = []
  for mesh in args.meshes:
    seq, ring = (int(n) for n in mesh.split("x"))
    rows += mesh_rows(args.gpu, seq, ring)
  print(f"\ncompiled for {args.gpu.upper()} GPUs (not run), jax {jax.__version__}; seconds on "
        "this machine, a lower bound of the check's time")
  print_table(rows, COLUMNS)
  if args.json:
    write_json(args.json, rows, gpu=args.gpu)


if __name__ == "__main__":
  main()
