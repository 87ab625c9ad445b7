"""Pallas kernel bodies and ``pallas_call`` builders of flash attention: forward, dq, dk/dv.

Use ``flash_attention.flash_attention``; this module assumes validated, padded inputs:

* q, o, dO, dq ``[B, Sp, Hq, D]``; k, v, dk, dv ``[B, Sp, Hkv, D]``; lse, delta ``[B, Hq, Sp]``;
  segment ids ``[B, Sp]`` int32 or None. ``Sp`` is the sequence length padded to a multiple of
  every block size; keys at positions >= ``KernelSpec.seq_len`` are masked out.
* Kernels read the ``[B, S, H, D]`` arrays in place through strided block specs: no transposes.
* Scores live in base 2 (``s2 = q.k * scale * log2(e)``) so the softmax uses ``exp2``; the lse
  written by the forward is natural-log, the backward takes ``lse2 = lse * log2(e)`` with +inf
  for rows that see no key (their probabilities then come out as exactly 0).

Each kernel splits its inner loop in two ranges of blocks: blocks that need a positional mask
(the causal diagonal; key blocks that hold padding) and blocks that need none. Blocks that the
causal mask hides completely, and blocks of padding only, are never visited. With a sliding
window W (``KernelSpec.sliding_window``) the loops start at the first block the window reaches
(dk/dv: end at the last query block that sees the key block), and blocks the window's lower
edge cuts are masked too: a query block visits about (block + W) / block_kv key blocks instead
of all before it. Segment masks apply to every visited block. The ranges
(``kv_block_ranges``, ``q_block_ranges``, walked by ``visit_blocks``) are shared with the
Mosaic kernels of ``flash_hopper`` and ``flash_hopper_backward``.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Tile:
  """Block sizes and launch parameters of one kernel. For the Mosaic kernels (``flash_hopper``,
  ``flash_hopper_backward``) ``num_warps`` is 12 or 16 (two or three compute warpgroups of 64
  rows and a copy warpgroup) and ``num_stages`` the slots of the streamed side in shared
  memory; the CTA owns ``block_q`` query rows (forward, dq) or ``block_kv`` keys (dk/dv), and
  streams blocks of the other size. ``pingpong``: the two compute warpgroups of the Mosaic
  forward or dq take turns on the tensor cores (``pingpong.PingPong``). ``overlap``: each
  compute warpgroup of the Mosaic forward runs a block's softmax while its own P·V matmul of
  the block before runs (``wgmma_forms.overlapped``). ``accumulate_dq``: the Mosaic dk/dv
  kernel also adds each block's dS·K into a float32 dq accumulator, and no dq kernel runs
  (FA3's single backward kernel; ``flash_hopper_backward``)."""
  block_q: int
  block_kv: int
  num_warps: int
  num_stages: int
  pingpong: bool = False
  overlap: bool = False
  accumulate_dq: bool = False


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """Everything the kernels specialise on (hashable: a nondiff argument of the custom_vjp)."""
  causal: bool
  scale: float
  seq_len: int        # unpadded sequence length
  padded_len: int     # Sp
  interpret: bool
  forward: Tile
  dq: Tile
  dkv: Tile
  forward_kernel: str = "triton"  # or "mosaic": flash_hopper.forward
  backward_kernel: str = "triton"  # or "mosaic": flash_hopper_backward
  sliding_window: int | None = None  # causal only: query i sees keys i - W < j <= i

  @property
  def ragged(self):
    return self.padded_len != self.seq_len


def visible(q_pos, kv_pos, q_seg, kv_seg, *, causal, kv_len, window=None):
  """Which keys each query sees, broadcast from ``[n, 1]`` / ``[1, m]`` operands; None: all."""
  conditions = []
  if causal:
    conditions.append(q_pos >= kv_pos)
  if window is not None:
    conditions.append(q_pos - kv_pos < window)
  if kv_len is not None:
    conditions.append(kv_pos < kv_len)
  if q_seg is not None:
    conditions.append(q_seg == kv_seg)
  return functools.reduce(jnp.logical_and, conditions) if conditions else None


def dot(a, b, contract_a, contract_b):
  """2-D matmul contracting the given axes, accumulating in float32."""
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _q_block(plan, num_q_blocks, i):
  # Causal: the last query blocks do the most work, so they are launched first.
  return num_q_blocks - 1 - i if plan.causal else i


def kv_ranges(plan, q_block, block_q, block_kv, num_kv_blocks):
  """``(n_plain, n_visible)``: key blocks ``[0, n_plain)`` need no positional mask,
  ``[n_plain, n_visible)`` do, the rest are hidden from every query of the block."""
  if plan.causal:
    first_q = q_block * block_q
    n_visible = jnp.minimum(num_kv_blocks, lax.div(first_q + block_q - 1, block_kv) + 1)
    n_plain = jnp.minimum(n_visible, lax.div(first_q + 1, block_kv))
  else:
    n_visible = n_plain = num_kv_blocks
  if plan.ragged:  # blocks holding padded keys need the mask; blocks of only padding are skipped
    n_plain = jnp.minimum(n_plain, plan.seq_len // block_kv)
    n_visible = jnp.minimum(n_visible, -(-plan.seq_len // block_kv))
  return n_plain, n_visible


def window_kv_ranges(plan, q_block, block_q, block_kv, n_plain):
  """``(first, plain_from)`` under a sliding window: key blocks before ``first`` are hidden
  from every query of the block, ``[first, plain_from)`` are cut by the window's lower edge
  (masked), ``[plain_from, n_plain)`` wholly visible; ``(0, 0)`` without a window."""
  if plan.sliding_window is None:
    return 0, 0
  first_q = q_block * block_q
  first = jnp.minimum(n_plain, lax.div(jnp.maximum(0, first_q - plan.sliding_window + 1),
                                       block_kv))
  last_q = first_q + block_q - 1
  plain_from = lax.div(jnp.maximum(0, last_q - plan.sliding_window + 1) + block_kv - 1,
                       block_kv)
  return first, jnp.clip(plain_from, first, n_plain)


def kv_block_ranges(plan, q_block, block_q, block_kv):
  """``(first, plain_from, n_plain, n_visible)`` of the key blocks query block ``q_block``
  sees: ``[first, plain_from)`` and ``[n_plain, n_visible)`` need a positional mask (window's
  lower edge; causal diagonal or padding), ``[plain_from, n_plain)`` none; the rest are hidden
  from every query of the block. Ranges for ``visit_blocks``."""
  n_plain, n_visible = kv_ranges(plan, q_block, block_q, block_kv, plan.padded_len // block_kv)
  first, plain_from = window_kv_ranges(plan, q_block, block_q, block_kv, n_plain)
  return first, plain_from, n_plain, n_visible


def q_block_ranges(plan, first_kv, block_kv, block_q):
  """``(lo, mid, plain_end, end)`` of the query blocks that see keys ``[first_kv, first_kv +
  block_kv)``: ``[lo, mid)`` need the causal mask, ``[mid, plain_end)`` see all of the keys,
  ``[plain_end, end)`` see only some (the window's lower edge cuts them); the rest see none or
  are padding only (those add nothing: their dO and delta are 0). Ranges for ``visit_blocks``."""
  end = -(-plan.seq_len // block_q)
  if plan.causal:
    lo = jnp.minimum(lax.div(first_kv, block_q), end)
    mid = jnp.clip(lax.div(first_kv + block_kv - 1 + block_q - 1, block_q), lo, end)
  else:
    lo = mid = 0
  plain_end = end
  if plan.sliding_window is not None:
    window = plan.sliding_window
    # The last query that sees the last key is first_kv + block_kv - 1 + window - 1.
    end = jnp.clip(lax.div(first_kv + block_kv + window - 2, block_q) + 1, mid, end)
    plain_end = jnp.clip(lax.div(first_kv + window, block_q), mid, end)
  return lo, mid, plain_end, end


def visit_blocks(ranges, visit, carry):
  """Runs ``visit(masked, i, carry)`` over the blocks of ``ranges = (a, b, c, d)``: masked in
  ``[a, b)`` and ``[c, d)``, unmasked in ``[b, c)``; returns the carry."""
  a, b, c, d = ranges
  carry = lax.fori_loop(a, b, functools.partial(visit, True), carry)
  carry = lax.fori_loop(b, c, functools.partial(visit, False), carry)
  return lax.fori_loop(c, d, functools.partial(visit, True), carry)


def all_masked(ranges):
  """The blocks of ``ranges`` (as ``visit_blocks`` takes them), every one masked."""
  return ranges[0], ranges[0], ranges[0], ranges[3]


def _kv_slice(j, block_kv):
  return pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)


def _forward_kernel(*refs, plan, has_segments):
  if has_segments:
    q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs
  else:
    (q_ref, k_ref, v_ref, o_ref, lse_ref), q_seg_ref, kv_seg_ref = refs, None, None
  block_q, block_kv = plan.forward.block_q, plan.forward.block_kv
  q_block = _q_block(plan, plan.padded_len // block_q, pl.program_id(0))
  q = q_ref[...]
  q_pos = (q_block * block_q + jnp.arange(block_q))[:, None]
  q_seg = q_seg_ref[...][:, None] if has_segments else None
  qk_scale = plan.scale * LOG2E

  def visit(masked, j, carry):
    acc, row_max, denom = carry
    kv = _kv_slice(j, block_kv)
    scores = dot(q, k_ref[kv, :], 1, 1) * qk_scale
    mask = visible(q_pos, (j * block_kv + jnp.arange(block_kv))[None, :], q_seg,
                    kv_seg_ref[kv][None, :] if has_segments else None,
                    causal=masked and plan.causal,
                    kv_len=plan.seq_len if masked and plan.ragged else None,
                    window=plan.sliding_window if masked else None)
    if mask is not None:
      scores = jnp.where(mask, scores, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
    # A row that has seen no visible key yet keeps max -inf; subtract 0 instead of -inf.
    ref_max = new_max if mask is None else jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp2(row_max - ref_max)
    probs = jnp.exp2(scores - ref_max[:, None])
    denom = correction * denom + jnp.sum(probs, axis=1)
    v = v_ref[kv, :]
    acc = correction[:, None] * acc + dot(probs.astype(v.dtype), v, 1, 0)
    return acc, new_max, denom

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, row_max, denom = visit_blocks(kv_block_ranges(plan, q_block, block_q, block_kv), visit,
                                     init)
  empty = denom == 0.0
  denom = jnp.where(empty, 1.0, denom)
  o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, -jnp.inf, (row_max + jnp.log2(denom)) / LOG2E)


def _dq_kernel(*refs, plan, has_segments):
  if has_segments:
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref), q_seg_ref, kv_seg_ref = (
        refs, None, None)
  block_q, block_kv = plan.dq.block_q, plan.dq.block_kv
  q_block = _q_block(plan, plan.padded_len // block_q, pl.program_id(0))
  q, do = q_ref[...], do_ref[...]
  lse2, delta = lse2_ref[...][:, None], delta_ref[...][:, None]
  q_pos = (q_block * block_q + jnp.arange(block_q))[:, None]
  q_seg = q_seg_ref[...][:, None] if has_segments else None
  qk_scale = plan.scale * LOG2E

  def visit(masked, j, dq):
    kv = _kv_slice(j, block_kv)
    k, v = k_ref[kv, :], v_ref[kv, :]
    probs = jnp.exp2(dot(q, k, 1, 1) * qk_scale - lse2)
    mask = visible(q_pos, (j * block_kv + jnp.arange(block_kv))[None, :], q_seg,
                    kv_seg_ref[kv][None, :] if has_segments else None,
                    causal=masked and plan.causal,
                    kv_len=plan.seq_len if masked and plan.ragged else None,
                    window=plan.sliding_window if masked else None)
    if mask is not None:
      probs = jnp.where(mask, probs, 0.0)
    d_scores = probs * (dot(do, v, 1, 1) - delta)
    return dq + dot(d_scores.astype(k.dtype), k, 1, 0)

  dq = visit_blocks(kv_block_ranges(plan, q_block, block_q, block_kv), visit,
                    jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, plan, has_segments, groups):
  """One key block of one KV head; loops over the ``groups`` query heads that share it.

  Works on transposed tiles ``[block_kv, block_q]`` so every matmul is a plain one. Padded
  query rows need no mask: their dO and delta are 0, so they add exactly 0 to dk and dv.
  """
  if has_segments:
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_seg_ref, kv_seg_ref,
     dk_ref, dv_ref) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref) = refs
    q_seg_ref = kv_seg_ref = None
  block_q, block_kv = plan.dkv.block_q, plan.dkv.block_kv
  first_kv = pl.program_id(0) * block_kv
  k, v = k_ref[...], v_ref[...]
  kv_pos = (first_kv + jnp.arange(block_kv))[:, None]
  kv_seg = kv_seg_ref[...][:, None] if has_segments else None
  qk_scale = plan.scale * LOG2E

  def visit(g, masked, i, carry):
    dk, dv = carry
    rows = _kv_slice(i, block_q)
    q, do = q_ref[rows, g, :], do_ref[rows, g, :]
    probs_t = jnp.exp2(dot(k, q, 1, 1) * qk_scale - lse2_ref[g, rows][None, :])
    mask = visible((i * block_q + jnp.arange(block_q))[None, :], kv_pos,
                    q_seg_ref[rows][None, :] if has_segments else None, kv_seg,
                    causal=masked and plan.causal, kv_len=None,
                    window=plan.sliding_window if masked else None)
    if mask is not None:
      probs_t = jnp.where(mask, probs_t, 0.0)
    dv = dv + dot(probs_t.astype(do.dtype), do, 1, 0)
    d_scores_t = probs_t * (dot(v, do, 1, 1) - delta_ref[g, rows][None, :])
    dk = dk + dot(d_scores_t.astype(q.dtype), q, 1, 0)
    return dk, dv

  ranges = q_block_ranges(plan, first_kv, block_kv, block_q)
  one_group = lambda g, carry: visit_blocks(ranges, functools.partial(visit, g), carry)
  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, groups, one_group, (zeros, zeros))
  dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def kernel_name(kernel, plan):
  """The kernel's name in the HLO: ``ulysses_jax.aot.cost`` reads its FLOPs from it."""
  window = "" if plan.sliding_window is None else f"_window{plan.sliding_window}"
  return f"flash_attention_{kernel}" + ("_causal" if plan.causal else "") + window


def _call(kernel, tile, plan, grid, in_specs, out_specs, out_shape, name):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=tile.num_warps,
                                               num_stages=tile.num_stages),
      interpret=plan.interpret, name=name)


def _row_blocked_specs(plan, block_q, groups, head_dim):
  """Specs over grid ``(q block, b, hq)``: a block of q-like rows, the whole K/V of the block's
  KV head, the block's lse-like stats, and its (query, key) segment ids."""
  n = plan.padded_len // block_q
  q_block = lambda i: _q_block(plan, n, i)
  sq = pl.squeezed
  rows = pl.BlockSpec((sq, block_q, sq, head_dim), lambda i, b, h: (b, q_block(i), h, 0))
  whole_kv = pl.BlockSpec((sq, plan.padded_len, sq, head_dim),
                          lambda i, b, h: (b, 0, lax.div(h, groups), 0))
  stats = pl.BlockSpec((sq, sq, block_q), lambda i, b, h: (b, h, q_block(i)))
  seg_specs = [pl.BlockSpec((sq, block_q), lambda i, b, h: (b, q_block(i))),
               pl.BlockSpec((sq, plan.padded_len), lambda i, b, h: (b, 0))]
  return rows, whole_kv, stats, seg_specs


def forward(plan, q, k, v, q_seg, kv_seg):
  """Returns out ``[B, Sp, Hq, D]`` (q's dtype) and lse ``[B, Hq, Sp]`` float32 (natural log)."""
  b, sp, hq, d = q.shape
  groups = hq // k.shape[2]
  rows, whole_kv, stats, seg_specs = _row_blocked_specs(plan, plan.forward.block_q, groups, d)
  has_segments = q_seg is not None
  kernel = functools.partial(_forward_kernel, plan=plan, has_segments=has_segments)
  call = _call(kernel, plan.forward, plan, (sp // plan.forward.block_q, b, hq),
               [rows, whole_kv, whole_kv] + (seg_specs if has_segments else []),
               [rows, stats],
               [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sp), jnp.float32)], kernel_name("forward", plan))
  return call(q, k, v, *((q_seg, kv_seg) if has_segments else ()))


