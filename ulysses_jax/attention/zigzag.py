"""The zigzag layout of a causal ring (``ulysses_jax.attention.ring``'s module docstring says
why): the sequence cut into 2R equal chunks, device r holding chunks r and 2R-1-r. The
permutation on the data side (``to_zigzag``, ``from_zigzag``), inside the sharded program
(``exchange``), the global positions each device holds (``chunk_positions``), and the lengths
the ring can split (``padded_length``, ``check_layout``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ulysses_jax.attention.common import Layout

# Chunks above this many tokens are whole multiples of it: the local attention's blocks then
# never straddle two chunks.
MAX_BLOCK = 512


def zigzag_order(ring_size: int) -> np.ndarray:
  """Chunk ids in zigzag memory order: ``[0, 2R-1, 1, 2R-2, ...]``; device r holds entries
  2r and 2r+1."""
  return np.stack([np.arange(ring_size), 2 * ring_size - 1 - np.arange(ring_size)], 1).ravel()


def to_zigzag(x: jax.Array, ring_size: int, axis: int = 1) -> jax.Array:
  """Natural -> zigzag order along ``axis``, whose length must be a multiple of 2·ring_size.

  ``ring_size`` is the number of ring positions: ``mesh.shape["ring"]`` for the hybrid
  ``ulysses_attention``, the product of the sequence axes for ``ring_attention``.
  """
  return _permute_chunks(x, zigzag_order(ring_size), axis)


def from_zigzag(x: jax.Array, ring_size: int, axis: int = 1) -> jax.Array:
  """Inverse of ``to_zigzag``."""
  return _permute_chunks(x, np.argsort(zigzag_order(ring_size)), axis)


def _permute_chunks(x, order, axis):
  n = x.shape[axis]
  if n % len(order):
    raise ValueError(f"zigzag layout needs a length divisible by 2*ring_size = {len(order)}, "
                     f"got {n} along axis {axis}; pad the sequence first.")
  chunks = jnp.split(x, len(order), axis=axis)
  return jnp.concatenate([chunks[i] for i in order], axis=axis)


def padded_length(seq_len: int, ring_size: int, inner: int = 1) -> int:
  """Smallest length >= ``seq_len`` the ring can split: 2·ring_size equal chunks of c tokens.

  Each device's two chunks must split over ``inner`` Ulysses shards (2c % inner == 0), and
  chunks above ``MAX_BLOCK`` tokens are whole blocks, so the local attention tiles them
  exactly (no tile straddles two chunks).
  """
  step = inner // math.gcd(2, inner)
  c = -(-seq_len // (2 * ring_size))
  c = -(-c // step) * step
  if c > MAX_BLOCK:
    c = -(-c // math.lcm(step, MAX_BLOCK)) * math.lcm(step, MAX_BLOCK)
  return 2 * ring_size * c


def check_layout(layout: Layout, seq_len: int, ring_size: int, inner: int = 1) -> None:
  """Raises unless the ``"zigzag"`` layout's ``seq_len`` needs no padding.

  ``layout`` is one of ``LAYOUTS`` already (``common.validate_inputs``). With ``ring_size`` 1
  the zigzag order is the natural one, so any length is accepted.
  """
  if layout == "zigzag" and ring_size > 1 and (seq_len % (2 * ring_size)
                                               or (seq_len // ring_size) % inner):
    raise ValueError(
        f"layout='zigzag' needs S divisible by 2*ring ({2 * ring_size}) with each ring "
        f"position's S/ring tokens divisible by seq ({inner}), got S={seq_len}; pad the "
        f"sequence to {padded_length(seq_len, ring_size, inner)} tokens before to_zigzag.")


def chunk_positions(index, ring_size, chunk, zigzag):
  """Global positions ``[2·chunk]`` of the tokens device ``index`` (traced) holds."""
  if zigzag:
    ids = jnp.asarray(zigzag_order(ring_size), jnp.int32)[2 * index + jnp.arange(2)]
  else:
    ids = 2 * index + jnp.arange(2, dtype=jnp.int32)
  return (ids[:, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)).ravel()


def exchange(x_BS, axis_name, ring_size, *, inverse):
  """Natural local halves (chunks 2r, 2r+1) <-> zigzag (chunks r, 2R-1-r), inside shard_map.

  Chunk c sits in natural half c % 2 and moves to zigzag device ``order.index(c) // 2``; one
  ``ppermute`` per half. Even zigzag devices keep chunk parity = half index, odd ones swap.
  """
  device_of = np.argsort(zigzag_order(ring_size)) // 2
  perms = [[(d, int(device_of[2 * d + h])) for d in range(ring_size)] for h in (0, 1)]
  odd = lax.axis_index(axis_name) % 2 == 1
  swap = lambda a, b: (jnp.where(odd, b, a), jnp.where(odd, a, b))
  halves = jnp.split(x_BS, 2, axis=1)
  if inverse:
    halves = swap(*halves)
    perms = [[(j, i) for i, j in perm] for perm in perms]
  moved = [lax.ppermute(half, axis_name, perm) for half, perm in zip(halves, perms)]
  return jnp.concatenate(moved if inverse else swap(*moved), axis=1)
