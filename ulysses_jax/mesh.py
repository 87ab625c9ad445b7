"""The device mesh: axis names and construction.

Every mesh in ulysses_jax has the axes ``("data", "seq")``. Batches are sharded over
``data``, sequences over ``seq``; parameters are sharded over both (FSDP).

All meshes are built with ``AxisType.Auto`` axes: under Auto, ``jit`` and ``shard_map``
reshard their inputs to the requested layout, so callers may pass sharded or unsharded
arrays alike. (JAX >= 0.10 defaults ``jax.make_mesh`` to Explicit axes, under which
shard_map no longer reshards; we never use Explicit meshes.)
"""

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

DATA = "data"
SEQ = "seq"
AXES = (DATA, SEQ)


def make_mesh(data: int = -1, seq: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a ``("data", "seq")`` mesh over ``devices`` (default: all devices).

  ``data=-1`` takes the devices that ``seq`` leaves over. The product of the two sizes must
  equal the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if seq < 1:
    raise ValueError(f"seq must be >= 1, got {seq}.")
  if data == -1:
    if n % seq:
      raise ValueError(
          f"seq={seq} does not divide the {n} available devices; pick seq from the divisors of {n}.")
    data = n // seq
  if data < 1:
    raise ValueError(f"data must be >= 1 or -1 (all remaining devices), got {data}.")
  if data * seq != n:
    raise ValueError(
        f"mesh data={data} x seq={seq} needs {data * seq} devices but {n} are available; "
        f"use data=-1 to take the rest, or pass devices= with {data * seq} devices.")
  return jax.make_mesh((data, seq), AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices)
