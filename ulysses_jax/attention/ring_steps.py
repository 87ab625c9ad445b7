"""Ring attention's local steps with the flash kernels, and the merge of partial results.

The Triton (``"pallas"``) and Mosaic GPU (``"pallas_mosaic"``) flash kernels know no
positions, so each step of ``ring.attend_shard`` is cut into calls whose masks they have:

* **Causal, zigzag layout** (``flash_step``): at step 0 the device's own block, a plain causal
  attention (both chunks ascend); at step t > 0, from source device s, two fully visible chunk
  tiles, one non-causal call with the tiles as batch rows: (q0, kv0) and (q1, kv0) when s < r
  (the query chunks are rows of q as it lies, kv0 is repeated), (q1, kv0) and (q1, kv1) when
  s > r (the key chunks are rows, q1 repeated; the query chunk q0 sees nothing). A
  ``lax.switch`` picks the case, so each builds only its own rows.
* **Sliding window W <= S/R, natural layout** (``flash_window_step``): shift 0 is the own block
  under the window; of the previous device's block only the last W - 1 keys are seen, by the
  first W - 1 queries, query i the tail keys j >= i: reversing both makes that a plain causal
  attention. Device 0 has no previous block.

``*_grads`` are the same calls' (dq, dk, dv) given the global output and lse, which makes the
sum over steps the exact gradient. ``ring`` is ``ring._Ring`` (axis, size, scale, window,
kernel).
"""

import functools

import jax.numpy as jnp
from jax import lax

from ulysses_jax.kernels.flash_attention import flash_attention, flash_attention_backward


def _step_case(ring, step):
  """Which local attention a causal step is (module docstring): 0 the device's own block
  (causal), 1 a block from an earlier device (both query chunks see its first chunk), 2 from a
  later one (the second query chunk sees both of its chunks)."""
  return jnp.where(step == 0, 0, jnp.where(ring.source_is_earlier(step), 1, 2))


# The rectangular tiles of steps t > 0 as flash calls over equal lengths: the chunks of a
# [B, 2c, ...] block become batch rows ([2B, c, ...], a reshape), and a chunk seen by both
# rows of the other side is repeated. None (no segment ids) passes through.

