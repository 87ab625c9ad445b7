"""Compile a config's train step for a GPU cluster, on any machine, and say whether it fits.

  ulysses-aot --gpu=h100 --topology=1x1x8 --gin_file=configs/llama1b_128k.gin \\
      [--gin_param=...] [--reserve_gib=G] [--json=PATH]
  ulysses-aot --generate (--preset=NAME | --init_from=DIR) --prompt_len=S [--max_new_tokens=N]
      [--batch=B] [--mesh_data=D] [--mesh_seq=P] [--mesh_ring=R] [--prefill_chunk=T]
      [--dtype=bfloat16] [--fsdp_params] [--decode_backend=auto|xla|mosaic] [--gpu=h100]
      [--topology=1x1x8] [--json=PATH]

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

With ``--generate`` it compiles generation instead (``ulysses_jax.aot.generate``): the prefill
(one pass, or one chunk of ``--prefill_chunk`` tokens) and one decode step of ``ulysses-generate``
for the model of a preset or checkpoint, prints the KV cache and each program's memory per
device, and predicts the prefill's and a token's time (compiled, not run); it fits when both
programs do. ``--decode_backend``: the decode step's attention (``generate.attention``).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot start without a GPU

from ulysses_jax import cli  # noqa: E402
from ulysses_jax.aot.devices import gpu_devices, gpu_spec, parse_topology  # noqa: E402
from ulysses_jax.cli import gin_config  # noqa: E402
from ulysses_jax.generate.attention import DECODE_BACKENDS  # noqa: E402
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
  g = p.add_argument_group("generation (--generate)")
  g.add_argument("--generate", action="store_true", help="compile generation, not training")
  g.add_argument("--preset", help="the model: a LlamaConfig preset")
  g.add_argument("--init_from", help="the model: a Hugging Face checkpoint or workdir's")
  g.add_argument("--prompt_len", type=int, help="tokens per prompt")
  g.add_argument("--max_new_tokens", type=int, default=128)
  g.add_argument("--batch", type=int, default=1, help="prompts at once")
  g.add_argument("--mesh_data", type=int, default=-1)
  g.add_argument("--mesh_seq", type=int, default=1)
  g.add_argument("--mesh_ring", type=int, default=1)
  g.add_argument("--prefill_chunk", type=int, default=0, help="0: the prompt in one pass")
  g.add_argument("--dtype", default="bfloat16", help="compute, cache and weights dtype")
  g.add_argument("--fsdp_params", action="store_true",
                 help="weights sharded as in training (default: replicated)")
  g.add_argument("--decode_backend", default="auto", choices=DECODE_BACKENDS,
                 help="the decode step's attention: our split-K Mosaic GPU kernel, XLA's, or "
                      "auto (the kernel on Hopper where it can take the cache)")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  if args.generate:
    return _generate(args)
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


def _generate(args) -> int:
  from ulysses_jax.aot import generate  # pylint: disable=import-outside-toplevel
  from ulysses_jax.hf import init_from as finetune
  from ulysses_jax.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  from ulysses_jax.models.config import preset  # pylint: disable=import-outside-toplevel
  try:  # every input checked before the compile
    if bool(args.preset) == bool(args.init_from):
      raise ValueError("--generate needs the model: give --preset=NAME or --init_from=DIR")
    if not args.prompt_len or args.prompt_len < 1:
      raise ValueError("--generate needs --prompt_len=S (tokens per prompt, >= 1)")
    dtypes = dict(dtype=args.dtype, param_dtype=args.dtype, remat_policy="none",
                  attn_head_chunks=1)
    config = (preset(args.preset, **dtypes) if args.preset else
              finetune.model_config(args.init_from).replace(**dtypes))
    setup = generate.GenerationSetup(
        prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens, batch=args.batch,
        chunk_len=args.prefill_chunk or None, mesh_data=args.mesh_data,
        mesh_seq=args.mesh_seq, mesh_ring=args.mesh_ring, fsdp_params=args.fsdp_params,
        decode_backend=args.decode_backend)
    gpu_spec(args.gpu)
    make_mesh(args.mesh_data, args.mesh_seq, args.mesh_ring,
              devices=gpu_devices(args.gpu, args.topology))
  except cli.BAD_INPUT as e:
    return cli.report(e, args.debug)
  report = generate.compile_generation(config, setup, args.gpu, args.topology,
                                       args.reserve_gib)
  print(generate.format_generation_report(report))
  if args.json:
    cli.write_json(args.json, report)
  fits = report["prefill"]["fits"] and report["decode"]["fits"]
  return cli.EXIT_OK if fits else cli.EXIT_FAILED
