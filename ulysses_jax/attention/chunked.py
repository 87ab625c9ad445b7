"""Memory-efficient exact attention in plain XLA (the ``"xla"`` backend).

Flash-attention's algorithm written with ``lax`` loops: queries are processed in blocks of
``block_q``, and for each query block an online softmax runs over key/value blocks of
``block_kv``, so no more than ``[B, H, block_q, block_kv]`` scores exist at once. A
``custom_vjp`` makes the backward recompute scores block by block from the saved output and
log-sum-exp (two passes: one for dq, one for dk/dv), so activation memory is O(S), never
O(S^2). Key/value blocks that the causal mask hides completely are skipped with ``lax.cond``.

Masking rules are those of ``reference.dense_attention``. Segment ids must be >= 0: the
negative ids -1 and -2 mark the padding added when S is not a multiple of the block size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Block padding: two ids below every id a caller may use (common.MIN_SEGMENT_ID), distinct
# so that padded queries and padded keys never match.
_Q_PAD_SEGMENT = int(np.iinfo(np.int32).min)
_KV_PAD_SEGMENT = _Q_PAD_SEGMENT + 1


def chunked_attention(q_BSHD, k_BSKD, v_BSKD, *, causal=True, q_segment_ids=None,
                      kv_segment_ids=None, q_positions=None, kv_positions=None, scale=None,
                      block_q=512, block_kv=512, return_lse=False):
  """Exact attention; same arguments, shapes and result as ``reference.dense_attention``.

  q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; segment ids ``[B, S]`` int; positions
  ``[S]`` int (default ``arange``; they place queries and keys for the causal mask, e.g. a
  query shard at an offset). Returns ``[B, Sq, Hq, D]`` and, with ``return_lse``, the
  differentiable log-sum-exp ``[B, Hq, Sq]`` float32 that ring attention merges with.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither.")
  b, sq, hq, d = q_BSHD.shape
  sk = k_BSKD.shape[1]
  scale = d ** -0.5 if scale is None else float(scale)
  block_q, block_kv = min(block_q, sq), min(block_kv, sk)
  if q_segment_ids is None:
    q_segment_ids = jnp.zeros((b, sq), jnp.int32)
    kv_segment_ids = jnp.zeros((b, sk), jnp.int32)
  q_positions = jnp.arange(sq, dtype=jnp.int32) if q_positions is None else q_positions
  kv_positions = jnp.arange(sk, dtype=jnp.int32) if kv_positions is None else kv_positions

  q, q_seg, q_pos = _pad_to_block(q_BSHD, q_segment_ids, q_positions, block_q, _Q_PAD_SEGMENT)
  k, kv_seg, kv_pos = _pad_to_block(k_BSKD, kv_segment_ids, kv_positions, block_kv,
                                    _KV_PAD_SEGMENT)
  v, _, _ = _pad_to_block(v_BSKD, kv_segment_ids, kv_positions, block_kv, _KV_PAD_SEGMENT)
  config = _Config(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv)
  out, lse = _attention(config, q, k, v, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32),
                        q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32))
  out, lse = out[:, :sq], lse[:, :, :sq]
  return (out, lse) if return_lse else out


def chunked_attention_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, d_out_BSHD, *,
                               causal, q_segment_ids, kv_segment_ids, q_positions,
                               kv_positions, scale, block_q, block_kv):
  """``(dq, dk, dv)`` of one query/key tile set, given an output and lse computed elsewhere.

  With the output and lse of a larger attention (ring attention passes the global ones),
  ``exp(scores - lse)`` are the true probabilities, so summing this over key shards gives
  the exact gradient. Here sequence lengths must be multiples of the blocks and segment ids
  and positions are required (no padding is added).
  """
  config = _Config(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv)
  residuals = (q_BSHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, q_positions,
               kv_positions, out_BSHD, lse_BHS)
  return _backward_rule(config, residuals, (d_out_BSHD, jnp.zeros_like(lse_BHS)))[:3]


class _Config(tuple):
  """Static settings, hashable so they can be a nondiff argument of the custom_vjp."""

  def __new__(cls, *, causal, scale, block_q, block_kv):
    return super().__new__(cls, (causal, scale, block_q, block_kv))

  causal = property(lambda self: self[0])
  scale = property(lambda self: self[1])
  block_q = property(lambda self: self[2])
  block_kv = property(lambda self: self[3])


def _pad_to_block(x_BS, segment_ids_BS, positions_S, block, pad_segment):
  pad = -x_BS.shape[1] % block
  if not pad:
    return x_BS, segment_ids_BS, positions_S
  x_BS = jnp.pad(x_BS, [(0, 0), (0, pad)] + [(0, 0)] * (x_BS.ndim - 2))
  segment_ids_BS = jnp.pad(segment_ids_BS, [(0, 0), (0, pad)], constant_values=pad_segment)
  positions_S = jnp.pad(positions_S, (0, pad), mode="edge")
  return x_BS, segment_ids_BS, positions_S


