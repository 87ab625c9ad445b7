"""ulysses-doctor [--json PATH] [--seq_lens 4096,16384,65536] [--no_kernels] [--no_decode]
    [--no_step] [--mesh_seq P --mesh_ring R]

(or ``python -m ulysses_jax.doctor``.) Checks this machine's devices for training: environment,
every attention kernel against the dense reference and its TFLOP/s, the split-K decode kernel
against XLA's decode and a copy's bandwidth (Hopper GPUs), and one small training step against
aot's prediction and compiled memory (see ``ulysses_jax.doctor``); ``--no_kernels``,
``--no_decode`` and ``--no_step`` leave a part out. With
``--mesh_ring`` R > 1 (and ``--mesh_seq`` P, default 1), also the ring check a run on that mesh
does before its first step (``TrainConfig.mesh_seq``, ``mesh_ring``; the data axis takes the
devices left), for every backend a ring runs. Exit codes (``ulysses_jax.cli``): 0 every check
passed, 1 a check failed, 2 bad arguments.
"""

import argparse

from ulysses_jax import cli, metrics
from ulysses_jax.doctor.decode import check as decode_check
from ulysses_jax.doctor.timing import format_table
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.mesh import make_mesh

KERNEL_COLUMNS = ["kernel", "S", "causal", "B", "H", "err_out", "err_grad", "fwd_tflops",
                  "bwd_tflops", "fa3_fwd_tflops", "status"]
RING_COLUMNS = ["kernel", "attention", "H", "KV", "max_error", "tolerance", "seconds",
                "status"]


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-doctor", __doc__)
  cli.add_json_flag(p)
  p.add_argument("--seq_lens", type=_lengths, default=None,
                 help="comma-separated sequence lengths of the kernel rows (default: "
                      "4096,16384,65536 on GPUs, 512,1024 on CPUs)")
  p.add_argument("--no_kernels", action="store_true",
                 help="skip the attention kernels' rows (minutes on a GPU)")
  p.add_argument("--no_decode", action="store_true", help="skip the decode kernel's rows")
  p.add_argument("--no_step", action="store_true", help="skip the training step")
  p.add_argument("--mesh_seq", type=_positive, default=1,
                 help="the ring check's seq axis (Ulysses, within a node); needs --mesh_ring")
  p.add_argument("--mesh_ring", type=_positive, default=1,
                 help="the ring check's ring axis (across nodes): > 1 runs the ring check")
  cli.add_platform_flags(p)
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)

  def body() -> int:
    if args.mesh_seq > 1 and args.mesh_ring == 1:
      raise ConfigError(f"--mesh_seq={args.mesh_seq} shapes the ring check, which needs "
                        "--mesh_ring > 1 (without a ring the kernel rows check the attention "
                        "a seq mesh runs)")
    cli.start_jax(args)  # the pool the trainer gives XLA, before JAX starts
    import ulysses_jax.doctor as doctor  # pylint: disable=import-outside-toplevel  (heavy)
    ring_mesh = None
    if args.mesh_ring > 1:
      try:
        ring_mesh = make_mesh(data=-1, seq=args.mesh_seq, ring=args.mesh_ring)
      except ValueError as e:
        raise ConfigError(f"--mesh_seq/--mesh_ring: {e}") from e
    report = doctor.run(args.seq_lens, with_step=not args.no_step, on_row=_print_row,
                        ring_mesh=ring_mesh, on_ring_row=_print_ring_row,
                        with_kernels=not args.no_kernels, with_decode=not args.no_decode,
                        on_decode_row=_print_decode_row)
    print(format_report(report))
    if args.json:
      cli.write_json(args.json, report, default=str)
      print(f"wrote {args.json}")
    return cli.EXIT_OK if report["passed"] else cli.EXIT_FAILED
  return cli.run(body, args.debug, bad_input=(ConfigError,))


def format_report(report: dict) -> str:
  """The text the command prints: environment, kernel table, step, checks, verdict."""
  lines = [f"{key}: {value}" for key, value in report["environment"].items()]
  auto = report["auto_backend"]
  lines.append(f"attention_backend='auto' picks {auto['backend']}: {auto['reason']}"
               + (f" (falls back to {', '.join(auto['fallbacks'])})" if auto["fallbacks"] else ""))
  if report["kernels"]:
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
              + f"; {metrics.mfu_text(s['mfu'], s['mfu_datasheet'])}"
              + f"; memory {s['compiled_memory_gib']:.3f} GiB compiled"
              + (f", {s['peak_memory_gib']:.3f} GiB peak measured"
                 if s["peak_memory_gib"] is not None else "")]
  if "ring" in report:
    mesh = report["ring"][0]["mesh"]
    lines += ["", f"ring check on mesh {mesh}: each backend's ring forward and backward "
              "against the float32 XLA reference without the ring (as a run on this mesh checks "
              "it before its first step)",
              format_table([{**r, "status": r["status"][:60]} for r in report["ring"]],
                           RING_COLUMNS)]
  verdict = {True: "ok", False: "FAILED", None: "cannot run here"}
  lines += ["", "checks:"]
  counted = []
  for prefix, title in (("kernel ", "kernels"), ("ring ", "ring")):
    group = [c for c in report["checks"] if c["name"].startswith(prefix)]
    if group:
      counts = {word: sum(c["passed"] is value for c in group) for value, word in verdict.items()}
      lines.append(f"  {title}: " + ", ".join(f"{n} {word}" for word, n in counts.items()))
      counted += group
  lines += [f"  {verdict[c['passed']]:7s} {c['name']}: {c['detail']}" for c in report["checks"]
            if c not in counted or c["passed"] is False]
  failed = [c["name"] for c in report["checks"] if c["passed"] is False]
  lines += ["", f"FAILED: {', '.join(failed)}" if failed else "every check that can run here "
            "passed"]
  return "\n".join(lines)


def _print_row(row: dict) -> None:
  """One kernel row as it is done (the table at the end repeats them all)."""
  print("kernel " + " ".join(f"{c}={row[c]:.4g}" if isinstance(row.get(c), float)
                             else f"{c}={row.get(c)}" for c in KERNEL_COLUMNS), flush=True)


def _print_decode_row(row: dict) -> None:
  check = decode_check(row)
  print(f"decode {check['name']}: {check['detail']}", flush=True)


def _print_ring_row(row: dict) -> None:
  print("ring " + " ".join(f"{c}={row[c]:.4g}" if isinstance(row.get(c), float)
                           else f"{c}={row.get(c)}" for c in RING_COLUMNS), flush=True)


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
  return value


def _lengths(text: str) -> tuple[int, ...]:
  try:
    lengths = tuple(int(part) for part in text.split(","))
  except ValueError:
    lengths = ()
  if not lengths or min(lengths) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. "
                                     f"4096,16384, got {text!r}")
  return lengths
