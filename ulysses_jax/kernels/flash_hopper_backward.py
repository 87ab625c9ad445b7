"""Hopper (sm90) backward kernels of flash attention in Pallas Mosaic GPU: dq, and dk/dv.

Same contracts as ``flash_kernels.backward_dq`` / ``backward_dkv`` (padded inputs, ``lse2`` in
base 2 with +inf for rows that see no key, ``delta = rowsum(dO * O) - dlse``), and the same
CTA shape as the forward of ``flash_hopper``: two or three compute warpgroups of 64 rows each
and a copy warpgroup streaming blocks of the other side through a ring of shared-memory slots.

* dq: a CTA owns ``plan.dq.block_q`` query rows of one (batch, query head), with their q, dO,
  lse2 and delta in shared memory, and streams the visible key blocks (K, V) exactly as the
  forward does. Per block: ``P = exp2(q k^T - lse2)``, ``dP = dO v^T``,
  ``dS = P (dP - delta)``, ``dq += dS k``; the last matmul reads dS from registers.
* dk/dv: a CTA owns ``plan.dkv.block_kv`` keys of one (batch, KV head), with K and V in shared
  memory, and streams ``(q, dO, lse2, delta)`` blocks of every query head that shares the KV
  head, so GQA/MQA needs neither repeated K/V nor atomics. It works on transposed tiles
  ``[keys, queries]``: ``P^T = exp2(k q^T - lse2)``, ``dv += P^T dO``, ``dP^T = v dO^T``,
  ``dS^T = P^T (dP^T - delta)``, ``dk += dS^T q``.
* dk/dv accumulating dq (``Tile.accumulate_dq``; FA3's single backward kernel): the dk/dv
  kernel also computes each block's ``dS k`` (dS^T through shared memory, read transposed by
  wgmma) and adds it into a float32 dq accumulator ``[B, Sp, Hq, D]`` by a TMA reduce-add
  from shared memory, so QK^T and dO V^T run once instead of twice and no dq kernel runs: five
  matmuls per block instead of seven. The accumulator is a mutable array (``jax.new_ref``,
  jax 0.11 on); dq is its sum scaled, cast after the kernel. GPU interpret mode has no TMA
  reduction (jax 0.12): there each compute warpgroup adds into its own slice of the
  accumulator with a plain read and write (the interpreter runs the grid's CTAs one after
  another), summed after the kernel; the hardware form is lowered.

Causal: blocks that the mask hides from every row of the CTA are never streamed; only blocks
on the diagonal (or all blocks, with segment ids) are masked. A sliding window W likewise
(``flash_kernels.kv_block_ranges``, ``q_block_ranges``): a dq CTA streams only the key blocks
the window of some of its rows reaches, a dk/dv CTA only the query blocks whose window reaches
some of its keys, and the blocks the window's lower edge cuts are masked too. Padded query
rows need no mask in dk/dv: their dO and delta are 0, so they add exactly 0. Gradients are
written in the inputs' dtype through the CTA's own buffers (q for dq; K and V for dk and dv).
Head dims 64 and 128: at 256 the dk and dv accumulators of 64 keys alone would fill a
warpgroup's registers; three compute warpgroups (160 registers each) at head dim 64 only.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ulysses_jax.kernels import flash_hopper as hopper
from ulysses_jax.kernels import wgmma_forms
from ulysses_jax.kernels.pingpong import PingPong
from ulysses_jax.kernels.flash_kernels import (LOG2E, all_masked, kernel_name, q_block_ranges,
                                                visible, visit_blocks)

HEAD_DIMS = (64, 128)


def backward_dq(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg, grad_dtype):
  """dq ``[B, Sp, Hq, D]``; ``grad_dtype`` must be q's dtype."""
  b, sp, hq, _ = q.shape
  assert grad_dtype == q.dtype, (grad_dtype, q.dtype)
  kernel = functools.partial(_dq_kernel, plan=plan, groups=hq // k.shape[2],
                             has_segments=q_seg is not None)
  call = hopper.launch(kernel, kernel_name("dq", plan), jax.ShapeDtypeStruct(q.shape, grad_dtype),
                       (sp // plan.dq.block_q, b, hq), plan, plan.dq)
  return call(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg) if q_seg is not None else ()))