def _chunks_as_rows(x, axis=1):
  """``[B, 2c, ...]`` -> ``[2B, c, ...]`` (row 2b+i: chunk i of b); lse ``[B, H, 2c]`` with
  ``axis=2`` -> ``[2B, H, c]``."""
  if x is None:
    return None
  if axis == 2:
    b, h, s = x.shape
    return x.reshape(b, h, 2, s // 2).swapaxes(1, 2).reshape(2 * b, h, s // 2)
  return x.reshape(2 * x.shape[0], x.shape[1] // 2, *x.shape[2:])


def _rows_as_chunks(x, axis=1):
  """Inverse of ``_chunks_as_rows``."""
  if axis == 2:
    b, h, c = x.shape
    return x.reshape(b // 2, 2, h, c).swapaxes(1, 2).reshape(b // 2, h, 2 * c)
  return x.reshape(x.shape[0] // 2, 2 * x.shape[1], *x.shape[2:])


def _chunk_twice(x, chunk, axis=1):
  """Local chunk ``chunk`` (0 or 1) of ``[B, 2c, ...]``, each batch row repeated:
  ``[2B, c, ...]``."""
  if x is None:
    return None
  return jnp.repeat(jnp.split(x, 2, axis)[chunk], 2, axis=0)


def _sum_row_pairs(x):
  """``[2B, c, ...]`` -> ``[B, c, ...]``: the two rows of each b added (gradients of a chunk
  that ``_chunk_twice`` repeated)."""
  return x.reshape(x.shape[0] // 2, 2, *x.shape[1:]).sum(1)


def _in_chunk(x, chunk, fill=0.0, axis=1):
  """``[B, c, ...]`` placed as local chunk ``chunk`` of ``[B, 2c, ...]``, ``fill`` elsewhere."""
  parts = [x, jnp.full_like(x, fill)]
  return jnp.concatenate(parts if chunk == 0 else parts[::-1], axis)


def flash_step(ring, q, k, v, q_seg, kv_seg, step):
  flash = functools.partial(flash_attention, scale=ring.scale, return_lse=True,
                            forward_kernel=ring.kernel, backward_kernel=ring.kernel)

  # Each case returns its output in q's dtype, as the kernel writes it: the float32 conversion
  # then fuses into the merge with the accumulator instead of being a float32 copy.
  def whole_block(causal):
    return flash(q, k, v, causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg)

  if not ring.causal:
    return whole_block(False)

  def from_earlier():  # rows (q0, kv0) and (q1, kv0): the output of the whole block
    out, lse = flash(_chunks_as_rows(q), _chunk_twice(k, 0), _chunk_twice(v, 0), causal=False,
                     segment_ids=_chunks_as_rows(q_seg), kv_segment_ids=_chunk_twice(kv_seg, 0))
    return _rows_as_chunks(out), _rows_as_chunks(lse, axis=2)

  def from_later():  # rows (q1, kv0) and (q1, kv1), merged: the second chunk's output only
    out, lse = flash(_chunk_twice(q, 1), _chunks_as_rows(k), _chunks_as_rows(v), causal=False,
                     segment_ids=_chunk_twice(q_seg, 1), kv_segment_ids=_chunks_as_rows(kv_seg))
    out = out.reshape(out.shape[0] // 2, 2, *out.shape[1:])
    lse = lse.reshape(lse.shape[0] // 2, 2, *lse.shape[1:])
    out, lse = merge(out[:, 0], lse[:, 0], out[:, 1], lse[:, 1])
    return _in_chunk(out.astype(q.dtype), 1), _in_chunk(lse, 1, -jnp.inf, axis=2)

  return lax.switch(_step_case(ring, step), [lambda: whole_block(True), from_earlier,
                                             from_later])


# A windowed ring in the natural layout with the flash kernels (module docstring): at shift 1
# the first W - 1 queries and the previous block's last W - 1 keys, both reversed, are a causal
# attention. None (no segment ids) passes through.

def _head(x, n, axis=1):
  return None if x is None else lax.slice_in_dim(x, 0, n, axis=axis)


def _tail(x, n, axis=1):
  return None if x is None else lax.slice_in_dim(x, x.shape[axis] - n, x.shape[axis], axis=axis)


def _reversed(x, axis=1):
  return None if x is None else jnp.flip(x, axis)


def _padded_to(x, length, fill=0.0, at_start=False, axis=1):
  """``x`` padded with ``fill`` along ``axis`` to ``length`` (at its end, or its start)."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (length - x.shape[axis], 0) if at_start else (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=fill)


def _has_previous_block(ring):
  """Device 0 of a natural-layout ring has no previous block (its shift-1 fetch is zeros)."""
  return lax.axis_index(ring.axis_name) > 0


def flash_window_step(ring, q, k, v, q_seg, kv_seg, shift):
  """Partial output and lse of a windowed ring step (``shift`` 0 or 1) with the kernels."""
  flash = functools.partial(flash_attention, scale=ring.scale, return_lse=True,
                            forward_kernel=ring.kernel, backward_kernel=ring.kernel)
  if shift == 0:
    return flash(q, k, v, causal=True, segment_ids=q_seg, kv_segment_ids=kv_seg,
                 sliding_window=ring.window)
  n, s = ring.window - 1, q.shape[1]
  out, lse = flash(_reversed(_head(q, n)), _reversed(_tail(k, n)),
                   _reversed(_tail(v, n)), causal=True, segment_ids=_reversed(_head(q_seg, n)),
                   kv_segment_ids=_reversed(_tail(kv_seg, n)))
  seen = _has_previous_block(ring)
  out = jnp.where(seen, _padded_to(_reversed(out), s), 0).astype(q.dtype)
  lse = jnp.where(seen, _padded_to(_reversed(lse, 2), s, -jnp.inf, axis=2), -jnp.inf)
  return out, lse


def flash_window_step_grads(ring, q, k, v, q_seg, kv_seg, out, lse, d_out, shift):
  """``flash_window_step``'s (dq, dk, dv), given the global out and lse."""
  grads = functools.partial(flash_attention_backward, scale=ring.scale, grad_dtype=q.dtype,
                            kernel=ring.kernel)
  if shift == 0:
    return grads(q, k, v, out, lse, d_out, causal=True, segment_ids=q_seg,
                 kv_segment_ids=kv_seg, sliding_window=ring.window)
  n, s = ring.window - 1, q.shape[1]
  head = lambda x, axis=1: _reversed(_head(x, n, axis), axis)
  dq, dk, dv = grads(head(q), _reversed(_tail(k, n)), _reversed(_tail(v, n)), head(out),
                     head(lse, 2), head(d_out), causal=True, segment_ids=head(q_seg),
                     kv_segment_ids=_reversed(_tail(kv_seg, n)))
  seen = _has_previous_block(ring)
  return (jnp.where(seen, _padded_to(_reversed(dq), s), 0),
          *(jnp.where(seen, _padded_to(_reversed(g), s, at_start=True), 0) for g in (dk, dv)))


def merge(out_BSHD, lse_BHS, part_BSHD, part_lse_BHS):
  """Combines two partial softmax results by their log-sum-exps (float32)."""
  lse = jnp.logaddexp(lse_BHS, part_lse_BHS)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that have seen no key yet
  weight = lambda x: jnp.swapaxes(jnp.exp(x - safe), 1, 2)[..., None]
  return out_BSHD * weight(lse_BHS) + part_BSHD.astype(jnp.float32) * weight(part_lse_BHS), lse


def flash_step_grads(ring, q, k, v, q_seg, kv_seg, out, lse, d_out, step):
  grads = functools.partial(flash_attention_backward, scale=ring.scale, grad_dtype=q.dtype,
                            kernel=ring.kernel)

  def whole_block(causal):
    return grads(q, k, v, out, lse, d_out, causal=causal, segment_ids=q_seg,
                 kv_segment_ids=kv_seg)

  if not ring.causal:
    return whole_block(False)

  def from_earlier():  # flash_step's rows; the keys' second chunk gets no gradient
    dq, dk, dv = grads(_chunks_as_rows(q), _chunk_twice(k, 0), _chunk_twice(v, 0),
                       _chunks_as_rows(out), _chunks_as_rows(lse, axis=2),
                       _chunks_as_rows(d_out), causal=False, segment_ids=_chunks_as_rows(q_seg),
                       kv_segment_ids=_chunk_twice(kv_seg, 0))
    return (_rows_as_chunks(dq), _in_chunk(_sum_row_pairs(dk), 0),
            _in_chunk(_sum_row_pairs(dv), 0))

  def from_later():  # the queries' first chunk gets no gradient
    dq, dk, dv = grads(_chunk_twice(q, 1), _chunks_as_rows(k), _chunks_as_rows(v),
                       _chunk_twice(out, 1), _chunk_twice(lse, 1, axis=2),
                       _chunk_twice(d_out, 1), causal=False, segment_ids=_chunk_twice(q_seg, 1),
                       kv_segment_ids=_chunks_as_rows(kv_seg))
    return _in_chunk(_sum_row_pairs(dq), 1), _rows_as_chunks(dk), _rows_as_chunks(dv)

  return lax.switch(_step_case(ring, step), [lambda: whole_block(True), from_earlier,
                                             from_later])
