"""The scaling study (``benchmarks.scaling``) checked by XLA's GPU compiler, for compile-only
H100s (JAX's CUDA plugin, ``make gpu-compile-venv``; no GPU; compiled, not run):

    JAX_PLATFORMS=cpu .venv-gpu-compile/bin/python -m benchmarks.scaling_compiled \\
        --devices 8,64,256,1024 --json benchmarks/results/scaling_compiled.json
    JAX_PLATFORMS=cpu .venv-newest/bin/python -m benchmarks.scaling_compiled --fit \\
        --nodes 1,2,4,8,16,32,64 --json benchmarks/results/scaling_fit_70b_jax0.12.0.1.json

Collectives (the default). For each mesh kind of the study on N GPUs (nodes of 8): the
hybrid (seq=8, a ring over N/8), pure Ulysses (seq=N; past Llama-3.1-8B's 32 query heads
the all-to-all exchanges padded heads, as ``plan_heads`` plans them), pure ring (seq=1) and
the all-gather-KV baseline (seq=N), one attention layer of Llama-3.1-8B's heads (32 query, 8
KV, head dim 128, bfloat16, causal, ``TOKENS_PER_GPU`` tokens per GPU, natural layout) is
compiled forward and backward. The bytes of each kind of collective per device in the
compiled program (``hlo.executed_collective_bytes``: loops weighted by their trip counts)
are set beside the planner's formula (``plan.comm.layer_traffic`` with one forward pass and
the backward): equal when the model counts what the program moves.

Fit (``--fit``). Llama-3.1-70B on 1 to 64 H100 nodes: the planner's longest sequence
(``plan.search.longest_seq_len``, 256 GB of host memory per GPU, steps of 1,024 tokens per
GPU) and its recommendation there, compiled by ``aot`` (the step as is and under memory
pressure, the smaller, as ``ulysses-plan --verify``): whether it fits the 71.20 GiB budget.
``benchmarks/results/scaling_fit_70b_jax<version>.json`` hold it for jax 0.10.2, 0.11.2 and
0.12.0.1 (the same command in ``.venv-gpu-compile`` and ``.venv-jax0.11.2``).
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot start without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks import common  # noqa: E402
from ulysses_jax import make_mesh, plan, ulysses_attention  # noqa: E402
from ulysses_jax.aot import hlo
from ulysses_jax.aot import gpu_devices  # noqa: E402
from ulysses_jax.attention.baselines import allgather_kv_attention  # noqa: E402
from ulysses_jax.mesh import sequence_axes  # noqa: E402
from ulysses_jax.models.config import preset  # noqa: E402
from ulysses_jax.plan import comm, search  # noqa: E402

TOKENS_PER_GPU = 1024
BACKEND = "xla"
GIB = 2**30
# The planner's names of the attention collectives, and the HLO op of each.
HLO_KIND = {"all_to_all": "all-to-all", "ring": "collective-permute",
            "allgather_kv": "all-gather", "allgather_kv_grad": "reduce-scatter"}


def meshes(devices: int) -> dict[str, tuple[int, int, str]]:
  """The study's mesh kinds on ``devices`` GPUs: ``(seq, ring, attention)``."""
  return {"hybrid": (min(8, devices), max(1, devices // 8), "ulysses"),
          "ulysses": (devices, 1, "ulysses"), "ring": (1, devices, "ulysses"),
          "allgather_kv": (devices, 1, "allgather_kv")}


def compiled_collectives(devices: int, seq: int, ring: int, attention: str,
                         model: plan.Model) -> tuple[dict, float]:
  """Collective bytes per device (by HLO op) of one attention layer's forward and backward,
  compiled for ``devices`` H100s in nodes of 8; and the compile's seconds."""
  topology = f"{max(1, devices // 8)}x1x{min(devices, 8)}"
  mesh = make_mesh(1, seq, ring, devices=gpu_devices("h100", topology))
  seq_len = TOKENS_PER_GPU * devices
  sharding = NamedSharding(mesh, P(None, sequence_axes(mesh), None, None))
  shape = lambda heads: jax.ShapeDtypeStruct((1, seq_len, heads, model.head_dim),
                                             jnp.bfloat16, sharding=sharding)
  attend = allgather_kv_attention if attention == "allgather_kv" else ulysses_attention

  def forward_and_backward(d_out, q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, mesh=mesh, backend=BACKEND), q, k, v)
    return out, vjp(d_out)

  q, kv = shape(model.num_heads), shape(model.num_kv_heads)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    text = jax.jit(forward_and_backward).lower(q, q, kv, kv).compile().as_text()
  return hlo.executed_collective_bytes(text), time.perf_counter() - start


def collective_rows(devices: int, kinds=None) -> list[dict]:
  """One row per mesh kind and collective: compiled bytes beside the planner's."""
  model = plan.Model.from_config(preset("llama3.1-8b"))
  rows = []
  for kind, (seq, ring, attention) in meshes(devices).items():
    if kinds and kind not in kinds:
      continue
    compiled, seconds = compiled_collectives(devices, seq, ring, attention, model)
    layout = plan.Layout(1, seq, ring, attention=attention)
    predicted = comm.layer_traffic(model, layout, None, seq_len=TOKENS_PER_GPU * devices,
                                   batch=1, dtype="bfloat16", forward_passes=1)
    by_kind = {HLO_KIND[name]: nbytes for name, nbytes in predicted.items() if nbytes}
    for op in sorted(set(by_kind) | {op for op, n in compiled.items() if n}):
      rows.append({"devices": devices, "mesh_kind": kind, "mesh": f"1x{seq}x{ring}",
                   "collective": op, "compiled_bytes": compiled[op],
                   "model_bytes": by_kind.get(op, 0),
                   "ratio": compiled[op] / by_kind[op] if by_kind.get(op) else None,
                   "compile_s": round(seconds, 1)})
  return rows


def fit_row(nodes: int) -> dict:
  """Llama-3.1-70B on ``nodes`` H100 nodes: the planner's longest sequence and its layout,
  compiled by ``aot``."""
  from ulysses_jax.aot.report import compile_config  # pylint: disable=import-outside-toplevel
  from ulysses_jax.cli import plan_text  # pylint: disable=import-outside-toplevel
  from ulysses_jax.cli.plan import config_with_settings  # pylint: disable=import-outside-toplevel
  from ulysses_jax.run_config import RunConfig  # pylint: disable=import-outside-toplevel
  config, devices = preset("llama3.1-70b"), 8 * nodes
  model, hardware = plan.Model.from_config(config), plan.Hardware.of("h100")
  longest = search.longest_seq_len(model, devices=devices, hardware=hardware)
  best = search.plan(model, seq_len=longest, devices=devices, hardware=hardware)[0]
  question = argparse.Namespace(accum_steps=1, dtype="bfloat16", seq_len=longest, batch=1,
                                 init_from=None)
  run = config_with_settings(RunConfig(model=config), plan_text.settings(best, question))
  compiled = compile_config(run, "h100", f"{nodes}x1x8", under_pressure=True)
  lay = best["layout"]
  return {"nodes": nodes, "devices": devices, "seq_len": longest,
          "mesh": "x".join(map(str, lay.mesh)), "remat": lay.remat,
          "remat_group": lay.remat_group, "head_chunks": lay.attn_head_chunks,
          "on_host": plan_text.on_host_label(lay),
          "params": plan_text.precision_label(best["precision"]), "mlp_chunk": best["mlp_chunk"],
          "plan_gib": round(best["memory"]["total"] / GIB, 2),
          "compiled_gib": round(compiled["least_device_bytes"] / GIB, 2),
          "budget_gib": round(compiled["budget_bytes"] / GIB, 2),
          # the trainer runs the step compiled under pressure where only that one fits
          "fits": compiled["least_device_bytes"] <= compiled["budget_bytes"],
          "plan_host_gb": round(best["memory"]["host"] / 1e9, 1),
          "compiled_host_gb": round(compiled["host_bytes"] / 1e9, 1),
          "predicted_step_s": round(best["step"]["step_s"]),
          "compile_s": round(compiled["compile_s"])}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", default="8,64,256", help="GPU counts (collectives)")
  parser.add_argument("--kinds", default="", help="mesh kinds to compile (default: all)")
  parser.add_argument("--fit", action="store_true", help="70B's longest fit per node count")
  parser.add_argument("--nodes", default="4,8,16,32,64", help="node counts (--fit)")
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv)
  if args.fit:
    rows = []
    for nodes in map(int, args.nodes.split(",")):
      rows.append(fit_row(nodes))
      print(rows[-1], flush=True)
  else:
    kinds = set(filter(None, args.kinds.split(",")))
    rows = []
    for devices in map(int, args.devices.split(",")):
      rows += collective_rows(devices, kinds)
      print(rows[-1], flush=True)
  common.print_table(rows, list(rows[0]))
  if args.json:
    common.write_json(args.json, rows, gpu="h100", tokens_per_gpu=TOKENS_PER_GPU)
  return rows


if __name__ == "__main__":
  main()
