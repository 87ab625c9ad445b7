"""Each attention kernel against the dense reference, then timed: the doctor's kernel rows
(and ``benchmarks/attention_kernels.py``'s measurement).

The check compares a kernel's output at sampled query rows, and dq at those rows, dk and dv
for an output cotangent that is nonzero only on them, with the float32 dense reference
(``attention.reference.dense_attention``) on the same bf16 inputs: the reference then needs
only the sampled rows, so it fits at S = 64K. A kernel that fails the check is not timed.
"""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax.attention import backends
from ulysses_jax.attention.reference import dense_attention
from ulysses_jax.doctor.timing import time_fn

FLOPS_FORMULA = ("FLOPs: forward 4*B*S^2*H*D, backward 2.5x forward (forward+backward 3.5x), "
                 "halved for causal; TFLOP/s = FLOPs / median wall time; bwd = (fwd+bwd) - fwd.")
TOLERANCE = 2e-2    # relative L2 error vs the float32 reference, bf16 inputs
SAMPLED_ROWS = 128
TIMED_S = 3.0  # a phase's timed calls stop after this long (``time_fn``'s ``max_s``)


def relative_error(actual, expected) -> float:
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def sampled_rows(seq_len: int) -> np.ndarray:
  """Up to ``SAMPLED_ROWS`` query positions spread over the sequence, first and last included."""
  return np.unique(np.linspace(0, seq_len - 1, min(SAMPLED_ROWS, seq_len)).astype(np.int32))


def reference_on_rows(q, k, v, d_out, rows, causal):
  """Float32 out[:, rows] and (dq[:, rows], dk, dv) for a cotangent nonzero only on ``rows``."""
  with jax.default_matmul_precision("highest"):
    def sampled(q_rows, k, v):
      return dense_attention(q_rows, k, v, causal=causal, q_positions=rows)
    f32 = lambda x: x.astype(jnp.float32)
    out, vjp = jax.vjp(sampled, f32(q[:, rows]), f32(k), f32(v))
    return jax.device_get((out, *vjp(f32(d_out[:, rows]))))


def forward_backward(fn):
  """``(q, k, v, d_out) -> (out, (dq, dk, dv))`` of ``fn(q, k, v) -> out``."""
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d_out)
  return run


PHASES = ("forward", "backward")


def compile_ahead(fns, arrays, threads, phases=None) -> dict:
  """``{name: {phase: Future}}``: the forward and forward+backward programs of ``fns`` (name ->
  ``fn(q, k, v) -> out``; only the phases ``phases[name]`` where given), compiled for ``arrays``
  ``(q, k, v, d_out)`` in ``threads`` threads, for ``measure``'s ``programs``. XLA compiles with
  the GIL released, so several kernels' programs compile at once (their tracing and lowering,
  in Python, one at a time). All are done on return, so that none compiles while a row is timed
  (a thread holding the GIL would delay the timed calls' dispatch)."""
  def compile_(f, args):
    return jax.jit(f).lower(*args).compile()

  programs = {"forward": lambda fn: (fn, arrays[:3]),
              "backward": lambda fn: (forward_backward(fn), arrays)}
  with concurrent.futures.ThreadPoolExecutor(threads) as compiler:
    return {name: {phase: compiler.submit(compile_, *programs[phase](fn))
                   for phase in (phases or {}).get(name, PHASES)}
            for name, fn in fns.items()}


def measure(fn, q, k, v, d_out, rows, reference, *, warmup, iters,
            phases=PHASES, programs=None):
  """Checks ``fn(q, k, v) -> out`` against the sampled reference, then times forward and
  forward+backward (``phases``: the forward alone, or only the gradients and forward+backward,
  one compile each, where only that phase changed). ``programs``: those phases' programs
  compiled ahead (``compile_ahead``); else they compile here.

  Any failure (compile, run, out of memory) ends the measurement with the reason as status;
  a failed check leaves that phase untimed.
  """
  def program(phase):  # inside the try below: a failed compile's reason becomes the status
    if programs is not None:
      return programs[phase].result()
    return jax.jit(fn if phase == "forward" else forward_backward(fn))

  row = {}
  phase = "forward"
  try:
    if "forward" in phases:
      forward = program("forward")
      row["err_out"] = relative_error(forward(q, k, v)[:, rows], reference[0])
      if row["err_out"] > TOLERANCE:
        return {**row, "status": f"FAILED check: out error {row['err_out']:.2e}"}
      row["fwd"] = time_fn(forward, q, k, v, warmup=warmup, iters=iters, max_s=TIMED_S)
    if "backward" not in phases:
      return {**row, "status": "ok"}
    phase = "backward"
    both = program("backward")
    sparse_d_out = jnp.zeros_like(d_out).at[:, rows].set(d_out[:, rows])
    _, (dq, dk, dv) = both(q, k, v, sparse_d_out)
    row["err_grad"] = max(relative_error(dq[:, rows], reference[1]),
                          relative_error(dk, reference[2]), relative_error(dv, reference[3]))
    if row["err_grad"] > TOLERANCE:
      return {**row, "status": f"FAILED check: gradient error {row['err_grad']:.2e}"}
    row["fwd_bwd"] = time_fn(both, q, k, v, d_out, warmup=warmup, iters=iters,
                             max_s=TIMED_S)
  except Exception as e:  # noqa: BLE001 - any failure means "skip, and say why"
    return {**row, "status": f"{phase} skipped: {type(e).__name__}: {e}".replace("\n", " ")}
  return {**row, "status": "ok"}


def throughput(result, flops, peak=None):
  """TFLOP/s (and % of ``peak`` TFLOP/s when given) of the timed phases in ``result`` (see
  ``FLOPS_FORMULA``)."""
  columns = {}
  if "fwd" in result:
    fwd_s = result["fwd"]["median_s"]
    columns.update(fwd_ms=fwd_s * 1e3, fwd_tflops=flops / fwd_s / 1e12)
  if "fwd_bwd" in result:
    total_s = result["fwd_bwd"]["median_s"]
    columns.update(fwd_bwd_ms=total_s * 1e3, fwd_bwd_tflops=3.5 * flops / total_s / 1e12)
    if "fwd" in result and total_s > fwd_s:  # noise on tiny CPU runs can invert them
      columns["bwd_tflops"] = 2.5 * flops / (total_s - fwd_s) / 1e12
  if peak:
    for phase in ("fwd", "bwd"):
      if f"{phase}_tflops" in columns:
        columns[f"{phase}_pct_peak"] = 100 * columns[f"{phase}_tflops"] / peak
  return columns


def attention_flops(batch, seq_len, heads, head_dim, causal) -> float:
  """Forward FLOPs of attention (``FLOPS_FORMULA``)."""
  return 4 * batch * seq_len ** 2 * heads * head_dim * (0.5 if causal else 1.0)


def backend_fn(backend: str, causal: bool, head_dim: int):
  """``fn(q, k, v) -> out`` of one of ``backends.BACKENDS`` (resolved), full sequence, no
  segment ids: what the local attention after the all-to-all runs."""
  scale = head_dim ** -0.5
  return lambda q, k, v: backends.local_attention(backend, q, k, v, causal=causal,
                                                  segment_ids=None, scale=scale)


def unavailable(backend: str, target) -> str | None:
  """Why ``backend`` cannot run on ``target`` (None if it can)."""
  if backend != "xla" and not target.on_gpu:
    return "needs a GPU"
  if backend == "pallas_mosaic" and (target.compute_capability or 0.0) < 9.0:
    return (f"not for this GPU: needs compute capability >= 9.0 (Hopper), "
            f"{target.device_kind} has {target.compute_capability}")
  return None
