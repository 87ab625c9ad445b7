"""Compile a config's train step for a GPU cluster, on any machine, and say whether it fits.

  ulysses-aot --gpu=h100 --topology=1x1x8 --gin_file=configs/llama1b_128k.gin \\
      [--gin_param=...] [--reserve_gib=G] [--json=PATH]

(or ``python -m ulysses_jax.aot``.) Builds the step ``ulysses-train`` would run for the config
on that cluster (``step_builder.build_train_step``: same model, mesh, state layout, offload,
accumulation), compiles it with XLA's GPU compiler for compile-only devices (no GPU needed;
JAX's CUDA plugin is: ``make gpu-compile-venv``), and prints per-device memory on the GPU and
the host, collectives, kernels, FLOPs, compile time and a roofline prediction of the step
time. The step fits when its device bytes are at most the budget: the GPU's memory less the
runtime reserve (the CUDA context, cuBLAS/cuDNN, NCCL: ``ulysses_jax.gpus``), the pool the
trainer gives XLA; the compile aims at the same budget as XLA does in the run
(``aot.report.budget_options``). Exit codes (``ulysses_jax.cli``): 0 fits, 1 does not fit (the
shortfall is printed), 2 bad input (unknown GPU, malformed topology, a config the trainer
would refuse, no CUDA plugin).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot start without a GPU

from ulysses_jax import cli  # noqa: E402
from ulysses_jax.aot.devices import gpu_devices, gpu_spec, parse_topology  # noqa: E402
from ulysses_jax.cli import gin_config  # noqa: E402
from ulysses_jax.gpus import GPUS, RUNTIME_RESERVE_FRACTION  # noqa: E402


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-aot", __doc__)
  p.add_argument("--gpu", default="h100", help="one of " + ", ".join(GPUS))
  p.add_argument("--topology", default="1x1x8",
                 help="<slices>x<hosts per slice>x<GPUs per host>, e.g. 4x1x8")
  cli.add_gin_flags(p)
  p.add_argument("--reserve_gib", type=float,
                 help="GPU memory (GiB per GPU) left to the CUDA context, the libraries and "
                      f"NCCL; a step fits when it needs at most the rest (default: "
                      f"{RUNTIME_RESERVE_FRACTION * 100:.0f}%% of the GPU)")
  cli.add_json_flag(p)
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  from ulysses_jax.aot.report import compile_and_report, format_report
  try:  # every input checked before the compile
    spec, nodes, built = _inputs(args)
  except cli.BAD_INPUT as e:
    return cli.report(e, args.debug)
  report = compile_and_report(built, spec, nodes=nodes)
  print(format_report(report))
  if args.json:
    cli.write_json(args.json, report)
  return cli.EXIT_OK if report["fits"] else cli.EXIT_FAILED


def _inputs(args):
  """(the GPU with its reserve, nodes, the step built on compile-only devices)."""
  from ulysses_jax import step_builder  # pylint: disable=import-outside-toplevel
  spec = gpu_spec(args.gpu).with_reserve(args.reserve_gib)
  slices, hosts, _ = parse_topology(args.topology)
  config = gin_config.read(args.gin_file, args.gin_param)
  mesh = step_builder.run_mesh(config.train, gpu_devices(args.gpu, args.topology))
  return spec, slices * hosts, step_builder.build_train_step(config, mesh)
