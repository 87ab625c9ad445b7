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
recommendation as the trainer's ``--gin_param`` settings and as the library's calls, its step
time by term (each collective with its group, NVLink or the network, and its bandwidth) and
why its mesh places ``seq`` and ``ring`` where it does (``plan.report.placement``). When
nothing fits it prints the longest sequence that fits on these devices (and how) and the
fewest devices of this kind that fit the asked length, and exits 1; bad input exits 2; each
with one ``error:`` line (``ulysses_jax.cli``'s exit codes). ``--json=OUT`` writes the answer
too: the question, the hardware, the recommendation (mesh, knobs, memory, step and its
breakdown, why), every feasible row, or what fits instead (``nothing_fits``).

Topology: GPUs come in NVLink domains of ``--intra_node`` (default: the ``--gpu``'s, 8 for
H100/H200/A100/B200 nodes, 72 for a GB200 NVL72 rack), or give ``--nodes`` (the devices split
evenly over them; with ``--nodes`` alone, ``--devices`` defaults to nodes x the GPU's
domain); ``--network_gb_s`` is the network per GPU per direction (default: the GPU's, 50 GB/s:
one 400 Gb/s NIC per GPU).

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
from ulysses_jax.cli import model_spec, plan_generate, plan_text
from ulysses_jax.gpus import GB as _GB, GPUS
from ulysses_jax.models.llama import PRESETS
from ulysses_jax.plan import moe, report, search
from ulysses_jax.plan.hardware import Hardware
from ulysses_jax.plan.model import DTYPE_BYTES as _DTYPE_BYTES, Model
from ulysses_jax.run_config import RunConfig

_GIB = 2**30
_HOST_GB_PER_GPU = 256.0


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
  add("--devices", type=int, help="GPUs in all (default with --nodes: nodes x the GPU's "
      "NVLink domain)")
  add("--gpu", default="h100", choices=sorted(GPUS),
      help="the GPU: its memory, speeds, and what --verify compiles for")
  add("--gpu_mem", type=float, help="GB (10^9 bytes) per device (default: the --gpu's)")
  add("--reserve_gib", type=float, help="GiB per device left to the CUDA context, the "
      "libraries and NCCL, as in aot (default: a tenth of the GPU's memory)")
  topology = p.add_mutually_exclusive_group()
  topology.add_argument("--intra_node", type=int, help="GPUs per NVLink domain (a node; "
                        "default: the --gpu's, 8, or 72 for gb200)")
  topology.add_argument("--nodes", type=int, help="NVLink domains the devices are spread over "
                        "evenly")
  add("--network_gb_s", type=float, help="network GB/s per GPU per direction (default: the "
      "--gpu's, 50: one 400 Gb/s NIC per GPU)")
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
  add("--expert_placement", choices=("auto", *moe.PLACEMENTS), default="auto",
      help="with experts: the LlamaConfig.expert_placement to model, or auto: the one "
      "plan.moe recommends for each layout (its values moved and memory)")
  add("--top", type=int, default=12, help="rows to print")
  gen = p.add_argument_group("generation (--generate: ulysses_jax.plan.generate)")
  gen.add_argument("--generate", action="store_true", help="plan generation, not training")
  gen.add_argument("--prompt_len", type=int, help="tokens per prompt")
  gen.add_argument("--max_new_tokens", type=int, default=128, help="new tokens per prompt")
  gen.add_argument("--prefill_chunk", type=int, help="prefill in chunks of this many tokens "
                   "(default: one pass)")
  cli.add_json_flag(p, "the answer")
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
  if args.seq_len is None and not args.generate:
    cli.fail("give --seq_len (tokens per sequence), or a gin --model that sets "
             "DataConfig.seq_len.")
  _topology_flags(args)
  args.model_config, args.base = config, base
  return args


def _topology_flags(args):
  """``--devices``, ``--nodes`` and ``--intra_node`` made consistent (``args.intra_node``
  set), or one error line."""
  domain = GPUS[args.gpu].nvlink_domain
  if args.devices is None and args.nodes is None:
    cli.fail("give --devices (GPUs in all), or --nodes (then --devices defaults to nodes x "
             f"{domain}, the {args.gpu}'s NVLink domain).")
  for flag in ("devices", "nodes", "intra_node"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      cli.fail(f"--{flag} must be >= 1, got {getattr(args, flag)}.")
  if args.nodes is not None:
    args.devices = args.devices or args.nodes * domain
    if args.devices % args.nodes:
      cli.fail(f"--devices ({args.devices}) must split evenly over --nodes ({args.nodes}): "
               f"give a multiple of {args.nodes}.")
    args.intra_node = args.devices // args.nodes
  elif args.intra_node is None:
    args.intra_node = domain


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
  try:
    return Hardware.of(gpu, intra_node=args.intra_node, host_gb_per_gpu=per_gpu,
                       network_gb_s=args.network_gb_s)
  except ValueError as e:
    cli.fail(str(e), debug=args.debug)


def _header(args, model, hardware) -> str:
  gpu = _gpu(args)
  memory, reserve = gpu.memory_bytes, gpu.runtime_reserve_bytes
  host = f"{hardware.host_bytes / _GB:g} GB of free host memory per GPU"
  if args.host_mem is not None:
    host += f" ({args.host_mem:g} GB per node, over {min(args.devices, args.intra_node)} GPUs)"
  return (f"{args.model}: {model.params / 1e9:.2f}B parameters, {args.batch} x "
          f"{args.seq_len:,} tokens (accum_steps={args.accum_steps}) on {args.devices} x "
          f"{gpu.name}, {args.intra_node} per NVLink domain (NVLink "
          f"{hardware.intra_bw / _GB:.0f} GB/s, network {hardware.inter_bw / _GB:.0f} GB/s per "
          f"GPU, achieved)\n"
          f"usable GPU memory {hardware.budget_bytes / _GIB:.2f} GiB per device: {memory / _GB:g}"
          f" GB less the runtime reserve ({reserve / _GIB:.2f} GiB), the budget aot's fit check "
          f"uses; {host}")


def main(argv: list[str] | None = None) -> int:
  """The command line: 0 after printing the plan; 1 when no layout fits and 2 on bad input
  (``SystemExit`` with one ``error:`` line)."""
  run(argv)
  return cli.EXIT_OK


def run(argv: list[str] | None = None) -> dict:
  """Prints the plan (and writes ``--json``) and returns its recommended row; exits 1 when
  no layout fits, 2 on bad input."""
  args = _parse(argv)
  if args.generate:
    return plan_generate.run(args, _gpu(args))
  model = dataclasses.replace(Model.from_config(args.model_config),
                              expert_placement=args.expert_placement)
  hardware = _hardware(args)
  knobs = _knobs(args, model)
  sizes = dict(batch=args.batch, dtype=args.dtype, accum_steps=args.accum_steps, knobs=knobs)
  try:
    rows = search.plan(model, seq_len=args.seq_len, devices=args.devices, hardware=hardware,
                       **sizes)
  except ValueError as e:
    cli.fail(str(e), debug=args.debug)
  print(_header(args, model, hardware))
  answer = {"question": _question(args, model), "hardware": dataclasses.asdict(hardware),
            "fits": bool(rows), "recommendation": None, "rows": [], "nothing_fits": None}
  if not rows:
    answer["nothing_fits"], message = _no_fit(args, model, hardware, sizes)
    _write_json(args, answer)
    cli.fail(message, code=cli.EXIT_FAILED)
  print(plan_text.format_rows(rows[:args.top], args.batch, args.seq_len))
  print(f"recommended, of {len(rows)} feasible layouts (the best numerics within "
        f"{search.NEAR - 1:.0%} of the fastest), " + plan_text.recommendation(rows[0], args))
  why = report.placement(rows, hardware)
  print(plan_text.breakdown(rows[0]) + "\nwhy this mesh: " + why["text"])
  tokens = args.batch * args.seq_len
  answer["recommendation"] = {**report.describe(rows[0], hardware, tokens), "why": why,
                              "gin_params": plan_text.gin_params(plan_text.settings(rows[0], args))}
  answer["rows"] = [report.describe(r, hardware, tokens) for r in rows]
  _write_json(args, answer)
  if "experts" in rows[0]["step"]:
    experts = rows[0]["step"]["experts"]
    source = "recommended" if args.expert_placement == "auto" else "--expert_placement"
    print(f"experts: {experts['why']}\nthe step and memory above model expert_placement = "
          f"{experts['placement']!r} ({source})")
  if args.verify:
    _verify(rows[0], args)
  return rows[0]


def _question(args, model):
  return {"model": args.model, "params": model.params, "seq_len": args.seq_len,
          "batch": args.batch, "accum_steps": args.accum_steps, "devices": args.devices,
          "gpu": args.gpu, "intra_node": args.intra_node,
          "nodes": -(-args.devices // args.intra_node)}


def _write_json(args, answer):
  if args.json:
    cli.write_json(args.json, answer)
    print(f"wrote {args.json}")


def _no_fit(args, model, hardware, sizes) -> tuple[dict, str]:
  """How far from fitting the question is (printed, and as JSON) and the error line."""
  longest = search.longest_seq_len(model, devices=args.devices, hardware=hardware, **sizes)
  answer = {"longest_seq_len": longest, "longest_layout": None, "fewest_devices": None,
            "splits": True}
  if longest:
    row = search.plan(model, seq_len=longest, devices=args.devices, hardware=hardware,
                      **sizes)[0]
    lay = row["layout"]
    answer["longest_layout"] = report.describe(row, hardware, args.batch * longest)
    print(f"longest sequence that fits on these {args.devices} devices: {longest:,} tokens "
          f"(mesh {lay.data}x{lay.seq}x{lay.ring}, remat {lay.remat}, group "
          f"{lay.remat_group}, head chunks {lay.attn_head_chunks}, on host "
          f"{plan_text.on_host_label(lay)}, {plan_text.precision_label(row['precision'])}, "
          f"MLP tile {row['mlp_chunk'] or 'none'}; plan it with --seq_len={longest})")
    fits_here = f"the longest that fits is {longest:,} tokens"
  else:
    fits_here = f"not even {args.devices * search.LENGTH_STEP:,} tokens fit"
  if not search.splits(args.devices, batch=args.batch, seq_len=args.seq_len,
                       accum_steps=args.accum_steps):
    answer["splits"] = False
    return answer, (
        f"no layout of {args.devices} devices splits the work as the trainer needs: data "
        f"x accum_steps ({args.accum_steps}) must divide the batch ({args.batch}) and seq "
        f"x ring must divide the sequence length ({args.seq_len}); change --batch, "
        f"--accum_steps or --seq_len (e.g. a multiple of {args.devices}; {fits_here}).")
  fewest = search.fewest_devices(model, seq_len=args.seq_len, hardware=hardware, **sizes)
  answer["fewest_devices"] = fewest
  needed = (f"the fewest devices of this kind for {args.seq_len:,} tokens: {fewest:,}"
            if fewest else f"no count up to {search.MAX_DEVICES:,} devices of this kind fits "
            f"{args.seq_len:,} tokens")
  print(needed)
  return answer, (f"no layout fits {args.seq_len:,} tokens on {args.devices} devices: "
                  f"{fits_here} there; {needed}.")


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
  return config_with_settings(args.base, plan_text.settings(row, args))


def config_with_settings(base: RunConfig, settings: dict) -> RunConfig:
  """``base`` with gin-style ``settings`` (``{"TrainConfig.mesh_seq": 8, ...}``, what the
  recommendation prints for the trainer) put in."""
  changes = {}
  for key, value in settings.items():
    cls, field = key.split(".")
    changes.setdefault(_CONFIG_FIELDS[cls], {})[field] = value
  return dataclasses.replace(base, **{
      name: dataclasses.replace(getattr(base, name), **fields)
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
  print(_fit_line(report))


def _fit_line(report: dict) -> str:
  """Whether the step a run compiles (XLA's limit at the budget) fits; where only the step
  compiled under memory pressure does, that the trainer runs that one (``train.fit``) and the
  flag that does the same for another program."""
  budget = f"{report['budget_bytes'] / _GIB:.2f} GiB"
  if report["fits"]:
    return f"  the compiled step fits in the budget, {budget}"
  line = f"  the compiled step DOES NOT FIT in the budget, {budget}"
  if report["device_bytes_under_pressure"] <= report["budget_bytes"]:
    from ulysses_jax.aot.report import UNDER_PRESSURE_XLA_FLAGS  # pylint: disable=import-outside-toplevel
    line += ("; compiled under memory pressure it does, and ulysses-train runs that program "
             "(it recomputes more: a slower step). Your own loop gets the same with "
             f"XLA_FLAGS={UNDER_PRESSURE_XLA_FLAGS}")
  return line
