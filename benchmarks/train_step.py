"""Training throughput, MFU and per-device memory of a model preset at a sequence length.

    python -m benchmarks.train_step --preset llama3.2-1b --seq-len 32768 [--data 1 --seq 8]
    python -m benchmarks.train_step --preset llama3.2-1b --seq-len 65536 \\
        --run-settings configs/runs/gpu.gin     # the shipped GPU settings

Runs the real train step (``ulysses_jax.step_builder``, the trainer's own: chunked loss, remat,
AdamW, donation) on synthetic tokens, on whatever devices JAX sees (add
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for virtual CPU devices).

MFU = model FLOP/s / measured peak matmul FLOP/s of all devices together
(``ulysses_jax.metrics``; ``MFU_datasheet`` divides by the datasheet's dense bf16 peak
instead, on the GPUs of ``ulysses_jax.gpus``: the figure published results state), with
model FLOPs per token = 6 * N + 12 * L * S * h / 2 (causal):
N = parameters taking part in matmuls (all but the embedding lookup; the LM head counts,
tied or not), L layers, S sequence length, h = heads * head_dim. Remat recomputation is not
counted (it is not model FLOPs). The peak is timed square matmuls in the compute dtype.
"""

import argparse
import time

import jax
import numpy as np

from benchmarks import common
from ulysses_jax import make_mesh, metrics, step_builder
from ulysses_jax.doctor.timing import time_fn
from ulysses_jax.data.pipeline import DataConfig
from ulysses_jax.models import llama
from ulysses_jax.run_config import RunConfig, TrainConfig

FORMULA = ("MFU = flops_per_token * tokens/s / peak(all devices), peak = the timed bf16 matmul "
           "(MFU) or the datasheet's dense bf16 (MFU_datasheet); flops_per_token = 6*N + "
           "6*L*S*h (causal attention: 12*L*S*h halved)")


def synthetic_batch(batch: int, seq_len: int, vocab: int, doc_len: int) -> dict:
  """Random tokens packed into documents of ``doc_len`` tokens (0 = one document per row)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32)
  index = np.arange(seq_len, dtype=np.int32)
  batch_dict = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
  if doc_len:
    batch_dict["segment_ids"] = np.broadcast_to(index // doc_len, (batch, seq_len)).copy()
    batch_dict["positions"] = np.broadcast_to(index % doc_len, (batch, seq_len)).copy()
    batch_dict["labels"] = np.where((index + 1) % doc_len == 0, -1, batch_dict["labels"])
  return {k: np.ascontiguousarray(v, np.int32) for k, v in batch_dict.items()}


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags that choose the step (model, mesh, memory options), shared with
  ``benchmarks.profile_step``."""
  on_gpu = jax.default_backend() == "gpu"
  parser.add_argument("--preset", default="small", choices=sorted(llama.PRESETS))
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=0, help="global batch (default: data axis)")
  parser.add_argument("--data", type=int, default=1)
  parser.add_argument("--seq", type=int, default=-1, help="seq axis (default: devices/data)")
  parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
  parser.add_argument("--remat", default="full", choices=llama.REMAT_POLICIES)
  parser.add_argument("--remat-group", type=int, default=1, help="layers per remat group")
  parser.add_argument("--keep-attention", action=argparse.BooleanOptionalAction, default=True,
                      help="remat keeps attention's output and lse (LlamaConfig."
                           "remat_keep_attention): the backward runs no attention forward")
  parser.add_argument("--param-dtype", default="float32")
  parser.add_argument("--master-weights", action="store_true",
                      help="float32 master weights (with --param-dtype bfloat16)")
  parser.add_argument("--offload-optimizer", action="store_true",
                      help="optimizer state in host memory, streamed a layer at a time")
  parser.add_argument("--offload-params", action="store_true",
                      help="layer parameters and gradients in host memory too")
  parser.add_argument("--mlp-chunk", type=int, default=0)
  parser.add_argument("--loss-chunk", type=int, default=1024)
  parser.add_argument("--backend", default="auto")
  parser.add_argument("--doc-len", type=int, default=0, help="packed documents of this length")
  parser.add_argument("--run-settings", default="", metavar="GIN_FILE",
                      help="take the model's settings bound in this gin file (e.g. "
                           "configs/runs/gpu.gin: dtypes, remat, MLP and loss chunks, "
                           "attention backend) over the flags above")


