"""Memory-efficient exact attention in plain XLA (the ``"xla"`` backend).

Flash-attention's algorithm written with ``lax`` loops: queries are processed in blocks of
``block_q``, and for each query block an online softmax runs over key/value blocks of
``block_kv``, so no more than ``[B, H, block_q, block_kv]`` scores exist at once. A
``custom_vjp`` makes the backward recompute scores block by block from the saved output and
log-sum-exp (two passes: one for dq, one for dk/dv), so activation memory is O(S), never
O(S^2). Tiles that the mask hides completely are never computed: each query block's loop runs
only from its first to its last visible key block (each key block's, in the dk/dv pass, over
its visible query blocks), and tiles in between that are hidden (possible with positions that
are not increasing, e.g. ring attention's zigzag chunks) are skipped with ``lax.cond``. With
a ``sliding_window`` of W keys (and increasing positions) that makes the work O(S·W), not
O(S^2).

Masking rules are those of ``reference.dense_attention``. Segment ids must be >= 0: the
negative ids -1 and -2 mark the padding added when S is not a multiple of the block size.
Sinks (``sinks.apply_sinks``) are applied to the output and lse, outside the ``custom_vjp``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ulysses_jax.attention.common import fori_loop
from ulysses_jax.kernels.variants import check_sliding_window
from ulysses_jax.kernels.variants import check_sinks, name_kernel_residuals
from ulysses_jax.kernels.variants import apply_sinks

# Block padding: two ids below every id a caller may use (common.MIN_SEGMENT_ID), distinct
# so that padded queries and padded keys never match.
_Q_PAD_SEGMENT = int(np.iinfo(np.int32).min)
_KV_PAD_SEGMENT = _Q_PAD_SEGMENT + 1


def chunked_attention(q_BSHD, k_BSKD, v_BSKD, *, causal=True, q_segment_ids=None,
                      kv_segment_ids=None, q_positions=None, kv_positions=None, scale=None,
                      sliding_window=None, block_q=512, block_kv=512, return_lse=False,
                      sinks=None):
  """Exact attention; same arguments, shapes and result as ``reference.dense_attention``.

  q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``; segment ids ``[B, S]`` int; positions
  ``[S]`` int (default ``arange``; they place queries and keys for the causal mask, e.g. a
  query shard at an offset). ``sliding_window``: None, or W >= 1 with ``causal`` (a query at
  position p sees keys at p' with ``0 <= p - p' < W``; transformers' definition); key blocks
  outside every window of a query block are not visited. ``sinks``: None or ``[Hq]`` float
  logits (``attention.sinks``). Returns ``[B, Sq, Hq, D]`` and, with ``return_lse``, the
  differentiable log-sum-exp ``[B, Hq, Sq]`` float32 (the sink included) that ring attention
  merges with.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither.")
  check_sliding_window(sliding_window, causal)
  b, sq, hq, d = q_BSHD.shape
  check_sinks(sinks, hq, "chunked_attention")
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
  config = _Config(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv,
                   sliding_window=sliding_window)
  out, lse = _attention(config, q, k, v, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32),
                        q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32))
  out, lse = out[:, :sq], lse[:, :, :sq]
  if sinks is not None:
    out, lse = apply_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


def chunked_attention_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, d_out_BSHD, *,
                               causal, q_segment_ids, kv_segment_ids, q_positions,
                               kv_positions, scale, block_q, block_kv, sliding_window=None):
  """``(dq, dk, dv)`` of one query/key tile set, given an output and lse computed elsewhere.

  With the output and lse of a larger attention (ring attention passes the global ones),
  ``exp(scores - lse)`` are the true probabilities, so summing this over key shards gives
  the exact gradient. Here sequence lengths must be multiples of the blocks and segment ids
  and positions are required (no padding is added). ``sliding_window`` as in
  ``chunked_attention``: tiles outside the window are not visited.
  """
  check_sliding_window(sliding_window, causal)
  config = _Config(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv,
                   sliding_window=sliding_window)
  residuals = (q_BSHD, k_BSKD, v_BSKD, q_segment_ids, kv_segment_ids, q_positions,
               kv_positions, out_BSHD, lse_BHS)
  return _backward_rule(config, residuals, (d_out_BSHD, jnp.zeros_like(lse_BHS)))[:3]


class _Config(tuple):
  """Static settings, hashable so they can be a nondiff argument of the custom_vjp."""

  def __new__(cls, *, causal, scale, block_q, block_kv, sliding_window):
    return super().__new__(cls, (causal, scale, block_q, block_kv, sliding_window))

  causal = property(lambda self: self[0])
  scale = property(lambda self: self[1])
  block_q = property(lambda self: self[2])
  block_kv = property(lambda self: self[3])
  sliding_window = property(lambda self: self[4])


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


