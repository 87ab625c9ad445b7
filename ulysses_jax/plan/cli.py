"""The planner's command line: ``python -m ulysses_jax.plan`` (see ``ulysses_jax.plan``).

``--model`` is a preset, a Hugging Face ``config.json`` (or its directory) or a gin file
(whose ``DataConfig.seq_len``, ``batch_size``, ``TrainConfig.accum_steps`` and
``LlamaConfig.dtype``, ``param_dtype`` are the defaults of ``--seq-len``, ``--batch``,
``--accum-steps``, ``--dtype``, ``--param-dtype``). It prints the feasible layouts,
fastest first, and the recommendation as the trainer's ``--gin_param`` settings and as the
library's calls; it exits 1 when no layout fits and 2 on bad input, each with one
``error:`` line.

``--verify`` then compiles the recommended layout for the cluster (``--gpu``; ``--devices``
GPUs, ``--intra-node`` per node) with ``ulysses_jax.aot``, as ``python -m ulysses_jax.aot``
would, and prints the compiled memory per device beside the prediction. It needs JAX's CUDA
plugin (``make gpu-compile-venv``; no GPU) and a preset or gin ``--model``.
"""

import argparse
import os
import sys
import tempfile

from ulysses_jax import model_spec
from ulysses_jax.models.llama import PRESETS
from ulysses_jax.plan import _DTYPE_BYTES, _GB, Hardware, Layout, Model, layouts, plan

_GIB = 2**30


def _on_host_label(layout):
  return "opt+params" if layout.offload_params else "opt" if layout.offload_optimizer else "-"


def _format(rows, batch, seq_len):
  header = (f"{'data':>4} {'seq':>4} {'ring':>4} {'remat':>12} {'group':>5} {'chunks':>6} "
            f"{'on host':>10} "
            f"{'mem GB':>7} {'host GB':>7} {'a2a GB':>7} {'ring GB':>7} {'fsdp GB':>7} "
            f"{'comm s':>7} {'step s':>8} {'tok/s':>9}")
  lines = [header]
  for r in rows:
    lay, mem, step = r["layout"], r["memory"], r["step"]
    comm = step["step_s"] - step["compute_s"]
    lines.append(
        f"{lay.data:>4} {lay.seq:>4} {lay.ring:>4} {lay.remat:>12} {lay.remat_group:>5} "
        f"{lay.attn_head_chunks:>6} {_on_host_label(lay):>10} {mem['total'] / _GB:>7.1f} "
        f"{mem['host'] / _GB:>7.1f} {step['all_to_all_bytes'] / _GB:>7.2f} "
        f"{step['ring_bytes'] / _GB:>7.2f} "
        f"{step['fsdp_bytes'] / _GB:>7.2f} {comm:>7.3f} {step['step_s']:>8.2f} "
        f"{batch * seq_len / step['step_s']:>9.0f}")
  return "\n".join(lines)


def _settings(best: Layout, args) -> dict:
  """The layout as the trainer's gin settings (``{"TrainConfig.mesh_seq": 8, ...}``)."""
  return {
      "TrainConfig.mesh_data": best.data, "TrainConfig.mesh_seq": best.seq,
      "TrainConfig.mesh_ring": best.ring, "TrainConfig.accum_steps": args.accum_steps,
      "TrainConfig.offload_optimizer": best.offload_optimizer,
      "TrainConfig.offload_params": best.offload_params,
      "TrainConfig.master_weights": args.master_weights,
      "LlamaConfig.remat_policy": best.remat, "LlamaConfig.remat_group": best.remat_group,
      "LlamaConfig.attn_head_chunks": best.attn_head_chunks,
      "LlamaConfig.mlp_chunk": args.model_config.mlp_chunk,
      "LlamaConfig.dtype": args.dtype, "LlamaConfig.param_dtype": args.param_dtype,
      "DataConfig.seq_len": args.seq_len, "DataConfig.batch_size": args.batch}


