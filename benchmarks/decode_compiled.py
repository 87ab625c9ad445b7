"""The decode step compiled for H100s with each decode backend (``generate.attention``): XLA's
fused products-and-sums against our split-K Mosaic GPU kernel (``kernels.decode_hopper``).
Compiled, not run: nothing here measures a GPU.

    JAX_PLATFORMS=cpu python -m benchmarks.decode_compiled [--preset llama3.1-8b]
        [--prompt_len 1048576] [--max_new_tokens 129] [--mesh_seq 8] [--layers N]
        [--json PATH]

For each backend it reports the compiled program's memory per device (arguments, temporaries,
aliased outputs), the Mosaic GPU kernels in it, the kernels a step launches
(``entry_launches``), and how many times each fusion that reads one layer's k or v reads it: a
fusion whose iteration space broadcasts the cache layer ``[C, D]`` to ``[G, C, D]`` (one pass
per query head of the group) reads it G times, from HBM, as a layer's cache (256 MiB at 1M
tokens) is far beyond the L2 cache (50 MiB) and the g axis is the outer one; the kernel's TMA
copies read every block once. From those reads, the predicted time per token (a lower bound, as
``aot.generate``'s): the bytes read at the H100's HBM bandwidth. ``--max_new_tokens 129`` gives
1,048,576 + 128 slots per device, a multiple of the kernel's 64-slot block (``plan_cache``
rounds 128 new tokens to the same).
"""

import argparse
import re
import time

import jax
import numpy as np

from ulysses_jax.aot import hlo
from ulysses_jax.aot import generate as aot_generate
from ulysses_jax.aot.devices import gpu_devices, gpu_spec
from ulysses_jax.aot.report import argument_bytes, budget_options
from ulysses_jax.generate import steps
from ulysses_jax.mesh import make_mesh
from ulysses_jax.models.config import preset

GIB = 2**30
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+\[[\d,]*\])\S* (\w[\w-]*)\((.*?)\)")


def _elements(shape_text: str) -> int:
  dims = shape_text[shape_text.index("[") + 1:-1]
  return int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1


def cache_reads(hlo_text: str, layer_elements: int) -> list[int]:
  """For each fused computation that broadcasts an array of ``layer_elements`` (one layer's k
  or v on a device) over more: how many times its iteration space reads it (the broadcast's
  elements over the layer's)."""
  reads = []
  for body in re.split(r"\n(?=%)", hlo_text):
    if not body.startswith("%fused"):
      continue
    shapes, multiple = {}, 0
    for line in body.splitlines():
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      name, shape, op, operands = m.groups()
      shapes[name] = _elements(shape)
      if op == "broadcast" and shapes.get(operands.strip().lstrip("%")) == layer_elements:
        multiple = max(multiple, shapes[name] // layer_elements)
    if multiple:
      reads.append(multiple)
  return reads


def entry_launches(hlo_text: str) -> int:
  """Kernels the entry computation launches: its fusions and custom calls (a GPU runs each
  as at least one kernel, each with its own launch and tail, however small its work)."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  return len(re.findall(r" (?:fusion|custom-call)\(", entry))


def compile_decode(config, setup, gpu: str = "h100") -> dict:
  spec = gpu_spec(gpu)
  mesh = make_mesh(setup.mesh_data, setup.mesh_seq, setup.mesh_ring,
                   devices=gpu_devices(gpu, f"1x1x{setup.mesh_seq * setup.mesh_ring}"))
  generator, layout, cache = aot_generate.abstract_generator(config, mesh, setup)
  lengths = jax.ShapeDtypeStruct((layout.batch,), np.int32, sharding=steps.rows_sharding(layout))
  start = time.perf_counter()
  compiled = generator.decode_step.lower(generator.params, cache, lengths, np.int32(0),
                                         lengths).compile(
      budget_options(spec, argument_bytes((generator.params, cache))))
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  text = compiled.as_text()
  slots = layout.capacity(layout.kinds[0]) // layout.slot_shards
  heads = -(-layout.kv_heads // layout.head_shards)
  layer_elements = layout.batch // mesh.shape["data"] * heads * slots * layout.head_dim
  reads = cache_reads(text, layer_elements)
  cache_bytes = layout.bytes_per_device()
  weight_bytes = memory.argument_size_in_bytes - cache_bytes
  # XLA: each fusion that broadcasts a layer's k or v reads it that many times; the kernel
  # reads every layer's k and v once (its TMA copies; its last block's overlap is < 1/16384).
  layer_bytes = layer_elements * np.dtype(layout.dtype).itemsize
  kernels = text.count('custom_call_target="mosaic_gpu')
  read_bytes = weight_bytes + sum(reads) * layer_bytes + (cache_bytes if kernels else 0)
  return {
      "decode_backend": setup.decode_backend, "slots_per_device": slots,
      "arguments_gib": memory.argument_size_in_bytes / GIB,
      "temporaries_gib": memory.temp_size_in_bytes / GIB,
      "aliased_gib": memory.alias_size_in_bytes / GIB, "cache_gib": cache_bytes / GIB,
      "mosaic_kernels": kernels, "kernels_per_step": entry_launches(text),
      "cache_reads_of_fusions": sorted(set(reads)),
      "fusions_broadcasting_a_cache_layer": len(reads),
      "predicted_bytes_read_gib": read_bytes / GIB,
      "predicted_ms_per_token": read_bytes / spec.memory_bandwidth * 1e3,
      "collective_bytes": hlo.executed_collective_bytes(text), "compile_s": compile_s}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="llama3.1-8b")
  parser.add_argument("--prompt_len", type=int, default=1048576)
  parser.add_argument("--max_new_tokens", type=int, default=129)
  parser.add_argument("--mesh_seq", type=int, default=8)
  parser.add_argument("--layers", type=int, default=0, help="0: the preset's")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  overrides = dict(dtype="bfloat16", param_dtype="bfloat16", remat_policy="none",
                   attn_head_chunks=1)
  if args.layers:
    overrides["num_layers"] = args.layers
  config = preset(args.preset, **overrides)
  rows = []
  for backend in ("xla", "mosaic"):
    setup = aot_generate.GenerationSetup(prompt_len=args.prompt_len,
                                         max_new_tokens=args.max_new_tokens,
                                         mesh_seq=args.mesh_seq, decode_backend=backend)
    rows.append(compile_decode(config, setup))
  print(f"{args.preset} ({config.num_layers} layers), {args.prompt_len:,} prompt tokens, "
        f"{args.mesh_seq} H100s, jax {jax.__version__}: COMPILED, NOT RUN; times PREDICTED")
  print("| backend | temporaries GiB | Mosaic kernels | kernels per step | reads of a cache "
        "layer per fusion | predicted bytes read GiB | predicted ms/token |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['decode_backend']} | {r['temporaries_gib']:.3f} | {r['mosaic_kernels']} | "
          f"{r['kernels_per_step']} | "
          f"{r['cache_reads_of_fusions'] or '-'} | {r['predicted_bytes_read_gib']:.2f} | "
          f"{r['predicted_ms_per_token']:.2f} |")
  if args.json:
    from benchmarks.common import write_json  # pylint: disable=import-outside-toplevel
    write_json(args.json, rows, preset=args.preset, layers=config.num_layers,
               prompt_len=args.prompt_len, jax=jax.__version__,
               device=f"H100 x {args.mesh_seq}, compile-only devices: compiled, not run")


if __name__ == "__main__":
  main()
