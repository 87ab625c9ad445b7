"""The tiles of our Hopper flash kernels (``kernels.mosaic_tiles``): the table's rows fitted
to a sequence, the checks a tile passes before any tracing, and what a JAX that cannot build a
tile runs instead. Their numerics and lowering: ``test_flash_hopper.py``."""

import dataclasses

import jax.numpy as jnp
import pytest

from ulysses_jax.kernels import flash_hopper, flash_hopper_backward, mosaic_tiles
from ulysses_jax.kernels.flash_attention import choose_tiles, flash_attention
from ulysses_jax.kernels.flash_kernels import Tile


def test_overlap_is_a_forward_schedule_without_pingpong():
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  plan = choose_tiles(256, 64, causal=True, scale=1.0, generation="sm90", forward_kernel="mosaic",
                      backward_kernel="mosaic")
  for tiles in ((Tile(128, 64, 12, 2, pingpong=True, overlap=True), plan.dq, plan.dkv),
                (plan.forward, Tile(128, 64, 12, 2, overlap=True), plan.dkv)):
    with pytest.raises(ValueError, match="overlap: the forward only, without pingpong"):
      flash_attention(q, q, q, forward_kernel="mosaic", backward_kernel="mosaic", tiles=tiles)


def test_mosaic_tiles_are_checked_before_tracing():
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  plan = choose_tiles(256, 128, causal=True, scale=1.0, generation="sm90",
                      forward_kernel="mosaic", backward_kernel="mosaic")
  three = (Tile(192, 128, 16, 2), plan.dq, plan.dkv)
  with pytest.raises(ValueError, match=r"Mosaic forward kernel cannot run .* at head dim 128: "
                     r"num_warps 16: 12 \(two compute warpgroups\), or 16 \(three\) at "
                     r"head dim 64"):
    flash_attention(q, q, q, forward_kernel="mosaic", backward_kernel="mosaic", tiles=three)
  pingpong_dkv = (plan.forward, plan.dq, Tile(64, 128, 12, 2, pingpong=True))
  with pytest.raises(ValueError, match="pingpong: the forward or dq with two compute warpgroups"):
    flash_attention(q, q, q, forward_kernel="mosaic", backward_kernel="mosaic",
                    tiles=pingpong_dkv)
  too_big = (Tile(128, 128, 12, 4), plan.dq, plan.dkv)
  with pytest.raises(ValueError, match=r"\d+ bytes of shared memory: at most 232448"):
    flash_attention(q, q, q, forward_kernel="mosaic", backward_kernel="mosaic", tiles=too_big)
  with pytest.raises(ValueError, match="pass tiles or block_q / block_kv, not both"):
    flash_attention(q, q, q, forward_kernel="mosaic", block_q=128, tiles=too_big)
  accumulating_dq = Tile(64, 128, 12, 2, accumulate_dq=True)
  with pytest.raises(ValueError, match="accumulate_dq: the dk/dv kernel only"):
    mosaic_tiles.check("dq", accumulating_dq, 128)


def test_the_dkv_kernel_accumulates_dq_only_on_a_jax_that_can_build_it(monkeypatch):
  monkeypatch.setattr(flash_hopper_backward, "can_accumulate_dq", lambda: False)
  with pytest.raises(ValueError, match=r"accumulate_dq: needs jax >= 0\.11 \(a mutable dq "
                     r"accumulator in the kernel\), this is jax \d"):
    mosaic_tiles.check("dkv", Tile(64, 128, 12, 2, accumulate_dq=True), 64)
  assert not any(t.accumulate_dq for t in mosaic_tiles.candidates(64)["dkv"])