def _gin_params(settings: dict) -> list[str]:
  """``settings`` as ``--gin_param`` values (``'LlamaConfig.remat_policy="full"'``)."""
  gin_value = lambda v: f'"{v}"' if isinstance(v, str) else v
  return [f"{k}={gin_value(v)}" for k, v in settings.items()]


def _recommendation(best: Layout, args) -> str:
  """The layout as the trainer's ``--gin_param`` settings and as the library's calls."""
  flags = " \\\n".join(f"  --gin_param='{p}'" for p in _gin_params(_settings(best, args)))
  return (f"for python -m ulysses_jax.train:\n{flags}\n"
          f"in Python: make_mesh(data={best.data}, seq={best.seq}, ring={best.ring}); "
          f"LlamaConfig(remat_policy={best.remat!r}, remat_group={best.remat_group}, "
          f"attn_head_chunks={best.attn_head_chunks}, "
          f"mlp_chunk={args.model_config.mlp_chunk}); init_train_state / make_train_step("
          f"offload_optimizer={best.offload_optimizer}, offload_params={best.offload_params}, "
          f"master_weights={args.master_weights}) with accum_steps={args.accum_steps}")


def _parse(argv):
  """The command line, with the model resolved and gin defaults applied; bad input exits 2
  with one ``error:`` line."""
  parser = argparse.ArgumentParser(description="Layout planner: which (data, seq, ring, remat, "
                                   "offload) to train a model at a sequence length.")
  parser.add_argument("--model", required=True,
                      help="a preset, a Hugging Face config.json (or its directory) or a gin file")
  parser.add_argument("--seq-len", type=int, help="tokens per sequence (DataConfig.seq_len)")
  parser.add_argument("--devices", type=int, required=True)
  parser.add_argument("--gpu-mem", type=float, default=80.0, help="GB per device")
  parser.add_argument("--intra-node", type=int, default=8, help="devices per node")
  parser.add_argument("--host-mem", type=float, default=Hardware.host_memory_gb,
                      help="host GB per node")
  parser.add_argument("--batch", type=int, help="sequences per step (default 1)")
  parser.add_argument("--accum-steps", type=int, help="micro-batches per step (default 1)")
  parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES),
                      help="LlamaConfig.dtype (default: bfloat16, or the gin file's)")
  parser.add_argument("--param-dtype", choices=sorted(_DTYPE_BYTES),
                      help="LlamaConfig.param_dtype (parameters, gradients, Adam moments; "
                           "default: float32, or the gin file's)")
  parser.add_argument("--master-weights", action="store_true",
                      help="the optimizer updates a float32 copy of the parameters")
  parser.add_argument("--mlp-chunk", type=int, default=None, help="tokens per MLP tile")
  parser.add_argument("--top", type=int, default=12, help="rows to print")
  parser.add_argument("--verify", action="store_true",
                      help="compile the recommendation for the GPUs with ulysses_jax.aot (needs "
                           "JAX's CUDA plugin) and print its memory beside the prediction")
  parser.add_argument("--gpu", default="h100", help="the GPU --verify compiles for")
  args = parser.parse_args(argv)
  try:
    config, run = model_spec.load(args.model)
    if args.mlp_chunk is not None:
      config = config.replace(mlp_chunk=args.mlp_chunk)
  except ValueError as e:
    _fail(str(e))
  for name, default in (("seq_len", None), ("batch", 1), ("accum_steps", 1)):
    if getattr(args, name) is None:
      setattr(args, name, run.get(name, default))
  for name, default in (("dtype", "bfloat16"), ("param_dtype", "float32")):
    if getattr(args, name) is None:  # run settings come from gin files only
      setattr(args, name, getattr(config, name) if run else default)
  if args.seq_len is None:
    _fail("give --seq-len (tokens per sequence), or a gin --model that sets DataConfig.seq_len.")
  args.model_config = config
  return args


def _fail(message: str, code: int = 2):
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(code)


