"""python -m ulysses_jax.doctor [--json PATH] [--seq-lens 4096,16384,65536] [--no-step]

Checks this machine's devices for training: environment, every attention kernel against the
dense reference and its TFLOP/s, and one small training step against aot's prediction and
compiled memory (see ``ulysses_jax.doctor``). Exit status: 0 every check passed, 1 a check
failed, 2 bad arguments.
"""

import argparse
import sys

from ulysses_jax.benchmarking import format_table
from ulysses_jax.cli import json_path, write_json

KERNEL_COLUMNS = ["kernel", "S", "causal", "B", "H", "err_out", "err_grad", "fwd_tflops",
                  "bwd_tflops", "fa3_fwd_tflops", "status"]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ulysses_jax.doctor", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", type=json_path, help="also write the report as JSON here")
  parser.add_argument("--seq-lens", type=_lengths, default=None,
                      help="comma-separated sequence lengths of the kernel rows (default: "
                           "4096,16384,65536 on GPUs, 512,1024 on CPUs)")
  parser.add_argument("--no-step", action="store_true", help="skip the training step")
  args = parser.parse_args(argv)
  from ulysses_jax import distributed  # pylint: disable=import-outside-toplevel
  distributed.reserve_gpu_memory()  # the pool the trainer gives XLA, before JAX starts
  import ulysses_jax.doctor as doctor  # pylint: disable=import-outside-toplevel  (starts JAX)
  report = doctor.run(args.seq_lens, with_step=not args.no_step)
  print(format_report(report))
  if args.json:
    write_json(args.json, report, default=str)
    print(f"wrote {args.json}")
  return 0 if report["passed"] else 1


def format_report(report: dict) -> str:
  """The text the command prints: environment, kernel table, step, checks, verdict."""
  lines = [f"{key}: {value}" for key, value in report["environment"].items()]
  auto = report["auto_backend"]
  lines.append(f"attention_backend='auto' picks {auto['backend']}: {auto['reason']}"
               + (f" (falls back to {', '.join(auto['fallbacks'])})" if auto["fallbacks"] else ""))
  lines += ["", f"attention kernels: bf16, head dim {report['head_dim']}; check: relative L2 "
            f"error < {report['tolerance']} against the float32 dense reference",
            report["flops_formula"], f"fa3_fwd_tflops: {report['fa3_source']}",
            format_table([{**r, "status": r["status"][:60]} for r in report["kernels"]],
                         KERNEL_COLUMNS)]
  if "step" in report:
    s = report["step"]
    lines += ["", f"training step: {s['model']} ({s['layers']} layers), {s['seq_len']:,} "
              f"tokens, mesh {s['mesh']}: {s['step_s']:.4f} s measured"
              + (f", {s['predicted_step_s']:.4f} s predicted (roofline)"
                 if "predicted_step_s" in s else "")
              + f"; memory {s['compiled_memory_gib']:.3f} GiB compiled"
              + (f", {s['peak_memory_gib']:.3f} GiB peak measured"
                 if s["peak_memory_gib"] is not None else "")]
  verdict = {True: "ok", False: "FAILED", None: "cannot run here"}
  kernel_checks = [c for c in report["checks"] if c["name"].startswith("kernel ")]
  counts = {word: sum(c["passed"] is value for c in kernel_checks)
            for value, word in verdict.items()}
  lines += ["", "checks:", "  kernels: " + ", ".join(f"{n} {word}" for word, n in counts.items())]
  lines += [f"  {verdict[c['passed']]:7s} {c['name']}: {c['detail']}" for c in report["checks"]
            if c not in kernel_checks or c["passed"] is False]
  failed = [c["name"] for c in report["checks"] if c["passed"] is False]
  lines += ["", f"FAILED: {', '.join(failed)}" if failed else "every check that can run here "
            "passed"]
  return "\n".join(lines)


def _lengths(text: str) -> tuple[int, ...]:
  try:
    lengths = tuple(int(part) for part in text.split(","))
  except ValueError:
    lengths = ()
  if not lengths or min(lengths) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. "
                                     f"4096,16384, got {text!r}")
  return lengths


if __name__ == "__main__":
  sys.exit(main())