def backward_dq(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg, grad_dtype):
  """dq ``[B, Sp, Hq, D]`` in ``grad_dtype``; ``lse2`` and ``delta`` ``[B, Hq, Sp]`` float32
  (see module doc)."""
  b, sp, hq, d = q.shape
  groups = hq // k.shape[2]
  rows, whole_kv, stats, seg_specs = _row_blocked_specs(plan, plan.dq.block_q, groups, d)
  has_segments = q_seg is not None
  kernel = functools.partial(_dq_kernel, plan=plan, has_segments=has_segments)
  call = _call(kernel, plan.dq, plan, (sp // plan.dq.block_q, b, hq),
               [rows, whole_kv, whole_kv, rows, stats, stats]
               + (seg_specs if has_segments else []),
               rows, jax.ShapeDtypeStruct(q.shape, grad_dtype), kernel_name("dq", plan))
  return call(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg) if has_segments else ()))


def backward_dkv(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg, grad_dtype):
  """dk, dv ``[B, Sp, Hkv, D]`` in ``grad_dtype``, each summed over the query heads that share
  the KV head."""
  b, sp, hkv, d = k.shape
  groups = q.shape[2] // hkv
  block_kv, sq = plan.dkv.block_kv, pl.squeezed
  # Block index h along the query-head axis with block size `groups` = heads [h*G, (h+1)*G).
  group_rows = pl.BlockSpec((sq, sp, groups, d), lambda j, b, h: (b, 0, h, 0))
  group_stats = pl.BlockSpec((sq, groups, sp), lambda j, b, h: (b, h, 0))
  kv_rows = pl.BlockSpec((sq, block_kv, sq, d), lambda j, b, h: (b, j, h, 0))
  seg_specs = [pl.BlockSpec((sq, sp), lambda j, b, h: (b, 0)),
               pl.BlockSpec((sq, block_kv), lambda j, b, h: (b, j))]
  has_segments = q_seg is not None
  kernel = functools.partial(_dkv_kernel, plan=plan, has_segments=has_segments, groups=groups)
  call = _call(kernel, plan.dkv, plan, (sp // block_kv, b, hkv),
               [group_rows, kv_rows, kv_rows, group_rows, group_stats, group_stats]
               + (seg_specs if has_segments else []),
               [kv_rows, kv_rows],
               [jax.ShapeDtypeStruct(k.shape, grad_dtype)] * 2,
               kernel_name("dkv", plan))
  return call(q, k, v, d_out, lse2, delta, *((q_seg, kv_seg) if has_segments else ()))
