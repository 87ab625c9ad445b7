"""What do our Pallas Triton kernels need on a GPU? Registers, spills, shared memory: no GPU.

Pallas lowers each kernel (forward, dq, dk/dv) to Triton IR on any machine; the `triton`
package (``pip install -e '.[kernel-tools]'``) then compiles that IR for the chosen compute
capability (default 90: sm_90a, H100/H200) and its ptxas reports registers per thread and spill
bytes. A tile that needs more shared memory than a block may have there (``SMEM_LIMIT_KIB``)
fails here as it would on the GPU. This prunes the tiles worth timing on a GPU; which of the
rest is fastest only a GPU shows (``benchmarks.attention_kernels --sweep``).

The `triton` package is not the Triton inside jaxlib that compiles these kernels on a GPU, so
the figures are those of the package's version (recorded in the JSON): close, not identical.
Its own IR passes run first, as jaxlib's do.

  python -m benchmarks.kernel_resources [--capability 90] [--head-dims 64,128,256] [--sweep]
      [--json PATH]

Without ``--sweep`` it compiles the tiles of ``flash_attention.choose_tiles``'s table for that
generation (``"sm90"``, or ``"other"`` below 90); with it, every (block_q, block_kv, warps,
stages) of ``SWEEP`` as well.
"""

import argparse
import contextlib
import dataclasses
import itertools
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from ulysses_jax.kernels import flash_kernels
from ulysses_jax.kernels.flash_attention import choose_tiles
from ulysses_jax.kernels.flash_kernels import Tile

KERNELS = ("forward", "dq", "dkv")
# Shared memory one block may use, by compute capability (CUDA programming guide, "Technical
# Specifications per Compute Capability"): A100, A10/RTX 30, L4/RTX 40, H100/H200.
SMEM_LIMIT_KIB = {80: 163, 86: 99, 89: 99, 90: 227}
SWEEP = dict(blocks=tuple(itertools.product((32, 64, 128), repeat=2)), warps=(4, 8), stages=(2, 3))
# Shapes the kernels are lowered for; the resources depend on the tile, not on these.
SEQ_LEN, Q_HEADS, KV_HEADS = 4096, 8, 2


# A GPU of each compute capability above. Lowering without a GPU attached, JAX 0.11 reads the
# capability from the abstract mesh's device (0.10 assumed 90).
GPU_KIND = {80: "NVIDIA A100", 86: "NVIDIA A10", 89: "NVIDIA L4", 90: "NVIDIA H100"}


def lowering_target(capability: int = 90):
  """A context in which ``lower(lowering_platforms=("cuda",))`` lowers Pallas GPU kernels for
  ``sm_<capability>`` on a machine without a GPU."""
  device = jax.sharding.AbstractDevice(GPU_KIND[capability], None, "cuda")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


@contextlib.contextmanager
def _capture_triton_modules():
  """Collects the Triton IR text of every Pallas Triton kernel lowered inside the block."""
  from jax._src.pallas.triton import pallas_call_registration  # no public hook exists
  modules, lower = [], pallas_call_registration.lowering.lower_jaxpr_to_triton_module

  def capturing(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result
  pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capturing
  try:
    yield modules
  finally:
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower


def _generation(capability):
  return "sm90" if capability >= 90 else "other"


def triton_ir(kernel, head_dim, tile, *, segments, capability=90):
  """The Triton IR (text) that Pallas emits for one kernel and tile."""
  plan = choose_tiles(SEQ_LEN, head_dim, causal=True, scale=head_dim ** -0.5,
                      generation=_generation(capability))
  plan = dataclasses.replace(plan, **{kernel: tile})
  q = jax.ShapeDtypeStruct((1, SEQ_LEN, Q_HEADS, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, SEQ_LEN, KV_HEADS, head_dim), jnp.bfloat16)
  stats = jax.ShapeDtypeStruct((1, Q_HEADS, SEQ_LEN), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, SEQ_LEN), jnp.int32) if segments else None
  if kernel == "forward":
    fn, args = lambda *a: flash_kernels.forward(plan, *a), (q, kv, kv, ids, ids)
  else:
    backward = getattr(flash_kernels, f"backward_{kernel}")
    fn = lambda *a: backward(plan, *a, jnp.bfloat16)
    args = (q, kv, kv, q, stats, stats, ids, ids)
  with _capture_triton_modules() as modules, lowering_target(capability):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  (module,) = modules
  return module


