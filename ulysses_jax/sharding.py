"""Logical axis names -> mesh axes, in one rules table; sharded init; sequence-local chunks.

Model code names the axes of every parameter and constrained activation with *logical*
names (``"embed"``, ``"act_seq"``, ...). ``DEFAULT_RULES`` maps each name to mesh axes:

* activations ``[B, S, ...]`` are sharded ``(data, seq)``: batch over ``data``, sequence over
  ``seq``; everything else in an activation is replicated;
* every parameter is sharded along its ``embed`` dimension over ``data`` and ``seq``
  together: each device holds 1/(data*seq) of every large parameter, and of its gradient and
  Adam moments, which follow the parameter's sharding (ZeRO-3 / FSDP). Layers all-gather
  their weights just in time (``gather``).

Pure FSDP vs FSDP + sequence parallelism vs the hybrid is the mesh shape (``seq``, ``ring``),
not a rule change: rules name every mesh axis, and axes a mesh lacks are dropped.
Parameters carry their logical names as ``nnx.Variable`` metadata ``logical_axes``.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax.mesh import DATA, RING, SEQ, sequence_axes, sequence_shards

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # Activations.
    ("act_batch", DATA),
    ("act_seq", (RING, SEQ)),
    ("act_embed", None),
    ("act_heads", None),
    ("act_head_dim", None),
    ("act_mlp", None),
    ("act_vocab", None),
    # Parameters: FSDP over every device, along the hidden (embed) dimension.
    ("embed", (DATA, RING, SEQ)),
    ("vocab", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)


def _present(mesh_axes, mesh: Mesh | None):
  """``mesh_axes`` (a name, tuple or None) less the axes ``mesh`` lacks, as a spec entry."""
  if mesh_axes is None or mesh is None:
    return mesh_axes
  kept = tuple(a for a in ((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes)
               if a in mesh.axis_names)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def logical_to_spec(axes: tuple[str | None, ...], rules: Rules = DEFAULT_RULES,
                    mesh: Mesh | None = None) -> P:
  """Maps logical axis names (None = replicated) to a PartitionSpec via ``rules``; with
  ``mesh``, mesh axes it lacks (e.g. ``ring``) are left out."""
  table = dict(rules)
  unknown = [a for a in axes if a is not None and a not in table]
  if unknown:
    raise ValueError(f"logical axes {unknown} are not in the sharding rules; known names: "
                     f"{sorted(table)}. Add them to the rules table.")
  return P(*(None if a is None else _present(table[a], mesh) for a in axes))


def _num_shards(axes: str | tuple[str, ...], mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _check_divisible(name, shape, spec, mesh):
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is None:
      continue
    shards = _num_shards(axes, mesh)
    if size % shards:
      raise ValueError(
          f"{name}: dimension {dim} of shape {tuple(shape)} has size {size}, not divisible by "
          f"the {shards} shards of mesh axes {axes}; choose sizes divisible by {shards} or map "
          "that logical axis to fewer mesh axes in the rules.")


def tree_shardings(tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """NamedShardings for a tree of (abstract) arrays and ``nnx.Variable``s.

  A Variable with ``logical_axes`` metadata gets ``rules`` applied (its dimensions must be
  divisible by their shard counts); every other array leaf (step counters, ...) is
  replicated. Works on parameter states, gradients and optax states alike, since optax
  moments keep the parameters' Variables and metadata. Returns the same tree with each
  Variable's value (or leaf) replaced by its NamedSharding.
  """
  def one(path, x):
    if isinstance(x, nnx.Variable):
      axes = x.get_metadata().get("logical_axes")
      if axes is None:
        return x.replace(NamedSharding(mesh, P()))
      if len(axes) != len(x.shape):
        raise ValueError(f"{jax.tree_util.keystr(path)}: logical_axes {axes} do not match "
                         f"shape {tuple(x.shape)}.")
      spec = logical_to_spec(axes, rules, mesh)
      _check_divisible(jax.tree_util.keystr(path), x.shape, spec, mesh)
      return x.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(one, tree,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def layer_slice(shardings, memory_kind: str = "device"):
  """Shardings of one layer of stacked ``[L, ...]`` arrays (the leading axis dropped), in
  ``memory_kind`` ("device" or "pinned_host")."""
  return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*s.spec[1:]), memory_kind=memory_kind),
                      shardings)


def on_host(shardings):
  """The same shardings in ``pinned_host`` memory."""
  return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)


def init_sharded(make: Callable[[], nnx.Module], mesh: Mesh,
                 rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Builds ``make()`` with every parameter created directly in its sharded layout.

  Shapes come from ``nnx.eval_shape`` (no memory); the real initialisation runs under
  ``jit`` with ``out_shardings``, so no device ever holds a full copy. ``make`` must create
  its own ``nnx.Rngs`` (from a seed): random values do not depend on the sharding.
  """
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  shardings = tree_shardings(abstract_state, mesh, rules)
  state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def put_sharded(make: Callable[[], nnx.Module], state, mesh: Mesh,
                rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """``make()``'s structure (built abstractly) holding ``state``, placed sharded on ``mesh``.

  Copies existing parameters (e.g. restored, or from a model on another mesh) to a new mesh
  or layout; ``state`` stays valid (a donating train step cannot delete it). ``make`` is
  only traced, never run.
  """
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  shardings = tree_shardings(abstract_state, mesh, rules)
  return nnx.merge(graphdef, jax.device_put(state, shardings, may_alias=False))


def constrain(x, axes: tuple[str | None, ...], mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """``with_sharding_constraint`` of ``x`` to the logical ``axes``.

  A dimension that its mesh axes do not divide (e.g. a sequence of odd length) is left
  unconstrained for XLA to lay out, rather than raising.
  """
  spec = logical_to_spec(axes, rules, mesh)
  spec = P(*(a if a is None or size % _num_shards(a, mesh) == 0 else P.UNCONSTRAINED
             for size, a in zip(x.shape, spec)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def gather(x, mesh: Mesh):
  """All-gathers a (FSDP-sharded) parameter: replicated on every device of ``mesh``.

  Callers cast to the compute dtype first, so the all-gather moves compute-dtype bytes. The
  transpose reduces the gradient back to the parameter's sharding.
  """
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def batch_spec(mesh: Mesh, seq_len: int) -> P:
  """Spec of ``[B, S]`` input arrays: ``(data, seq)`` (``(data, (ring, seq))`` on a hybrid
  mesh), or ``(data, None)`` if the sequence shards do not divide S (the model pads such
  batches and shards them itself)."""
  if seq_len % sequence_shards(mesh):
    return P(DATA, None)
  return P(DATA, _present(sequence_axes(mesh), mesh))


def to_local_chunks(x_BS, *, mesh: Mesh, chunk: int, pad_value=0):
  """``[B, S, ...]`` sharded ``(data, seq)`` -> ``[N, B, P, c, ...]`` chunks of local tokens.

  P = ``sequence_shards(mesh)`` (seq x ring) must divide S. Each device's local slice of S/P
  tokens is padded to a multiple of ``c = min(chunk, S/P)`` with ``pad_value`` and cut into N
  chunks; chunk
  ``n`` holds tokens ``[n*c, (n+1)*c)`` of every device's slice, so a ``lax.scan`` over N
  works on local data only (no communication). Inverse: ``from_local_chunks``.
  """
  b, s = x_BS.shape[:2]
  p = sequence_shards(mesh)
  if s % p:
    raise ValueError(f"sequence length {s} must be divisible by the sequence shards ({p}); "
                     "pad it first.")
  local = s // p
  c = min(chunk, local)
  rest = x_BS.shape[2:]
  x = x_BS.reshape(b, p, local, *rest)
  pad = -local % c
  if pad:
    x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * len(rest), constant_values=pad_value)
  x = jnp.moveaxis(x.reshape(b, p, (local + pad) // c, c, *rest), 2, 0)
  spec = P(None, DATA, _present(sequence_axes(mesh), mesh), *([None] * (1 + len(rest))))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def from_local_chunks(x_NBPc, seq_len: int, *, mesh: Mesh):
  """Inverse of ``to_local_chunks``: ``[N, B, P, c, ...]`` -> ``[B, seq_len, ...]``."""
  n, b, p, c = x_NBPc.shape[:4]
  rest = x_NBPc.shape[4:]
  x = jnp.moveaxis(x_NBPc, 0, 2).reshape(b, p, n * c, *rest)[:, :, :seq_len // p]
  x = x.reshape(b, seq_len, *rest)
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(DATA, _present(sequence_axes(mesh), mesh), *([None] * len(rest)))))