def parse_step_arguments(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
  """``parser``'s arguments, with ``--run-settings``' bindings applied over the flags."""
  args = parser.parse_args(argv)
  if args.run_settings:
    try:
      bindings = common.gin_bindings(args.run_settings, "LlamaConfig")
    except (OSError, ValueError) as e:
      parser.error(f"--run-settings: {e}")
    for field, value in bindings.items():
      if field not in RUN_SETTINGS:
        parser.error(f"--run-settings {args.run_settings} binds LlamaConfig.{field}, which "
                     f"this benchmark has no flag for; it knows {sorted(RUN_SETTINGS)}")
      setattr(args, RUN_SETTINGS[field], value)
  return args


# LlamaConfig field -> the flag's attribute
RUN_SETTINGS = {"dtype": "dtype", "param_dtype": "param_dtype", "remat_policy": "remat",
                "remat_group": "remat_group", "remat_keep_attention": "keep_attention",
                "mlp_chunk": "mlp_chunk", "loss_chunk": "loss_chunk",
                "attention_backend": "backend"}


def build_step(args: argparse.Namespace) -> dict:
  """The compiled train step of ``args`` (``add_step_arguments``) with its first state and
  batch: ``compiled``, ``state``, ``batch``, ``config`` (the model's), ``mesh``,
  ``batch_size``, ``compile_s``."""
  seq_axis = jax.device_count() // args.data if args.seq == -1 else args.seq
  mesh = make_mesh(data=args.data, seq=seq_axis)
  batch_size = args.batch or args.data
  config = llama.preset(args.preset, dtype=args.dtype, param_dtype=args.param_dtype,
                        remat_policy=args.remat, remat_group=args.remat_group,
                        remat_keep_attention=args.keep_attention,
                        mlp_chunk=args.mlp_chunk, loss_chunk=args.loss_chunk,
                        attention_backend=args.backend)
  run = RunConfig(train=TrainConfig(mesh_data=mesh.shape["data"], mesh_seq=seq_axis,
                                    offload_optimizer=args.offload_optimizer,
                                    offload_params=args.offload_params,
                                    master_weights=args.master_weights),
                  model=config, data=DataConfig(seq_len=args.seq_len, batch_size=batch_size))
  start = time.perf_counter()
  built = step_builder.build_train_step(run, mesh)
  state = step_builder.initial_state(built)
  batch = synthetic_batch(batch_size, args.seq_len, config.vocab_size, args.doc_len)
  compiled = built.step.lower(state, batch).compile()
  return {"compiled": compiled, "state": state, "batch": batch, "config": config, "mesh": mesh,
          "batch_size": batch_size, "compile_s": time.perf_counter() - start}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_step_arguments(parser)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--json", default="")
  args = parse_step_arguments(parser, argv)
  step = build_step(args)
  compiled, batch, config, mesh = step["compiled"], step["batch"], step["config"], step["mesh"]
  batch_size = step["batch_size"]
  memory = compiled.memory_analysis()

  holder = {"state": step["state"]}

  def one_step():
    holder["state"], metrics = compiled(holder["state"], batch)
    return holder["state"], metrics

  timing = time_fn(one_step, warmup=2, iters=args.steps)
  tokens_per_s = batch_size * args.seq_len / timing["median_s"]
  model_flops = metrics.flops_per_token(config, args.seq_len) * tokens_per_s
  peak = metrics.measure_peak_flops(args.dtype)
  datasheet = metrics.datasheet_peak_flops()
  datasheet = datasheet and datasheet * jax.device_count()
  stats = jax.devices()[0].memory_stats() or {}
  gib = 2.0 ** -30
  row = {
      "preset": args.preset, "params_M": llama.count_params(config) / 1e6,
      "mesh": f"{mesh.shape['data']}x{mesh.shape['seq']}", "batch": batch_size,
      "seq_len": args.seq_len, "dtype": args.dtype, "param_dtype": args.param_dtype,
      "master_weights": args.master_weights, "offload_optimizer": args.offload_optimizer,
      "offload_params": args.offload_params,
      "remat": args.remat, "remat_group": args.remat_group,
      "keep_attention": args.keep_attention, "mlp_chunk": args.mlp_chunk,
      "loss_chunk": args.loss_chunk, "backend": args.backend,
      "step_s": timing["median_s"], "tokens_per_s": tokens_per_s,
      "model_TFLOPs": model_flops / 1e12, "peak_TFLOPs": peak / 1e12,
      "MFU": model_flops / peak,
      "datasheet_TFLOPs": datasheet and datasheet / 1e12,
      "MFU_datasheet": datasheet and model_flops / datasheet,
      "args_GiB": memory.argument_size_in_bytes * gib,
      "temp_GiB": memory.temp_size_in_bytes * gib,
      "peak_GiB": stats.get("peak_bytes_in_use", float("nan")) * gib,
      "compile_s": step["compile_s"],
      "loss": float(one_step()[1]["loss"]),
  }
  print(FORMULA)
  print("memory per device: args = state + batch shard; temp = XLA scratch (activations); "
        "peak = allocator peak (GPU only)")
  common.print_table([row], list(row))
  print(metrics.mfu_text(row["MFU"], row["MFU_datasheet"])
        + f" (measured {row['peak_TFLOPs']:.4g} TFLOP/s"
        + ("" if datasheet is None else f", datasheet {row['datasheet_TFLOPs']:.4g}")
        + f" over {jax.device_count()} device(s))")
  if args.json:
    common.write_json(args.json, [row], formula=FORMULA)
  return row


if __name__ == "__main__":
  main()
