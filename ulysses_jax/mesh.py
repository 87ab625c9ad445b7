"""The device mesh: axis names and construction.

A mesh in ulysses_jax has the axes ``("data", "seq")``, or ``("data", "ring", "seq")`` for
the hybrid of Ulysses and ring attention (USP, arXiv 2405.07719). Batches are sharded over
``data``; sequences over ``seq`` (and ``ring``, which is the major part of the sequence
split: ``P(DATA, sequence_axes(mesh))``); parameters over every axis (FSDP). ``seq`` is the
innermost axis, so its all-to-alls stay on the fast links between neighbouring devices (one
node); ``ring`` spans nodes and carries only the ring's point-to-point K/V traffic.

All meshes are built with ``AxisType.Auto`` axes: under Auto, ``jit`` and ``shard_map``
reshard their inputs to the requested layout, so callers may pass sharded or unsharded
arrays alike. (JAX >= 0.10 defaults ``jax.make_mesh`` to Explicit axes, under which
shard_map no longer reshards; we never use Explicit meshes.)
"""

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

DATA = "data"
SEQ = "seq"
RING = "ring"
AXES = (DATA, SEQ)
RING_AXES = (DATA, RING, SEQ)


def make_mesh(data: int = -1, seq: int = 1, ring: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a ``("data", "seq")`` mesh, or ``("data", "ring", "seq")`` when ``ring > 1``.

  ``data=-1`` takes the devices that ``seq`` (times ``ring``) leaves over. The product of the
  sizes must equal the number of devices (default: all devices). With ``ring=1`` the mesh
  has no ``ring`` axis at all, so plain Ulysses code is unaffected.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if seq < 1:
    raise ValueError(f"seq must be >= 1, got {seq}.")
  if ring < 1:
    raise ValueError(f"ring must be >= 1, got {ring}.")
  sequence = seq * ring
  what = f"seq={seq}" if ring == 1 else f"seq={seq} x ring={ring}"
  if data == -1:
    if n % sequence:
      raise ValueError(
          f"{what} does not divide the {n} available devices; pick seq"
          f"{'' if ring == 1 else ' x ring'} from the divisors of {n}.")
    data = n // sequence
  if data < 1:
    raise ValueError(f"data must be >= 1 or -1 (all remaining devices), got {data}.")
  if data * sequence != n:
    raise ValueError(
        f"mesh data={data} x {what} needs {data * sequence} devices but {n} are available; "
        f"use data=-1 to take the rest, or pass devices= with {data * sequence} devices.")
  if ring == 1:
    return jax.make_mesh((data, seq), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)
  return jax.make_mesh((data, ring, seq), RING_AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=devices)


def sequence_axes(mesh: Mesh) -> tuple[str, ...]:
  """Mesh axes the sequence is sharded over, major first: ``("ring", "seq")`` or ``("seq",)``."""
  return (RING, SEQ) if RING in mesh.axis_names else (SEQ,)


def sequence_shards(mesh: Mesh) -> int:
  """How many shards the sequence is cut into: seq x ring."""
  return math.prod(mesh.shape[a] for a in sequence_axes(mesh))


def ring_size(mesh: Mesh) -> int:
  """Size of the mesh's ``ring`` axis; 1 when it has none."""
  return mesh.shape[RING] if RING in mesh.axis_names else 1
