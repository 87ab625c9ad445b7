"""Which accelerator a computation is built for, read from the devices it will run on.

A program compiled for GPUs from a CPU-only machine (``ulysses_jax.aot``) runs in a process
whose default backend is the CPU, so every platform decision (the ``"auto"`` attention
backend, the kernels' interpret mode, the tile table's GPU generation, cuDNN and Mosaic
checks) must come from the devices of the mesh or arrays in use, never from
``jax.default_backend()``. ``current`` looks, in order, at: an explicit mesh; the mesh of the
enclosing ``shard_map`` or ``jax.set_mesh`` (its abstract device: platform and device kind);
the arrays' devices (concrete arrays) or their shardings' abstract mesh (traced ones); and only
when none of these says anything, the process's first device (JAX's default, what a direct
call on unsharded arrays runs on).

An abstract device carries no compute capability, so the capability of every concrete device
seen here is remembered by device kind (``Target.compute_capability`` is None for a kind never
seen: the generation is then ``"other"``, whose tiles compile on every GPU).
"""

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

_CAPABILITIES: dict[str, float] = {}  # device kind -> compute capability, of devices seen
_CORE_COUNTS: dict[str, int] = {}  # device kind -> SMs (GPUs), of devices seen


@dataclasses.dataclass(frozen=True)
class Target:
  """The platform (``"gpu"``, ``"cpu"``, ``"tpu"``; an abstract device made for lowering may
  say ``"cuda"``), device kind (e.g. ``"NVIDIA H100 80GB HBM3"``) and, for GPUs, compute
  capability (9.0 for Hopper) and SM count (``core_count``: 132 for an H100 SXM); None if
  unknown."""
  platform: str
  device_kind: str
  compute_capability: float | None = None
  core_count: int | None = None

  @property
  def on_gpu(self) -> bool:
    return self.platform in ("gpu", "cuda", "rocm")

  @property
  def generation(self) -> str:
    """The flash kernels' tile table: ``"sm90"`` (Hopper and newer) or ``"other"``."""
    hopper = self.on_gpu and (self.compute_capability or 0.0) >= 9.0
    return "sm90" if hopper else "other"


def of_device(device: jax.Device) -> Target:
  """The target of one concrete device (compile-only devices included)."""
  capability = getattr(device, "compute_capability", None)
  if capability is not None:
    _CAPABILITIES[device.device_kind] = float(capability)
  cores = getattr(device, "core_count", None) if device.platform != "cpu" else None
  if cores is not None:
    _CORE_COUNTS[device.device_kind] = int(cores)
  return Target(device.platform, device.device_kind,
                None if capability is None else float(capability),
                None if cores is None else int(cores))


def of_mesh(mesh) -> Target | None:
  """The target of a ``Mesh`` (its first device) or ``AbstractMesh`` (its abstract device);
  None for an abstract mesh without one."""
  if isinstance(mesh, Mesh):
    return of_device(mesh.devices.flat[0])
  device = getattr(mesh, "abstract_device", None)
  if device is None:
    return None
  return Target(device.platform, device.device_kind, _CAPABILITIES.get(device.device_kind),
                _CORE_COUNTS.get(device.device_kind))


def current(mesh=None, arrays: Sequence = ()) -> Target:
  """The target of ``mesh`` if given, else of the enclosing mesh context, else of the concrete
  ``arrays``' devices, else of JAX's first device (see the module docstring)."""
  if mesh is not None:
    found = of_mesh(mesh)
    if found is not None:
      return found
  found = of_mesh(jax.sharding.get_abstract_mesh())
  if found is not None:
    return found
  for x in arrays:
    found = _of_array(x)
    if found is not None:
      return found
  return of_device(jax.devices()[0])


def _of_array(x) -> Target | None:
  """A concrete array's devices, or a traced one's abstract mesh (under ``jit``, the mesh of
  its input sharding); None when neither says."""
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
    return of_mesh(getattr(sharding, "mesh", None))
  if isinstance(x, jax.Array):
    return of_device(next(iter(x.sharding.device_set)))
  return None
