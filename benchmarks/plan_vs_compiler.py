"""The layout planner's memory prediction against XLA's GPU compiler, per shipped GPU config.

    make gpu-compile-venv
    .venv-gpu-compile/bin/python -m benchmarks.plan_vs_compiler --json \\
        benchmarks/results/plan_vs_compiler.json
    .venv-gpu-compile/bin/python -m benchmarks.plan_vs_compiler --layouts grid --json \\
        benchmarks/results/plan_vs_compiler_grid.json

For each config (with the ``--gin_param`` overrides listed beside it), on the cluster its
header names: ``ulysses_jax.plan.predict_memory`` for the config's layout (micro-batch of
``batch_size / accum_steps`` rows) next to the compiled step's per-device memory (``python -m
ulysses_jax.aot``'s figures: device arguments + outputs + temporaries, host state + host
temporaries). Each step is compiled twice: as is for the GPU, and under memory pressure
(``aot.report.UNDER_PRESSURE``: XLA told its limit is a tenth of the GPU). Far below the
capacity XLA keeps buffers it could do without; near it, it trades time for memory, so a
layout fits when the smaller of the two does, and that is what the planner predicts and the
error is taken against. Compiling takes 10 s to 2 minutes per step on 2 CPU cores; no GPU.
``--layouts grid`` compares instead the shipped layouts varied over models (1B, 8B), GPU counts
(1, 8, 32), lengths, head chunks and where the state lives (``GRID``); ``--layouts none`` the
1B and 8B without rematerialisation (``NO_REMAT``); ``--layouts untiled`` with the shipped
remat and no MLP tiles (``UNTILED``). ``--replan FILE`` (with the ``--layouts``
FILE was written with) compiles nothing: it prints the planner's figures now beside the
compiled ones FILE stores, for a change of the planner's model.
"""

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot start without a GPU

from benchmarks import common  # noqa: E402
from ulysses_jax import plan, step_builder  # noqa: E402
from ulysses_jax.aot import gpu_devices, gpu_spec, parse_topology  # noqa: E402
from ulysses_jax.aot.report import compile_and_report  # noqa: E402
from ulysses_jax.cli import gin_config  # noqa: E402

GIB = 2**30
# (gin file, topology, --gin_param overrides)
CONFIGS = (("configs/llama1b_128k.gin", "1x1x8", ()), ("configs/llama8b_512k.gin", "1x1x8", ()),
           ("configs/llama8b_1gpu_512k.gin", "1x1x1", ()),
           ("configs/llama8b_1gpu_1m.gin", "1x1x1", ()),
           ("configs/llama8b_1gpu_1m.gin", "1x1x1", ("LlamaConfig.remat_group=4",)),
           ("configs/llama8b_8gpu_8m.gin", "1x1x8", ()),
           ("configs/llama8b_8gpu_8m.gin", "1x1x8", ("LlamaConfig.attn_head_chunks=1",)),
           ("configs/llama8b_8gpu_8m.gin", "1x1x8", ("LlamaConfig.attn_head_chunks=4",)),
           ("configs/llama8b_32gpu_32m.gin", "4x1x8", ()))

_ONE_ROW = ("DataConfig.batch_size=1", "TrainConfig.accum_steps=1")
_1B_ON = {  # llama1b_128k.gin's layout (float32 state on the GPUs, full remat) on other meshes
    "1x1x1": ("TrainConfig.mesh_data=1", "TrainConfig.mesh_seq=1") + _ONE_ROW,
    "1x1x8": ("TrainConfig.mesh_data=1",) + _ONE_ROW,
    "4x1x8": ("TrainConfig.mesh_data=1", "TrainConfig.mesh_ring=4") + _ONE_ROW,
}
_STATE_ON_GPUS = ("TrainConfig.offload_optimizer=False", "TrainConfig.offload_params=False")
# (gin file, topology, --gin_param overrides): the shipped layouts over models, GPU counts,
# lengths (DataConfig.seq_len), head chunks and state placement.
GRID = tuple(
    [("configs/llama1b_128k.gin", topology, _1B_ON[topology] + (f"DataConfig.seq_len={s}",))
     for topology, lengths in (("1x1x1", (65536, 131072)), ("1x1x8", (524288, 1048576)),
                               ("4x1x8", (2097152, 4194304)))
     for s in lengths]
    + [("configs/llama8b_512k.gin", "1x1x8", (f"DataConfig.seq_len={s}",))
       for s in (262144, 524288)]
    + [("configs/llama8b_1gpu_1m.gin", "1x1x1", (f"DataConfig.seq_len={s}", f"LlamaConfig."
                                                  f"attn_head_chunks={n}"))
       for s, n in ((262144, 1), (524288, 4), (786432, 2))]
    + [("configs/llama8b_8gpu_8m.gin", "1x1x8", (f"DataConfig.seq_len={s}",) + extra)
       for s, extra in ((2097152, ()), (4194304, ("LlamaConfig.attn_head_chunks=2",)),
                        (4194304, _STATE_ON_GPUS))]
    + [("configs/llama8b_32gpu_32m.gin", "4x1x8", (f"DataConfig.seq_len={s}",))
       for s in (8388608, 16777216)])
