"""Do our Mosaic (Hopper) kernels spill registers? ptxas says so without a GPU.

JAX's CUDA plugin compiles each Mosaic GPU kernel down to a cubin (through ptxas, for sm_90a)
when XLA compiles the program, for compile-only devices too (``ulysses_jax.aot``). With
``MOSAIC_GPU_DUMP_PTXAS`` and ``MOSAIC_GPU_DUMP_TO`` set it writes ptxas's report of every
kernel to ``<kernel name>_<n>.ptxas`` (``flash_kernels.kernel_name``:
``flash_attention_forward_causal`` and the like). A compute warpgroup of ours raises its
register limit (``setmaxnreg``, ``flash_hopper.REGISTERS``) above what the launch gives every
thread (the "registers" column): whatever its code holds beyond that limit ptxas spills to
local memory, which costs a round trip through the L1 per spilled value in the inner loop.
Spill-free is necessary, not sufficient: which tile is fastest only a GPU says
(``benchmarks.attention_kernels --sweep``).

  python -m benchmarks.mosaic_resources [--head-dims 64,128] [--sweep] [--json PATH]

Runs where JAX's CUDA plugin is installed (``make gpu-compile-venv``), with JAX_PLATFORMS=cpu.
Without ``--sweep`` it compiles the table's tiles (``mosaic_tiles.TABLE``, as fitted to
``SEQ_LEN`` tokens), causal and full, with and without packed-segment ids; with it, every tile
of ``mosaic_tiles.candidates`` too (causal, packed), each in its kernel's place beside the
table's others.
"""

import argparse
import functools
import glob
import os
import re
import tempfile
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks.attention_kernels import mosaic_name
from benchmarks.common import print_table, write_json
from ulysses_jax import aot
from ulysses_jax.kernels import flash_hopper, flash_kernels, mosaic_tiles
from ulysses_jax.kernels.flash_attention import choose_tiles, flash_attention

# The resources depend on the tile, not on these; 16,384 tokens gets the table's three
# warpgroup tiles (``mosaic_tiles.THREE_WARPGROUPS_FROM``).
SEQ_LEN, Q_HEADS, KV_HEADS = 16384, 8, 2
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def table_tiles(head_dim, causal):
  """The table's (forward, dq, dk/dv) tiles as ``flash_attention`` fits them to SEQ_LEN."""
  plan = choose_tiles(SEQ_LEN, head_dim, causal=causal, scale=1.0, generation="sm90",
                      forward_kernel="mosaic", backward_kernel="mosaic")
  return plan.forward, plan.dq, plan.dkv


def gpu_kernel_name(kernel, tile, causal):
  """The name the Mosaic ``kernel`` (one of ``mosaic_tiles.KERNELS``) of ``tile`` gets
  (``flash_kernels.kernel_name``): its ptxas report is ``<name>_<n>.ptxas``."""
  kind = "dkv_dq" if tile.accumulate_dq else kernel
  return flash_kernels.kernel_name(kind, types.SimpleNamespace(causal=causal,
                                                               sliding_window=None))