def _blocks(x_BS, block):
  """``[B, S, ...]`` -> ``[S // block, B, block, ...]``: the loop axis first."""
  b, s = x_BS.shape[:2]
  return jnp.moveaxis(x_BS.reshape(b, s // block, block, *x_BS.shape[2:]), 1, 0)


def _unblocks(x_NBb):
  """Inverse of ``_blocks``."""
  n, b, block = x_NBb.shape[:3]
  return jnp.moveaxis(x_NBb, 0, 1).reshape(b, n * block, *x_NBb.shape[3:])


def _fori_loop(num_steps, body, init):
  """``lax.fori_loop(0, num_steps, body, init)`` that always lowers to a while loop.

  A fori_loop with static bounds becomes a scan, and when this attention runs inside a
  differentiated ``lax.scan`` (a model's layer stack) JAX then keeps every tile of that scan
  as a residual, O(S^2) memory, even though the custom_vjp never differentiates it. A while
  loop has no residuals to keep.
  """
  def cond(carry):
    return carry[0] < num_steps

  def step(carry):
    i, value = carry
    return i + 1, body(i, value)

  return lax.while_loop(cond, step, (jnp.int32(0), init))[1]


def _block_visible(config, q_pos_b, kv_pos_b):
  """False when the causal mask hides the whole (query block, key block) tile."""
  if not config.causal:
    return jnp.bool_(True)
  return jnp.min(kv_pos_b) <= jnp.max(q_pos_b)


def _tile_probs(config, q_BbKGD, k_BbKD, q_seg_Bb, kv_seg_Bb, q_pos_b, kv_pos_b, row_max):
  """Scores of one tile, masked; returns (scores - row_max exponentiated, mask).

  Shapes: q ``[B, bq, Hkv, G, D]``, k ``[B, bk, Hkv, D]``; result ``[B, Hkv, G, bq, bk]``.
  ``row_max`` ``[B, Hkv, G, bq]`` is the running max (forward) or the lse (backward).
  """
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", q_BbKGD, k_BbKD,
                      preferred_element_type=jnp.float32) * config.scale
  mask = q_seg_Bb[:, :, None] == kv_seg_Bb[:, None, :]
  if config.causal:
    mask = mask & (q_pos_b[:, None] >= kv_pos_b[None, :])[None]
  mask = mask[:, None, None]
  if row_max is None:
    return scores, mask
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[..., None]
  return jnp.where(mask, jnp.exp(scores - safe_max), 0.0), mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  return _forward(config, q, k, v, q_seg, kv_seg, q_pos, kv_pos)


def _forward(config, q_BSHD, k_BSKD, v_BSKD, q_seg, kv_seg, q_pos, kv_pos):
  b, sq, hq, d = q_BSHD.shape
  hkv = k_BSKD.shape[2]
  groups = hq // hkv
  q_blocks = _blocks(q_BSHD.reshape(b, sq, hkv, groups, d), config.block_q)
  k_blocks, v_blocks = _blocks(k_BSKD, config.block_kv), _blocks(v_BSKD, config.block_kv)
  kv_seg_blocks, kv_pos_blocks = _blocks(kv_seg, config.block_kv), kv_pos.reshape(
      -1, config.block_kv)

  def one_query_block(args):
    q_b, q_seg_b, q_pos_b = args
    stats_shape = (b, hkv, groups, config.block_q)
    init = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (d,), jnp.float32))

    def update(j, carry):
      row_max, denom, acc = carry
      scores, mask = _tile_probs(config, q_b, k_blocks[j], q_seg_b, kv_seg_blocks[j], q_pos_b,
                                 kv_pos_blocks[j], None)
      scores = jnp.where(mask, scores, -jnp.inf)
      new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
      safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
      probs = jnp.exp(scores - safe_max[..., None])
      correction = jnp.exp(row_max - safe_max)
      denom = correction * denom + jnp.sum(probs, axis=-1)
      acc = correction[..., None] * acc + jnp.einsum(
          "bhgqk,bkhd->bhgqd", probs.astype(v_blocks.dtype), v_blocks[j],
          preferred_element_type=jnp.float32)
      return new_max, denom, acc

    def visit(j, carry):
      visible = _block_visible(config, q_pos_b, kv_pos_blocks[j])
      return lax.cond(visible, lambda c: update(j, c), lambda c: c, carry)

    row_max, denom, acc = _fori_loop(k_blocks.shape[0], visit, init)
    out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]
    lse = jnp.where(denom == 0, -jnp.inf, row_max + jnp.log(jnp.where(denom == 0, 1.0, denom)))
    return jnp.einsum("bhgqd->bqhgd", out).astype(q_BSHD.dtype), lse

  out_blocks, lse_blocks = lax.map(
      one_query_block, (q_blocks, _blocks(q_seg, config.block_q),
                        q_pos.reshape(-1, config.block_q)))
  out = _unblocks(out_blocks).reshape(b, sq, hq, d)
  # lse blocks: [nq, B, Hkv, G, bq] -> [B, Hq, Sq]
  lse = jnp.moveaxis(lse_blocks, 0, 3).reshape(b, hq, sq)
  return out, lse


