"""Compile a config's train step for a GPU cluster, on any machine, and say whether it fits.

  python -m ulysses_jax.aot --gpu=h100 --topology=1x1x8 --gin_file=configs/llama1b_128k.gin \\
      [--gin_param=...] [--reserve_gib=G] [--json=PATH]

Builds the step ``python -m ulysses_jax.train`` would run for the config on that cluster
(same model, mesh, state layout, offload, accumulation), compiles it with XLA's GPU compiler
for compile-only devices (no GPU needed; JAX's CUDA plugin is: ``make gpu-compile-venv``),
and prints per-device memory on the GPU and the host, collectives, kernels, FLOPs, compile
time and a roofline prediction of the step time. The step fits when its device bytes are at
most the budget: the GPU's memory less the runtime reserve (the CUDA context, cuBLAS/cuDNN,
NCCL: ``ulysses_jax.gpus``), the pool the trainer gives XLA; the compile aims at the same
budget as XLA does in the run (``report.budget_options``). Exit status: 0 fits, 1 does not fit
(the shortfall is printed), 2 bad input (unknown GPU, malformed topology, a config the trainer
would refuse, no CUDA plugin).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot start without a GPU

from ulysses_jax.aot.devices import AotError, gpu_devices, gpu_spec, parse_topology  # noqa: E402
from ulysses_jax.cli import json_path, write_json  # noqa: E402
from ulysses_jax.gpus import GPUS, RUNTIME_RESERVE_FRACTION  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ulysses_jax.aot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gpu", default="h100", help="one of " + ", ".join(GPUS))
  parser.add_argument("--topology", default="1x1x8",
                      help="<slices>x<hosts per slice>x<GPUs per host>, e.g. 4x1x8")
  parser.add_argument("--gin_file", action="append", default=[], help="repeatable")
  parser.add_argument("--gin_param", action="append", default=[], help="repeatable")
  parser.add_argument("--reserve_gib", type=float,
                      help="GPU memory (GiB per GPU) left to the CUDA context, the libraries "
                           f"and NCCL; a step fits when it needs at most the rest (default: "
                           f"{RUNTIME_RESERVE_FRACTION:.0%} of the GPU)")
  parser.add_argument("--json", type=json_path, help="also write the report as JSON here")
  args = parser.parse_args(argv)
  from ulysses_jax.aot.report import compile_and_report, format_report
  from ulysses_jax.aot.step import build_train_step
  try:
    spec = gpu_spec(args.gpu).with_reserve(args.reserve_gib)
    slices, hosts, _ = parse_topology(args.topology)
    built = build_train_step(args.gin_file, args.gin_param, gpu_devices(args.gpu, args.topology))
  except (AotError, ValueError, TypeError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  report = compile_and_report(built, spec, nodes=slices * hosts)
  print(format_report(report))
  if args.json:
    write_json(args.json, report)
  return 0 if report["fits"] else 1


if __name__ == "__main__":
  sys.exit(main())
