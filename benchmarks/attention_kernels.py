"""How fast is our Pallas flash attention, against cuDNN, JAX's Pallas kernels and XLA?

Forward and forward+backward TFLOP/s for each implementation on the same bf16 inputs, against
the device's measured bf16 matmul TFLOP/s (the ceiling). Before timing, each implementation
is checked against the float32 dense reference on the same inputs: output rows at 128 sampled
query positions, and dq (those rows), dk, dv for an output cotangent that is nonzero only on
those rows (the reference then needs only the sampled rows, so it fits at S = 64K).
Implementations that fail to compile or run are skipped with the reason.

Run on a GPU (one H100/H200 run of the default grid takes a few minutes):
  python -m benchmarks.attention_kernels [--seq-lens 4096,16384,65536] [--head-dims 64,128]
      [--masks causal,full] [--impls ours,ours_mosaic,cudnn,pallas_triton,pallas_mgpu,xla,
      xla_chunked,'mosaic_*'] [--sweep] [--json PATH]
"ours" is our flash attention with the Triton-lowered kernels, "ours_mosaic" the same with the
Hopper kernels of ``ulysses_jax.kernels.flash_hopper`` (forward) and ``flash_hopper_backward``
(dq, dk/dv; head dims 64 and 128). A row's bwd column is the backward kernel's.

``--sweep`` also times our Triton kernels at other block sizes and, on a Hopper GPU, every
Mosaic tile of ``kernels.mosaic_tiles.candidates``: rows ``mosaic_forward[...]`` change the
forward's tile, ``mosaic_dq[...]`` / ``mosaic_dkv[...]`` one backward kernel's, the other
kernels keeping the table's (a forward tile's row checks and times the forward alone, a backward
tile's the gradients and forward+backward). It ends with the table rows
(``kernels.mosaic_tiles.TABLE``) of the fastest tile of each kernel per head dim and mask (a
row's tiles were each timed beside the table's, which is among the candidates);
``--write-table`` also writes them into ``ulysses_jax/kernels/mosaic_tiles.py``, so that the
commands after it run them. On an H200 a tile took 9-13 s when its row compiled and timed both
phases (2026-11-27) and about 12 s compiling one (2026-11-28). Now our kernels' rows go in
groups of ``--compile-threads`` (default: 8, at most one a core): the group's programs compile
at once, in that many threads (their tracing and lowering, in Python, still one at a time),
then each of its rows is checked and timed with nothing compiling beside it; the line
"compiled N programs of M rows in T s" says what the compiles took.
Smoke test on CPU (interpret mode, tiny shapes):
  python -m benchmarks.attention_kernels --tiny
"""

import argparse
import fnmatch
import functools
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.common import environment, print_table, write_json
from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.doctor.kernels import (FLOPS_FORMULA, SAMPLED_ROWS, TOLERANCE, attention_flops,
                                        compile_ahead, measure, reference_on_rows,
                                        sampled_rows, throughput)
from ulysses_jax.kernels import flash_hopper_backward, mosaic_tiles
from ulysses_jax.kernels.flash_attention import choose_tiles, flash_attention
from ulysses_jax.doctor.timing import time_fn

SWEEP_BLOCKS = ((64, 64), (128, 64), (64, 128), (128, 128))
# The phases a swept Mosaic tile changes, so the only ones its row checks and times (one
# compile each: a sweep stage fits a GPU command).
SWEPT_PHASES = {"mosaic_forward": ("forward",), "mosaic_dq": ("backward",),
                "mosaic_dkv": ("backward",)}
OURS = ("ours", "mosaic_")  # the rows of our kernels