def _forward_rule(config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  out, lse = _forward(config, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return (out, lse), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)


def _backward_rule(config, residuals, cotangents):
  q_BSHD, k_BSKD, v_BSKD, q_seg, kv_seg, q_pos, kv_pos, out, lse = residuals
  d_out, d_lse = cotangents
  b, sq, hq, d = q_BSHD.shape
  sk, hkv = k_BSKD.shape[1:3]
  groups = hq // hkv
  to_groups = lambda x: x.reshape(b, x.shape[1], hkv, groups, d)
  # delta_i = rowsum(dO * O) - dlse_i: the lse cotangent enters every dS_ij as + P_ij dlse_i.
  delta = jnp.einsum("bqhgd,bqhgd->bhgq", to_groups(d_out).astype(jnp.float32),
                     to_groups(out).astype(jnp.float32))
  delta = delta - d_lse.reshape(b, hkv, groups, sq)
  lse = lse.reshape(b, hkv, groups, sq)

  q_blocks, do_blocks = (_blocks(to_groups(x), config.block_q) for x in (q_BSHD, d_out))
  q_seg_blocks, q_pos_blocks = _blocks(q_seg, config.block_q), q_pos.reshape(-1, config.block_q)
  lse_blocks, delta_blocks = (jnp.moveaxis(x.reshape(b, hkv, groups, -1, config.block_q), 3, 0)
                              for x in (lse, delta))
  k_blocks, v_blocks = _blocks(k_BSKD, config.block_kv), _blocks(v_BSKD, config.block_kv)
  kv_seg_blocks, kv_pos_blocks = _blocks(kv_seg, config.block_kv), kv_pos.reshape(
      -1, config.block_kv)

  def tile_grads(i, j):
    """dS and P of tile (query block i, key block j), both ``[B, Hkv, G, bq, bk]`` float32."""
    probs, _ = _tile_probs(config, q_blocks[i], k_blocks[j], q_seg_blocks[i], kv_seg_blocks[j],
                           q_pos_blocks[i], kv_pos_blocks[j], lse_blocks[i])
    d_probs = jnp.einsum("bqhgd,bkhd->bhgqk", do_blocks[i], v_blocks[j],
                         preferred_element_type=jnp.float32)
    return probs * (d_probs - delta_blocks[i][..., None]), probs

  def dq_block(i):
    def visit(j, dq):
      def add(dq):
        d_scores, _ = tile_grads(i, j)
        return dq + jnp.einsum("bhgqk,bkhd->bqhgd", d_scores.astype(k_blocks.dtype),
                               k_blocks[j], preferred_element_type=jnp.float32)
      visible = _block_visible(config, q_pos_blocks[i], kv_pos_blocks[j])
      return lax.cond(visible, add, lambda dq: dq, dq)
    dq = _fori_loop(k_blocks.shape[0], visit, jnp.zeros(q_blocks.shape[1:], jnp.float32))
    return (dq * config.scale).astype(q_BSHD.dtype)

  def dkv_block(j):
    def visit(i, carry):
      def add(carry):
        dk, dv = carry
        d_scores, probs = tile_grads(i, j)
        dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", probs.astype(do_blocks.dtype), do_blocks[i],
                             preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", d_scores.astype(q_blocks.dtype), q_blocks[i],
                             preferred_element_type=jnp.float32)
        return dk, dv
      visible = _block_visible(config, q_pos_blocks[i], kv_pos_blocks[j])
      return lax.cond(visible, add, lambda c: c, carry)
    zeros = jnp.zeros(k_blocks.shape[1:], jnp.float32)
    dk, dv = _fori_loop(q_blocks.shape[0], visit, (zeros, zeros))
    return (dk * config.scale).astype(k_BSKD.dtype), dv.astype(v_BSKD.dtype)

  dq = _unblocks(lax.map(dq_block, jnp.arange(q_blocks.shape[0]))).reshape(b, sq, hq, d)
  dk_blocks, dv_blocks = lax.map(dkv_block, jnp.arange(k_blocks.shape[0]))
  dk, dv = _unblocks(dk_blocks), _unblocks(dv_blocks)
  return dq, dk, dv, None, None, None, None


_attention.defvjp(_forward_rule, _backward_rule)