def main(argv=None) -> dict:
  """Prints the plan and returns its fastest row; exits 1 when no layout fits, 2 on bad input."""
  args = _parse(argv)
  model = Model.from_config(args.model_config)
  hardware = Hardware(memory_gb=args.gpu_mem, intra_node=args.intra_node,
                      host_memory_gb=args.host_mem)
  try:
    rows = plan(model, seq_len=args.seq_len, devices=args.devices, hardware=hardware,
                batch=args.batch, dtype=args.dtype, param_dtype=args.param_dtype,
                master_weights=args.master_weights, accum_steps=args.accum_steps)
  except ValueError as e:
    _fail(str(e))
  print(f"{args.model}: {model.params / 1e9:.2f}B parameters, {args.batch} x {args.seq_len} "
        f"tokens (accum_steps={args.accum_steps}) on {args.devices} devices of "
        f"{args.gpu_mem:g} GB ({hardware.usable:.0%} usable), {args.intra_node} per node with "
        f"{args.host_mem:g} GB of host memory")
  if not rows:
    if not any(layouts(args.devices, args.batch, seq_len=args.seq_len,
                       accum_steps=args.accum_steps)):
      _fail(f"no layout of {args.devices} devices splits the work as the trainer needs: data x "
            f"accum_steps ({args.accum_steps}) must divide the batch ({args.batch}) and seq x "
            f"ring must divide the sequence length ({args.seq_len}); change --batch, "
            f"--accum-steps or --seq-len (e.g. a multiple of {args.devices}).", code=1)
    _fail("no layout fits in memory: add devices, lower --seq-len, or tile the MLP "
          "(--mlp-chunk).", code=1)
  print(_format(rows[:args.top], args.batch, args.seq_len))
  print(f"recommended, the fastest of {len(rows)} feasible layouts, "
        + _recommendation(rows[0]["layout"], args))
  if args.verify:
    _verify(rows[0], args)
  return rows[0]


def _topology(devices: int, intra_node: int) -> str:
  """``ulysses_jax.aot``'s ``<slices>x<hosts>x<GPUs per host>`` for the planned cluster."""
  if devices <= intra_node:
    return f"1x1x{devices}"
  if devices % intra_node:
    _fail(f"--verify compiles for whole nodes: --devices ({devices}) must be a multiple of "
          f"--intra-node ({intra_node}), or at most one node.")
  return f"{devices // intra_node}x1x{intra_node}"


def _model_gin_file(args, directory: str) -> str:
  """A gin file of the model, for ``ulysses_jax.aot``: the gin ``--model`` itself, or for a
  preset one binding ``LlamaConfig.preset`` (written in ``directory``)."""
  if args.model.endswith(".gin"):
    return args.model
  if args.model not in PRESETS:
    _fail(f"--verify compiles a preset or a gin --model, got {args.model!r}: write the model as "
          f"a gin file (LlamaConfig.* bindings) and give --model=that.gin.")
  path = os.path.join(directory, "model.gin")
  with open(path, "w", encoding="utf-8") as f:
    f.write(f'LlamaConfig.preset = "{args.model}"\n')
  return path


def _verify(row: dict, args):
  """Compiles ``row``'s layout for ``args.gpu`` GPUs, as is and under memory pressure
  (``aot.report.UNDER_PRESSURE``), and prints compiled vs predicted GiB: the prediction is
  the footprint XLA reaches when memory is tight, the smaller of the two."""
  topology = _topology(args.devices, args.intra_node)
  params = _gin_params(_settings(row["layout"], args))
  with tempfile.TemporaryDirectory() as directory:
    try:
      from ulysses_jax.aot.report import compile_config
      report = compile_config([_model_gin_file(args, directory)], params, args.gpu, topology,
                              under_pressure=True)
    except (ValueError, TypeError, OSError) as e:  # AotError is a ValueError
      _fail(f"--verify: {e}")
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
  print(f"  the compiled step {'fits' if report['fits'] else 'DOES NOT FIT'} in "
        f"{report['device_capacity_bytes'] / _GIB:.1f} GiB")
