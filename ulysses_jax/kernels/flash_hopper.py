"""Hopper (sm90) forward kernel of flash attention in Pallas Mosaic GPU: TMA copies, wgmma,
warp specialisation.

One CTA computes a tile of ``Tile.block_q`` query rows of one (batch, query head). Three
warpgroups share it: two compute warpgroups own half of the rows each and run the online
softmax with wgmma matmuls; the third only issues TMA copies of the K and V blocks (and key
segment ids) into a ring of ``Tile.num_stages`` shared-memory slots, running ahead of the
compute warpgroups by up to that many blocks. Per slot, a ``*_ready`` barrier says the copy
landed and a ``*_free`` barrier (two arrivals, one per compute warpgroup) says the slot may be
overwritten.

Both compute warpgroups visit the same key blocks, those visible to some row of the tile
(``flash_kernels.kv_ranges`` of the whole tile), so producer and consumers follow one schedule
and no warpgroup waits on a slot the other never frees. The price under a causal mask is at
most one fully masked block for the first warpgroup's rows (none when ``block_kv`` equals the
tile's rows, the default for head dims 64 and 128).

Inputs and outputs follow ``flash_kernels.forward`` (padded ``[B, Sp, H, D]`` arrays read in
place by strided TMA windows; lse ``[B, Hq, Sp]`` natural log, ``-inf`` for a row that sees no
key), so the Triton backward kernels consume its residuals unchanged. 16-bit inputs only
(wgmma); head dims 64, 128, 256.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ulysses_jax.kernels.flash_kernels import LOG2E, dot, kv_ranges, visible

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.bfloat16, jnp.float16)
COMPUTE_WARPGROUPS = 2
WGMMA_ROWS = 64  # one warpgroup's wgmma covers 64 rows: a compute warpgroup's share is a multiple
# 128-byte swizzle over tiles of 64 16-bit elements: a layout wgmma reads without bank conflicts.
_SMEM_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def forward(plan, q, k, v, q_seg, kv_seg):
  """Same contract as ``flash_kernels.forward``; ``plan.forward`` is the CTA's tile:
  ``block_q`` rows (split over the compute warpgroups), ``block_kv`` keys per pipeline slot,
  ``num_stages`` slots."""
  b, sp, hq, d = q.shape
  tile = plan.forward
  has_segments = q_seg is not None
  kernel = functools.partial(_kernel, plan=plan, groups=hq // k.shape[2],
                             has_segments=has_segments)
  call = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sp), jnp.float32)),
      grid=(sp // tile.block_q, b, hq), grid_names=("tile", "batch", "head"),
      num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params() if plan.interpret else None)
  return call(q, k, v, *((q_seg, kv_seg) if has_segments else ()))


def interpret_params():
  # GPU interpret mode simulates shared memory, warpgroups, barriers and TMA on the CPU. JAX
  # 0.10 does not export its parameters class yet.
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _kernel(*refs, plan, groups, has_segments):
  if has_segments:
    q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs
  else:
    (q_ref, k_ref, v_ref, o_ref, lse_ref), q_seg_ref, kv_seg_ref = refs, None, None
  tile = plan.forward
  rows, d, dtype = tile.block_q // COMPUTE_WARPGROUPS, q_ref.shape[-1], q_ref.dtype
  kv_shape = (tile.num_stages, tile.block_kv, d)
  buffers = dict(
      q=plgpu.SMEM((COMPUTE_WARPGROUPS, rows, d), dtype, transforms=_SMEM_TRANSFORMS),
      k=plgpu.SMEM(kv_shape, dtype, transforms=_SMEM_TRANSFORMS),
      v=plgpu.SMEM(kv_shape, dtype, transforms=_SMEM_TRANSFORMS),
      lse=plgpu.SMEM((COMPUTE_WARPGROUPS, rows), jnp.float32),
      q_ready=plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),
      k_ready=plgpu.Barrier(num_barriers=tile.num_stages),
      v_ready=plgpu.Barrier(num_barriers=tile.num_stages),
      k_free=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=tile.num_stages),
      v_free=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=tile.num_stages))
  if has_segments:
    buffers.update(
        q_seg=plgpu.SMEM((COMPUTE_WARPGROUPS, rows), jnp.int32),
        kv_seg=plgpu.SMEM((tile.num_stages, tile.block_kv), jnp.int32),
        q_seg_ready=plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),
        kv_seg_ready=plgpu.Barrier(num_barriers=tile.num_stages))
  names = list(buffers)

  def scoped(*allocated):
    smem = dict(zip(names, allocated))
    num_tiles = plan.padded_len // tile.block_q
    tile_index = lax.axis_index("tile")
    # Causal: the last tiles do the most work, so they are launched first.
    tile_index = num_tiles - 1 - tile_index if plan.causal else tile_index
    n_plain, n_visible = kv_ranges(plan, tile_index, tile.block_q, tile.block_kv,
                                   plan.padded_len // tile.block_kv)
    if has_segments:
      n_plain = 0  # every block needs the segment mask
    gmem = dict(q=q_ref, k=k_ref, v=v_ref, o=o_ref, lse=lse_ref, q_seg=q_seg_ref,
                kv_seg=kv_seg_ref)
    wg = lax.axis_index("wg")
    batch, head = lax.axis_index("batch"), lax.axis_index("head")
    for w in range(COMPUTE_WARPGROUPS):
      first_row = tile_index * tile.block_q + w * rows
      pl.when(wg == w)(functools.partial(
          _compute, plan, gmem, smem, w, batch, head, first_row, n_plain, n_visible))
    pl.when(wg == COMPUTE_WARPGROUPS)(functools.partial(
        _produce, plan, gmem, smem, batch, lax.div(head, groups), n_visible))

  pl.run_scoped(scoped, *buffers.values(), collective_axes="wg")


def _produce(plan, gmem, smem, batch, kv_head, n_visible):
  """The copy warpgroup: streams key blocks ``[0, n_visible)`` through the slots."""
  plgpu.set_max_registers(40, action="decrease")
  block_kv, stages = plan.forward.block_kv, plan.forward.num_stages

  @pl.loop(0, n_visible)
  def _(j):
    slot = lax.rem(j, stages)
    keys = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
    refill = j >= stages  # the slot held block j - stages: wait until both consumers freed it
    pl.when(refill)(lambda: plgpu.barrier_wait(smem["k_free"].at[slot]))
    plgpu.copy_gmem_to_smem(gmem["k"].at[batch, keys, kv_head], smem["k"].at[slot],
                            smem["k_ready"].at[slot])
    pl.when(refill)(lambda: plgpu.barrier_wait(smem["v_free"].at[slot]))
    plgpu.copy_gmem_to_smem(gmem["v"].at[batch, keys, kv_head], smem["v"].at[slot],
                            smem["v_ready"].at[slot])
    if gmem["kv_seg"] is not None:  # consumers read these ids before they free V
      plgpu.copy_gmem_to_smem(gmem["kv_seg"].at[batch, keys], smem["kv_seg"].at[slot],
                              smem["kv_seg_ready"].at[slot])

  # Exit only once the consumers released the last slots: every phase of every barrier is
  # observed, so none is left pending when the shared memory goes away.
  @pl.loop(jnp.maximum(n_visible - stages, 0), n_visible)
  def _(j):
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(smem["k_free"].at[slot])
    plgpu.barrier_wait(smem["v_free"].at[slot])


def _compute(plan, gmem, smem, w, batch, head, first_row, n_plain, n_visible):
  """One compute warpgroup: ``rows`` query rows against key blocks ``[0, n_visible)``."""
  plgpu.set_max_registers(232, action="increase")
  tile = plan.forward
  rows, block_kv, stages = tile.block_q // COMPUTE_WARPGROUPS, tile.block_kv, tile.num_stages
  has_segments = gmem["q_seg"] is not None
  q_smem = smem["q"].at[w]
  query_rows = pl.ds(first_row, rows)
  plgpu.copy_gmem_to_smem(gmem["q"].at[batch, query_rows, head], q_smem, smem["q_ready"].at[w])
  layout, row_layout, col_layout = (plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1),
                                    plgpu.Layout.WGMMA.reduce(0))
  cast = functools.partial(_layout_cast, interpret=plan.interpret)
  to_tile = lambda x, dim: lax.broadcast_in_dim(x, (rows, block_kv), [dim])
  iota = lambda dim: cast(lax.broadcasted_iota(jnp.int32, (rows, block_kv), dim), layout)
  q_seg = None
  if has_segments:
    plgpu.copy_gmem_to_smem(gmem["q_seg"].at[batch, query_rows], smem["q_seg"].at[w],
                            smem["q_seg_ready"].at[w])
    plgpu.barrier_wait(smem["q_seg_ready"].at[w])
    q_seg = to_tile(cast(smem["q_seg"].at[w][...], row_layout), 0)
  q_pos = first_row + iota(0)
  qk_scale = plan.scale * LOG2E
  plgpu.barrier_wait(smem["q_ready"].at[w])

  def visit(masked, j, carry):
    acc, row_max, denom = carry
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(smem["k_ready"].at[slot])

    scores = _q_times_kt(q_smem, smem["k"].at[slot], interpret=plan.interpret) * qk_scale
    plgpu.barrier_arrive(smem["k_free"].at[slot])
    kv_seg = None
    if has_segments:
      plgpu.barrier_wait(smem["kv_seg_ready"].at[slot])
      kv_seg = to_tile(cast(smem["kv_seg"].at[slot][...], col_layout), 1)
    kv_pos = j * block_kv + iota(1)
    mask = visible(q_pos, kv_pos, q_seg, kv_seg, causal=masked and plan.causal,
                   kv_len=plan.seq_len if masked and plan.ragged else None)
    if mask is not None:
      scores = jnp.where(mask, scores, -jnp.inf)
    new_max = jnp.maximum(row_max, scores.max(axis=1))
    # A row that has seen no visible key yet keeps max -inf; subtract 0 instead of -inf.
    ref_max = new_max if mask is None else jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp2(row_max - ref_max)
    probs = jnp.exp2(scores - to_tile(ref_max, 0))
    denom = denom * correction + probs.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
    plgpu.barrier_wait(smem["v_ready"].at[slot])
    acc = _plus_p_times_v(acc, probs.astype(q_smem.dtype), smem["v"].at[slot],
                          interpret=plan.interpret)
    plgpu.barrier_arrive(smem["v_free"].at[slot])
    return acc, new_max, denom

  d = q_smem.shape[-1]
  init = (cast(jnp.zeros((rows, d), jnp.float32), layout),
          cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout),
          cast(jnp.zeros((rows,), jnp.float32), row_layout))
  carry = lax.fori_loop(0, n_plain, functools.partial(visit, False), init)
  acc, row_max, denom = lax.fori_loop(n_plain, n_visible, functools.partial(visit, True), carry)

  empty = denom == 0.0
  denom = jnp.where(empty, 1.0, denom)
  q_smem[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(q_smem.dtype)
  smem["lse"].at[w][...] = jnp.where(empty, -jnp.inf, row_max / LOG2E + jnp.log(denom))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, gmem["o"].at[batch, query_rows, head])
  plgpu.copy_smem_to_gmem(smem["lse"].at[w], gmem["lse"].at[batch, head, query_rows])
  plgpu.wait_smem_to_gmem(0)


def _layout_cast(x, layout, *, interpret):
  """``plgpu.layout_cast``: which register layout ``x`` takes (wgmma's, or a row or column of
  it). GPU interpret mode has no register layouts and no lowering for the cast: a no-op there."""
  return x if interpret else plgpu.layout_cast(x, layout)



# GPU interpret mode (JAX 0.10) cannot run these wgmma forms (transposed B operand, register A
# operand, initialised accumulator), so there both matmuls are plain dots of the same
# shared-memory tiles; everything around them (TMA windows, barriers, masks, softmax) is shared.

def _q_times_kt(q_smem, k_smem, *, interpret):
  """Scores ``q @ k.T`` ``[rows, block_kv]`` float32 from the two shared-memory tiles."""
  if interpret:
    return dot(q_smem[...], k_smem[...], 1, 1)

  def product(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
    return acc_ref[...]
  return pl.run_scoped(product, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32))


def _plus_p_times_v(acc, probs, v_smem, *, interpret):
  """``acc + probs @ v``: wgmma reads ``probs`` from registers, accumulates into ``acc``."""
  if interpret:
    return acc + dot(probs, v_smem[...], 1, 0)

  def accumulate(acc_ref):
    plgpu.wgmma(acc_ref, probs, v_smem)
  return pl.run_state(accumulate)(plgpu.ACC.init(acc))