def _block_visibility(config, q_pos, kv_pos):
  """``[Sq / block_q, Sk / block_kv]`` bool: False where the mask hides the whole tile.

  Judged from each block's lowest and highest position (a tile is visible when some query
  to key distance in it lies in ``[0, sliding_window)``), so it may keep a hidden tile,
  never drop a visible one. Segment ids are not considered.
  """
  q_pos_N = q_pos.reshape(-1, config.block_q)
  kv_pos_N = kv_pos.reshape(-1, config.block_kv)
  q_min, q_max = jnp.min(q_pos_N, axis=1)[:, None], jnp.max(q_pos_N, axis=1)[:, None]
  kv_min, kv_max = jnp.min(kv_pos_N, axis=1)[None], jnp.max(kv_pos_N, axis=1)[None]
  visible = jnp.ones((q_pos_N.shape[0], kv_pos_N.shape[0]), bool)
  if config.causal:
    visible = visible & (kv_min <= q_max)
  if config.sliding_window is not None:
    visible = visible & (q_min - kv_max < config.sliding_window)
  return visible


def _visible_range(visible_N):
  """``(first, last + 1)`` of the True entries of ``visible_N`` ``[N]``; ``(0, 0)`` if none."""
  n = visible_N.shape[0]
  first = jnp.argmax(visible_N).astype(jnp.int32)
  end = (n - jnp.argmax(visible_N[::-1])).astype(jnp.int32)
  seen = jnp.any(visible_N)
  return jnp.where(seen, first, 0), jnp.where(seen, end, 0)


def _visible_loop(visible_N, body, init):
  """Runs ``body(j, carry)`` for the visible ``j`` only, looping over their range alone."""
  first, end = _visible_range(visible_N)
  return fori_loop(first, end, lambda j, carry: lax.cond(
      visible_N[j], lambda c: body(j, c), lambda c: c, carry), init)


def _tile_probs(config, q_BbKGD, k_BbKD, q_seg_Bb, kv_seg_Bb, q_pos_b, kv_pos_b, row_max):
  """Scores of one tile, masked; returns (scores - row_max exponentiated, mask).

  Shapes: q ``[B, bq, Hkv, G, D]``, k ``[B, bk, Hkv, D]``; result ``[B, Hkv, G, bq, bk]``.
  ``row_max`` ``[B, Hkv, G, bq]`` is the running max (forward) or the lse (backward).
  """
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", q_BbKGD, k_BbKD,
                      preferred_element_type=jnp.float32) * config.scale
  mask = q_seg_Bb[:, :, None] == kv_seg_Bb[:, None, :]
  distance = q_pos_b[:, None] - kv_pos_b[None, :]
  if config.causal:
    mask = mask & (distance >= 0)[None]
  if config.sliding_window is not None:
    mask = mask & (distance < config.sliding_window)[None]
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
    q_b, q_seg_b, q_pos_b, visible_N = args
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

    row_max, denom, acc = _visible_loop(visible_N, update, init)
    out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]
    lse = jnp.where(denom == 0, -jnp.inf, row_max + jnp.log(jnp.where(denom == 0, 1.0, denom)))
    return jnp.einsum("bhgqd->bqhgd", out).astype(q_BSHD.dtype), lse

  out_blocks, lse_blocks = lax.map(
      one_query_block, (q_blocks, _blocks(q_seg, config.block_q),
                        q_pos.reshape(-1, config.block_q),
                        _block_visibility(config, q_pos, kv_pos)))
  out = _unblocks(out_blocks).reshape(b, sq, hq, d)
  # lse blocks: [nq, B, Hkv, G, bq] -> [B, Hq, Sq]
  lse = jnp.moveaxis(lse_blocks, 0, 3).reshape(b, hq, sq)
  return out, lse


def _forward_rule(config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  out, lse = name_kernel_residuals(*_forward(config, q, k, v, q_seg, kv_seg, q_pos, kv_pos))
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

  visible_NqNk = _block_visibility(config, q_pos, kv_pos)

  def dq_block(i):
    def add(j, dq):
      d_scores, _ = tile_grads(i, j)
      return dq + jnp.einsum("bhgqk,bkhd->bqhgd", d_scores.astype(k_blocks.dtype),
                             k_blocks[j], preferred_element_type=jnp.float32)
    dq = _visible_loop(visible_NqNk[i], add, jnp.zeros(q_blocks.shape[1:], jnp.float32))
    return (dq * config.scale).astype(q_BSHD.dtype)

  def dkv_block(j):
    def add(i, carry):
      dk, dv = carry
      d_scores, probs = tile_grads(i, j)
      dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", probs.astype(do_blocks.dtype), do_blocks[i],
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", d_scores.astype(q_blocks.dtype), q_blocks[i],
                           preferred_element_type=jnp.float32)
      return dk, dv
    zeros = jnp.zeros(k_blocks.shape[1:], jnp.float32)
    dk, dv = _visible_loop(visible_NqNk[:, j], add, (zeros, zeros))
    return (dk * config.scale).astype(k_BSKD.dtype), dv.astype(v_BSKD.dtype)

  dq = _unblocks(lax.map(dq_block, jnp.arange(q_blocks.shape[0]))).reshape(b, sq, hq, d)
  dk_blocks, dv_blocks = lax.map(dkv_block, jnp.arange(k_blocks.shape[0]))
  dk, dv = _unblocks(dk_blocks), _unblocks(dv_blocks)
  return dq, dk, dv, None, None, None, None


_attention.defvjp(_forward_rule, _backward_rule)