def implementations(causal, head_dim, *, interpret, sweep):
  """name -> factory; a factory returns ``fn(q, k, v) -> out`` or raises (the skip reason)."""
  scale = head_dim ** -0.5

  def ours(block_q=None, block_kv=None, kernel="triton"):
    return functools.partial(flash_attention, causal=causal, block_q=block_q,
                             block_kv=block_kv, interpret=interpret, forward_kernel=kernel,
                             backward_kernel=kernel)

  def ours_mosaic(kernel=None, tile=None):
    """Our Mosaic kernels (Triton's backward at D = 256), with ``tile`` for one ``kernel``."""
    if interpret:  # GPU interpret mode runs them in the tests; far too slow for a benchmark
      raise RuntimeError("the Mosaic GPU kernels need a Hopper GPU")
    backward = "mosaic" if head_dim in flash_hopper_backward.HEAD_DIMS else "triton"

    def attention(q, k, v):
      tiles = None
      if tile is not None:
        plan = choose_tiles(q.shape[1], head_dim, causal=causal, scale=scale,
                            generation="sm90", forward_kernel="mosaic",
                            backward_kernel=backward)
        tiles = [plan.forward, plan.dq, plan.dkv]
        tiles[mosaic_tiles.KERNELS.index(kernel)] = tile
      return flash_attention(q, k, v, causal=causal, interpret=interpret,
                             forward_kernel="mosaic", backward_kernel=backward,
                             tiles=None if tiles is None else tuple(tiles))
    return attention

  def cudnn():
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation="cudnn")

  def pallas_triton():
    from jax.experimental.pallas.ops.gpu import attention
    return lambda q, k, v: attention.mha(q, k, v, None, sm_scale=scale, causal=causal,
                                         interpret=interpret)

  def pallas_mgpu():
    if interpret:
      raise RuntimeError("Mosaic GPU kernels need a Hopper GPU")
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal, block_q_dkv=64,
        block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    # This kernel has no scale argument: scale q (an O(S) elementwise op, timed with it).
    return lambda q, k, v: attention_mgpu.attention(q * jnp.asarray(scale, q.dtype), k, v,
                                                    config)

  def xla():
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation="xla")

  def xla_chunked():
    return functools.partial(chunked_attention, causal=causal)

  impls = {"ours": ours, "ours_mosaic": ours_mosaic}
  if sweep:
    impls.update({f"ours[{bq}x{bk}]": functools.partial(ours, bq, bk) for bq, bk in SWEEP_BLOCKS})
    impls.update({mosaic_name(kernel, tile): functools.partial(ours_mosaic, kernel, tile)
                  for kernel, tiles in mosaic_tiles.candidates(head_dim).items() for tile in tiles})
  impls.update(cudnn=cudnn, pallas_triton=pallas_triton, pallas_mgpu=pallas_mgpu, xla=xla,
               xla_chunked=xla_chunked)
  return impls


SCHEDULES = ("pingpong", "overlap", "accumulate_dq")  # Tile's fields beside blocks, warps, stages


def mosaic_name(kernel, tile):
  """The row of a swept Mosaic tile: ``mosaic_<kernel>[<block_q>x<block_kv>-<warps>w-
  <stages>st(-pingpong)(-overlap)(-accumulate_dq)]`` (no commas: ``--impls`` takes a list of
  them)."""
  schedule = "".join(f"-{name}" for name in SCHEDULES if getattr(tile, name))
  return (f"mosaic_{kernel}[{tile.block_q}x{tile.block_kv}-{tile.num_warps}w-"
          f"{tile.num_stages}st{schedule}]")


def tile_source(tile):
  """A ``Tile`` as the table in ``flash_attention`` writes it."""
  schedule = "".join(f", {name}=True" for name in SCHEDULES if getattr(tile, name))
  return f"Tile({tile.block_q}, {tile.block_kv}, {tile.num_warps}, {tile.num_stages}{schedule})"


def mosaic_times(rows, head_dim):
  """``{(S, causal): {kernel: {tile: ms}}}`` of the swept Mosaic rows of ``head_dim`` that ran:
  a forward tile's forward time, a dq or dk/dv tile's forward+backward time (the other kernels
  are the table's in those rows)."""
  by_name = {mosaic_name(kernel, tile): (kernel, tile)
             for kernel, tiles in mosaic_tiles.candidates(head_dim).items() for tile in tiles}
  times = {}
  for row in rows:
    if row["D"] != head_dim or row["impl"] not in by_name or row["status"] != "ok":
      continue
    kernel, tile = by_name[row["impl"]]
    ms = row["fwd_ms"] if kernel == "forward" else row["fwd_bwd_ms"]
    times.setdefault((row["S"], row["causal"]), {}).setdefault(kernel, {})[tile] = ms
  return times