def _dq_kernel(*refs, plan, groups, has_segments):
  (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), q_seg_ref, kv_seg_ref, (dq_ref,) = (
      hopper.unpack_refs(refs, has_segments, 6, 1))
  tile = plan.dq
  warpgroups = hopper.compute_warpgroups(tile)
  rows, d, dtype = tile.block_q // warpgroups, q_ref.shape[-1], q_ref.dtype
  own = dict(q=((rows, d), dtype), do=((rows, d), dtype), lse2=((rows,), jnp.float32),
             delta=((rows,), jnp.float32))
  if has_segments:
    own["q_seg"] = ((rows,), jnp.int32)
  buffers = dict(**hopper.own_buffers(own, warpgroups),
                 **hopper.key_ring(tile, d, dtype, has_segments), **PingPong.buffers(tile))
  gmem = dict(q=q_ref, k=k_ref, v=v_ref, do=do_ref, lse2=lse2_ref, delta=delta_ref,
              q_seg=q_seg_ref, kv_seg=kv_seg_ref, dq=dq_ref)

  hopper.run_query_tile(plan, tile, buffers, gmem, groups,
                        functools.partial(_dq_compute, plan, gmem))


def _dq_compute(plan, gmem, smem, w, batch, head, first_row, ranges):
  """One compute warpgroup: dq of ``rows`` query rows from the key blocks of ``ranges``."""
  tile = plan.dq
  warpgroups = hopper.compute_warpgroups(tile)
  plgpu.set_max_registers(hopper.REGISTERS[warpgroups][0], action="increase")
  rows, block_kv, stages = tile.block_q // warpgroups, tile.block_kv, tile.num_stages
  has_segments = gmem["q_seg"] is not None
  query_rows = pl.ds(first_row, rows)
  windows = {name: gmem[name].at[batch, query_rows, head] for name in ("q", "do")}
  windows.update({name: gmem[name].at[batch, head, query_rows] for name in ("lse2", "delta")})
  if has_segments:
    windows["q_seg"] = gmem["q_seg"].at[batch, query_rows]
  own = hopper.load_own(smem, w, windows)
  scores_tile = wgmma_forms.TileLayout((rows, block_kv), interpret=plan.interpret)
  lse2, delta = scores_tile.rows_of(own["lse2"]), scores_tile.rows_of(own["delta"])
  q_seg = scores_tile.rows_of(own["q_seg"]) if has_segments else None
  q_pos = first_row + scores_tile.iota(0)
  qk_scale = plan.scale * LOG2E
  matmul = functools.partial(wgmma_forms.a_times_bt, interpret=plan.interpret)
  accumulate = functools.partial(wgmma_forms.plus_a_times_b, interpret=plan.interpret)
  pingpong = PingPong(smem, tile, w)

  def visit(masked, j, dq):
    slot = lax.rem(j - ranges[0], stages)  # the producer's step
    k = hopper.wait_ready(smem, "k", slot)
    probs = jnp.exp2(matmul(own["q"], k, while_running=pingpong.turn) * qk_scale - lse2)
    kv_seg = scores_tile.cols_of(hopper.wait_ready(smem, "kv_seg", slot)) if has_segments else None
    mask = visible(q_pos, j * block_kv + scores_tile.iota(1), q_seg, kv_seg,
                   causal=masked and plan.causal,
                   kv_len=plan.seq_len if masked and plan.ragged else None,
                   window=plan.sliding_window if masked else None)
    if mask is not None:
      probs = jnp.where(mask, probs, 0.0)
    d_probs = matmul(own["do"], hopper.wait_ready(smem, "v", slot))
    # On hardware only wgmma reads K, and V too without segment ids: no fence (``flash_hopper``).
    hopper.release(smem, "v", slot,
                   fence=has_segments or wgmma_forms.stand_in_reads(plan.interpret, "a_times_bt"))
    d_scores = probs * (d_probs - delta)
    pingpong.hand_over()  # dS done
    dq = accumulate(dq, d_scores.astype(k.dtype), k)
    hopper.release(smem, "k", slot, fence=wgmma_forms.stand_in_reads(
        plan.interpret, "a_times_bt", "plus_a_times_b"))
    return dq

  pingpong.start()
  dq = visit_blocks(ranges, visit, scores_tile.zeros((rows, own["q"].shape[-1])))
  pingpong.end()
  hopper.store_own([(dq * plan.scale, own["q"], gmem["dq"].at[batch, query_rows, head])])


def can_accumulate_dq():
  """Whether this JAX builds a Mosaic GPU kernel that writes a mutable array (the dq
  accumulator of ``Tile.accumulate_dq``): jax 0.11 on."""
  return jax.__version_info__ >= (0, 11)


