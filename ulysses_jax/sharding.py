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

Parameters carry their names in Flax's own partitioning metadata, ``out_sharding`` (what
``nnx.with_partitioning`` sets and ``nnx.get_partition_spec`` reads): our layers
(``ulysses_jax.layers``) set it to logical names, a Flax layer to whatever its
``nnx.with_partitioning`` says. ``init_sharded`` places every parameter by it: logical names
through the rules, mesh-axis names (``"data"``, ``("data", "seq")``, ...) as they are;
parameters without it are replicated.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax.mesh import DATA, RING, RING_AXES, SEQ, sequence_axes, sequence_shards

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
    ("experts", None),
    ("expert_mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)


def _present(mesh_axes, mesh: Mesh | None):
  """``mesh_axes`` (a name, tuple or None) less the axes ``mesh`` lacks, as a spec entry."""
  if mesh_axes is None:
    return None
  names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
  kept = tuple(a for a in names if mesh is None or a in mesh.axis_names)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def _spec_entry(entry, table: dict, mesh: Mesh | None):
  """One dimension's names (None, a name, or a tuple of names) -> its mesh axes: logical names
  through ``table``, mesh-axis names as they are, axes ``mesh`` lacks left out."""
  if entry is None:
    return None
  mesh_axes = set(RING_AXES) | set(() if mesh is None else mesh.axis_names)
  axes = []
  for name in entry if isinstance(entry, tuple) else (entry,):
    if name in table:
      mapped = table[name]
      axes += [] if mapped is None else [mapped] if isinstance(mapped, str) else list(mapped)
    elif name in mesh_axes:
      axes.append(name)
    else:
      raise ValueError(f"logical axes [{name!r}] are not in the sharding rules nor mesh axes; "
                       f"known names: {sorted(table)}, mesh axes {sorted(mesh_axes)}. Add them "
                       "to the rules table.")
  return _present(axes or None, mesh)


def logical_to_spec(axes, rules: Rules = DEFAULT_RULES, mesh: Mesh | None = None) -> P:
  """Maps one name per dimension to a PartitionSpec: logical names via ``rules``, mesh-axis
  names (``"data"``, ``("data", "seq")``) as they are, None = replicated; with ``mesh``,
  mesh axes it lacks (e.g. ``ring``) are left out."""
  table = dict(rules)
  return P(*(_spec_entry(a, table, mesh) for a in axes))


def _num_shards(axes: str | tuple[str, ...], mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def check_divisible(name: str, shape, spec: P, mesh: Mesh):
  """Raises unless each dimension of ``shape`` divides into its shards under ``spec``."""
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

  A Variable with Flax's ``out_sharding`` metadata (one name per leading dimension; see the
  module docstring) gets that spec through ``rules`` (its dimensions must be divisible by
  their shard counts); every other Variable and array leaf (step counters, ...) is
  replicated. Works on parameter states, gradients and optax states alike, since optax
  moments keep the parameters' Variables and metadata. Returns the same tree with each
  Variable's value (or leaf) replaced by its NamedSharding.
  """
  def one(path, x):
    if isinstance(x, nnx.Variable):
      names = x.get_metadata().get("out_sharding")
      if not names:
        return x.replace(NamedSharding(mesh, P()))
      if len(names) > len(x.shape):
        raise ValueError(f"{jax.tree_util.keystr(path)}: out_sharding {tuple(names)} names "
                         f"more dimensions than its shape {tuple(x.shape)} has.")
      spec = logical_to_spec(names, rules, mesh)
      check_divisible(jax.tree_util.keystr(path), x.shape, spec, mesh)
      return x.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(one, tree,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def in_memory(mesh: Mesh, spec: P, memory_kind: str) -> NamedSharding:
  """``NamedSharding(mesh, spec)`` in ``memory_kind`` ("device" or "pinned_host").

  Devices that expose no memory spaces (the compile-only GPUs of ``ulysses_jax.aot``) drop a
  memory kind when the sharding is built on them; the same sharding on ``mesh``'s abstract
  mesh keeps it, and jit arguments, results and in-program copies then land where they would
  on the real devices (host arguments, host-to-device copies, host outputs).
  """
  placed = NamedSharding(mesh, spec, memory_kind=memory_kind)
  if placed.memory_kind == memory_kind or isinstance(mesh, jax.sharding.AbstractMesh):
    return placed
  return NamedSharding(mesh.abstract_mesh, spec, memory_kind=memory_kind)


def layer_slice(shardings, memory_kind: str = "device"):
  """Shardings of one layer of stacked ``[L, ...]`` arrays (the leading axis dropped), in
  ``memory_kind`` ("device" or "pinned_host")."""
  return jax.tree.map(lambda s: in_memory(s.mesh, P(*s.spec[1:]), memory_kind), shardings)


def on_host(shardings):
  """The same shardings in ``pinned_host`` memory."""
  return jax.tree.map(lambda s: in_memory(s.mesh, s.spec, "pinned_host"), shardings)


def on_device(shardings):
  """The same shardings in device memory, explicitly (a copy there from the host)."""
  return jax.tree.map(lambda s: in_memory(s.mesh, s.spec, "device"), shardings)


def _abstract(make: Callable[[], Any], mesh: Mesh, rules: Rules):
  """``make()``'s graphdef and the shardings of its state (traced: no memory used)."""
  with nnx.use_eager_sharding(False):
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  return graphdef, tree_shardings(abstract_state, mesh, rules)


def init_sharded(make: Callable[[], Any], mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """Builds ``make()`` with every parameter created directly in its sharded layout.

  The one call for any NNX model, ours or your own mixing our layers with Flax's: each
  variable is placed by its ``out_sharding`` metadata (``tree_shardings``): FSDP for ours,
  as ``nnx.with_partitioning`` says for Flax's, replicated without it. ``make`` returns a
  module, or a tuple of them such as ``(model, nnx.Optimizer(model, tx, wrt=nnx.Param))``:
  then the optimizer state is placed too (moments like their parameters, step counters
  replicated on ``mesh``), so the first step changes no sharding and nothing compiles twice.

  Shapes come from ``nnx.eval_shape`` (no memory); the real initialisation runs under ``jit``
  with ``out_shardings``, so no device ever holds a full copy. Flax's eager sharding is off
  while ``make`` runs (its variables record ``eager_sharding=False``), so no mesh context is
  needed. ``make`` must create its own ``nnx.Rngs`` (from a seed): random values do not
  depend on the sharding.
  """
  graphdef, shardings = _abstract(make, mesh, rules)
  with nnx.use_eager_sharding(False):
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def put_sharded(make: Callable[[], nnx.Module], state, mesh: Mesh,
                rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """``make()``'s structure (built abstractly) holding ``state``, placed sharded on ``mesh``.

  Copies existing parameters (e.g. restored, or from a model on another mesh) to a new mesh
  or layout; ``state`` stays valid (a donating train step cannot delete it). ``make`` is
  only traced, never run. The values move, not the variables' metadata: ``state`` may come
  from a layout that names its axes differently (``LlamaConfig.expert_placement``).
  """
  graphdef, placed = _abstract(make, mesh, rules)
  values = jax.device_put(nnx.to_pure_dict(state), nnx.to_pure_dict(placed), may_alias=False)
  nnx.replace_by_pure_dict(placed, values)
  return nnx.merge(graphdef, placed)


def constrain(x, axes: tuple[str | None, ...], mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """``with_sharding_constraint`` of ``x`` to the logical ``axes``.

  A dimension that its mesh axes do not divide (e.g. a sequence of odd length) is left
  unconstrained for XLA to lay out, rather than raising.
  """
  return jax.lax.with_sharding_constraint(x, logical_sharding(x.shape, axes, mesh, rules))


def logical_sharding(shape, axes: tuple[str | None, ...], mesh: Mesh,
                     rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """The sharding ``constrain`` gives an array of ``shape`` with the logical ``axes``."""
  spec = logical_to_spec(axes, rules, mesh)
  return NamedSharding(mesh, P(*(a if a is None or size % _num_shards(a, mesh) == 0
                                 else P.UNCONSTRAINED for size, a in zip(shape, spec))))


def gather(x, dtype, mesh: Mesh, *, axes: tuple[str | None, ...] | None = None,
           rules: Rules = DEFAULT_RULES, gradient_in_shards: bool = False):
  """An FSDP-sharded parameter ``x`` cast to ``dtype`` and all-gathered: replicated on every
  device of ``mesh``. The transpose reduces the gradient back to the parameter's shards.

  With the parameter's logical ``axes`` the cast is pinned to its own shards first. Without,
  XLA may gather the float32 parameter and cast it gathered: it did so with Llama-3.2-1B's
  tied table (cast twice, for the lookup and the head: one float32 gather of 0.98 GiB per
  micro-batch on 8 GPUs, now two bfloat16 ones of the same bytes and 0.48 GiB less peak
  memory), and all-reduced some untied tables' gradients
  (``llama8b_8gpu_8m.gin``'s, the MoE fine-tunes') that pinned are reduce-scattered. The
  layers' kernels are not pinned: they were gathered in bfloat16 already, and pinning them
  moved XLA's schedule (``llama8b_8gpu_8m.gin`` +1.0 GiB per GPU with jax 0.12.0.1;
  ``benchmarks/RESULTS.md``, "Parameters gathered in the compute dtype").

  ``gradient_in_shards`` (with ``axes``): the transpose constrains the gradient to the
  shards alone, for a gradient that arrives reduced to them (the LM head's,
  ``loss.chunked_cross_entropy``'s ``head_sharding``); the transpose of the replicated
  constraint made XLA all-gather it again (0.98 GiB per step, ``llama8b_512k.gin``). Not for
  the embedding table: its lookup's gradient constrained so has XLA move the hidden states'
  gradients to the table's columns, which jax 0.10's partitioner does by replicating them.
  """
  if gradient_in_shards and axes is None:
    raise ValueError("gradient_in_shards needs the parameter's logical axes: pass axes=(...), "
                     "one name per dimension, as the parameter was created with (got axes=None).")
  x = x.astype(dtype)
  if axes is None:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
  shards = logical_sharding(x.shape, axes, mesh, rules)
  x = jax.lax.with_sharding_constraint(x, shards)
  if gradient_in_shards:
    return _replicated_gradient_in_shards(x, shards)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _replicated_gradient_in_shards(x, shards: NamedSharding):
  """``x`` replicated; its gradient constrained to ``shards`` alone (``gather``)."""
  return jax.lax.with_sharding_constraint(x, NamedSharding(shards.mesh, P()))


def _replicated_forward(x, shards):
  return _replicated_gradient_in_shards(x, shards), None


def _replicated_backward(shards, _, gradient):
  return (jax.lax.with_sharding_constraint(gradient, shards),)


_replicated_gradient_in_shards.defvjp(_replicated_forward, _replicated_backward)


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
