"""Hopper (sm90) flash attention in Pallas Mosaic GPU: the forward kernel, and the pieces that
the backward kernels of ``flash_hopper_backward`` share with it.

Every kernel here is a CTA of ``Tile.num_warps / 4`` warpgroups. Two or three compute warpgroups
(``compute_warpgroups``) own 64 of the CTA's rows each (query rows, or key rows in the dk/dv
kernel) and run wgmma matmuls on them; the last warpgroup only issues TMA copies (``produce``):
it streams blocks of the other side (key blocks here and in dq, query blocks in dk/dv) into a
ring of ``Tile.num_stages`` shared-memory slots, running ahead of the compute warpgroups by up
to that many blocks. Three compute warpgroups (192 rows, FA3's tile at head dim 64) read each
streamed block for 1.5x the rows, at 160 registers per thread instead of 232. Each
streamed operand has a ``<name>_ready`` barrier per slot (its copy landed); groups of operands
share a ``<name>_free`` barrier per slot (two arrivals, one per compute warpgroup), after which
the producer may overwrite them. Both compute warpgroups visit the same blocks, so producer and
consumers follow one schedule and no warpgroup waits on a slot the other never frees.

Proxy fences: the producer refills a slot by TMA, which writes through the async proxy; a
consumer that read some buffer of the slot through the generic proxy (``ld.shared`` into
registers: segment ids, lse2, delta) must fence those reads (``fence.proxy.async``) before it
frees the slot, or the refill may overtake them: the mbarrier orders the two warpgroups but not
the two proxies (PTX ISA, memory consistency model, proxies). ``release`` does so with
``plgpu.commit_smem``. A slot read only by wgmma needs no fence: wgmma reads shared memory
through the async proxy too, and its reads are complete once its accumulator has been read,
before the release. Cost on hardware: at most one fenced release per pipeline step and compute
warpgroup (dk/dv: every step, for lse2 and delta; forward and dq: only with segment ids), i.e.
two instructions per thread (``fence.proxy.async.shared::cta`` and a ``bar.sync`` of the 128
threads), assumed at 50-100 cycles (neither latency is documented) against 750 (dq, D = 64) to
2,000 (D = 128) cycles of tensor-core work per CTA and step at peak (4,096 bf16 flops per cycle
and SM): at most 13 % of a step if nothing hid it, far less as only the fencing warpgroup waits
while the other's wgmma keeps the tensor cores busy. Not yet measured on a GPU. In interpret
mode a stand-in matmul reads through the generic proxy, so its slots are fenced there too.
What of all this GPU interpret mode executes on the CPU, and what is only lowered:
``hopper_interpret``; the matmul forms and their stand-ins: ``wgmma_forms``.

The forward: one CTA computes ``Tile.block_q`` query rows of one (batch, query head) with an
online softmax, against the key blocks visible to some row of the tile
(``flash_kernels.kv_block_ranges`` of the whole tile: under a sliding window W from the first
block the window reaches, about (block_q + W) / block_kv blocks; the others are never copied).
The price under a causal mask is at most one fully masked block for the first warpgroup's rows
(none when ``block_kv`` equals the tile's rows, the default for head dims 64 and 128); a window
adds at most one for the second warpgroup's rows at its lower edge.

With ``Tile.pingpong`` the two compute warpgroups of the forward or dq take turns on the
tensor cores (FA3's ping-pong; JAX's ``attention_mgpu`` schedule barrier; ``pingpong``): a
barrier of two arrivals, passed twice per key block by each, lets one warpgroup's softmax (dq:
its probabilities and dS) run while the other's matmuls run. Whether that wins depends on the
head dim and GPU: ``benchmarks.attention_kernels --sweep`` times it. With ``Tile.overlap``
(the forward, without ping-pong or a sliding window) each compute warpgroup overlaps within
itself (FA3's intra-warpgroup pipelining): it issues block j's QKᵀ and block j - 1's P·V
together, waits for the first only, and runs block j's softmax while the second runs
(``wgmma_forms.overlapped``); the first block's QKᵀ and the last block's P·V run alone. Its
probabilities wait in registers for one block, so its registers hold a scores tile, a
probabilities tile and the output accumulator at once.

Inputs and outputs follow ``flash_kernels.forward`` (padded ``[B, Sp, H, D]`` arrays read in
place by strided TMA windows; lse ``[B, Hq, Sp]`` natural log, ``-inf`` for a row that sees no
key), so either backward (Triton or Mosaic) consumes its residuals unchanged. 16-bit inputs
only (wgmma); head dims 64, 128, 256.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ulysses_jax.kernels import hopper_interpret
from ulysses_jax.kernels.pingpong import PingPong
from ulysses_jax.kernels.flash_kernels import (LOG2E, all_masked, kernel_name, kv_block_ranges,
                                                visible, visit_blocks)
from ulysses_jax.kernels.wgmma_forms import (TileLayout, a_times_bt, overlapped, plus_a_times_b,
                                             smem_tile, stand_in_reads)

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.bfloat16, jnp.float16)
WGMMA_ROWS = 64  # one warpgroup's wgmma covers 64 rows: a compute warpgroup's share
# Registers per thread of (a compute warpgroup, the copy warpgroup), by compute warpgroups: the
# SM's 65,536 over (n + 1) x 128 threads, the copy warpgroup needing few (FA3's split: 240 / 24
# with two; at 232 / 40 ptxas spilled the dk/dv kernel's, ``benchmarks.mosaic_resources``).
REGISTERS = {2: (240, 24), 3: (160, 32)}


# --- Shared by the forward and the backward kernels -----------------------------------------

def unpack_refs(refs, has_segments, num_inputs, num_outputs):
  """``(inputs, q_seg_ref, kv_seg_ref, outputs)`` of a kernel called with ``(*inputs, [q_seg,
  kv_seg])`` and ``num_outputs`` outputs."""
  segments = refs[num_inputs:num_inputs + 2] if has_segments else (None, None)
  return refs[:num_inputs], *segments, refs[len(refs) - num_outputs:]


def compute_warpgroups(tile):
  """The compute warpgroups of a CTA of ``tile`` (``num_warps`` counts the copy warpgroup too)."""
  return tile.num_warps // 4 - 1


def launch(kernel, name, out_type, grid, plan, tile):
  """``plgpu.kernel`` over grid ``("tile", "batch", "head")``, ``tile.num_warps / 4``
  warpgroups; ``name`` (``flash_kernels.kernel_name``) names the GPU kernel in profiles and
  Mosaic's dumps."""
  return plgpu.kernel(
      kernel, out_type=out_type, grid=grid, grid_names=("tile", "batch", "head"),
      num_threads=compute_warpgroups(tile) + 1, thread_name="wg", kernel_name=name,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params() if plan.interpret else None)


