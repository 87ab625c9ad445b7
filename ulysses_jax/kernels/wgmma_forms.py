"""The register-level forms of the Mosaic (Hopper) attention kernels (``flash_hopper``,
``flash_hopper_backward``, ``decode_hopper``): wgmma matmuls from shared-memory tiles and
registers, the accumulator layout of their results, and the plain stand-ins that GPU interpret
mode runs where it cannot run a form as built for hardware (``interpreter_runs``)."""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ulysses_jax.kernels import hopper_interpret
from ulysses_jax.kernels.flash_kernels import dot

# 128-byte swizzle over tiles of 64 16-bit elements: a layout wgmma reads without bank conflicts.
SMEM_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def smem_tile(shape, dtype):
  """A shared-memory buffer; 2-D (or stacked 2-D) 16-bit tiles get wgmma's swizzled layout."""
  swizzled = len(shape) >= 2 and jnp.dtype(dtype).itemsize == 2
  return plgpu.SMEM(shape, dtype, transforms=SMEM_TRANSFORMS if swizzled else ())


@functools.cache
def interpreter_runs(form):
  """Whether the installed JAX's GPU interpret mode runs ``form`` (``"layout_cast"``,
  ``"a_times_bt"``, ``"plus_a_times_b"``, ``"at_times_b"`` or ``"plus_a_times_bt"``) as built
  for hardware, with the right result."""
  compute, expected = {
      "layout_cast": (lambda a, b: plgpu.layout_cast(a[...].astype(jnp.float32),
                                                     plgpu.Layout.WGMMA), lambda a, b: a),
      "a_times_bt": (lambda a, b: a_times_bt(a, b, interpret=False), lambda a, b: a @ b.T),
      "plus_a_times_b": (
          lambda a, b: plus_a_times_b(jnp.ones((64, 64), jnp.float32), a[...], b,
                                      interpret=False), lambda a, b: 1 + a @ b),
      "at_times_b": (lambda a, b: at_times_b(a, b, interpret=False), lambda a, b: a.T @ b),
      "plus_a_times_bt": (
          lambda a, b: a_times_bt(a, b, interpret=False, acc=jnp.ones((64, 64), jnp.float32)),
          lambda a, b: 1 + a @ b.T),
  }[form]
  return hopper_interpret.runs_correctly(compute, expected, smem_tile)


def stand_in(form, interpret):
  """Whether ``form`` runs as its stand-in: in interpret mode, if the interpreter cannot run it."""
  return interpret and not interpreter_runs(form)


def stand_in_reads(interpret, *forms):
  """Whether one of the matmul ``forms`` reads its shared-memory operands through the generic
  proxy: only their stand-ins do (wgmma reads through the async proxy)."""
  return any(stand_in(form, interpret) for form in forms)


class TileLayout:
  """Register values of a ``[rows, cols]`` tile in wgmma's accumulator layout (or, where GPU
  interpret mode cannot cast layouts, plain arrays)."""

  def __init__(self, shape, *, interpret):
    self.shape, self.plain = shape, stand_in("layout_cast", interpret)

  def cast(self, x, layout):
    return x if self.plain else plgpu.layout_cast(x, layout)

  def zeros(self, shape=None):
    return self.cast(jnp.zeros(shape or self.shape, jnp.float32), plgpu.Layout.WGMMA)

  def iota(self, dim):
    return self.cast(lax.broadcasted_iota(jnp.int32, self.shape, dim), plgpu.Layout.WGMMA)

  def per_row(self, vector):
    """A ``[rows]`` vector in the tile's row layout, broadcast along the columns."""
    return lax.broadcast_in_dim(vector, self.shape, [0])

  def rows_of(self, vector_ref):
    """A ``[rows]`` shared-memory vector, one value per row of the tile."""
    return self.per_row(self.cast(vector_ref[...], plgpu.Layout.WGMMA.reduce(1)))

  def cols_of(self, vector_ref):
    """A ``[cols]`` shared-memory vector, one value per column of the tile."""
    vector = self.cast(vector_ref[...], plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(vector, self.shape, [1])


# Where GPU interpret mode cannot run a wgmma form (JAX 0.10: the transposed B operand; all
# versions so far: the register A operand with an initialised accumulator), it is a plain dot of
# the same shared-memory tiles; everything around it (TMA, barriers, masks, softmax) is shared.


def a_times_bt(a_smem, b_smem, *, interpret, acc=None, while_running=None):
  """``a @ b.T`` float32 from two shared-memory tiles ``[m, k]`` and ``[n, k]``, or ``acc + a @
  b.T``: wgmma accumulates into ``acc`` (float32, accumulator layout) in place, so a term added
  to the product holds no registers of its own while the product is live. Runs
  ``while_running()`` after issuing the (asynchronous) wgmma, before reading its result."""
  if stand_in("a_times_bt" if acc is None else "plus_a_times_bt", interpret):
    product = dot(a_smem[...], b_smem[...], 1, 1)
    if while_running is not None:
      while_running()
    return product if acc is None else acc + product

  def product(acc_ref):
    if acc is not None:
      acc_ref[...] = acc
    plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
    if while_running is not None:
      while_running()
    return acc_ref[...]
  return pl.run_scoped(product, plgpu.ACC((a_smem.shape[0], b_smem.shape[0]), jnp.float32))


def at_times_b(a_smem, b_smem, *, interpret):
  """``a.T @ b`` float32 from two shared-memory tiles ``[k, m]`` and ``[k, n]``: wgmma reads
  ``a`` transposed (16-bit operands)."""
  if stand_in("at_times_b", interpret):
    return dot(a_smem[...], b_smem[...], 0, 0)

  def product(acc_ref):
    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem)
    return acc_ref[...]
  return pl.run_scoped(product, plgpu.ACC((a_smem.shape[1], b_smem.shape[1]), jnp.float32))


def plus_a_times_b(acc, a, b_smem, *, interpret):
  """``acc + a @ b``: wgmma reads ``a`` ``[m, k]`` from registers, ``b`` ``[k, n]`` from shared
  memory, and accumulates into ``acc`` in place."""
  if stand_in("plus_a_times_b", interpret):
    return acc + dot(a, b_smem[...], 1, 0)

  def accumulate(acc_ref):
    plgpu.wgmma(acc_ref, a, b_smem)
  return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def overlapped(q_smem, k_smem, acc, probs, v_smem, then, *, interpret):
  """FA3's intra-warpgroup overlap: issues ``scores = q @ k.T``, then ``acc + probs @ v``,
  waits for the first only and runs ``then(scores)`` while the second runs on the tensor
  cores; returns ``(acc + probs @ v, then(scores))``. Stand-ins run them one after the other."""
  if stand_in("a_times_bt", interpret) or stand_in("plus_a_times_b", interpret):
    result = then(a_times_bt(q_smem, k_smem, interpret=interpret))
    return plus_a_times_b(acc, probs, v_smem, interpret=interpret), result

  def issue(scores_ref, acc_ref):
    acc_ref[...] = acc
    plgpu.wgmma(scores_ref, q_smem, k_smem.transpose((1, 0)))
    plgpu.wgmma(acc_ref, probs, v_smem)
    # wgmma groups complete in order: one left in flight is the P·V issued second.
    result = then(plgpu.wgmma_accumulator_load(scores_ref, wait_n=1))
    return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0), result
  return pl.run_scoped(issue, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32),
                       plgpu.ACC(acc.shape, jnp.float32))
