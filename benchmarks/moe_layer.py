"""The mixture-of-experts layer (``ulysses_jax.models.moe``): what its forward and backward cost.

CPU (the default; one device, float32): the MoE layer's forward+backward time beside a dense
SwiGLU MLP of the same active FLOPs (width k·I), over the number of experts X and the experts
per token k; ``ratio`` is MoE / dense. On the CPU the experts' grouped matmul is
``jax.lax.ragged_dot``, which XLA:CPU computes as a masked dense product over the X experts,
so the MoE's time grows with X, not only with k:

  python -m benchmarks.moe_layer [--tokens 2048] [--json PATH]

H100, compiled (``--h100``; JAX's CUDA plugin, ``make gpu-compile-venv``, no GPU): one layer
of Qwen3-30B-A3B (128 experts of width 768, 8 per token, width 2048) on ``--tokens`` tokens
of one GPU, forward and backward, bfloat16, with each grouped-matmul backend: the compiled
FLOPs (``aot.cost``) and temporaries. Compiled, not run:

  JAX_PLATFORMS=cpu .venv-gpu-compile/bin/python -m benchmarks.moe_layer --h100 --tokens 4096

8 H100s, compiled (``--h100x8``): the same layer on a Ulysses mesh (seq = 8) with ``--tokens``
tokens per GPU in tiles of 2,048, with each expert placement (``LlamaConfig.
expert_placement``): the collectives' bytes per GPU as they run, FLOPs, temporaries:

  JAX_PLATFORMS=cpu .venv-gpu-compile/bin/python -m benchmarks.moe_layer --h100x8 --tokens 4096
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import print_table, write_json
from ulysses_jax import make_mesh, sharding
from ulysses_jax.doctor.timing import time_fn
from ulysses_jax.models.config import MoeConfig, preset
from ulysses_jax.models.llama import MLP
from ulysses_jax.models.moe import MoE

CPU_COLUMNS = ["experts", "k", "tokens", "moe_ms", "dense_ms", "ratio"]
H100_COLUMNS = ["backend", "tokens", "tflop", "temporaries_gib"]
H100X8_COLUMNS = ["placement", "tokens_per_gpu", "tflop", "all_gather_gib", "all_to_all_gib",
                  "reduce_gib", "temporaries_gib"]
WIDTH, EXPERT_WIDTH = 256, 128


def _layer_and_input(config, mesh, tokens, make):
  """An initialised layer of ``config`` and a random ``[1, tokens, E]`` input on ``mesh``."""
  layer = sharding.init_sharded(lambda: make(config, mesh=mesh, rngs=nnx.Rngs(0)), mesh)
  x = jax.random.normal(jax.random.key(1), (1, tokens, config.hidden_dim), config.dtype)
  return layer, jax.device_put(x, NamedSharding(mesh, P()))


def _step(layer, x, valid):
  """The jitted forward and backward (gradients of every weight and of the input)."""
  graphdef, state = nnx.split(layer)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x, valid) if valid is not None else (
        nnx.merge(graphdef, state)(x))
    y = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y.astype(jnp.float32) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1))), state


def cpu_rows(tokens: int) -> list[dict]:
  mesh = make_mesh(1, 1, devices=jax.devices()[:1])
  valid = jax.device_put(jnp.ones((1, tokens), bool), NamedSharding(mesh, P()))
  rows = []
  for experts, k in ((4, 1), (8, 1), (16, 1), (32, 1), (8, 2), (8, 4), (32, 4)):
    base = preset("tiny", hidden_dim=WIDTH, mlp_chunk=0)
    moe = base.replace(moe=MoeConfig(num_experts=experts, experts_per_token=k,
                                     expert_mlp_dim=EXPERT_WIDTH))
    dense = base.replace(mlp_dim=k * EXPERT_WIDTH)
    layer, x = _layer_and_input(moe, mesh, tokens, MoE)
    step, state = _step(layer, x, valid)
    moe_s = time_fn(step, state, x)["median_s"]
    layer, x = _layer_and_input(dense, mesh, tokens, MLP)
    step, state = _step(layer, x, None)
    dense_s = time_fn(step, state, x)["median_s"]
    rows.append({"experts": experts, "k": k, "tokens": tokens, "moe_ms": 1e3 * moe_s,
                 "dense_ms": 1e3 * dense_s, "ratio": moe_s / dense_s})
    print_table(rows[-1:], CPU_COLUMNS)
  return rows


def compile_moe_layer(config, mesh, tokens: int):
  """The forward and backward of one MoE layer of ``config`` on ``[1, tokens, E]`` inputs
  sharded over ``mesh``'s sequence axes (``tokens`` / seq per device), compiled (abstract
  inputs: nothing is allocated)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(config, mesh=mesh, rngs=nnx.Rngs(0))))
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                       sharding.tree_shardings(state, mesh))
  rows = NamedSharding(mesh, sharding.batch_spec(mesh, tokens))
  x = jax.ShapeDtypeStruct((1, tokens, config.hidden_dim), config.dtype,
                           sharding=NamedSharding(mesh, P(*rows.spec, None)))
  valid = jax.ShapeDtypeStruct((1, tokens), jnp.bool_, sharding=rows)

  def loss(state, x, valid):
    y, stats = nnx.merge(graphdef, state)(x, valid)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(stats.probs)
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x, valid).compile()


