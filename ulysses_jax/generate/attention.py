"""Attention of new tokens over the KV cache, split over the devices that hold it
(distributed flash-decoding).

Each device attends its queries over the slots it holds and returns a partial output and its
float32 log-sum-exp; the partials of the devices along the cache's slot axes combine into the
exact attention:

    m = max_r lse_r,  w_r = exp(lse_r - m),  out = Σ_r w_r · o_r / Σ_r w_r

all in float32 (a bfloat16 combine loses the precision vLLM's decode context parallelism
lost, vLLM issue 41623). A device whose slots hold nothing a query may see (an empty shard:
a short prompt in a long batch, or a window that ends before the shard) contributes the
neutral state o = 0, lse = -inf, whose weight is 0; a query that sees nothing at all gets 0.

A slot is visible to a query at position q when its position p (``cache.KVCache.positions``)
satisfies ``0 <= p <= q`` and, in a layer with a sliding window W, ``q - p < W``.

A decode step's partial attention (one new token per row) is XLA's (``partial_attention``) or
our split-K Mosaic GPU kernel's (``kernels.decode_hopper``), as ``CacheLayout.decode_backend``
says: ``"xla"``; ``"mosaic"`` (Hopper GPUs; in GPU interpret mode off GPUs, for tests; an
error on other GPUs or for a cache it cannot take); ``"auto"``: the kernel on Hopper where it
can take the cache, else XLA (why: ``benchmarks/RESULTS.md``, split-K decode kernel).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ulysses_jax.generate.cache import (  # noqa: F401  (DECODE_BACKENDS: public here too)
    DECODE_BACKENDS, CacheLayout, decode_kernel_chosen)
from ulysses_jax.kernels import decode_hopper, target
from ulysses_jax.mesh import DATA


# Slots per step of a device's loop when queries times slots would make big score blocks
# (chunked prefill); a decode step (one query per row) scores all its slots at once.
BLOCK_SLOTS = 512
MAX_SCORES = 1 << 22  # query x slot scores per head group beyond which slots are looped


def partial_attention(q_bKGTD, k_bKCD, v, q_pos_bT, k_pos_bC, *, scale: float,
                      window: int | None, fused: bool = False, v_layout: str = "DC"):
  """One device's partial attention: ``(o, lse)``, o ``[b, Hkv, G, T, D]`` and lse
  ``[b, Hkv, G, T]`` float32, the neutral (0, -inf) where a query sees no slot here. The
  cache's layout (heads first; k's D and v's slots last) makes both products batched matrix
  products over (row, head) contracting the cache's last axis; v may also be laid out like k
  (``v_layout="CD"``: ``cache.CacheLayout.v_layout``). ``fused``: a decode step's products as
  fused products-and-sums (``_scores``), for XLA's GPU compiler."""
  c = k_bKCD.shape[2]
  t = q_bKGTD.shape[3]
  block = c if t * c <= MAX_SCORES else min(c, BLOCK_SLOTS)
  init = (jnp.full(q_bKGTD.shape[:4], -jnp.inf, jnp.float32),
          jnp.zeros(q_bKGTD.shape[:4], jnp.float32),
          jnp.zeros(q_bKGTD.shape, jnp.float32))

  def update(j, carry):
    row_max, denom, acc = carry
    # The last block starts early enough to stay inside; slots before j * block are masked
    # there, so none counts twice.
    start = jnp.minimum(j * block, c - block)
    k = lax.dynamic_slice_in_dim(k_bKCD, start, block, axis=2)
    v_block = lax.dynamic_slice_in_dim(v, start, block, axis=3 if v_layout == "DC" else 2)
    k_pos = lax.dynamic_slice_in_dim(k_pos_bC, start, block, axis=1)
    fresh = start + jnp.arange(block) >= j * block
    scores = _scores(q_bKGTD, k, fused) * scale
    distance = q_pos_bT[:, :, None] - k_pos[:, None, :]
    visible = (k_pos[:, None, :] >= 0) & (distance >= 0) & fresh
    if window is not None:
      visible = visible & (distance < window)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    new_max = jnp.maximum(row_max, scores.max(-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = jnp.exp(scores - safe_max[..., None])
    correction = jnp.exp(row_max - safe_max)
    denom = correction * denom + probs.sum(-1)
    acc = correction[..., None] * acc + _values_product(probs.astype(v.dtype), v_block, fused,
                                                         v_layout)
    return new_max, denom, acc

  blocks = -(-c // block)
  row_max, denom, acc = (update(0, init) if blocks == 1 else
                         lax.fori_loop(0, blocks, update, init))
  seen = denom > 0
  o = acc / jnp.where(seen, denom, 1.0)[..., None]
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
  return o, lse


# On GPUs a decode step (T = 1) computes both products as a product and a sum over the
# cache's last axis, which XLA fuses into one pass over the cache where it lies. As matrix
# products, XLA's GPU compiler copies a layer's cache slice for them: v for a split-K product
# over the slots (jax 0.10.2), k too for its GEMM fusion (jax 0.12). Products in float32 are
# exact, as the matrix products' are. XLA's CPU compiler runs matrix products faster (3x at 16K
# slots).


def _scores(q_bKGTD, k_bKCD, fused: bool):
  """``q . k`` float32 ``[b, Hkv, G, T, C]``."""
  if fused:
    f32 = lambda x: x.astype(jnp.float32)
    return (f32(q_bKGTD)[:, :, :, :, None, :] * f32(k_bKCD)[:, :, None, None]).sum(-1)
  # The cache first: XLA's CPU compiler then multiplies it where it lies (second, it
  # transposed a copy of each layer's k for its matrix product).
  scores_bKCGT = lax.dot_general(k_bKCD, q_bKGTD, (((3,), (4,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32)
  return scores_bKCGT.transpose(0, 1, 3, 4, 2)


def _values_product(probs_bKGTC, v, fused: bool, v_layout: str):
  """``probs @ v`` summed over the slots, float32 ``[b, Hkv, G, T, D]``; v ``[b, Hkv, D, C]``
  (``v_layout="DC"``) or ``[b, Hkv, C, D]``."""
  slots_last = v_layout == "DC"
  if fused:
    f32 = lambda x: x.astype(jnp.float32)
    if slots_last:
      return (f32(probs_bKGTC)[:, :, :, :, None, :] * f32(v)[:, :, None, None]).sum(-1)
    return (f32(probs_bKGTC)[..., None] * f32(v)[:, :, None, None]).sum(-2)
  if not slots_last:
    return lax.dot_general(probs_bKGTC, v, (((4,), (2,)), ((0, 1), (0, 1))),
                           preferred_element_type=jnp.float32)
  out_bKDGT = lax.dot_general(v, probs_bKGTC, (((3,), (4,)), ((0, 1), (0, 1))),
                              preferred_element_type=jnp.float32)
  return out_bKDGT.transpose(0, 1, 3, 4, 2)


def combine(o, lse, axes):
  """The exact attention from each device's ``(o, lse)`` along mesh ``axes`` (inside
  shard_map): ``(o, lse)`` of all of them, float32; (0, -inf) where no device has a visible
  slot."""
  if axes:
    top = lax.pmax(lse, axes)
    weight = jnp.where(jnp.isfinite(lse),
                       jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    numerator = lax.psum(weight[..., None] * o, axes)
    denominator = lax.psum(weight, axes)
    o = numerator / jnp.where(denominator > 0, denominator, 1.0)[..., None]
    lse = jnp.where(denominator > 0, top + jnp.log(jnp.where(denominator > 0, denominator,
                                                             1.0)), -jnp.inf)
  return jnp.where(jnp.isfinite(lse)[..., None], o, 0.0), lse


def _with_new_token(o, lse, q_bKGTD, k_bKD, v_bKD, scale):
  """``(o, lse)`` merged with the attention of each query to the new token itself (its own
  key and value, visible to it whatever the window)."""
  f32 = lambda x: x.astype(jnp.float32)
  score = (f32(q_bKGTD) * f32(k_bKD)[:, :, None, None]).sum(-1) * scale  # [b, k, g, t]
  top = jnp.maximum(lse, score)
  old = jnp.where(jnp.isfinite(lse), jnp.exp(lse - top), 0.0)
  new = jnp.exp(score - top)
  o = (old[..., None] * o + new[..., None] * f32(v_bKD)[:, :, None, None]) / (
      old + new)[..., None]
  return o, top + jnp.log(old + new)


def _with_sinks(o, lse, sinks_KG):
  """``o`` with each query head's sink logit in its softmax (``attention.sinks``): o ·
  σ(lse - s), applied once to the combined attention (a row that sees nothing stays 0)."""
  return o * jax.nn.sigmoid(lse - sinks_KG[None, :, :, None])[..., None]


def cache_attention(layout: CacheLayout, q_BTHD, k_BKCD, v_BK, q_pos_BT, k_pos_BC, *,
                    scale: float, window: int | None, new_kv=None, sinks_H=None,
                    layer: int | None = None):
  """Attention of queries q ``[B, T, Hq, D]`` at positions ``q_pos_BT`` over one layer's
  cache (k ``[B, Hkv, C, D]``, v in ``layout.v_layout`` and the slots' positions ``[B, C]``,
  placed as ``layout`` says; with ``layer``, k and v are a kind's stacks, layers first, and
  layer ``layer`` of them is attended: the kernel reads it where it lies, where a slice taken
  before would be copied for it). ``new_kv``: a decode step's own k and v ``[B, 1, Hkv, D]``,
  not in the cache yet, which each query (T = 1) sees besides the cache's slots. ``sinks_H``:
  float32 sink logits ``[Hq]`` (gpt-oss) or None, applied once to the attention combined over
  the devices and merged with the new token (per shard, each device's partial lse would give
  the sink a share of every shard's mass). Returns ``[B, T, Hq, D]`` in q's dtype, replicated
  over the slot axes."""
  hq, hkv = q_BTHD.shape[2], k_BKCD.shape[-3]
  q_spec = P(DATA, None, layout.heads_axis, None)

  def attend(q_bThD, k_bkCD, v_bk, q_pos_bT, k_pos_bC, *extra):
    b, t, h, d = q_bThD.shape
    k_heads = k_bkCD.shape[-3]
    q = q_bThD.reshape(b, t, k_heads, h // k_heads, d).transpose(0, 2, 3, 1, 4)
    if use_kernel(q.shape, k_bkCD.shape[-4:]):
      o, lse = decode_hopper.decode_attention(q, k_bkCD, v_bk, q_pos_bT, k_pos_bC,
                                              scale=scale, window=window, layer=layer,
                                              v_layout=v_layout,
                                              interpret=on is None or not on.on_gpu)
    else:
      if layer is not None:
        k_bkCD, v_bk = k_bkCD[layer], v_bk[layer]
      o, lse = partial_attention(q, k_bkCD, v_bk, q_pos_bT, k_pos_bC, scale=scale,
                                 window=window, fused=fused, v_layout=v_layout)
    out, lse = combine(o, lse, layout.slot_axes)  # [b, k, g, t, d]
    if new_kv:
      out, lse = _with_new_token(out, lse, q, *(x[:, 0] for x in extra[:2]), scale)
    if sinks_H is not None:
      out = _with_sinks(out, lse, extra[-1].reshape(k_heads, h // k_heads))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q_bThD.dtype)

  if hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}).")
  new_kv = () if new_kv is None else tuple(new_kv)
  sinks = () if sinks_H is None else (sinks_H.astype(jnp.float32),)
  kv_specs = ((layout.kv_spec(), layout.kv_spec(values=True)) if layer is None else
              (layout.stack_spec(), layout.stack_spec(values=True)))
  on = target.of_mesh(layout.mesh)
  v_layout = layout.v_layout
  fused = q_BTHD.shape[1] == 1 and on is not None and on.on_gpu
  use_kernel = lambda q_shape, k_shape: q_BTHD.shape[1] == 1 and decode_kernel_chosen(
      layout.decode_backend, on, q_shape, k_shape, q_BTHD.dtype, v_layout=v_layout)
  return jax.shard_map(attend, mesh=layout.mesh,
                       in_specs=(q_spec, *kv_specs, P(DATA),
                                 layout.positions_spec(), *(q_spec,) * len(new_kv),
                                 *(P(layout.heads_axis),) * len(sinks)),
                       out_specs=q_spec, check_vma=False)(
                           q_BTHD, k_BKCD, v_BK, q_pos_BT, k_pos_BC, *new_kv, *sinks)