@functools.cache
def compile_reports(head_dim, tiles, *, causal, segments):
  """``{kernel name: ptxas report}`` of the Mosaic kernels of ``flash_attention`` and its
  gradient with ``tiles``, compiled for one compile-only H100. Cached: JAX compiles a program
  it has compiled before only once, and the plugin dumps only then."""
  mesh = Mesh(np.array(aot.gpu_devices("h100", "1x1x1")), ("gpu",))
  replicated = NamedSharding(mesh, P())
  q = jax.ShapeDtypeStruct((1, SEQ_LEN, Q_HEADS, head_dim), jnp.bfloat16, sharding=replicated)
  kv = jax.ShapeDtypeStruct((1, SEQ_LEN, KV_HEADS, head_dim), jnp.bfloat16, sharding=replicated)
  ids = jax.ShapeDtypeStruct((1, SEQ_LEN), jnp.int32, sharding=replicated)

  def attend(q, k, v, ids):
    return flash_attention(q, k, v, causal=causal, segment_ids=ids if segments else None,
                           forward_kernel="mosaic", backward_kernel="mosaic", tiles=tiles)
  fn = jax.grad(lambda *a: attend(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  # The plugin reads these at each compile.
  with tempfile.TemporaryDirectory() as dump, mock.patch.dict(
      os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump):
    with jax.set_mesh(mesh):
      jax.jit(fn).lower(q, kv, kv, ids).compile()
    reports = {}
    for path in glob.glob(os.path.join(dump, "*.ptxas")):
      name = re.sub(r"_\d+$", "", os.path.basename(path)[:-len(".ptxas")])
      with open(path) as f:
        reports[name] = f.read()
  return reports


def parse_report(text):
  """Registers per thread at launch, stack frame and spill bytes from a ptxas report."""
  registers = re.search(r"Used (\d+) registers", text)
  spills = _SPILLS.search(text)
  if not (registers and spills):
    raise ValueError(f"not a ptxas report: {text[:300]!r}")
  return {"registers": int(registers.group(1)), "stack_bytes": int(spills.group(1)),
          "spill_stores": int(spills.group(2)), "spill_loads": int(spills.group(3))}


def measure(kernel, head_dim, tiles, *, causal, segments, table):
  """One row: what ptxas reports of ``kernel`` in a program with ``tiles`` (forward, dq,
  dk/dv)."""
  tile = tiles[mosaic_tiles.KERNELS.index(kernel)]
  name = gpu_kernel_name(kernel, tile, causal)
  warpgroups = flash_hopper.compute_warpgroups(tile)
  row = {"kernel": kernel, "D": head_dim, "causal": causal, "segments": segments,
         "tile": mosaic_name(kernel, tile), "table": table,
         "compute_limit": flash_hopper.REGISTERS[warpgroups][0]}
  try:
    reports = compile_reports(head_dim, tiles, causal=causal, segments=segments)
    row.update(parse_report(reports[name]))
  except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
    return {**row, "status": f"failed: {type(e).__name__}: {e}".replace("\n", " ")[:300]}
  spilled = row["spill_stores"] + row["spill_loads"]
  return {**row, "status": "spills" if spilled else "ok"}


def rows_for(head_dim, *, sweep, kernels=mosaic_tiles.KERNELS):
  """The table's tiles (causal and full, with and without segments), then with ``sweep``
  every candidate (causal, with segments) in its kernel's place."""
  rows = []
  for causal in (True, False):
    table = table_tiles(head_dim, causal)
    for segments in (False, True):
      for kernel in kernels:
        rows.append(measure(kernel, head_dim, table, causal=causal, segments=segments,
                            table=True))
        _print_progress(rows[-1])
  if sweep:
    table = table_tiles(head_dim, True)
    for kernel in kernels:
      index = mosaic_tiles.KERNELS.index(kernel)
      for tile in mosaic_tiles.candidates(head_dim)[kernel]:
        if tile != table[index]:
          tiles = tuple(tile if i == index else t for i, t in enumerate(table))
          rows.append(measure(kernel, head_dim, tiles, causal=True, segments=True, table=False))
          _print_progress(rows[-1])
  return rows


def _print_progress(row):
  print(f"{row['kernel']} D={row['D']} {row['tile']} causal={row['causal']} "
        f"segments={row['segments']}: {row['status']}", flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--head-dims", default="64,128")
  parser.add_argument("--kernels", default=",".join(mosaic_tiles.KERNELS))
  parser.add_argument("--sweep", action="store_true", help="also mosaic_tiles.candidates")
  parser.add_argument("--json", default="", help="write the rows here as JSON "
                      "(nothing is written without it)")
  args = parser.parse_args(argv)
  kernels = tuple(args.kernels.split(","))
  rows = [row for d in map(int, args.head_dims.split(","))
          for row in rows_for(d, sweep=args.sweep, kernels=kernels)]
  print(f"\nsm_90a (compile-only H100), bf16, jax {jax.__version__}; {SEQ_LEN} tokens, GQA "
        f"{Q_HEADS}:{KV_HEADS}; registers at launch, compute_limit = a compute warpgroup's "
        "setmaxnreg")
  print_table(rows, ["kernel", "D", "causal", "segments", "tile", "table", "registers",
                     "compute_limit", "spill_stores", "spill_loads", "stack_bytes", "status"])
  if args.json:
    write_json(args.json, rows, seq_len=SEQ_LEN)
  return rows


if __name__ == "__main__":
  main()