def compile_for_gpu(ir_text, tile, workdir, capability=90):
  """Compiles Triton IR for ``sm_<capability>`` (sm_90a for 90); returns registers, spill bytes
  and shared memory."""
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # fused multiply-adds, as jaxlib's
  import triton  # noqa: PLC0415 - optional: only this tool needs it
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget
  target = GPUTarget("cuda", capability, 32)
  backend = triton.compiler.make_backend(target)
  options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  raw = os.path.join(workdir, "kernel.raw.ttir")
  with open(raw, "w") as f:
    f.write(ir_text)
  module = ir.parse_mlir_module(raw, context)
  module.context = context
  backend.make_ttir(module, {}, backend.parse_options(options), capability)
  optimized = os.path.join(workdir, "kernel.ttir")  # compile() starts after the TTIR passes
  with open(optimized, "w") as f:
    f.write(str(module))
  compiled = triton.compile(optimized, target=target, options=options)
  ptx = os.path.join(workdir, "kernel.ptx")
  with open(ptx, "w") as f:
    f.write(compiled.asm["ptx"])
  report = subprocess.run(
      [_ptxas(), f"-arch=sm_{capability}{'a' if capability == 90 else ''}", "-v", ptx, "-o",
       os.path.join(workdir, "kernel.cubin")],
      capture_output=True, text=True, check=True).stderr
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
  return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
          "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
          "smem_KiB": compiled.metadata.shared / 1024, "triton": triton.__version__}


def _ptxas():
  """The newest ptxas bundled with the triton package (it emits PTX for that one)."""
  import triton
  folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  names = [n for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(folder, n))]
  return os.path.join(folder, names[0])


def tiles(kernel, head_dim, *, sweep, capability=90):
  """The table's tile for this kernel and head dim, then (with sweep) the alternatives."""
  plan = choose_tiles(SEQ_LEN, head_dim, causal=True, scale=1.0,
                      generation=_generation(capability))
  default = getattr(plan, kernel)
  found = [default]
  if sweep:
    for (block_q, block_kv), warps, stages in itertools.product(*SWEEP.values()):
      tile = Tile(block_q, block_kv, warps, stages)
      if tile != default:
        found.append(tile)
  return default, found


def measure(kernel, head_dim, tile, *, segments, default, workdir, capability):
  row = {"kernel": kernel, "D": head_dim, "segments": segments, "block_q": tile.block_q,
         "block_kv": tile.block_kv, "warps": tile.num_warps, "stages": tile.num_stages,
         "table": tile == default}
  try:
    ir_text = triton_ir(kernel, head_dim, tile, segments=segments, capability=capability)
    row.update(compile_for_gpu(ir_text, tile, workdir, capability))
  except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
    return {**row, "status": f"failed: {type(e).__name__}: {e}".replace("\n", " ")[:300]}
  fits = row["smem_KiB"] <= SMEM_LIMIT_KIB[capability]
  return {**row, "status": "ok" if fits else "too much shared memory"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--capability", type=int, default=90, choices=sorted(SMEM_LIMIT_KIB))
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--kernels", default=",".join(KERNELS))
  parser.add_argument("--sweep", action="store_true", help="also the tiles of SWEEP")
  parser.add_argument("--json", default="", help="write the rows here as JSON "
                      "(nothing is written without it)")
  args = parser.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    for kernel in args.kernels.split(","):
      for head_dim in map(int, args.head_dims.split(",")):
        default, candidates = tiles(kernel, head_dim, sweep=args.sweep,
                                    capability=args.capability)
        for tile in candidates:
          for segments in (False, True):
            rows.append(measure(kernel, head_dim, tile, segments=segments, default=default,
                                workdir=workdir, capability=args.capability))
            print(f"{kernel} D={head_dim} {tile} segments={segments}: {rows[-1]['status']}",
                  flush=True)
  limit = SMEM_LIMIT_KIB[args.capability]
  print(f"\nsm_{args.capability}, bf16, causal; Triton {rows[0].get('triton', '?')} (the triton "
        f"package); shared memory limit {limit} KiB per block")
  print_table(rows, ["kernel", "D", "segments", "block_q", "block_kv", "warps", "stages",
                     "table", "registers", "spill_bytes", "smem_KiB", "status"])
  if args.json:
    write_json(args.json, rows, capability=args.capability, smem_limit_kib=limit)
  return rows


if __name__ == "__main__":
  main()
