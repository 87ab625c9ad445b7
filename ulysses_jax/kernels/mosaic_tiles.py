"""The tiles of our Mosaic (Hopper) flash-attention kernels: the table they run by default,
the checks a tile must pass, and the candidates a GPU sweep times.

A tile (``flash_kernels.Tile``) of a Mosaic kernel (``flash_hopper``,
``flash_hopper_backward``) says how many rows its CTA owns (query rows in the forward and dq,
keys in dk/dv), split over two or three compute warpgroups of 64 rows (``num_warps`` 12 or
16, the copy warpgroup included), how wide a streamed block of the other side is, how many
blocks the ring holds (``num_stages``) and its schedule: whether its two compute warpgroups
take turns on the tensor cores (``pingpong``, the forward and dq), or each overlaps a block's
softmax with its own matmul of the block before (``overlap``, the forward), and whether the
dk/dv kernel accumulates dq too, so that no dq kernel runs (``accumulate_dq``). ``python -m
benchmarks.attention_kernels --sweep`` times every ``candidates`` tile on a Hopper GPU beside
the table's and prints the rows of ``TABLE`` for its winners.
"""

import dataclasses

import jax

from ulysses_jax.kernels import flash_hopper, flash_hopper_backward
from ulysses_jax.kernels.flash_kernels import Tile

# Per (GPU generation, head dim, causal): the tiles of the forward, dq and dk/dv (None: no
# Mosaic backward at D = 256). Forward: CTA query rows, keys per slot; dq: CTA query rows, keys
# per slot; dk/dv: queries per slot, CTA keys. Warps 12: two compute warpgroups (16: three,
# head dim 64 only). Shared memory (``shared_memory``) at most 192 KiB (the forward at D =
# 256); registers bound the backward's slot width (dk and dv accumulators of 64 keys x D
# float32, plus two 64 x 64 float32 tiles per warpgroup). The sweep
# (``benchmarks.attention_kernels --sweep --write-table``) writes the rows of its winners here.
# Causal D = 64: the sweep's winners on an H200 (2026-11-27, 16K tokens, each tile timed beside
# the previous row's: forward 2.687 vs 3.140 ms, dq 10.082 vs 10.748 and dk/dv 10.108 vs
# 11.044 ms forward+backward; benchmarks/results/gpu_h200_20261127/). The other rows ran on an
# H200 in issue 47's profile, unswept.
TABLE = {
    ("sm90", 64, True): (
        Tile(192, 128, 16, 2),
        Tile(128, 128, 12, 4, pingpong=True),
        Tile(128, 128, 12, 4)),
    ("sm90", 64, False): (Tile(128, 128, 12, 3), Tile(128, 64, 12, 3), Tile(64, 128, 12, 3)),
    ("sm90", 128, True): (Tile(128, 128, 12, 2), Tile(128, 64, 12, 2), Tile(64, 128, 12, 2)),
    ("sm90", 128, False): (Tile(128, 128, 12, 2), Tile(128, 64, 12, 2), Tile(64, 128, 12, 2)),
    ("sm90", 256, True): (Tile(128, 64, 12, 2), None, None),
    ("sm90", 256, False): (Tile(128, 64, 12, 2), None, None),
}
SHARED_MEMORY = 227 * 1024  # the most one CTA may allocate on Hopper
# Three compute warpgroups own 192 rows, so the padded length is a multiple of 384: from a
# sequence cap of 16K tokens (more than 8,192) that pads at most 3 %, less than the forward's
# 14 % gain (the sweep above); shorter sequences run two warpgroups.
THREE_WARPGROUPS_FROM = 16384
KERNELS = ("forward", "dq", "dkv")


def _owned_and_streamed(kernel):
  """Which of a Mosaic kernel's blocks its CTA owns (split over its compute warpgroups), and
  which it streams: dk/dv owns keys, the forward and dq own query rows."""
  return ("block_kv", "block_q") if kernel == "dkv" else ("block_q", "block_kv")


def buildable(tile):
  """``tile`` as this JAX builds it: a dk/dv tile accumulating dq (a table row a sweep on jax
  0.11 or newer may write) runs without on older JAX, the row's dq tile computing dq."""
  if tile.accumulate_dq and not flash_hopper_backward.can_accumulate_dq():
    return dataclasses.replace(tile, accumulate_dq=False)
  return tile


def fit(tile, kernel, cap, block_q, block_kv):
  """The table's Mosaic ``tile`` for a sequence of at most ``cap`` (a power of two) tokens: no
  block beyond it, but at least 64 rows per compute warpgroup and 64 streamed; two compute
  warpgroups (128 owned rows) where three would pad a sequence shorter than
  ``THREE_WARPGROUPS_FROM`` too much. Blocks the caller gives replace the table's, with two
  compute warpgroups and no ping-pong. A tile this JAX cannot build: ``buildable``'s."""
  tile = buildable(tile)
  owned, streamed = _owned_and_streamed(kernel)
  if block_q or block_kv:
    tile = Tile(block_q or tile.block_q, block_kv or tile.block_kv, 12, tile.num_stages)
  elif flash_hopper.compute_warpgroups(tile) == 3 and cap < THREE_WARPGROUPS_FROM:
    tile = dataclasses.replace(tile, num_warps=12, **{owned: 2 * flash_hopper.WGMMA_ROWS})
  least = {owned: flash_hopper.WGMMA_ROWS * flash_hopper.compute_warpgroups(tile), streamed: 64}
  return dataclasses.replace(tile, **{name: max(min(getattr(tile, name), cap), least[name])
                                      for name in least})