def mosaic_table(rows, head_dims):
  """Per head dim, length and mask, the table row of the fastest tile of each kernel (the
  table's own where none of its candidates ran) and a note of their times beside the table's
  tiles': ``{"sm90,D,causal,S=..": ([tile sources], note)}``. The ``ours_mosaic`` row of the
  same shape, where it ran, times the table's tiles too: a sweep cut short before a kernel's
  table tile came up keeps that tile unless a faster one ran."""
  table = {}
  for head_dim in head_dims:
    backward = "mosaic" if head_dim in flash_hopper_backward.HEAD_DIMS else "triton"
    for (seq_len, causal), times in sorted(mosaic_times(rows, head_dim).items()):
      plan = choose_tiles(seq_len, head_dim, causal=causal, scale=1.0, generation="sm90",
                          forward_kernel="mosaic", backward_kernel=backward)
      ours = [r for r in rows if r["impl"] == "ours_mosaic" and r["status"] == "ok" and
              (r["S"], r["D"], r["causal"]) == (seq_len, head_dim, causal)]
      chosen, notes = [], []
      for kernel in mosaic_tiles.KERNELS if backward == "mosaic" else mosaic_tiles.KERNELS[:1]:
        current = getattr(plan, kernel)
        kernel_times = dict(times.get(kernel, {}))
        if ours and current not in kernel_times:
          kernel_times[current] = ours[0]["fwd_ms" if kernel == "forward" else "fwd_bwd_ms"]
        best = min((kernel_times or {current: None}).items(),
                   key=lambda item: float("inf") if item[1] is None else item[1])
        chosen.append(tile_source(best[0]))
        if kernel in times:
          table_ms = kernel_times.get(current)
          notes.append(f"{kernel} {best[1]:.3f} ms (table's "
                       + ("not run" if table_ms is None else f"{table_ms:.3f}") + ")")
      chosen += ["None"] * (3 - len(chosen))
      table[f"sm90,{head_dim},{causal},S={seq_len}"] = (chosen, f"S={seq_len}: "
                                                       + "; ".join(notes))
  return table


def print_mosaic_table(rows, head_dims):
  """Prints ``mosaic_table``'s rows as rows of ``TABLE``; returns ``{"sm90,D,causal,S=..":
  [tile sources]}``."""
  table = {}
  for key, (chosen, note) in mosaic_table(rows, head_dims).items():
    _, head_dim, causal, _ = key.split(",")
    print(f'    ("sm90", {head_dim}, {causal}): ({", ".join(chosen)}),  # {note}')
    table[key] = chosen
  return table


def write_mosaic_table(table, path=mosaic_tiles.__file__, quiet=False):
  """Replaces the rows of ``TABLE`` in ``path`` (mosaic_tiles.py) by those of ``table``
  (``print_mosaic_table``'s answer; of several lengths of one row, the longest). Only rows
  the table has: a new one is a decision for its author."""
  source = open(path, encoding="utf-8").read()
  for key, tiles in sorted(table.items(), key=lambda item: int(item[0].split("S=")[1])):
    generation, head_dim, causal, _ = key.split(",")
    prefix = f'    ("{generation}", {head_dim}, {causal}): '
    if prefix not in source:
      raise ValueError(f"{path} has no TABLE row {prefix.strip()} to replace with the sweep's "
                       f"{key}; add the row by hand (the sweep printed it above)")
    start = source.index(prefix) + len(prefix)
    end, depth = start, 0
    while depth or end == start:  # to the parenthesis closing the row's tuple
      depth += {"(": 1, ")": -1}.get(source[end], 0)
      end += 1
    row = f"({', '.join(tiles)})"
    if len(prefix) + len(row) + 1 > 100:  # the project's line length
      row = "(\n" + ",\n".join(" " * 8 + tile for tile in tiles) + ")"
    source = source[:start] + row + source[end:]
  with open(path, "w", encoding="utf-8") as f:
    f.write(source)
  if not quiet:
    print(f"wrote {len(table)} rows into {path}")


