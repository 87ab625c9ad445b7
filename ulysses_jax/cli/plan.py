"""The planner's command line: ``ulysses-plan`` or ``python -m ulysses_jax.plan`` (the planner
itself: ``ulysses_jax.plan``).

    ulysses-plan --model=llama3.1-8b --seq_len=4194304 --devices=8 --gpu_mem=80 \\
        --host_mem_per_gpu=256

``--model`` is a preset, a checkpoint directory (a Hugging Face one or a ulysses_jax workdir:
the fine-tune's ``TrainConfig.init_from``), a ``config.json`` or a gin file (whose
``DataConfig.seq_len``, ``batch_size``, ``TrainConfig.accum_steps``, ``master_weights``,
``init_from`` and ``LlamaConfig.dtype``, ``param_dtype``, ``mlp_chunk`` are the defaults of
the flags of the same names; a fine-tuning gin file takes its checkpoint from
``--init_from``). The knobs a user would otherwise guess are searched unless given
(``ulysses_jax.plan.search``): precision, MLP tile, remat policy and groups, head chunks,
offload, mesh. It prints the feasible layouts, the recommendation first, and the
recommendation as the trainer's ``--gin_param`` settings and as the library's calls. When
nothing fits it prints the longest sequence that fits on these devices (and how) and the
fewest devices of this kind that fit the asked length, and exits 1; bad input exits 2; each
with one ``error:`` line (``ulysses_jax.cli``'s exit codes).

Units: GPU memory in GB (10^9 bytes) per device, by default the ``--gpu``'s capacity, and the
usable part is the budget ``aot``'s fit check uses (``Gpu.budget_bytes``); host memory in GB
per GPU (``--host_mem_per_gpu``), or per node (``--host_mem``, shared by the node's devices
in use); the header repeats both per device.

``--verify`` then compiles the recommended layout for the cluster (``--gpu``; ``--devices``
GPUs, ``--intra_node`` per node) with ``ulysses_jax.aot``, as ``ulysses-aot`` would: the
model's ``RunConfig`` with the layout put in by ``dataclasses.replace``. It prints the compiled
memory per device beside the prediction. It needs JAX's CUDA plugin (``make gpu-compile-venv``;
no GPU) and a preset, checkpoint directory or gin ``--model``.
"""

import argparse
import dataclasses

from ulysses_jax import cli
from ulysses_jax.cli import model_spec
from ulysses_jax.gpus import GPUS
from ulysses_jax.models.llama import PRESETS
from ulysses_jax.plan import search
from ulysses_jax.run_config import RunConfig
from ulysses_jax.plan.model import _DTYPE_BYTES, _GB, Hardware, Model

_GIB = 2**30
_HOST_GB_PER_GPU = 256.0


def _on_host_label(layout):
  return "opt+params" if layout.offload_params else "opt" if layout.offload_optimizer else "-"


def _precision_label(precision):
  short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[precision.param_dtype]
  return short + ("+master" if precision.master_weights else "")


def _format(rows, batch, seq_len):
  header = (f"{'data':>4} {'seq':>4} {'ring':>4} {'remat':>12} {'group':>5} {'chunks':>6} "
            f"{'on host':>10} {'params':>11} {'mlp tile':>8} "
            f"{'mem GiB':>7} {'host GB':>7} {'a2a GB':>7} {'ring GB':>7} {'fsdp GB':>7} "
            f"{'comm s':>7} {'step s':>8} {'tok/s':>9}")
  lines = [header]
  for r in rows:
    lay, mem, step = r["layout"], r["memory"], r["step"]
    comm = step["step_s"] - step["compute_s"]
    lines.append(
        f"{lay.data:>4} {lay.seq:>4} {lay.ring:>4} {lay.remat:>12} {lay.remat_group:>5} "
        f"{lay.attn_head_chunks:>6} {_on_host_label(lay):>10} "
        f"{_precision_label(r['precision']):>11} {r['mlp_chunk'] or 'none':>8} "
        f"{mem['total'] / _GIB:>7.1f} "
        f"{mem['host'] / _GB:>7.1f} {step['all_to_all_bytes'] / _GB:>7.2f} "
        f"{step['ring_bytes'] / _GB:>7.2f} "
        f"{step['fsdp_bytes'] / _GB:>7.2f} {comm:>7.3f} {step['step_s']:>8.2f} "
        f"{batch * seq_len / step['step_s']:>9.0f}")
  shown = {_precision_label(r["precision"]): r["precision"].trade_off for r in rows}
  lines += [f"  {label}: {trade_off}" for label, trade_off in shown.items()]
  return "\n".join(lines)