def shared_memory(kernel, tile, head_dim):
  """Bytes of shared memory a Mosaic kernel's CTA allocates (16-bit inputs, segment ids): each
  buffer rounded up to 1 KiB as Mosaic GPU aligns them (its lowering checks the real figure)."""
  owned, streamed = (getattr(tile, name) for name in _owned_and_streamed(kernel))
  tiles = {"forward": (1, 2), "dq": (2, 2), "dkv": (2, 2)}[kernel]  # (owned, streamed) [*, D]
  vectors = {"forward": (2, 1), "dq": (3, 1), "dkv": (1, 3)}[kernel]  # float32 / int32 [*]
  buffers = ([owned * head_dim * 2] * tiles[0] + [owned * 4] * vectors[0]
             + [tile.num_stages * streamed * head_dim * 2] * tiles[1]
             + [tile.num_stages * streamed * 4] * vectors[1])
  if tile.accumulate_dq:  # per compute warpgroup: its dS^T (16-bit), its dq part (float32)
    buffers += [owned * streamed * 2, streamed * head_dim * 4 * owned // flash_hopper.WGMMA_ROWS]
  return sum(-(-size // 1024) * 1024 for size in buffers)


def check(kernel, tile, head_dim):
  """Raises unless the Mosaic ``kernel`` (one of ``KERNELS``) can run ``tile`` at ``head_dim``."""
  warpgroups = flash_hopper.compute_warpgroups(tile)
  owned, streamed = _owned_and_streamed(kernel)
  problems = []
  if tile.num_warps not in (12, 16) or (warpgroups == 3 and head_dim != 64):
    problems.append(f"num_warps {tile.num_warps}: 12 (two compute warpgroups), or 16 (three) at "
                    "head dim 64")
  elif getattr(tile, owned) % (flash_hopper.WGMMA_ROWS * warpgroups):
    problems.append(f"{owned} {getattr(tile, owned)}: a multiple of "
                    f"{flash_hopper.WGMMA_ROWS * warpgroups} ({warpgroups} compute warpgroups)")
  if getattr(tile, streamed) % 64:
    problems.append(f"{streamed} {getattr(tile, streamed)}: a multiple of 64")
  if tile.num_stages < 2:
    problems.append(f"num_stages {tile.num_stages}: at least 2")
  if tile.pingpong and (kernel == "dkv" or warpgroups != 2):
    problems.append("pingpong: the forward or dq with two compute warpgroups only")
  if tile.overlap and (kernel != "forward" or tile.pingpong):
    problems.append("overlap: the forward only, without pingpong")
  if tile.accumulate_dq and kernel != "dkv":
    problems.append("accumulate_dq: the dk/dv kernel only")
  elif tile.accumulate_dq and not flash_hopper_backward.can_accumulate_dq():
    problems.append(f"accumulate_dq: needs jax >= 0.11 (a mutable dq accumulator in the "
                    f"kernel), this is jax {jax.__version__}: upgrade JAX or leave it False")
  if (smem := shared_memory(kernel, tile, head_dim)) > SHARED_MEMORY:
    problems.append(f"{smem} bytes of shared memory: at most {SHARED_MEMORY}")
  if problems:
    raise ValueError(f"flash_attention: the Mosaic {kernel} kernel cannot run {tile} at head dim "
                     f"{head_dim}: " + "; ".join(problems) + ". Use mosaic_tiles.candidates().")


def _schedules(kernel, warpgroups):
  """The schedules a sweep tries for ``kernel``: plain; ping-pong (the forward and dq, two
  compute warpgroups); the forward's intra-warpgroup overlap; dk/dv accumulating dq (where
  this JAX can build it)."""
  schedules = [{}]
  if kernel != "dkv" and warpgroups == 2:
    schedules.append({"pingpong": True})
  if kernel == "forward":
    schedules.append({"overlap": True})
  if kernel == "dkv" and flash_hopper_backward.can_accumulate_dq():
    schedules.append({"accumulate_dq": True})
  return schedules


def candidates(head_dim):
  """``{kernel: [Tile]}``: the Mosaic tiles ``benchmarks.attention_kernels --sweep`` times at
  ``head_dim``: two or three compute warpgroups (FA3's 192-row tile at 64), streamed blocks of
  64 or 128, two to four slots, each of ``_schedules``; those that fit. Not dk/dv with three
  compute warpgroups streaming 128 queries: at 160 registers a thread ptxas spills 1-2 KiB of
  them (``benchmarks.mosaic_resources``), and on an H200 they took 31-48 % longer than the
  others (benchmarks/results/gpu_h200_20261127/sweep_d64_causal_dkv.log)."""
  warpgroups = (2, 3) if head_dim == 64 else (2,)
  found = {kernel: [] for kernel in KERNELS}
  for kernel in KERNELS if head_dim in flash_hopper_backward.HEAD_DIMS else ("forward",):
    owned, streamed = _owned_and_streamed(kernel)
    for n in warpgroups:
      for block in (64, 128):
        for stages in (2, 3, 4):
          for schedule in _schedules(kernel, n):
            tile = Tile(**{owned: 64 * n, streamed: block}, num_warps=4 * (n + 1),
                        num_stages=stages, **schedule)
            if shared_memory(kernel, tile, head_dim) <= SHARED_MEMORY and not (
                kernel == "dkv" and n == 3 and block == 128):
              found[kernel].append(tile)
  # The schedules not yet run on a GPU last: a fault there costs a sweep only its last rows.
  found["dkv"].sort(key=lambda tile: tile.accumulate_dq)
  return found