def interpret_params():
  """The parameters of GPU interpret mode that every kernel here runs under."""
  return hopper_interpret.params()


def own_buffers(operands, warpgroups):
  """Per compute warpgroup, one buffer per ``{name: (shape, dtype)}`` and a barrier per copy."""
  buffers = {name: smem_tile((warpgroups, *shape), dtype)
             for name, (shape, dtype) in operands.items()}
  buffers["own_ready"] = plgpu.Barrier(num_barriers=warpgroups * len(operands))
  return buffers


def ring_buffers(stages, operands, free_groups, consumers):
  """The producer's ring: ``stages`` slots of each ``{name: (shape, dtype)}``, a ``<name>_ready``
  barrier per operand and slot, and a ``<group>_free`` barrier per group name and slot (one
  arrival per consumer warpgroup)."""
  buffers = {}
  for name, (shape, dtype) in operands.items():
    buffers[name] = smem_tile((stages, *shape), dtype)
    buffers[f"{name}_ready"] = plgpu.Barrier(num_barriers=stages)
  for group in free_groups:
    buffers[f"{group}_free"] = plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)
  return buffers


def with_shared_memory(buffers, body):
  """Allocates ``buffers`` (a dict) for all warpgroups and runs ``body(dict of refs)``."""
  names = list(buffers)
  pl.run_scoped(lambda *allocated: body(dict(zip(names, allocated))), *buffers.values(),
                collective_axes="wg")


def load_own(smem, w, windows):
  """Compute warpgroup ``w`` copies ``{name: gmem window}`` into its own buffers and waits."""
  for i, (name, window) in enumerate(windows.items()):
    plgpu.copy_gmem_to_smem(window, smem[name].at[w], smem["own_ready"].at[w * len(windows) + i])
  for i in range(len(windows)):
    plgpu.barrier_wait(smem["own_ready"].at[w * len(windows) + i])
  return {name: smem[name].at[w] for name in windows}


