"""``python -m ulysses_jax.doctor``: the first command to run on your GPUs.

It checks what a training run relies on, on the machine it runs on, in a few minutes:

* the environment: devices, JAX and jaxlib, the CUDA runtime and driver, and which attention
  kernel ``attention_backend="auto"`` picks here for a training run (bf16, head dim 128, GQA,
  causal, packed documents) and why;
* each attention kernel (our Mosaic GPU kernels for Hopper, our Triton-lowered kernels,
  cuDNN, the XLA chunked backend) against the float32 dense reference (bf16 inputs, head dim
  128, causal and full, S = 4K / 16K / 64K on GPUs), then its forward and backward TFLOP/s
  beside published FlashAttention-3 figures where they exist for the shape;
* our split-K decode kernel against XLA's decode attention (``doctor.decode``): both checked
  against float32 and timed over caches of 8K to 1M slots, each bandwidth also as a share of
  a device-to-device copy timed on the same GPU (Hopper GPUs only);
* with a ring mesh (``--mesh_seq``, ``--mesh_ring``), the trainer's first-contact check of
  every backend a ring runs, on that mesh of this machine's devices (``doctor.ring``);
* one training step of a small model on all devices present (``doctor.step``): its measured
  time against ``aot``'s roofline prediction of the same compiled step, and the runtime's peak
  memory against the compiled figure that ``aot``'s "fits" rests on.

On a machine without a GPU it runs the XLA backend and the small step, and every GPU-only
check says "needs a GPU". Exit status: 0 every check passed, 1 a check failed (the failures
are listed), 2 bad arguments.
"""

import os
import platform
import subprocess

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ulysses_jax.attention import backends
from ulysses_jax.doctor import decode as decode_lib
from ulysses_jax.doctor import kernels as kernels_lib
from ulysses_jax.doctor import ring as ring_lib
from ulysses_jax.doctor import step as step_lib
from ulysses_jax.kernels import target as target_lib

GPU_SEQ_LENS = (4096, 16384, 65536)
CPU_SEQ_LENS = (512, 1024)
HEAD_DIM = 128
# name in the table -> backend of ulysses_attention (attention.backends)
KERNELS = {"ours mosaic": "pallas_mosaic", "ours triton": "pallas", "cudnn": "cudnn",
           "xla chunked": "xla"}
# Their programs (both masks, forward and forward+backward: 8) compile in threads before the
# length's rows run (on an H200 the 16 rows of 4K and 16K took about 190 s, 2026-11-28, and a
# swept tile's row about 12 s, mostly compiling). cuDNN's and XLA's compile in their rows (their
# compiles may autotune on the GPU, which timing other kernels beside disturbs).
COMPILED_AHEAD = ("ours mosaic", "ours triton")
# FlashAttention-3 (Shah et al., arXiv 2407.08608, Figure 5: forward pass, BF16, head dim 128,
# without causal mask, H100 80GB SXM5, batch x S = 16K tokens, 2048 hidden), TFLOP/s as the
# figure labels its bars. The paper's causal panel is not transcribed here.
FA3_FORWARD_TFLOPS = {(4096, False): 638.0, (16384, False): 648.0}
FA3_SOURCE = ("FlashAttention-3 paper (arXiv 2407.08608), Fig. 5: forward, BF16, head dim 128, "
              "no causal mask, H100 SXM5, 16K tokens per batch")