def _settings(row: dict, args) -> dict:
  """The row as the trainer's gin settings (``{"TrainConfig.mesh_seq": 8, ...}``)."""
  best, precision = row["layout"], row["precision"]
  settings = {
      "TrainConfig.mesh_data": best.data, "TrainConfig.mesh_seq": best.seq,
      "TrainConfig.mesh_ring": best.ring, "TrainConfig.accum_steps": args.accum_steps,
      "TrainConfig.offload_optimizer": best.offload_optimizer,
      "TrainConfig.offload_params": best.offload_params,
      "TrainConfig.master_weights": precision.master_weights,
      "LlamaConfig.remat_policy": best.remat, "LlamaConfig.remat_group": best.remat_group,
      "LlamaConfig.attn_head_chunks": best.attn_head_chunks,
      "LlamaConfig.mlp_chunk": row["mlp_chunk"],
      "LlamaConfig.dtype": args.dtype, "LlamaConfig.param_dtype": precision.param_dtype,
      "DataConfig.seq_len": args.seq_len, "DataConfig.batch_size": args.batch}
  if args.init_from:
    settings["TrainConfig.init_from"] = args.init_from
  return settings


def _gin_params(settings: dict) -> list[str]:
  """``settings`` as ``--gin_param`` values (``'LlamaConfig.remat_policy="full"'``)."""
  gin_value = lambda v: f'"{v}"' if isinstance(v, str) else v
  return [f"{k}={gin_value(v)}" for k, v in settings.items()]


def _recommendation(row: dict, args) -> str:
  """The row as the trainer's ``--gin_param`` settings and as the library's calls."""
  best, precision = row["layout"], row["precision"]
  flags = " \\\n".join(f"  --gin_param='{p}'" for p in _gin_params(_settings(row, args)))
  start = f"init_from={args.init_from!r}, " if args.init_from else ""
  return (f"({precision.trade_off})\nfor python -m ulysses_jax.train:\n{flags}\n"
          f"in Python: make_mesh(data={best.data}, seq={best.seq}, ring={best.ring}); "
          f"LlamaConfig(remat_policy={best.remat!r}, remat_group={best.remat_group}, "
          f"attn_head_chunks={best.attn_head_chunks}, mlp_chunk={row['mlp_chunk']}, "
          f"param_dtype={precision.param_dtype!r}); TrainConfig({start}"
          f"offload_optimizer={best.offload_optimizer}, offload_params={best.offload_params}, "
          f"master_weights={precision.master_weights}, accum_steps={args.accum_steps})")


