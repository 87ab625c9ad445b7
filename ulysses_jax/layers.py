"""Building blocks shared by ``UlyssesAttention`` and the models: ``Dense``, ``RMSNorm``.

Parameters are stored in ``param_dtype`` (float32) and cast to the compute ``dtype`` at use.
Each carries Flax's partitioning metadata (``param``): built eagerly, a layer's parameters
are already in their FSDP layout on ``mesh``; ``sharding.init_sharded`` creates them there
without a full copy on any device.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ulysses_jax import sharding


def param(value: jax.Array, axes: Sequence[str | None], *, mesh: Mesh,
          rules: sharding.Rules = sharding.DEFAULT_RULES) -> nnx.Param:
  """``value`` placed by its logical ``axes`` (one name per dimension), as an ``nnx.Param``.

  The names go into Flax's ``out_sharding`` metadata, as ``nnx.with_partitioning`` puts them
  (``nnx.get_partition_spec`` shows them; ``sharding.tree_shardings`` resolves them). The
  value is placed here, on ``mesh`` by ``rules`` (a sharding constraint under a trace), so
  Flax's own eager sharding is off: it would need a mesh context. The metadata holds no
  mesh, so the parameter moves to other meshes. ``logical_axes`` repeats the names for
  ``optimizer.split_layers``, which reads that key.
  """
  axes = tuple(axes)
  spec = sharding.logical_to_spec(axes, rules, mesh)
  if isinstance(value, jax.core.Tracer):
    value = jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
  else:
    sharding.check_divisible(f"parameter {axes}", value.shape, spec, mesh)
    value = jax.device_put(value, NamedSharding(mesh, spec))
  return nnx.Param(value, out_sharding=axes, eager_sharding=False, logical_axes=axes)


def contract(x: jax.Array, kernel: jax.Array, num_in: int) -> jax.Array:
  """``jnp.tensordot(x, kernel, num_in)``: x ``[..., *in_shape]``, kernel ``[*in_shape,
  *out_shape]`` -> ``[..., *out_shape]``.

  With a single row (decoding one sequence), XLA's GPU compiler turns the dot with a kernel of
  under 10M elements into a multiply that writes a kernel-sized product and a reduce of it:
  three times the kernel's bytes (Llama-3.2-1B: q and o, 8 MiB each a layer). Here a zero
  second row keeps it a GEMM that reads the kernel once.
  """
  lead, feature = x.shape[:x.ndim - num_in], x.shape[x.ndim - num_in:]
  if math.prod(lead) != 1:
    return jnp.tensordot(x, kernel, axes=num_in)
  out_shape, size = kernel.shape[num_in:], math.prod(feature)
  rows = jnp.concatenate([x.reshape(1, size), jnp.zeros((1, size), x.dtype)])
  return (rows @ kernel.reshape(size, -1))[0].reshape(*lead, *out_shape)


class Dense(nnx.Module):
  """``y = x @ kernel (+ bias)``, contracting the last ``len(in_shape)`` dims of x.

  kernel: ``in_shape + out_shape``, normal(0, ``init_std``), logical axes ``axes`` (FSDP
  over the ``embed`` one by ``rules``); bias (optional): ``out_shape``, zeros. At use the
  kernel is cast to ``dtype`` and all-gathered from its FSDP shards (``sharding.gather``).
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *,
               axes: Sequence[str], mesh: Mesh, use_bias: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, init_std: float = 0.02,
               rules: sharding.Rules = sharding.DEFAULT_RULES, rngs: nnx.Rngs):
    in_shape, out_shape, axes = tuple(in_shape), tuple(out_shape), tuple(axes)
    if len(axes) != len(in_shape) + len(out_shape):
      raise ValueError(f"axes {axes} must name all {len(in_shape) + len(out_shape)} kernel "
                       "dimensions.")
    shape = in_shape + out_shape
    place = dict(mesh=mesh, rules=rules)
    self.kernel = param(init_std * jax.random.normal(rngs.params(), shape, param_dtype), axes,
                        **place)
    self.bias = (param(jnp.zeros(out_shape, param_dtype), axes[len(in_shape):], **place)
                 if use_bias else None)
    self.num_in = len(in_shape)
    self.mesh = mesh
    self.dtype = jnp.dtype(dtype)

  def compute_kernel(self) -> jax.Array:
    """The kernel in the compute dtype, replicated (one all-gather)."""
    return sharding.gather(self.kernel[...], self.dtype, self.mesh)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., *in_shape]`` -> ``[..., *out_shape]`` in the compute dtype."""
    y = contract(x.astype(self.dtype), self.compute_kernel(), self.num_in)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale`` over the last axis, computed in float32; scale ``[dim]`` = 1,
  logical axis ``norm`` (replicated by the default rules). With ``offset_one`` (Gemma) the
  factor is ``1 + scale`` and scale starts at 0."""

  def __init__(self, dim: int, *, mesh: Mesh, eps: float = 1e-6, offset_one: bool = False,
               dtype=jnp.float32, param_dtype=jnp.float32,
               rules: sharding.Rules = sharding.DEFAULT_RULES):
    init = jnp.zeros if offset_one else jnp.ones
    self.scale = param(init((dim,), param_dtype), ("norm",), mesh=mesh, rules=rules)
    self.eps = eps
    self.offset_one = offset_one
    self.dtype = jnp.dtype(dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * (self.offset_one + self.scale[...].astype(jnp.float32))).astype(self.dtype)