def test_a_table_row_accumulating_dq_runs_the_dq_kernel_on_a_jax_that_cannot(monkeypatch):
  """A sweep on jax 0.11 or newer may write a dk/dv tile accumulating dq into the table; on
  jax 0.10 the same tile runs without, and the row's dq tile computes dq."""
  forward, dq, dkv = mosaic_tiles.TABLE[("sm90", 64, True)]
  accumulating = dataclasses.replace(dkv, block_q=64, num_warps=12, accumulate_dq=True)
  monkeypatch.setitem(mosaic_tiles.TABLE, ("sm90", 64, True), (forward, dq, accumulating))
  plan = lambda: choose_tiles(16384, 64, causal=True, scale=1.0, forward_kernel="mosaic",
                              backward_kernel="mosaic")
  monkeypatch.setattr(flash_hopper_backward, "can_accumulate_dq", lambda: False)
  older = plan()
  assert older.dkv == dataclasses.replace(accumulating, accumulate_dq=False)
  assert older.dq == dq
  monkeypatch.setattr(flash_hopper_backward, "can_accumulate_dq", lambda: True)
  assert plan().dkv == accumulating


def test_mosaic_table_tiles_are_all_sweep_candidates_that_run():
  """The sweep times the table's own tiles beside the others (its winners never lose to the
  table in the same run), and every row of the table passes the checks a user's tiles do."""
  for (generation, head_dim, causal), tiles in mosaic_tiles.TABLE.items():
    candidates = mosaic_tiles.candidates(head_dim)
    for kernel, tile in zip(mosaic_tiles.KERNELS, tiles):
      if tile is not None:
        tile = mosaic_tiles.buildable(tile)
        mosaic_tiles.check(kernel, tile, head_dim)
        assert tile in candidates[kernel], (generation, head_dim, causal, kernel, tile)


def test_mosaic_plan():
  """Long sequences run the table's tiles; three compute warpgroups (192 rows, a 384-token
  padding step) only from 8,193 tokens on; a short sequence's blocks shrink to it, down to 64
  rows per compute warpgroup and 64 streamed."""
  plan = lambda seq_len, head_dim: choose_tiles(seq_len, head_dim, causal=True, scale=1.0,
                                                generation="sm90", forward_kernel="mosaic",
                                                backward_kernel="mosaic")
  long = plan(16384, 128)
  assert (long.forward, long.dq, long.dkv) == mosaic_tiles.TABLE[("sm90", 128, True)]
  forward = mosaic_tiles.TABLE[("sm90", 64, True)][0]
  assert flash_hopper.compute_warpgroups(forward) == 3  # the swept winner at 16K
  assert plan(65536, 64).forward == forward and plan(65536, 64).padded_len == 65664
  two = plan(8192, 64)
  assert (two.forward.block_q, two.forward.num_warps, two.padded_len) == (128, 12, 8192)
  short = plan(20, 64)
  assert (short.forward.block_q, short.forward.block_kv, short.padded_len) == (128, 64, 128)
  assert (short.dq.block_q, short.dq.block_kv, short.dkv.block_q, short.dkv.block_kv) == (
      128, 64, 64, 128)


def test_three_warpgroup_tiles_pad_to_a_common_multiple_and_give_way_to_two_when_short():
  tiles = (Tile(192, 128, 16, 2), Tile(192, 64, 16, 2), Tile(64, 192, 16, 2))
  plan = choose_tiles(65536, 64, causal=True, scale=1.0, tiles=tiles, forward_kernel="mosaic",
                      backward_kernel="mosaic")
  assert plan.padded_len == 65664 and (plan.forward, plan.dq, plan.dkv) == tiles  # 171 x 384
  # A table row of three warpgroups keeps them from a 16K cap on; below, two warpgroups of 64
  # rows each own the block (a 384-token padding step would cost a short sequence too much).
  least = mosaic_tiles.THREE_WARPGROUPS_FROM
  assert mosaic_tiles.fit(tiles[0], "forward", least, None, None) == tiles[0]
  assert mosaic_tiles.fit(tiles[2], "dkv", least, None, None) == tiles[2]
  assert mosaic_tiles.fit(tiles[0], "forward", least // 2, None, None) == Tile(128, 128, 12, 2)
  assert mosaic_tiles.fit(tiles[2], "dkv", 32, None, None) == Tile(64, 128, 12, 2)
  assert mosaic_tiles.fit(tiles[0], "forward", 32, None, None) == Tile(128, 64, 12, 2)