def produce(smem, stages, num_steps, groups_of_step, registers=REGISTERS[2][1]):
  """The copy warpgroup: fills slot ``t % stages`` for steps ``t`` in ``[0, num_steps)``.

  ``groups_of_step(t)`` lists ``(group, {name: gmem window})`` in the order the consumers free
  the groups; before refilling a slot the producer waits until every consumer freed the group.
  """
  plgpu.set_max_registers(registers, action="decrease")

  @pl.loop(0, num_steps)
  def _(t):
    slot = lax.rem(t, stages)
    refill = t >= stages  # the slot held step t - stages
    for group, windows in groups_of_step(t):
      pl.when(refill)(lambda group=group: plgpu.barrier_wait(smem[f"{group}_free"].at[slot]))
      for name, window in windows.items():
        plgpu.copy_gmem_to_smem(window, smem[name].at[slot], smem[f"{name}_ready"].at[slot])

  # Exit only once the consumers released the last slots: every phase of every barrier is
  # observed, so none is left pending when the shared memory goes away.
  @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
  def _(t):
    for group, _ in groups_of_step(t):
      plgpu.barrier_wait(smem[f"{group}_free"].at[lax.rem(t, stages)])


def wait_ready(smem, name, slot):
  plgpu.barrier_wait(smem[f"{name}_ready"].at[slot])
  return smem[name].at[slot]


def release(smem, group, slot, *, fence):
  """Frees ``slot`` of ``group`` for the producer's next TMA copy into it; ``fence``: this
  warpgroup read one of the group's buffers through the generic proxy (module docstring)."""
  if fence:
    plgpu.commit_smem()
  plgpu.barrier_arrive(smem[f"{group}_free"].at[slot])


def store_own(pairs):
  """Writes ``[(registers, own smem buffer, gmem window)]`` out through shared memory by TMA; a
  window smaller than its buffer takes the buffer's leading part (e.g. its first rows)."""
  for value, buffer, _ in pairs:
    buffer[...] = value.astype(buffer.dtype)
  plgpu.commit_smem()
  for _, buffer, window in pairs:
    source = buffer if window.shape == buffer.shape else buffer.at[
        tuple(pl.ds(0, n) for n in window.shape)]
    plgpu.copy_smem_to_gmem(source, window)
  plgpu.wait_smem_to_gmem(0)


# --- The forward ------------------------------------------------------------------------------

