"""How fast is our Pallas flash attention, against cuDNN, JAX's Pallas kernels and XLA?

Forward and forward+backward TFLOP/s for each implementation on the same bf16 inputs, against
the device's measured bf16 matmul TFLOP/s (the ceiling). Before timing, each implementation
is checked against the float32 dense reference on the same inputs: output rows at 128 sampled
query positions, and dq (those rows), dk, dv for an output cotangent that is nonzero only on
those rows (the reference then needs only the sampled rows, so it fits at S = 64K).
Implementations that fail to compile or run are skipped with the reason.

Run on a GPU (one H100/H200 run of the default grid takes a few minutes):
  python -m benchmarks.attention_kernels [--seq-lens 4096,16384,65536] [--head-dims 64,128]
      [--impls ours,ours_mosaic,cudnn,pallas_triton,pallas_mgpu,xla,xla_chunked] [--sweep]
      [--json PATH]
"ours" is our flash attention with the Triton-lowered kernels, "ours_mosaic" the same with the
Hopper kernels of ``ulysses_jax.kernels.flash_hopper`` (forward) and ``flash_hopper_backward``
(dq, dk/dv; head dims 64 and 128). A row's bwd column is the backward kernel's.
Smoke test on CPU (interpret mode, tiny shapes):
  python -m benchmarks.attention_kernels --tiny
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, print_table, time_fn, write_json
from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.kernels.flash_attention import flash_attention, choose_tiles

FLOPS_FORMULA = ("FLOPs: forward 4*B*S^2*H*D, backward 2.5x forward (forward+backward 3.5x), "
                 "halved for causal; TFLOP/s = FLOPs / median wall time; bwd = (fwd+bwd) - fwd.")
TOLERANCE = 2e-2    # relative L2 error vs the float32 reference, bf16 inputs
SAMPLED_ROWS = 128
SWEEP_BLOCKS = ((64, 64), (128, 64), (64, 128), (128, 128))


def implementations(causal, head_dim, *, interpret, sweep):
  """name -> factory; a factory returns ``fn(q, k, v) -> out`` or raises (the skip reason)."""
  scale = head_dim ** -0.5

  def ours(block_q=None, block_kv=None, kernel="triton"):
    return functools.partial(flash_attention, causal=causal, block_q=block_q,
                             block_kv=block_kv, interpret=interpret, forward_kernel=kernel,
                             backward_kernel=kernel)

  def ours_mosaic():
    if interpret:  # GPU interpret mode runs them in the tests; far too slow for a benchmark
      raise RuntimeError("the Mosaic GPU kernels need a Hopper GPU")
    return ours(kernel="mosaic")

  def cudnn():
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation="cudnn")

  def pallas_triton():
    from jax.experimental.pallas.ops.gpu import attention
    return lambda q, k, v: attention.mha(q, k, v, None, sm_scale=scale, causal=causal,
                                         interpret=interpret)

  def pallas_mgpu():
    if interpret:
      raise RuntimeError("Mosaic GPU kernels need a Hopper GPU")
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal, block_q_dkv=64,
        block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    # This kernel has no scale argument: scale q (an O(S) elementwise op, timed with it).
    return lambda q, k, v: attention_mgpu.attention(q * jnp.asarray(scale, q.dtype), k, v,
                                                    config)

  def xla():
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation="xla")

  def xla_chunked():
    return functools.partial(chunked_attention, causal=causal)

  impls = {"ours": ours, "ours_mosaic": ours_mosaic}
  if sweep:
    impls.update({f"ours[{bq}x{bk}]": functools.partial(ours, bq, bk) for bq, bk in SWEEP_BLOCKS})
  impls.update(cudnn=cudnn, pallas_triton=pallas_triton, pallas_mgpu=pallas_mgpu, xla=xla,
               xla_chunked=xla_chunked)
  return impls


def matmul_peak_tflops(size):
  """Best measured bf16 matmul TFLOP/s over square sizes up to ``size``."""
  best = 0.0
  for n in (size // 2, size):
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    timing = time_fn(jax.jit(jnp.matmul), a, a, warmup=2, iters=10)
    best = max(best, 2 * n ** 3 / timing["median_s"] / 1e12)
  return best


def relative_error(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def reference_on_rows(q, k, v, d_out, rows, causal):
  """Float32 out[:, rows] and (dq[:, rows], dk, dv) for a cotangent nonzero only on ``rows``."""
  with jax.default_matmul_precision("highest"):
    def sampled(q_rows, k, v):
      return dense_attention(q_rows, k, v, causal=causal, q_positions=rows)
    f32 = lambda x: x.astype(jnp.float32)
    out, vjp = jax.vjp(sampled, f32(q[:, rows]), f32(k), f32(v))
    return jax.device_get((out, *vjp(f32(d_out[:, rows]))))


def measure(fn, q, k, v, d_out, rows, reference, *, warmup, iters):
  """Checks ``fn`` against the sampled reference, then times forward and forward+backward.

  Any failure (compile, run, out of memory) ends the measurement with the reason as status;
  a failed check leaves that phase untimed.
  """
  row = {}
  forward = jax.jit(fn)

  @jax.jit
  def forward_backward(q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d_out)

  phase = "forward"
  try:
    row["err_out"] = relative_error(forward(q, k, v)[:, rows], reference[0])
    if row["err_out"] > TOLERANCE:
      return {**row, "status": f"FAILED check: out error {row['err_out']:.2e}"}
    row["fwd"] = time_fn(forward, q, k, v, warmup=warmup, iters=iters)
    phase = "backward"
    sparse_d_out = jnp.zeros_like(d_out).at[:, rows].set(d_out[:, rows])
    _, (dq, dk, dv) = forward_backward(q, k, v, sparse_d_out)
    row["err_grad"] = max(relative_error(dq[:, rows], reference[1]),
                          relative_error(dk, reference[2]), relative_error(dv, reference[3]))
    if row["err_grad"] > TOLERANCE:
      return {**row, "status": f"FAILED check: gradient error {row['err_grad']:.2e}"}
    row["fwd_bwd"] = time_fn(forward_backward, q, k, v, d_out, warmup=warmup, iters=iters)
  except Exception as e:  # noqa: BLE001 - any failure means "skip, and say why"
    return {**row, "status": f"{phase} skipped: {type(e).__name__}: {e}".replace("\n", " ")}
  return {**row, "status": "ok"}


def throughput(result, flops, peak):
  """TFLOP/s and % of the matmul peak of the timed phases in ``result`` (see FLOPS_FORMULA)."""
  columns = {}
  if "fwd" in result:
    fwd_s = result["fwd"]["median_s"]
    columns.update(fwd_ms=fwd_s * 1e3, fwd_tflops=flops / fwd_s / 1e12)
    columns["fwd_pct_peak"] = 100 * columns["fwd_tflops"] / peak
  if "fwd_bwd" in result:
    total_s = result["fwd_bwd"]["median_s"]
    columns.update(fwd_bwd_ms=total_s * 1e3, fwd_bwd_tflops=3.5 * flops / total_s / 1e12)
    if total_s > fwd_s:  # timing noise on tiny CPU runs can invert them
      columns["bwd_tflops"] = 2.5 * flops / (total_s - fwd_s) / 1e12
      columns["bwd_pct_peak"] = 100 * columns["bwd_tflops"] / peak
  return columns


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq-lens", default="4096,16384,65536")
  parser.add_argument("--head-dims", default="64,128")
  parser.add_argument("--impls", default="all", help="comma-separated names, or all")
  parser.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // S)")
  parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // D")
  parser.add_argument("--sweep", action="store_true", help=f"also time ours at {SWEEP_BLOCKS}")
  parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode")
  parser.add_argument("--json", default="", help="write the rows here as JSON "
                      "(nothing is written without it)")
  args = parser.parse_args()
  if args.tiny:
    args.seq_lens, args.head_dims, args.tokens, args.hidden = "128,200", "64", 256, 128
  interpret = jax.default_backend() != "gpu"
  known = implementations(True, 64, interpret=interpret, sweep=args.sweep)
  chosen = list(known) if args.impls == "all" else args.impls.split(",")
  if unknown := [name for name in chosen if name not in known]:
    parser.error(f"unknown --impls {unknown}; choose from {list(known)}")
  warmup, iters = (1, 2) if args.tiny else (2, 10)

  env = environment()
  for key, value in env.items():
    print(f"{key}: {value}")
  peak = matmul_peak_tflops(512 if args.tiny else 8192)
  print(f"measured bf16 matmul peak: {peak:.1f} TFLOP/s (the ceiling for %peak)")
  print(FLOPS_FORMULA)
  print(f"check: relative L2 error < {TOLERANCE} vs float32 dense reference on "
        f"{SAMPLED_ROWS} sampled query rows (out, dq) and dk, dv")

  rows_out = []
  for head_dim in map(int, args.head_dims.split(",")):
    for seq_len in map(int, args.seq_lens.split(",")):
      batch, heads = max(1, args.tokens // seq_len), args.hidden // head_dim
      keys = jax.random.split(jax.random.PRNGKey(seq_len + head_dim), 4)
      q, k, v, d_out = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.bfloat16)
                        for key in keys)
      rows = np.unique(np.linspace(0, seq_len - 1, min(SAMPLED_ROWS, seq_len)).astype(np.int32))
      for causal in (True, False):
        plan = choose_tiles(seq_len, head_dim, causal=causal, scale=head_dim ** -0.5,
                            interpret=interpret)
        print(f"\nB={batch} S={seq_len} H={heads} D={head_dim} causal={causal}; ours: "
              f"fwd {plan.forward}, dq {plan.dq}, dkv {plan.dkv}", flush=True)
        reference = reference_on_rows(q, k, v, d_out, rows, causal)
        flops = 4 * batch * seq_len ** 2 * heads * head_dim * (0.5 if causal else 1.0)
        impls = implementations(causal, head_dim, interpret=interpret, sweep=args.sweep)
        for name in chosen:
          try:
            fn = impls[name]()
          except Exception as e:  # noqa: BLE001
            result = {"status": f"skipped: {type(e).__name__}: {e}".replace("\n", " ")}
          else:
            result = measure(fn, q, k, v, d_out, rows, reference, warmup=warmup, iters=iters)
          row = {"impl": name, "S": seq_len, "D": head_dim, "causal": causal, "B": batch,
                 "H": heads, **result, **throughput(result, flops, peak)}
          print(f"  {name}: {row['status']}", flush=True)
          rows_out.append(row)
        del reference

  columns = ["impl", "S", "D", "causal", "fwd_ms", "fwd_tflops", "fwd_pct_peak", "fwd_bwd_ms",
             "fwd_bwd_tflops", "bwd_tflops", "bwd_pct_peak", "err_out", "err_grad", "status"]
  print()
  print_table([{**r, "status": r["status"][:80]} for r in rows_out], columns)
  if args.json:
    write_json(args.json, rows_out, matmul_peak_tflops=peak, flops_formula=FLOPS_FORMULA,
               tolerance=TOLERANCE, sampled_rows=SAMPLED_ROWS, interpret=interpret,
               tokens=args.tokens, hidden=args.hidden)


if __name__ == "__main__":
  main()
