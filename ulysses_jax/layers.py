"""Building blocks shared by ``UlyssesAttention`` and the models: ``Dense``, ``RMSNorm``.

Parameters are stored in ``param_dtype`` (float32) with ``logical_axes`` metadata (see
``ulysses_jax.sharding``) and cast to the compute ``dtype`` at use.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ulysses_jax import sharding


class Dense(nnx.Module):
  """``y = x @ kernel (+ bias)``, contracting the last ``len(in_shape)`` dims of x.

  kernel: ``in_shape + out_shape``, normal(0, ``init_std``), logical axes ``axes``;
  bias (optional): ``out_shape``, zeros. At use the kernel is cast to ``dtype`` and
  all-gathered from its FSDP shards (``sharding.gather``).
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
               axes: Sequence[str], mesh: Mesh, use_bias: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, init_std: float = 0.02, rngs: nnx.Rngs):
    in_shape, out_shape, axes = tuple(in_shape), tuple(out_shape), tuple(axes)
    if len(axes) != len(in_shape) + len(out_shape):
      raise ValueError(f"axes {axes} must name all {len(in_shape) + len(out_shape)} kernel "
                       "dimensions.")
    shape = in_shape + out_shape
    self.kernel = nnx.Param(init_std * jax.random.normal(rngs.params(), shape, param_dtype),
                            logical_axes=axes)
    self.bias = (nnx.Param(jnp.zeros(out_shape, param_dtype), logical_axes=axes[len(in_shape):])
                 if use_bias else None)
    self.num_in = len(in_shape)
    self.mesh = mesh
    self.dtype = jnp.dtype(dtype)

  def compute_kernel(self) -> jax.Array:
    """The kernel in the compute dtype, replicated (one all-gather)."""
    return sharding.gather(self.kernel[...].astype(self.dtype), self.mesh)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., *in_shape]`` -> ``[..., *out_shape]`` in the compute dtype."""
    y = jnp.tensordot(x.astype(self.dtype), self.compute_kernel(), axes=self.num_in)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale`` over the last axis, computed in float32; scale ``[dim]`` = 1."""

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
    self.eps = eps
    self.dtype = jnp.dtype(dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)