def forward(plan, q, k, v, q_seg, kv_seg):
  """Same contract as ``flash_kernels.forward``; ``plan.forward`` is the CTA's tile:
  ``block_q`` rows (split over the compute warpgroups), ``block_kv`` keys per pipeline slot,
  ``num_stages`` slots."""
  b, sp, hq, _ = q.shape
  kernel = functools.partial(_forward_kernel, plan=plan, groups=hq // k.shape[2],
                             has_segments=q_seg is not None)
  out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((b, hq, sp), jnp.float32))
  call = launch(kernel, kernel_name("forward", plan), out_type,
                (sp // plan.forward.block_q, b, hq), plan, plan.forward)
  return call(q, k, v, *((q_seg, kv_seg) if q_seg is not None else ()))


def key_ring(tile, head_dim, dtype, has_segments):
  """Ring buffers of key blocks (K, V and the keys' segment ids) for ``stream_keys``."""
  operands = dict(k=((tile.block_kv, head_dim), dtype), v=((tile.block_kv, head_dim), dtype))
  if has_segments:
    operands["kv_seg"] = ((tile.block_kv,), jnp.int32)
  return ring_buffers(tile.num_stages, operands, ("k", "v"), compute_warpgroups(tile))


def stream_keys(tile, gmem, smem, batch, kv_head, first, end):
  """Producer of key blocks ``[first, end)``, block ``first + t`` at step ``t``. Consumers free
  K, then V; they read the keys' segment ids before they free V."""
  def groups_of_step(t):
    keys = pl.ds(pl.multiple_of((first + t) * tile.block_kv, tile.block_kv), tile.block_kv)
    v_group = dict(v=gmem["v"].at[batch, keys, kv_head])
    if gmem["kv_seg"] is not None:
      v_group["kv_seg"] = gmem["kv_seg"].at[batch, keys]
    return [("k", dict(k=gmem["k"].at[batch, keys, kv_head])), ("v", v_group)]
  produce(smem, tile.num_stages, end - first, groups_of_step,
          REGISTERS[compute_warpgroups(tile)][1])


def _forward_kernel(*refs, plan, groups, has_segments):
  (q_ref, k_ref, v_ref), q_seg_ref, kv_seg_ref, (o_ref, lse_ref) = unpack_refs(
      refs, has_segments, 3, 2)
  tile = plan.forward
  warpgroups = compute_warpgroups(tile)
  rows, d, dtype = tile.block_q // warpgroups, q_ref.shape[-1], q_ref.dtype
  own = dict(q=((rows, d), dtype))
  if has_segments:
    own["q_seg"] = ((rows,), jnp.int32)
  buffers = dict(**own_buffers(own, warpgroups), lse=smem_tile((warpgroups, rows), jnp.float32),
                 **key_ring(tile, d, dtype, has_segments), **PingPong.buffers(tile))
  gmem = dict(q=q_ref, k=k_ref, v=v_ref, o=o_ref, lse=lse_ref, q_seg=q_seg_ref,
              kv_seg=kv_seg_ref)

  run_query_tile(plan, tile, buffers, gmem, groups,
                 functools.partial(_forward_compute, plan, gmem))


def run_query_tile(plan, tile, buffers, gmem, groups, compute):
  """A CTA that owns ``tile.block_q`` query rows of one (batch, query head) and streams the
  key blocks some row of them sees: each compute warpgroup ``w`` runs ``compute(smem, w, batch,
  head, first_row, ranges)`` on its rows (``ranges``: ``flash_kernels.kv_block_ranges`` of the
  whole tile, for ``visit_blocks``; its step ``t`` is block ``ranges[0] + t``), the copy
  warpgroup ``stream_keys`` of the same blocks."""
  def body(smem):
    num_tiles = plan.padded_len // tile.block_q
    tile_index = lax.axis_index("tile")
    # Causal: the last tiles do the most work, so they are launched first.
    tile_index = num_tiles - 1 - tile_index if plan.causal else tile_index
    ranges = kv_block_ranges(plan, tile_index, tile.block_q, tile.block_kv)
    if gmem["q_seg"] is not None:
      ranges = all_masked(ranges)  # every block needs the segment mask
    wg = lax.axis_index("wg")
    batch, head = lax.axis_index("batch"), lax.axis_index("head")
    warpgroups = compute_warpgroups(tile)
    rows = tile.block_q // warpgroups
    for w in range(warpgroups):
      first_row = tile_index * tile.block_q + w * rows
      pl.when(wg == w)(functools.partial(compute, smem, w, batch, head, first_row, ranges))
    pl.when(wg == warpgroups)(functools.partial(
        stream_keys, tile, gmem, smem, batch, lax.div(head, groups), ranges[0], ranges[3]))

  with_shared_memory(buffers, body)


def _forward_compute(plan, gmem, smem, w, batch, head, first_row, ranges):
  """One compute warpgroup: ``rows`` query rows against the key blocks of ``ranges``."""
  tile = plan.forward
  warpgroups = compute_warpgroups(tile)
  plgpu.set_max_registers(REGISTERS[warpgroups][0], action="increase")
  rows, block_kv, stages = tile.block_q // warpgroups, tile.block_kv, tile.num_stages
  has_segments = gmem["q_seg"] is not None
  query_rows = pl.ds(first_row, rows)
  windows = dict(q=gmem["q"].at[batch, query_rows, head])
  if has_segments:
    windows["q_seg"] = gmem["q_seg"].at[batch, query_rows]
  own = load_own(smem, w, windows)
  scores_tile = TileLayout((rows, block_kv), interpret=plan.interpret)
  q_seg = scores_tile.rows_of(own["q_seg"]) if has_segments else None
  q_pos = first_row + scores_tile.iota(0)
  qk_scale = plan.scale * LOG2E
  accumulate = functools.partial(plus_a_times_b, interpret=plan.interpret)
  pingpong = PingPong(smem, tile, w)
  matmul = functools.partial(a_times_bt, interpret=plan.interpret, while_running=pingpong.turn)
  # On hardware only wgmma reads K, and V too without segment ids: no fence (module docstring).
  k_fence = stand_in_reads(plan.interpret, "a_times_bt")
  v_fence = has_segments or stand_in_reads(plan.interpret, "plus_a_times_b")

  def step(j):
    return lax.rem(j - ranges[0], stages)  # the producer's step, and its slot

  def softmax(masked, j, scores, row_max, denom):
    """Block ``j``'s probabilities (16-bit), the correction of the rows' earlier sums, and the
    rows' new max and denominator."""
    kv_seg = scores_tile.cols_of(wait_ready(smem, "kv_seg", step(j))) if has_segments else None
    mask = visible(q_pos, j * block_kv + scores_tile.iota(1), q_seg, kv_seg,
                   causal=masked and plan.causal,
                   kv_len=plan.seq_len if masked and plan.ragged else None,
                   window=plan.sliding_window if masked else None)
    if mask is not None:
      scores = jnp.where(mask, scores, -jnp.inf)
    new_max = jnp.maximum(row_max, scores.max(axis=1))
    # A row that has seen no visible key yet keeps max -inf; subtract 0 instead of -inf.
    ref_max = new_max if mask is None else jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp2(row_max - ref_max)
    probs = jnp.exp2(scores - scores_tile.per_row(ref_max))
    return (probs.astype(own["q"].dtype), correction, new_max,
            denom * correction + probs.sum(axis=1))

  def rescale(acc, correction):
    return acc * lax.broadcast_in_dim(correction, acc.shape, [0])

  def visit(masked, j, carry):
    acc, row_max, denom = carry
    scores = matmul(own["q"], wait_ready(smem, "k", step(j))) * qk_scale
    release(smem, "k", step(j), fence=k_fence)
    probs, correction, row_max, denom = softmax(masked, j, scores, row_max, denom)
    acc = rescale(acc, correction)
    v = pingpong.hand_over(lambda: wait_ready(smem, "v", step(j)))  # softmax done
    acc = accumulate(acc, probs, v)
    release(smem, "v", step(j), fence=v_fence)
    return acc, row_max, denom

  def visit_overlapped(masked, j, carry):
    """Block ``j``'s softmax while block ``j - 1``'s probabilities meet its values."""
    acc, row_max, denom, probs = carry

    def softmax_of(scores):
      release(smem, "k", step(j), fence=k_fence)
      return softmax(masked, j, scores * qk_scale, row_max, denom)
    acc, (probs, correction, row_max, denom) = overlapped(
        own["q"], wait_ready(smem, "k", step(j)), acc, probs,
        wait_ready(smem, "v", step(j - 1)), softmax_of, interpret=plan.interpret)
    release(smem, "v", step(j - 1), fence=v_fence)
    return rescale(acc, correction), row_max, denom, probs

  row_layout = plgpu.Layout.WGMMA.reduce(1)
  init = (scores_tile.zeros((rows, own["q"].shape[-1])),
          scores_tile.cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout),
          scores_tile.cast(jnp.zeros((rows,), jnp.float32), row_layout))
  if tile.overlap and plan.sliding_window is None:
    # The first block alone, then each later one overlapped with its predecessor's P·V, then
    # the last P·V. Without a window every tile sees a key block (ranges[0] < ranges[3]).
    first, plain_from, n_plain, n_visible = ranges
    acc, row_max, denom = init
    scores = a_times_bt(own["q"], wait_ready(smem, "k", 0), interpret=plan.interpret)
    release(smem, "k", 0, fence=k_fence)
    probs, _, row_max, denom = softmax(True, first, scores * qk_scale, row_max, denom)
    later = (first + 1, *(jnp.maximum(end, first + 1) for end in (plain_from, n_plain)),
             n_visible)
    acc, row_max, denom, probs = visit_blocks(later, visit_overlapped,
                                              (acc, row_max, denom, probs))
    acc = accumulate(acc, probs, wait_ready(smem, "v", step(n_visible - 1)))
    release(smem, "v", step(n_visible - 1), fence=v_fence)
  else:
    pingpong.start()
    acc, row_max, denom = visit_blocks(ranges, visit, init)
    pingpong.end()

  empty = denom == 0.0
  denom = jnp.where(empty, 1.0, denom)
  lse = jnp.where(empty, -jnp.inf, row_max / LOG2E + jnp.log(denom))
  store_own([(acc / lax.broadcast_in_dim(denom, acc.shape, [0]), own["q"],
              gmem["o"].at[batch, query_rows, head]),
             (lse, smem["lse"].at[w], gmem["lse"].at[batch, head, query_rows])])