def environment(devices: list) -> dict:
  """Devices and the versions a GPU report needs (driver and CUDA where there is a GPU)."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  first = devices[0]
  info = {"devices": f"{len(devices)} x {first.device_kind}", "platform": first.platform,
          "processes": jax.process_count(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "python": platform.python_version()}
  if target_lib.of_device(first).on_gpu:
    info["cuda"] = getattr(first.client, "platform_version", "unknown")
    info["compute_capability"] = getattr(first, "compute_capability", "unknown")
    info["driver"] = _nvidia_driver()
  return info


def kernel_rows(device, seq_lens, *, warmup: int, iters: int, on_row=None) -> list[dict]:
  """One row per kernel, sequence length and mask: the check against the reference and the
  throughput (``passed`` None where the kernel cannot run on ``device``). ``on_row(row)`` is
  called as each row is done (the command prints it: on a GPU the rows take minutes). Per
  length, our kernels' programs compile first, at once (``COMPILED_AHEAD``)."""
  target = target_lib.of_device(device)
  heads, tokens = (16, 16384) if target.on_gpu else (4, 1024)
  threads = min(4 * len(COMPILED_AHEAD), os.cpu_count() or 1)
  rows = []
  for seq_len in seq_lens:
    batch = max(1, tokens // seq_len)
    keys = jax.random.split(jax.random.PRNGKey(seq_len), 4)
    q, k, v, d_out = (jax.device_put(jax.random.normal(
        key, (batch, seq_len, heads, HEAD_DIM), jnp.bfloat16), device) for key in keys)
    rows_sampled = kernels_lib.sampled_rows(seq_len)
    fns = {(name, causal): kernels_lib.backend_fn(backend, causal, HEAD_DIM)
           for causal in (True, False) for name, backend in KERNELS.items()
           if not kernels_lib.unavailable(backend, target)}
    programs = kernels_lib.compile_ahead(
        {case: fn for case, fn in fns.items() if case[0] in COMPILED_AHEAD}, (q, k, v, d_out),
        threads)
    for causal in (True, False):
      reference = kernels_lib.reference_on_rows(q, k, v, d_out, rows_sampled, causal)
      flops = kernels_lib.attention_flops(batch, seq_len, heads, HEAD_DIM, causal)
      for name, backend in KERNELS.items():
        row = {"kernel": name, "S": seq_len, "causal": causal, "B": batch, "H": heads,
               "fa3_fwd_tflops": FA3_FORWARD_TFLOPS.get((seq_len, causal))}
        if (name, causal) not in fns:
          row.update(status=kernels_lib.unavailable(backend, target), passed=None)
        else:
          result = kernels_lib.measure(fns[name, causal], q, k, v, d_out, rows_sampled,
                                       reference, warmup=warmup, iters=iters,
                                       programs=programs.get((name, causal)))
          row.update(**result, **kernels_lib.throughput(result, flops),
                     passed=result["status"] == "ok")
        rows.append(row)
        if on_row:
          on_row(row)
    del programs
  return rows


def run(seq_lens=None, with_step: bool = True, on_row=None, ring_mesh: Mesh | None = None,
        on_ring_row=None, with_kernels: bool = True, with_decode: bool = True,
        on_decode_row=None) -> dict:
  """Every check on the devices of this process; the report (JSON-ready) with ``checks``
  (name, passed: True / False / None for "cannot run here", detail) and ``passed``.
  ``on_row`` as in ``kernel_rows``; with ``ring_mesh`` the ring check on it too
  (``doctor.ring``), ``on_ring_row`` called as each of its rows is done; ``with_kernels``,
  ``with_decode`` and ``with_step`` False leave out the attention kernels' rows, the decode
  kernel's and the step (``on_decode_row`` as ``on_row``, for the decode rows)."""
  devices = jax.devices()
  on_gpu = target_lib.of_device(devices[0]).on_gpu
  seq_lens = seq_lens or (GPU_SEQ_LENS if on_gpu else CPU_SEQ_LENS)
  warmup, iters = (2, 10) if on_gpu else (1, 2)
  choice = backends.choose_backend(dtype=jnp.bfloat16, head_dim=HEAD_DIM, num_q_heads=32,
                                   num_kv_heads=8, causal=True, segment_ids_given=True,
                                   mesh=jax.sharding.Mesh(devices[:1], ("d",)))
  report = {"environment": environment(devices), "head_dim": HEAD_DIM,
            "auto_backend": {"backend": choice.backend, "reason": choice.reason,
                             "fallbacks": list(choice.fallbacks)},
            "flops_formula": kernels_lib.FLOPS_FORMULA, "tolerance": kernels_lib.TOLERANCE,
            "fa3_source": FA3_SOURCE,
            "kernels": kernel_rows(devices[0], seq_lens, warmup=warmup, iters=iters,
                                  on_row=on_row) if with_kernels else []}
  checks = [{"name": f"kernel {r['kernel']} S={r['S']} causal={r['causal']}",
             "passed": r["passed"], "detail": r["status"]} for r in report["kernels"]]
  if with_decode:
    report["decode"] = decode_lib.decode_rows(devices[0], warmup=warmup, iters=iters,
                                              on_row=on_decode_row)
    checks += [decode_lib.check(row) for row in report["decode"]]
  if ring_mesh is not None:
    report["ring"] = ring_lib.ring_rows(ring_mesh, HEAD_DIM, on_row=on_ring_row)
    checks += [{"name": f"ring {r['kernel']} {r['attention']}", "passed": r["passed"],
                "detail": r["status"]} for r in report["ring"]]
  if with_step:
    report["step"] = step_lib.run_step(devices, on_gpu)
    checks += step_lib.checks(report["step"], on_gpu)
  report["checks"] = checks
  report["passed"] = all(c["passed"] is not False for c in checks)
  return report


def _nvidia_driver() -> str:
  """The NVIDIA driver version as nvidia-smi reports it, or why it is unknown."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return out.splitlines()[0].strip() if out.strip() else "unknown"
  except (OSError, subprocess.SubprocessError) as e:
    return f"unknown ({type(e).__name__})"