_NONE = ("LlamaConfig.remat_policy='none'",)
_UNTILED = ("LlamaConfig.mlp_chunk=0",)
# (gin file, topology, --gin_param overrides): no rematerialisation, the MLP tiled or not.
NO_REMAT = tuple(
    [("configs/llama1b_128k.gin", topology, _1B_ON[topology] + _NONE + tiles
      + (f"DataConfig.seq_len={s}",))
     for topology, s, tiles in (("1x1x1", 16384, ()), ("1x1x1", 16384, _UNTILED),
                                ("1x1x1", 32768, _UNTILED), ("1x1x1", 65536, ()),
                                ("1x1x8", 524288, ()), ("1x1x8", 524288, _UNTILED))]
    + [("configs/llama8b_512k.gin", "1x1x8", _NONE + tiles + ("DataConfig.seq_len=131072",))
       for tiles in ((), _UNTILED)]
    + [("configs/llama8b_512k.gin", "1x1x1", _NONE + ("TrainConfig.mesh_seq=1",
                                                      "DataConfig.seq_len=16384"))])
# (gin file, topology, --gin_param overrides): the shipped remat ("full"), the MLP untiled.
UNTILED = (
    [("configs/llama1b_128k.gin", topology, _1B_ON[topology] + _UNTILED
      + (f"DataConfig.seq_len={s}",))
     for topology, s in (("1x1x1", 65536), ("1x1x1", 131072), ("1x1x8", 1048576))]
    + [("configs/llama8b_512k.gin", "1x1x8", _UNTILED + (f"DataConfig.seq_len={s}",))
       for s in (524288, 262144)])
LAYOUTS = {"configs": CONFIGS, "grid": GRID, "none": NO_REMAT, "untiled": UNTILED}


def predict(config, devices: int) -> dict:
  """``plan.predict_memory`` for a read config (its model resolved) on ``devices`` devices."""
  cfg, model_cfg, data_cfg = config.train, config.model, config.data
  layout = plan.Layout.from_config(cfg, model_cfg, devices)
  return plan.predict_memory(
      plan.Model.from_config(model_cfg), layout, batch=data_cfg.batch_size // cfg.accum_steps,
      seq_len=data_cfg.seq_len, dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype,
      master_weights=cfg.master_weights)


def compare(gin_file: str, topology: str, params: tuple[str, ...], gpu: str) -> dict:
  """One row: the planner's and the compiler's GiB per device for ``gin_file``."""
  slices, hosts, per_host = parse_topology(topology)
  config = gin_config.read([gin_file], list(params))
  built = step_builder.build_train_step(
      config, step_builder.run_mesh(config.train, gpu_devices(gpu, topology)))
  predicted = predict(built.config, slices * hosts * per_host)
  compiled = compile_and_report(built, gpu_spec(gpu), nodes=slices * hosts, under_pressure=True)
  device, host = compiled["least_device_bytes"] / GIB, compiled["host_bytes"] / GIB
  name = " ".join([os.path.basename(gin_file), *(p.split(".", 1)[1] for p in params)])
  return {"config": name, "cluster": f"{topology} {gpu}",
          "plan_device_gib": round(predicted["total"] / GIB, 2),
          "compiled_device_gib": round(compiled["device_bytes"] / GIB, 2),
          "under_pressure_gib": round(compiled["device_bytes_under_pressure"] / GIB, 2),
          "device_error": f"{predicted['total'] / GIB / device - 1:+.0%}",
          "plan_host_gib": round(predicted["host"] / GIB, 2),
          "compiled_host_gib": round(host, 2),
          "host_error": f"{predicted['host'] / GIB / host - 1:+.0%}" if host else "-"}


def replan(path: str, layouts) -> list[dict]:
  """The planner's figure now beside the compiled figures stored in ``path`` (rows in the
  order of ``layouts``), without compiling: for a change of the planner's model."""
  rows = []
  with open(path) as f:
    stored = json.load(f)["rows"]
  for (gin_file, topology, params), row in zip(layouts, stored):
    config = gin_config.read([gin_file], list(params))
    slices, hosts, per_host = parse_topology(topology)
    predicted = predict(config, slices * hosts * per_host)
    planned, host = predicted["total"] / GIB, predicted["host"] / GIB
    least = min(row["compiled_device_gib"], row["under_pressure_gib"])
    rows.append({"config": row["config"], "cluster": row["cluster"],
                 "stored_plan_gib": row["plan_device_gib"], "plan_device_gib": round(planned, 2),
                 "least_compiled_gib": least, "device_error": f"{planned / least - 1:+.1%}",
                 "plan_host_gib": round(host, 2), "compiled_host_gib": row["compiled_host_gib"]})
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gpu", default="h100")
  parser.add_argument("--layouts", choices=sorted(LAYOUTS), default="configs",
                      help="the shipped configs, GRID of their layouts, NO_REMAT or UNTILED")
  parser.add_argument("--json", default="")
  parser.add_argument("--replan", default="", help="a JSON this wrote: the planner's figures "
                      "now beside its compiled ones, no compile")
  args = parser.parse_args(argv)
  if args.replan:
    rows = replan(args.replan, LAYOUTS[args.layouts])
    common.print_table(rows, list(rows[0]))
    return rows
  rows = [compare(gin_file, topology, params, args.gpu)
          for gin_file, topology, params in LAYOUTS[args.layouts]]
  print("GiB per device: ulysses_jax.plan.predict_memory vs the compiled GPU step (python -m "
        "ulysses_jax.aot), as is and under memory pressure; error against the smaller")
  common.print_table(rows, list(rows[0]))
  if args.json:
    common.write_json(args.json, rows, gpu=args.gpu)
  return rows


if __name__ == "__main__":
  main()