def backward_dkv(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg, grad_dtype):
  """dk, dv ``[B, Sp, Hkv, D]``, each summed over the query heads that share the KV head;
  ``grad_dtype`` must be the inputs' dtype. With ``plan.dkv.accumulate_dq`` also dq
  ``[B, Sp, Hq, D]``: ``(dk, dv, dq)``."""
  b, sp, hkv, d = k.shape
  assert grad_dtype == k.dtype, (grad_dtype, k.dtype)
  accumulate_dq = plan.dkv.accumulate_dq
  kernel = functools.partial(_dkv_kernel, plan=plan, groups=q.shape[2] // hkv,
                             has_segments=q_seg is not None, accumulate_dq=accumulate_dq)
  name = kernel_name("dkv_dq" if accumulate_dq else "dkv", plan)
  call = hopper.launch(kernel, name, [jax.ShapeDtypeStruct(k.shape, grad_dtype)] * 2,
                       (sp // plan.dkv.block_kv, b, hkv), plan, plan.dkv)
  segments = (q_seg, kv_seg) if q_seg is not None else ()
  if not accumulate_dq:
    return call(q, k, v, d_out, lse2, delta, *segments)
  slices = hopper.compute_warpgroups(plan.dkv) if plan.interpret else 1  # module docstring
  dq_accum = jax.new_ref(jnp.zeros((slices, b, sp, q.shape[2], d), jnp.float32))
  dk, dv = call(q, k, v, d_out, lse2, delta, dq_accum, *segments)
  return dk, dv, (dq_accum[...].sum(0) * plan.scale).astype(grad_dtype)


def _dkv_kernel(*refs, plan, groups, has_segments, accumulate_dq):
  inputs, q_seg_ref, kv_seg_ref, (dk_ref, dv_ref) = hopper.unpack_refs(
      refs, has_segments, 6 + accumulate_dq, 2)
  q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref = inputs[:6]
  tile = plan.dkv
  warpgroups = hopper.compute_warpgroups(tile)
  keys, d, dtype = tile.block_kv // warpgroups, k_ref.shape[-1], k_ref.dtype
  own = dict(k=((keys, d), dtype), v=((keys, d), dtype))
  if has_segments:
    own["kv_seg"] = ((keys,), jnp.int32)
  streamed = dict(q=((tile.block_q, d), dtype), do=((tile.block_q, d), dtype),
                  lse2=((tile.block_q,), jnp.float32), delta=((tile.block_q,), jnp.float32))
  if has_segments:
    streamed["q_seg"] = ((tile.block_q,), jnp.int32)
  buffers = dict(**hopper.own_buffers(own, warpgroups),
                 **hopper.ring_buffers(tile.num_stages, streamed, ("q", "do"), warpgroups))
  if accumulate_dq:  # per compute warpgroup: dS^T for wgmma, its dq part for the TMA reduction
    buffers.update(ds_t=wgmma_forms.smem_tile((warpgroups, keys, tile.block_q), dtype),
                   dq_part=plgpu.SMEM((warpgroups, tile.block_q, d), jnp.float32))
  gmem = dict(q=q_ref, k=k_ref, v=v_ref, do=do_ref, lse2=lse2_ref, delta=delta_ref,
              q_seg=q_seg_ref, kv_seg=kv_seg_ref, dk=dk_ref, dv=dv_ref,
              dq_accum=inputs[6] if accumulate_dq else None)

  def body(smem):
    first_key = lax.axis_index("tile") * tile.block_kv  # causal: the first tiles work longest
    ranges = q_block_ranges(plan, first_key, tile.block_kv, tile.block_q)
    if has_segments:
      ranges = all_masked(ranges)  # every block needs the segment mask
    wg = lax.axis_index("wg")
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("head")
    for w in range(warpgroups):
      pl.when(wg == w)(functools.partial(
          _dkv_compute, plan, gmem, smem, w, batch, kv_head, groups, first_key + w * keys,
          ranges))
    pl.when(wg == warpgroups)(functools.partial(
        _stream_queries, plan, gmem, smem, batch, kv_head, groups, ranges[0], ranges[3]))

  hopper.with_shared_memory(buffers, body)


def _stream_queries(plan, gmem, smem, batch, kv_head, groups, lo, end):
  """Producer of query blocks ``[lo, end)`` of each query head of the group, head by head.
  Consumers free q last; they read lse2, delta and the segment ids before they free dO."""
  block_q, num_blocks = plan.dkv.block_q, end - lo

  def groups_of_step(t):
    head = kv_head * groups + lax.div(t, num_blocks)
    first = (lo + lax.rem(t, num_blocks)) * block_q
    rows = pl.ds(pl.multiple_of(first, block_q), block_q)
    late = dict(do=gmem["do"].at[batch, rows, head], lse2=gmem["lse2"].at[batch, head, rows],
                delta=gmem["delta"].at[batch, head, rows])
    if gmem["q_seg"] is not None:
      late["q_seg"] = gmem["q_seg"].at[batch, rows]
    return [("q", dict(q=gmem["q"].at[batch, rows, head])), ("do", late)]
  hopper.produce(smem, plan.dkv.num_stages, groups * num_blocks, groups_of_step,
                 hopper.REGISTERS[hopper.compute_warpgroups(plan.dkv)][1])


def _dkv_compute(plan, gmem, smem, w, batch, kv_head, groups, first_key, ranges):
  """One compute warpgroup: dk, dv of ``keys`` keys from the query blocks of ``ranges``
  (``flash_kernels.q_block_ranges`` of the CTA's keys) of each query head of the group."""
  tile = plan.dkv
  warpgroups = hopper.compute_warpgroups(tile)
  plgpu.set_max_registers(hopper.REGISTERS[warpgroups][0], action="increase")
  keys, block_q, stages = tile.block_kv // warpgroups, tile.block_q, tile.num_stages
  has_segments = gmem["q_seg"] is not None
  key_rows = pl.ds(first_key, keys)
  windows = {name: gmem[name].at[batch, key_rows, kv_head] for name in ("k", "v")}
  if has_segments:
    windows["kv_seg"] = gmem["kv_seg"].at[batch, key_rows]
  own = hopper.load_own(smem, w, windows)
  scores_tile = wgmma_forms.TileLayout((keys, block_q), interpret=plan.interpret)
  qk_scale = plan.scale * LOG2E
  matmul = functools.partial(wgmma_forms.a_times_bt, interpret=plan.interpret)
  accumulate = functools.partial(wgmma_forms.plus_a_times_b, interpret=plan.interpret)

  lo, end = ranges[0], ranges[3]

  def add_to_dq(head, i, d_scores_t):
    """dq of query block ``i`` of ``head`` += dS k over this warpgroup's keys."""
    smem["ds_t"].at[w][...] = d_scores_t
    plgpu.commit_smem()  # the register store (generic proxy) before wgmma's read (async)
    part = wgmma_forms.at_times_b(smem["ds_t"].at[w], own["k"], interpret=plan.interpret)
    rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    if plan.interpret:  # its own slice (module docstring)
      window = gmem["dq_accum"].at[w, batch, rows, head]
      window[...] = window[...] + part
      return
    staging = smem["dq_part"].at[w]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's reduction read it
    staging[...] = part
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(staging, gmem["dq_accum"].at[0, batch, rows, head],
                            reduction_op="add")

  def visit(g, masked, i, carry):
    dk, dv = carry
    slot = lax.rem(g * (end - lo) + i - lo, stages)  # the producer's step t
    q = hopper.wait_ready(smem, "q", slot)
    # The mask and the lse go into the scores' accumulator before wgmma adds K Q^T to it:
    # built while the probabilities are not yet live, they take no registers beside them.
    minus_lse = scores_tile.cols_of(hopper.wait_ready(smem, "lse2", slot)) * (-1 / qk_scale)
    q_seg = scores_tile.cols_of(hopper.wait_ready(smem, "q_seg", slot)) if has_segments else None
    kv_pos = first_key - i * block_q + scores_tile.iota(0)  # relative to the query block
    kv_seg = scores_tile.rows_of(own["kv_seg"]) if has_segments else None
    mask = visible(scores_tile.iota(1), kv_pos, q_seg, kv_seg,
                   causal=masked and plan.causal, kv_len=None,
                   window=plan.sliding_window if masked else None)
    if mask is not None:
      minus_lse = jnp.where(mask, minus_lse, -jnp.inf)
    probs_t = jnp.exp2(matmul(own["k"], q, acc=minus_lse) * qk_scale)
    d_out = hopper.wait_ready(smem, "do", slot)
    dv = accumulate(dv, probs_t.astype(d_out.dtype), d_out)
    # dP - delta: wgmma adds dP to -delta in place, so delta takes no registers beside dP.
    minus_delta = -scores_tile.cols_of(hopper.wait_ready(smem, "delta", slot))
    d_probs_t = matmul(own["v"], d_out, acc=minus_delta)
    hopper.release(smem, "do", slot, fence=True)  # lse2 and delta were loaded into registers
    d_scores_t = (probs_t * d_probs_t).astype(q.dtype)
    dk = accumulate(dk, d_scores_t, q)
    # On hardware only wgmma reads q: no fence (``flash_hopper``).
    hopper.release(smem, "q", slot, fence=wgmma_forms.stand_in_reads(
        plan.interpret, "plus_a_times_bt", "plus_a_times_b"))
    if gmem["dq_accum"] is not None:  # after the release: the producer may refill meanwhile
      add_to_dq(kv_head * groups + g, i, d_scores_t)
    return dk, dv

  one_head = lambda g, carry: visit_blocks(ranges, functools.partial(visit, g), carry)
  zeros = scores_tile.zeros((keys, own["k"].shape[-1]))
  dk, dv = lax.fori_loop(0, groups, one_head, (zeros, zeros))
  hopper.store_own([(dk * plan.scale, own["k"], gmem["dk"].at[batch, key_rows, kv_head]),
                    (dv, own["v"], gmem["dv"].at[batch, key_rows, kv_head])])