def _mesh(text: str) -> tuple[int, int, int]:
  try:
    mesh = tuple(int(x) for x in text.split("x"))
  except ValueError:
    mesh = ()
  if len(mesh) != 3 or min(mesh) < 1:
    raise argparse.ArgumentTypeError(f"expected DATAxSEQxRING with positive integers, e.g. "
                                     f"1x8x1, got {text!r}")
  return mesh


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-plan", __doc__)
  add = p.add_argument
  add("--model", required=True, help="a preset, a checkpoint directory, a Hugging Face "
      "config.json or a gin file")
  add("--init_from", help="with a fine-tuning gin --model: the checkpoint it starts from")
  add("--seq_len", type=int, help="tokens per sequence (DataConfig.seq_len)")
  add("--devices", type=int, required=True)
  add("--gpu", default="h100", choices=sorted(GPUS),
      help="the GPU: its memory, speeds, and what --verify compiles for")
  add("--gpu_mem", type=float, help="GB (10^9 bytes) per device (default: the --gpu's)")
  add("--reserve_gib", type=float, help="GiB per device left to the CUDA context, the "
      "libraries and NCCL, as in aot (default: a tenth of the GPU's memory)")
  add("--intra_node", type=int, default=8, help="devices per node")
  host = p.add_mutually_exclusive_group()
  host.add_argument("--host_mem_per_gpu", type=float,
                    help=f"free host GB per GPU (default {_HOST_GB_PER_GPU:g})")
  host.add_argument("--host_mem", type=float, help="free host GB per node, shared by its "
                    "devices in use")
  add("--batch", type=int, help="sequences per step (default 1)")
  add("--accum_steps", type=int, help="micro-batches per step (default 1)")
  add("--dtype", choices=sorted(_DTYPE_BYTES),
      help="LlamaConfig.dtype (default: bfloat16, or the gin file's)")
  add("--param_dtype", choices=sorted(_DTYPE_BYTES), help="LlamaConfig.param_dtype "
      "(parameters, gradients, Adam moments; default: searched, or the gin file's)")
  master = p.add_mutually_exclusive_group()
  master.add_argument("--master_weights", action="store_true", default=None,
                      help="the optimizer updates a float32 copy of the parameters "
                           "(default: searched)")
  master.add_argument("--no_master_weights", dest="master_weights", action="store_false")
  add("--mlp_chunk", type=int, help="tokens per MLP tile, 0 untiled (default: searched)")
  add("--remat", choices=search.REMATS, help="LlamaConfig.remat_policy (default: searched)")
  add("--remat_group", type=int, help="LlamaConfig.remat_group (default: searched)")
  add("--head_chunks", type=int, help="LlamaConfig.attn_head_chunks (default: searched)")
  add("--offload", choices=sorted(search.OFFLOADS), help="state on the host: none, the "
      "optimizer's, or it and the layer parameters (default: searched)")
  add("--mesh", type=_mesh, help="DATAxSEQxRING (default: searched)")
  add("--top", type=int, default=12, help="rows to print")
  add("--verify", action="store_true", help="compile the recommendation for the GPUs with "
      "ulysses_jax.aot (needs JAX's CUDA plugin) and print its memory beside the prediction")
  return p


def _parse(argv):
  """The command line, with the model resolved and gin defaults applied; bad input exits 2
  with one ``error:`` line."""
  args = parser().parse_args(argv)
  try:
    base, run = model_spec.load(args.model, args.init_from)
  except ValueError as e:
    cli.fail(str(e), debug=args.debug)
  config = base.model
  for name, default in (("seq_len", None), ("batch", 1), ("accum_steps", 1),
                        ("master_weights", None), ("init_from", None)):
    if getattr(args, name) is None:
      setattr(args, name, run.get(name, default))
  from_gin = args.model.endswith(".gin")  # a gin file states its precision and MLP tile
  for name, default in (("dtype", "bfloat16"), ("param_dtype", None), ("mlp_chunk", None)):
    if getattr(args, name) is None:
      setattr(args, name, getattr(config, name) if from_gin else default)
  if args.seq_len is None:
    cli.fail("give --seq_len (tokens per sequence), or a gin --model that sets "
             "DataConfig.seq_len.")
  args.model_config, args.base = config, base
  return args


def _knobs(args, model: Model) -> search.Knobs:
  """The search's candidates, each given flag pinning its knob."""
  pinned = lambda value, candidates: candidates if value is None else (value,)
  try:
    precisions = search.precisions(args.param_dtype, args.master_weights)
  except ValueError as e:
    cli.fail(str(e), debug=args.debug)
  for flag, value, total in (("--head_chunks", args.head_chunks, model.num_kv_heads),
                             ("--remat_group", args.remat_group, model.num_layers)):
    if value is not None and (value < 1 or total % value):
      cli.fail(f"{flag} must divide {total} (the model's), got {value}; use one of "
               f"{[k for k in range(1, total + 1) if total % k == 0]}.")
  return search.Knobs(
      precisions=precisions, mlp_chunks=pinned(args.mlp_chunk, search.MLP_CHUNKS),
      remats=pinned(args.remat, search.REMATS),
      remat_groups=pinned(args.remat_group, search.REMAT_GROUPS),
      head_chunks=pinned(args.head_chunks, search.HEAD_CHUNKS),
      offloads=pinned(args.offload, tuple(search.OFFLOADS)), mesh=args.mesh)