def h100_rows(tokens: int) -> list[dict]:
  from ulysses_jax.aot import cost, gpu_devices
  mesh = make_mesh(1, 1, devices=gpu_devices("h100", "1x1x1"))
  rows = []
  for backend in ("auto", "ragged_dot"):
    config = preset("qwen3-30b-a3b", dtype="bfloat16", param_dtype="bfloat16",
                    mlp_chunk=tokens, expert_backend=backend)
    compiled = compile_moe_layer(config, mesh, tokens)
    flops = sum(op.count * op.flops for op in cost.operations(compiled.as_text()))
    rows.append({"backend": "mosaic (auto)" if backend == "auto" else backend,
                 "tokens": tokens, "tflop": flops / 1e12,
                 "temporaries_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30})
  return rows


def h100x8_rows(tokens: int) -> list[dict]:
  """One Qwen3-30B-A3B MoE layer on 8 H100s (Ulysses, seq = 8), ``tokens`` per GPU in tiles
  of 2,048, with each expert placement: the collectives' bytes per GPU as they run (loops
  weighted by their trip counts), FLOPs and temporaries."""
  from ulysses_jax.aot import hlo
  from ulysses_jax.aot import cost, gpu_devices
  mesh = make_mesh(1, 8, devices=gpu_devices("h100", "1x1x8"))
  rows = []
  for placement in ("fsdp", "expert"):
    config = preset("qwen3-30b-a3b", dtype="bfloat16", param_dtype="bfloat16", mlp_chunk=2048,
                    expert_placement=placement)
    compiled = compile_moe_layer(config, mesh, 8 * tokens)
    text = compiled.as_text()
    moved = hlo.executed_collective_bytes(text)
    rows.append({"placement": placement, "tokens_per_gpu": tokens,
                 "tflop": sum(op.count * op.flops for op in cost.operations(text)) / 1e12,
                 "all_gather_gib": moved["all-gather"] / 2**30,
                 "all_to_all_gib": moved["all-to-all"] / 2**30,
                 "reduce_gib": (moved["reduce-scatter"] + moved["all-reduce"]) / 2**30,
                 "temporaries_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--h100", action="store_true", help="compile for one H100 instead")
  parser.add_argument("--h100x8", action="store_true",
                      help="compile for 8 H100s, each expert placement, instead")
  parser.add_argument("--json", default="", help="also write the rows here")
  args = parser.parse_args()
  if args.h100x8:
    rows, columns = h100x8_rows(args.tokens), H100X8_COLUMNS
  elif args.h100:
    rows, columns = h100_rows(args.tokens), H100_COLUMNS
  else:
    rows, columns = cpu_rows(args.tokens), CPU_COLUMNS
  print_table(rows, columns)
  if args.json:
    note = ("compiled for 8 H100s, not run" if args.h100x8 else
            "compiled for one H100, not run" if args.h100 else
            "measured on the CPU, float32, one device")
    write_json(args.json, rows, note=note)


if __name__ == "__main__":
  main()