def compile_ours(fns, phases, arrays, threads):
  """``{name: {phase: Future} or None}`` for the rows ``fns`` (name -> ``fn(q, k, v)``, or a
  skipped row's dict): our kernels' programs (``phases[name]``) compiled ahead for ``arrays``
  ``(q, k, v, d_out)`` in ``threads`` threads (``doctor.kernels.compile_ahead``). cuDNN's and
  XLA's (None) compile in their rows: their compiles may autotune on the GPU."""
  start = time.perf_counter()
  ours = {name: fn for name, fn in fns.items() if name.startswith(OURS) and callable(fn)}
  programs = compile_ahead(ours, arrays, threads, phases)
  if programs:
    print(f"  compiled {sum(map(len, programs.values()))} programs of {len(programs)} rows in "
          f"{time.perf_counter() - start:.1f} s (--compile-threads {threads})", flush=True)
  return {name: programs.get(name) for name in fns}


def select(names, patterns):
  """The ``names`` matching any of ``patterns``, in the patterns' order (then the names'): the
  order ``--impls`` asks for is the order they run in, so a run cut short has the first."""
  # A tile's name holds brackets, which fnmatch would read as a set: they match themselves.
  globs = [p.replace("[", "[[]") for p in patterns]
  return list(dict.fromkeys(n for g in globs for n in names if fnmatch.fnmatch(n, g)))