def _gpu(args):
  """The ``--gpu`` with ``--gpu_mem`` and ``--reserve_gib`` applied."""
  gpu = GPUS[args.gpu]
  if args.gpu_mem is not None:
    gpu = dataclasses.replace(gpu, memory_bytes=int(args.gpu_mem * _GB))
  try:
    return gpu.with_reserve(args.reserve_gib)
  except ValueError as e:
    cli.fail(f"--reserve_gib: {e}", debug=args.debug)


def _hardware(args) -> Hardware:
  gpu = _gpu(args)
  per_gpu = (args.host_mem / min(args.devices, args.intra_node) if args.host_mem is not None
             else args.host_mem_per_gpu or _HOST_GB_PER_GPU)
  return Hardware.of(gpu, intra_node=args.intra_node, host_gb_per_gpu=per_gpu)


def _header(args, model, hardware) -> str:
  gpu = _gpu(args)
  memory, reserve = gpu.memory_bytes, gpu.runtime_reserve_bytes
  host = f"{hardware.host_bytes / _GB:g} GB of free host memory per GPU"
  if args.host_mem is not None:
    host += f" ({args.host_mem:g} GB per node, over {min(args.devices, args.intra_node)} GPUs)"
  return (f"{args.model}: {model.params / 1e9:.2f}B parameters, {args.batch} x "
          f"{args.seq_len:,} tokens (accum_steps={args.accum_steps}) on {args.devices} x "
          f"{gpu.name}, {args.intra_node} per node\n"
          f"usable GPU memory {hardware.budget_bytes / _GIB:.2f} GiB per device: {memory / _GB:g}"
          f" GB less the runtime reserve ({reserve / _GIB:.2f} GiB), the budget aot's fit check "
          f"uses; {host}")


def main(argv: list[str] | None = None) -> int:
  """The command line: 0 after printing the plan; 1 when no layout fits and 2 on bad input
  (``SystemExit`` with one ``error:`` line)."""
  run(argv)
  return cli.EXIT_OK


def run(argv: list[str] | None = None) -> dict:
  """Prints the plan and returns its recommended row; exits 1 when no layout fits, 2 on bad
  input."""
  args = _parse(argv)
  model = Model.from_config(args.model_config)
  hardware = _hardware(args)
  knobs = _knobs(args, model)
  sizes = dict(batch=args.batch, dtype=args.dtype, accum_steps=args.accum_steps, knobs=knobs)
  try:
    rows = search.plan(model, seq_len=args.seq_len, devices=args.devices, hardware=hardware,
                       **sizes)
  except ValueError as e:
    cli.fail(str(e), debug=args.debug)
  print(_header(args, model, hardware))
  if not rows:
    _no_fit(args, model, hardware, sizes)
  print(_format(rows[:args.top], args.batch, args.seq_len))
  print(f"recommended, of {len(rows)} feasible layouts (the best numerics within "
        f"{search.NEAR - 1:.0%} of the fastest), " + _recommendation(rows[0], args))
  if "experts" in rows[0]["step"]:
    print(f"experts: {rows[0]['step']['experts']['why']}")
  if args.verify:
    _verify(rows[0], args)
  return rows[0]


def _no_fit(args, model, hardware, sizes):
  """Says how far from fitting the question is, and exits 1."""
  longest = search.longest_seq_len(model, devices=args.devices, hardware=hardware, **sizes)
  if longest:
    row = search.plan(model, seq_len=longest, devices=args.devices, hardware=hardware,
                      **sizes)[0]
    lay = row["layout"]
    print(f"longest sequence that fits on these {args.devices} devices: {longest:,} tokens "
          f"(mesh {lay.data}x{lay.seq}x{lay.ring}, remat {lay.remat}, group "
          f"{lay.remat_group}, head chunks {lay.attn_head_chunks}, on host "
          f"{_on_host_label(lay)}, {_precision_label(row['precision'])}, MLP tile "
          f"{row['mlp_chunk'] or 'none'}; plan it with --seq_len={longest})")
    fits_here = f"the longest that fits is {longest:,} tokens"
  else:
    fits_here = f"not even {args.devices * search.LENGTH_STEP:,} tokens fit"
  if not search.splits(args.devices, batch=args.batch, seq_len=args.seq_len,
                       accum_steps=args.accum_steps):
    cli.fail(f"no layout of {args.devices} devices splits the work as the trainer needs: data "
             f"x accum_steps ({args.accum_steps}) must divide the batch ({args.batch}) and seq "
             f"x ring must divide the sequence length ({args.seq_len}); change --batch, "
             f"--accum_steps or --seq_len (e.g. a multiple of {args.devices}; {fits_here}).",
             code=cli.EXIT_FAILED)
  fewest = search.fewest_devices(model, seq_len=args.seq_len, hardware=hardware, **sizes)
  needed = (f"the fewest devices of this kind for {args.seq_len:,} tokens: {fewest:,}"
            if fewest else f"no count up to {search.MAX_DEVICES:,} devices of this kind fits "
            f"{args.seq_len:,} tokens")
  print(needed)
  cli.fail(f"no layout fits {args.seq_len:,} tokens on {args.devices} devices: {fits_here} "
           f"there; {needed}.", code=cli.EXIT_FAILED)


