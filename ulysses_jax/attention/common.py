"""What every sequence-parallel attention shares: input validation, sequence padding, constants.

The leaf of ``attention/``: it imports nothing from the rest of the package, so plain Ulysses
(``ulysses.py``), ring attention (``ring.py``), their hybrid (``hybrid.py``) and the baselines
all build on it without importing each other.
"""

import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from ulysses_jax.config_checks import ConfigError
from ulysses_jax.kernels.variants import check_sinks
from ulysses_jax.mesh import DATA, SEQ

# Segment ids are any int32 values above ``MIN_SEGMENT_ID`` (negative ones included): the
# lowest int32 values are reserved for padding, so padding never mixes with real tokens.
# ``PAD_SEGMENT`` marks sequence padding (pad queries see only pad keys, so they stay finite);
# chunked attention pads its blocks with the two ids below it.
PAD_SEGMENT = int(np.iinfo(np.int32).min) + 2
MIN_SEGMENT_ID = PAD_SEGMENT + 1

# Sequence order of a ring's inputs (``ring.py``): "zigzag" balances the causal mask over the
# ring, "natural" is converted to it inside. Without a ring both orders coincide.
Layout = Literal["natural", "zigzag"]
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)


def check_head_chunks(head_chunks: int, num_kv_heads: int, name: str = "head_chunks") -> None:
  """Raises ``ConfigError`` unless ``head_chunks`` divides ``num_kv_heads``: attention run
  over chunks of heads (``UlyssesAttention``'s ``head_chunks``, ``LlamaConfig``'s and the
  planner's ``attn_head_chunks``) keeps each query group whole in one chunk."""
  if head_chunks < 1 or num_kv_heads % head_chunks:
    divisors = [k for k in range(1, num_kv_heads + 1) if num_kv_heads % k == 0]
    raise ConfigError(f"{name} ({head_chunks}) must divide num_kv_heads ({num_kv_heads}) so "
                      f"that each chunk holds whole query groups; use one of {divisors} (1: "
                      "the unchunked layer).")


def validate_inputs(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh,
                    segment_ids: jax.Array | None, scale: float | None,
                    layout: str = "natural", sinks: jax.Array | None = None) -> None:
  """Raises a ValueError naming expected vs actual values before any work is done."""
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
                     "with ulysses_jax.make_mesh(data=..., seq=...).")
  missing = [a for a in (DATA, SEQ) if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}; build the mesh with "
                     "ulysses_jax.make_mesh(data=..., seq=...).")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape "
                       f"{tuple(x.shape)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {x.dtype}.")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                     f"{tuple(v.shape)}.")
  b, s, hq, d = q.shape
  if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
    raise ValueError(f"k/v [batch, seq, _, head_dim] must match q's ({b}, {s}, _, {d}), got "
                     f"{tuple(k.shape)}.")
  hkv = k.shape[2]
  if hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}): each "
                     "key/value head serves Hq/Hkv query heads.")
  data = mesh.shape[DATA]
  if b % data:
    raise ValueError(f"batch ({b}) must be divisible by the mesh's data axis ({data}); change "
                     "the batch size or build the mesh with a data size that divides it.")
  if segment_ids is not None:
    if tuple(segment_ids.shape) != (b, s):
      raise ValueError(f"segment_ids must have shape [batch, seq] = ({b}, {s}), got "
                       f"{tuple(segment_ids.shape)}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}.")
    try:
      values = np.asarray(segment_ids)
    except jax.errors.TracerArrayConversionError:
      values = None  # traced under jit: the values are not known yet
    lowest = int(values.min()) if values is not None and values.size else MIN_SEGMENT_ID
    if lowest < MIN_SEGMENT_ID:
      raise ValueError(f"segment_ids must be >= {MIN_SEGMENT_ID} (lower int32 values mark "
                       f"padding), got {lowest}; renumber the segments, e.g. from 0.")
  if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
    raise ValueError(f"scale must be a positive number or None (1/sqrt(head_dim)), got {scale!r}.")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
  check_sinks(sinks, hq, "attention")


def pad_sequence(seq_multiple: int, q: jax.Array, k: jax.Array, v: jax.Array,
                 segment_ids: jax.Array | None, *, causal: bool):
  """Pads the sequence axis (1) to a multiple of ``seq_multiple``; returns q, k, v, segment_ids.

  With a causal mask the padding (at the end) is invisible to real queries already; otherwise
  segment ids are created or extended with ``PAD_SEGMENT`` to mask it. ``segment_ids`` comes
  back ``[B, S']`` int32, or None when it was None and the mask is causal.
  """
  s = q.shape[1]
  pad = -s % seq_multiple
  if not pad:
    return q, k, v, segment_ids
  q, k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
  if segment_ids is None and not causal:
    segment_ids = jnp.zeros(q.shape[:1] + (s,), jnp.int32)
  if segment_ids is not None:
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, pad)],
                          constant_values=PAD_SEGMENT)
  return q, k, v, segment_ids


def fori_loop(lower, upper, body, init):
  """``lax.fori_loop(lower, upper, body, init)`` that always lowers to a while loop.

  A fori_loop with static bounds becomes a scan, and when an attention's custom_vjp forward
  runs inside a differentiated ``lax.scan`` (a model's layer stack) JAX partial-evaluates that
  scan although the custom_vjp never differentiates it, and keeps every step's carry as a
  residual: every tile of the chunked attention (O(S^2) memory), every K/V block of a ring
  (memory growing with the ring: 1.2 GiB per step for Llama-3.1-70B at 595K tokens per GPU).
  A while loop has no residuals to keep, and its bounds may be traced (the visible blocks).
  """
  def cond(carry):
    return carry[0] < upper

  def step(carry):
    i, value = carry
    return i + 1, body(i, value)

  return lax.while_loop(cond, step, (jnp.asarray(lower, jnp.int32), init))[1]