def matmul_peak_tflops(size):
  """Best measured bf16 matmul TFLOP/s over square sizes up to ``size``, ten calls dispatched
  back to back per sample (one at a time, an H200 read 615 TFLOP/s where
  ``metrics.measure_peak_flops`` read 815: each sample held the host's dispatch)."""
  best = 0.0
  for n in (size // 2, size):
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    timing = time_fn(jax.jit(jnp.matmul), a, a, warmup=2, iters=10, burst=10)
    best = max(best, 2 * n ** 3 / timing["median_s"] / 1e12)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq-lens", default="4096,16384,65536")
  parser.add_argument("--head-dims", default="64,128")
  parser.add_argument("--impls", default="all", help="comma-separated names or patterns "
                      "('mosaic_*': every swept Mosaic tile), or all")
  parser.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // S)")
  parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden // D")
  parser.add_argument("--masks", default="causal,full", help="causal, full or both")
  parser.add_argument("--sweep", action="store_true", help=f"also time ours at {SWEEP_BLOCKS} "
                      "and, on a Hopper GPU, every Mosaic tile of mosaic_tiles.candidates")
  parser.add_argument("--write-table", action="store_true", help="with --sweep: write the "
                      "fastest tiles into ulysses_jax/kernels/mosaic_tiles.py's TABLE")
  parser.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1),
                      help="rows whose programs compile at once, in as many threads, before "
                      "they are timed")
  parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode")
  parser.add_argument("--json", default="", help="write the rows here as JSON "
                      "(nothing is written without it)")
  args = parser.parse_args()
  if args.write_table and not args.sweep:
    parser.error("--write-table writes the sweep's winners: add --sweep")
  if args.tiny:
    args.seq_lens, args.head_dims, args.tokens, args.hidden = "128,200", "64", 256, 128
  interpret = jax.default_backend() != "gpu"
  known = list(implementations(True, 64, interpret=interpret, sweep=args.sweep))
  requested = ["*"] if args.impls == "all" else args.impls.split(",")
  if unknown := [p for p in requested if not select(known, [p])]:
    parser.error(f"unknown --impls {unknown}; choose from {known}")
  warmup, iters = (1, 2) if args.tiny else (2, 10)

  env = environment()
  for key, value in env.items():
    print(f"{key}: {value}")
  peak = matmul_peak_tflops(512 if args.tiny else 8192)
  print(f"measured bf16 matmul peak: {peak:.1f} TFLOP/s (the ceiling for %peak)")
  print(FLOPS_FORMULA)
  print(f"check: relative L2 error < {TOLERANCE} vs float32 dense reference on "
        f"{SAMPLED_ROWS} sampled query rows (out, dq) and dk, dv")

  rows_out = []
  head_dims = [int(d) for d in args.head_dims.split(",")]
  for head_dim in head_dims:
    for seq_len in map(int, args.seq_lens.split(",")):
      batch, heads = max(1, args.tokens // seq_len), args.hidden // head_dim
      keys = jax.random.split(jax.random.PRNGKey(seq_len + head_dim), 4)
      q, k, v, d_out = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.bfloat16)
                        for key in keys)
      rows = sampled_rows(seq_len)
      for causal in [{"causal": True, "full": False}[mask] for mask in args.masks.split(",")]:
        plans = {"ours (Triton)": choose_tiles(seq_len, head_dim, causal=causal, scale=1.0,
                                               interpret=interpret)}
        if head_dim in flash_hopper_backward.HEAD_DIMS:
          plans["ours_mosaic"] = choose_tiles(seq_len, head_dim, causal=causal, scale=1.0,
                                              forward_kernel="mosaic", backward_kernel="mosaic")
        print(f"\nB={batch} S={seq_len} H={heads} D={head_dim} causal={causal}; " + "; ".join(
            f"{name}: fwd {plan.forward}, dq {plan.dq}, dkv {plan.dkv}"
            for name, plan in plans.items()), flush=True)
        reference = reference_on_rows(q, k, v, d_out, rows, causal)
        flops = attention_flops(batch, seq_len, heads, head_dim, causal)
        impls = implementations(causal, head_dim, interpret=interpret, sweep=args.sweep)
        names = select(impls, requested)
        fns = {}
        for name in names:
          try:
            fns[name] = impls[name]()
          except Exception as e:  # noqa: BLE001
            fns[name] = {"status": f"skipped: {type(e).__name__}: {e}".replace("\n", " ")}
        phases = {name: SWEPT_PHASES.get(name.split("[")[0], ("forward", "backward"))
                  for name in names}
        programs = {}
        for name in names:
          if name not in programs:  # the next rows' programs, as many rows as threads
            group = names[names.index(name):][:args.compile_threads]
            programs = compile_ours({n: fns[n] for n in group}, phases, (q, k, v, d_out),
                                    args.compile_threads)
          if isinstance(fns[name], dict):
            result = fns[name]
          else:
            result = measure(fns[name], q, k, v, d_out, rows, reference, warmup=warmup,
                             iters=iters, phases=phases[name], programs=programs[name])
          row = {"impl": name, "S": seq_len, "D": head_dim, "causal": causal, "B": batch,
                 "H": heads, **result, **throughput(result, flops, peak)}
          times = "".join(f" {phase} {row[f'{phase}_ms']:.3f} ms" for phase in ("fwd", "fwd_bwd")
                          if f"{phase}_ms" in row)
          print(f"  {name}: {row['status']}{times}", flush=True)
          rows_out.append(row)
          # So far: a run stopped later (its limit, a kernel's fault) keeps these, and the table
          # the fastest tiles that ran.
          if args.json:
            write_json(args.json, rows_out, matmul_peak_tflops=peak, interpret=interpret)
          if args.write_table and (swept := mosaic_table(rows_out, head_dims)):
            write_mosaic_table({key: chosen for key, (chosen, _) in swept.items()}, quiet=True)
        del reference, programs

  columns = ["impl", "S", "D", "causal", "fwd_ms", "fwd_tflops", "fwd_pct_peak", "fwd_bwd_ms",
             "fwd_bwd_tflops", "bwd_tflops", "bwd_pct_peak", "err_out", "err_grad", "status"]
  print()
  print_table([{**r, "status": r["status"][:80]} for r in rows_out], columns)
  table_rows = {}
  if args.sweep:
    print("\nThe fastest Mosaic tiles, as rows of ulysses_jax/kernels/mosaic_tiles.py's TABLE:")
    table_rows = print_mosaic_table(rows_out, head_dims)
    if args.write_table and table_rows:
      write_mosaic_table(table_rows)
  if args.json:
    write_json(args.json, rows_out, matmul_peak_tflops=peak, flops_formula=FLOPS_FORMULA,
               tolerance=TOLERANCE, sampled_rows=SAMPLED_ROWS, interpret=interpret,
               tokens=args.tokens, hidden=args.hidden, mosaic_table=table_rows)


if __name__ == "__main__":
  main()