def _topology(devices: int, intra_node: int) -> str:
  """``ulysses_jax.aot``'s ``<slices>x<hosts>x<GPUs per host>`` for the planned cluster."""
  if devices <= intra_node:
    return f"1x1x{devices}"
  if devices % intra_node:
    cli.fail(f"--verify compiles for whole nodes: --devices ({devices}) must be a multiple "
             f"of --intra_node ({intra_node}), or at most one node.")
  return f"{devices // intra_node}x1x{intra_node}"


_CONFIG_FIELDS = {"TrainConfig": "train", "LlamaConfig": "model", "DataConfig": "data"}


def _layout_config(row: dict, args) -> RunConfig:
  """The ``--model``'s ``RunConfig`` with ``row``'s layout put in (``_settings``, the same
  values the recommendation prints for the trainer)."""
  if not args.model.endswith(".gin") and args.model not in PRESETS and not args.init_from:
    cli.fail(f"--verify compiles a preset, a checkpoint directory or a gin --model, got "
             f"{args.model!r}: give the directory holding it, or write the model as a gin file "
             f"(LlamaConfig.* bindings) and give --model=that.gin.")
  changes = {}
  for key, value in _settings(row, args).items():
    cls, field = key.split(".")
    changes.setdefault(_CONFIG_FIELDS[cls], {})[field] = value
  return dataclasses.replace(args.base, **{
      name: dataclasses.replace(getattr(args.base, name), **fields)
      for name, fields in changes.items()})


def _verify(row: dict, args):
  """Compiles ``row``'s layout for ``args.gpu`` GPUs, as is and under memory pressure
  (``aot.report.UNDER_PRESSURE``), and prints compiled vs predicted GiB: the prediction is
  the footprint XLA reaches when memory is tight, the smaller of the two."""
  topology = _topology(args.devices, args.intra_node)
  config = _layout_config(row, args)
  try:
    from ulysses_jax.aot.report import compile_config  # pylint: disable=import-outside-toplevel
    report = compile_config(config, args.gpu, topology, under_pressure=True,
                            reserve_gib=args.reserve_gib)
  except (ValueError, TypeError, OSError) as e:  # AotError is a ValueError
    cli.fail(f"--verify: {e}", debug=args.debug)
  memory = row["memory"]
  device = report["least_device_bytes"]
  print(f"verified: compiled for {topology} {report['gpu']} in {report['compile_s']:.0f} s, "
        f"GiB per device (predicted / compiled / error):")
  for name, predicted, compiled in (("device", memory["total"], device),
                                    ("host", memory["host"], report["host_bytes"])):
    error = f"{predicted / compiled - 1:+.0%}" if compiled else "-"
    print(f"  {name:6} {predicted / _GIB:8.2f} {compiled / _GIB:8.2f} {error:>6}")
  print(f"  (device: the smaller of the step compiled as is, {report['device_bytes'] / _GIB:.2f}"
        f", and under memory pressure, {report['device_bytes_under_pressure'] / _GIB:.2f})")
  print(f"  the compiled step {'fits' if report['fits'] else 'DOES NOT FIT'} in the budget, "
        f"{report['budget_bytes'] / _GIB:.2f} GiB")
