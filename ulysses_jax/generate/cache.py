"""The KV cache of generation: where it lives on the mesh, its memory, and how it is written.

Every layer keeps k ``[B, Hkv, C, D]`` and v ``[B, Hkv, D, C]`` in the compute dtype: both of
XLA's decode products then contract the cache's last (minor) axis, which XLA's GPU compiler
reads where it lies (``attention.partial_attention``; with v's slots before D it copied v to
lay it out). Where every decode step runs our decode kernel (``CacheLayout.v_layout``), v is
``[B, Hkv, C, D]`` like k: the kernel's copies then read a block of slots' values as one run of
memory, not D runs of a few hundred bytes each. They are stacked ``[L_kind, B, Hkv, C, D]``
(v: ``[L_kind, B, Hkv, D, C]`` or like k) over the layers of each kind (full, or one window:
the layers that share a capacity, ``CacheLayout.kinds``), and every kind a ``positions``
``[B, C]`` int32 array: the position of the token each slot holds, -1 for an empty slot.
Attention masks by these positions alone (``attention.cache_attention``), so slots need not be
in position order, and each write stays on the device that holds the slot.

Placement (``plan_cache``), R' the devices the slots are split over and U those the KV heads
are split over:

* the KV heads go over ``seq`` when ``seq`` divides Hkv (U = seq); the slots go over ``ring``
  (R' = ring);
* otherwise (``seq`` has more devices than Hkv, or does not divide it) the slots go over
  ``ring`` and ``seq`` (R' = ring x seq, U = 1): each device keeps all heads of 1/R' of the
  slots, the same bytes;
* rows go over ``data``.

Slots, with S the padded prompt length (prefilled in N chunks of T tokens, S = N·T, t = T/R')
and G the slots for generated tokens (a multiple of R'):

* a full-attention layer has C = S + G slots, c = C/R' per device: device r keeps, for each
  chunk n, the chunk's tokens n·T + r·t ... n·T + (r + 1)·t - 1 (local slots n·t ...), then
  the generated tokens of steps r, r + R', r + 2R', ... So the prefill writes each device's own
  tokens in place (no communication), and generated tokens are spread over the devices.
* a sliding-window layer of window W keeps a rolling buffer of C_W = W (W + T - 1 when the
  prompt is prefilled in several chunks) slots, rounded up to a multiple of R': position p
  lives in slot p mod C_W. Where C_W would reach the full layer's C, the layer keeps C slots.

Memory per device of k and v (``CacheLayout.bytes_per_device``, checked against the arrays in
``tests/test_generate.py``)::

    2 · sum over layers of ⌈Hkv/U⌉ · D · bytes · ⌈C_layer/R'⌉ · ⌈B/data⌉

(for a model without windows: 2 · L · ⌈Hkv/U⌉ · D · bytes · ⌈C/R'⌉ · ⌈B/data⌉), plus 4 bytes per
slot and row for each kind's positions.

The write functions run inside ``shard_map`` over the whole mesh; each device touches only the
slots it holds (a decode step writes one slot per row with an out-of-range index, dropped, on
the other devices), so the cache donated to a step is updated in place.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax.attention.ulysses import seq_to_heads
from ulysses_jax.kernels import decode_hopper, target
from ulysses_jax.mesh import DATA, RING, SEQ, sequence_axes

EMPTY = -1  # the position of an empty slot
DECODE_BACKENDS = ("auto", "xla", "mosaic")  # a decode step's attention (generate.attention)


class KVCache(NamedTuple):
  """``k``, ``v``: per kind of layer (``CacheLayout.kinds``) the stack of its layers' keys
  ``[L_kind, B, Hkv, C_kind, D]`` or values (``[L_kind, B, Hkv, D, C_kind]``, or like the keys:
  ``CacheLayout.v_layout``); ``positions``:
  per kind ``[B, C_kind]`` int32."""
  k: tuple
  v: tuple
  positions: tuple


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """The cache's shapes and placement (hashable: a static argument of the jitted steps).

  ``batch`` B (a multiple of the data axis), ``prompt_len`` S = ``chunks`` · ``chunk_len``
  (T), ``gen_slots`` G, ``layer_windows`` (each layer's sliding window or None),
  ``slot_axes`` (mesh axes the slots are split over, major first), ``heads_axis`` (the mesh
  axis the KV heads are split over, or None), ``decode_backend`` (a decode step's attention
  over the cache: ``generate.attention.DECODE_BACKENDS``). See the module docstring.
  """
  mesh: Mesh
  batch: int
  prompt_len: int
  chunk_len: int
  gen_slots: int
  kv_heads: int
  head_dim: int
  dtype: str
  layer_windows: tuple
  slot_axes: tuple
  heads_axis: str | None
  decode_backend: str = "auto"

  @property
  def chunks(self) -> int:
    return self.prompt_len // self.chunk_len

  @property
  def slot_shards(self) -> int:
    """R': the devices the slots are split over."""
    return math.prod(self.mesh.shape[a] for a in self.slot_axes)

  @property
  def head_shards(self) -> int:
    """U: the devices the KV heads are split over."""
    return 1 if self.heads_axis is None else self.mesh.shape[self.heads_axis]

  @property
  def full_capacity(self) -> int:
    return self.prompt_len + self.gen_slots

  def window_capacity(self, window: int) -> int:
    """Slots of a layer with this window: its rolling buffer, or the full layer's C. A
    device holding at least one of the decode kernel's blocks gets a multiple of 8 slots (at
    most 7 more), the counts the kernel takes (``decode_hopper.SLOT_MULTIPLE``)."""
    keep = _round_up(window if self.chunks == 1 else window + self.chunk_len - 1,
                     self.slot_shards)
    if keep // self.slot_shards >= decode_hopper.MIN_BLOCK:
      keep = _round_up(keep, decode_hopper.SLOT_MULTIPLE["CD"] * self.slot_shards)
    return min(keep, self.full_capacity)

  @property
  def kinds(self) -> tuple:
    """The distinct capacities, full first: each kind shares one positions array. A kind is
    None (full) or the window W of a rolling buffer."""
    rolling = sorted({w for w in self.layer_windows if w is not None
                      and self.window_capacity(w) < self.full_capacity})
    return (None, *rolling) if any(self.layer_kind(i) is None
                                   for i in range(len(self.layer_windows))) else tuple(rolling)

  def layer_kind(self, layer: int):
    """The kind of ``layer``: None (full slots, maybe with a window mask) or its window."""
    w = self.layer_windows[layer]
    return None if w is None or self.window_capacity(w) >= self.full_capacity else w

  def stack_index(self, layer: int) -> tuple[int, int]:
    """(the index of ``layer``'s kind in ``kinds``, its index in that kind's stack)."""
    kind = self.layer_kind(layer)
    return self.kinds.index(kind), sum(self.layer_kind(i) == kind for i in range(layer))

  def stack_size(self, kind) -> int:
    return sum(self.layer_kind(i) == kind for i in range(len(self.layer_windows)))

  def capacity(self, kind) -> int:
    return self.full_capacity if kind is None else self.window_capacity(kind)

  @property
  def v_layout(self) -> str:
    """``"CD"``: v ``[B, Hkv, C, D]`` like k, where ``decode_backend`` runs every kind's decode
    step in our kernel (``decode_kernel_chosen``, for query groups the kernel takes: a model
    with more than 64 query heads per KV head decodes with XLA over this layout, slower);
    ``"DC"``: v ``[B, Hkv, D, C]``, slots last, where XLA's decode reads it
    (``decode_hopper.V_LAYOUTS``)."""
    on = target.of_mesh(self.mesh)
    rows = -(-self.batch // self.mesh.shape[DATA])
    heads = -(-self.kv_heads // self.head_shards)
    kernel = all(decode_kernel_chosen(
        self.decode_backend, on, (rows, heads, 1, 1, self.head_dim),
        (rows, heads, self.capacity(kind) // self.slot_shards, self.head_dim), self.dtype,
        v_layout="CD", strict=False) for kind in self.kinds)
    return "CD" if kernel else "DC"

  def slots_last(self, values: bool) -> bool:
    """Whether the slots are the last axis of a layer's k (False) or v (``values``)."""
    return values and self.v_layout == "DC"

  def kv_spec(self, values: bool = False) -> P:
    """Spec of one layer's k ``[B, Hkv, C, D]`` (or, ``values``, v in ``v_layout``)."""
    slots = self.slot_axes or None
    return P(DATA, self.heads_axis,
             *((None, slots) if self.slots_last(values) else (slots, None)))

  def stack_spec(self, values: bool = False) -> P:
    """Spec of a kind's stack of k (or v), with the layers first."""
    return P(None, *self.kv_spec(values))

  def positions_spec(self) -> P:
    return P(DATA, self.slot_axes or None)

  def bytes_per_device(self) -> int:
    """K and V bytes per device: 2 · Σ_layers ⌈Hkv/U⌉ · D · bytes · ⌈C_layer/R'⌉ · ⌈B/data⌉."""
    rows = -(-self.batch // self.mesh.shape[DATA])
    heads = -(-self.kv_heads // self.head_shards)
    per_slot = 2 * heads * self.head_dim * jnp.dtype(self.dtype).itemsize * rows
    return sum(per_slot * -(-self.capacity(self.layer_kind(i)) // self.slot_shards)
               for i in range(len(self.layer_windows)))

  def positions_bytes_per_device(self) -> int:
    rows = -(-self.batch // self.mesh.shape[DATA])
    return sum(4 * rows * self.capacity(kind) // self.slot_shards for kind in self.kinds)

  def shardings(self) -> KVCache:
    stack = lambda values: (NamedSharding(self.mesh, self.stack_spec(values)),) * len(self.kinds)
    return KVCache(stack(False), stack(True),
                   (NamedSharding(self.mesh, self.positions_spec()),) * len(self.kinds))

  def stack_shape(self, kind, values: bool = False) -> tuple[int, ...]:
    slots, d = self.capacity(kind), self.head_dim
    return (self.stack_size(kind), self.batch, self.kv_heads,
            *((d, slots) if self.slots_last(values) else (slots, d)))


def plan_cache(mesh: Mesh, *, batch: int, prompt_len: int, max_new_tokens: int, kv_heads: int,
               head_dim: int, dtype: str, layer_windows, chunk_len: int | None = None
               ) -> CacheLayout:
  """The layout for ``batch`` rows of prompts up to ``prompt_len`` tokens and
  ``max_new_tokens`` new ones: S is ``prompt_len`` rounded up to a multiple of the sequence
  shards (seq x ring) and of ``chunk_len`` (default: one chunk), B ``batch`` rounded up to a
  multiple of the data axis."""
  sequence = math.prod(mesh.shape[a] for a in sequence_axes(mesh))
  heads_split = mesh.shape[SEQ] > 1 and kv_heads % mesh.shape[SEQ] == 0
  slot_axes = ((RING,) if RING in mesh.axis_names else ()) if heads_split else sequence_axes(mesh)
  chunk = _round_up(chunk_len or prompt_len, sequence)
  layout = CacheLayout(
      mesh=mesh, batch=_round_up(batch, mesh.shape[DATA]),
      prompt_len=_round_up(prompt_len, chunk), chunk_len=chunk, gen_slots=0,
      kv_heads=kv_heads, head_dim=head_dim, dtype=str(jnp.dtype(dtype)),
      layer_windows=tuple(layer_windows), slot_axes=tuple(slot_axes),
      heads_axis=SEQ if heads_split else None)
  # The last new token is sampled, never fed back: max_new_tokens - 1 slots at least one. A
  # device holding at least one of the decode kernel's blocks of slots gets a multiple of them
  # (at most 63 slots more): what the kernel takes in either v layout (``kernels.decode_hopper``).
  capacity = _round_up(layout.prompt_len + max(max_new_tokens - 1, 1), layout.slot_shards)
  if capacity // layout.slot_shards >= decode_hopper.MIN_BLOCK:
    capacity = _round_up(capacity, decode_hopper.MIN_BLOCK * layout.slot_shards)
  return dataclasses.replace(layout, gen_slots=capacity - layout.prompt_len)


def empty_cache(layout: CacheLayout) -> KVCache:
  """Zeros and empty positions, created sharded (no device holds more than its shard)."""
  def make():
    stacks = lambda values: tuple(jnp.zeros(layout.stack_shape(kind, values), layout.dtype)
                                  for kind in layout.kinds)
    return KVCache(stacks(False), stacks(True),
                   tuple(jnp.full((layout.batch, layout.capacity(kind)), EMPTY, jnp.int32)
                         for kind in layout.kinds))
  return jax.jit(make, out_shardings=layout.shardings())()


def abstract_cache(layout: CacheLayout) -> KVCache:
  """The cache's ``ShapeDtypeStruct``s with their shardings (to lower the steps without
  allocating it, e.g. for GPUs this machine lacks: ``ulysses_jax.aot``)."""
  shardings = layout.shardings()
  stacks = lambda values, place: tuple(
      jax.ShapeDtypeStruct(layout.stack_shape(kind, values), jnp.dtype(layout.dtype),
                           sharding=place[n]) for n, kind in enumerate(layout.kinds))
  return KVCache(stacks(False, shardings.k), stacks(True, shardings.v),
                 tuple(jax.ShapeDtypeStruct((layout.batch, layout.capacity(kind)), jnp.int32,
                                            sharding=shardings.positions[n])
                       for n, kind in enumerate(layout.kinds)))


def _slot_shard_index(layout: CacheLayout):
  """Inside shard_map: this device's index along the slot axes (major first)."""
  index = 0
  for axis in layout.slot_axes:
    index = index * layout.mesh.shape[axis] + lax.axis_index(axis)
  return index


def _full_prompt_positions(layout: CacheLayout, lengths_B):
  """``[B, C]`` positions of a full layer's slots once the whole prompt is written."""
  r_prime, t = layout.slot_shards, layout.chunk_len // layout.slot_shards
  local = layout.full_capacity // r_prime
  slot = np.arange(layout.full_capacity)
  device, j = slot // local, slot % local
  position = (j // t) * layout.chunk_len + device * t + j % t
  prompt = j < layout.chunks * t
  position = jnp.asarray(np.where(prompt, position, EMPTY), jnp.int32)
  return jnp.where(position[None] < lengths_B[:, None], position[None], EMPTY)


def _rolling_positions(capacity: int, last_B):
  """``[B, capacity]``: the position in each slot of a rolling buffer holding positions up to
  ``last_B`` (slot p mod capacity), -1 where none."""
  slot = jnp.arange(capacity, dtype=jnp.int32)[None]
  position = last_B[:, None] - jnp.mod(last_B[:, None] - slot, capacity)
  return jnp.where(position >= 0, position, EMPTY)


def chunk_positions(layout: CacheLayout, kind, chunk, lengths_B):
  """The positions array of ``kind`` once chunk ``chunk`` (traced int) of prompts of
  ``lengths_B`` tokens is written. A full layer's holds the whole prompt from the start (the
  causal mask hides the chunks not yet written)."""
  if kind is None:
    return _full_prompt_positions(layout, lengths_B)
  last_B = jnp.minimum(lengths_B, (chunk + 1) * layout.chunk_len) - 1
  return _rolling_positions(layout.capacity(kind), last_B)


def write_chunk(layout: CacheLayout, kind, stack, layer, new_BTKD, chunk, lengths_B, *,
                values: bool = False):
  """A kind's stack of k (of v, with ``values``) with chunk ``chunk`` (traced int) of layer
  ``layer``'s (its index in the stack, an int or traced) keys (values) written.

  ``new_BTKD``: the chunk's k or v ``[B, T, Hkv, D]`` sharded like the model's activations
  (tokens over the sequence axes). Full layers: each device writes its own tokens (after the
  Ulysses all-to-all when heads are split over ``seq``); rolling buffers: each slot takes the
  newest position of the chunk that maps to it, gathered from the devices holding it (one
  reduce-scatter of a layer's ``[B, Hkv, C_W, D]``).
  """
  act = P(DATA, sequence_axes(layout.mesh), None, None)
  capacity, t = layout.capacity(kind), layout.chunk_len // layout.slot_shards
  slots_last = layout.slots_last(values)
  slot_axis = 3 if slots_last else 2  # in one layer's [b, k, C, D] or [b, k, D, C]
  along_slots = lambda x_bC: x_bC[:, None, None, :] if slots_last else x_bC[:, None, :, None]

  def write(stack, new_btKD, layer, chunk, lengths_b):
    if layout.heads_axis is not None:
      new_btKD = seq_to_heads(new_btKD, layout.heads_axis)
    new = new_btKD.transpose((0, 2, 3, 1) if slots_last else (0, 2, 1, 3)).astype(stack.dtype)
    if kind is None:
      start = [layer, 0, 0, 0, 0]
      start[1 + slot_axis] = chunk * t
      return lax.dynamic_update_slice(stack, new[None], start)
    position_bC = chunk_positions(layout, kind, chunk, lengths_b)
    written_bC = position_bC >= chunk * layout.chunk_len
    index_bC = position_bC - chunk * layout.chunk_len - _slot_shard_index(layout) * t
    mine_bC = written_bC & (index_bC >= 0) & (index_bC < t)
    taken = jnp.take_along_axis(new, along_slots(jnp.clip(index_bC, 0, t - 1)), axis=slot_axis)
    taken = jnp.where(along_slots(mine_bC), taken, 0).astype(stack.dtype)
    local = capacity // layout.slot_shards
    if layout.slot_axes:
      taken = lax.psum_scatter(taken, layout.slot_axes, scatter_dimension=slot_axis, tiled=True)
      start = _slot_shard_index(layout) * local
      written_bC = lax.dynamic_slice_in_dim(written_bC, start, local, axis=1)
    held = lax.dynamic_index_in_dim(stack, layer, keepdims=False)
    updated = jnp.where(along_slots(written_bC), taken, held)
    return lax.dynamic_update_index_in_dim(stack, updated, layer, axis=0)

  spec = layout.stack_spec(values)
  return jax.shard_map(write, mesh=layout.mesh, in_specs=(spec, act, P(), P(), P(DATA)),
                       out_specs=spec, check_vma=False)(stack, new_BTKD, layer, chunk,
                                                        lengths_B)


def token_slots(layout: CacheLayout, kind, step, positions_B):
  """``[B]`` slot of the token fed at decode step ``step`` (traced int), at ``positions_B``:
  a full layer's slot for that step (the same in every row), a rolling buffer's p mod C_W."""
  if kind is not None:
    return jnp.mod(positions_B, layout.capacity(kind))
  r_prime = layout.slot_shards
  local = layout.full_capacity // r_prime
  slot = (step % r_prime) * local + layout.prompt_len // r_prime + step // r_prime
  return jnp.broadcast_to(slot, positions_B.shape).astype(jnp.int32)


def write_token(layout: CacheLayout, cache, new, slots_B, *, values: bool = False):
  """``cache`` (a kind's stack of k, or of v with ``values``; or a positions array ``[B, C]``)
  with ``new`` (every layer's ``[L_kind, B, 1, Hkv, D]``, or ``[B]``) written at ``slots_B``,
  in place: the device holding a row's slot writes the new values there, the others write
  back what the slot holds (one dynamic-update-slice per row, which XLA does in place on a
  donated cache)."""
  is_kv = cache.ndim == 5
  spec = layout.stack_spec(values) if is_kv else layout.positions_spec()
  new_spec = P(None, DATA, None, layout.heads_axis, None) if is_kv else P(DATA)
  slots_last = layout.slots_last(values)
  slot_axis = (4 if slots_last else 3) if is_kv else 1

  def write(cache_c, new_b, slots_b):
    local = cache_c.shape[slot_axis]
    index_b = slots_b - _slot_shard_index(layout) * local
    mine_b = (index_b >= 0) & (index_b < local)
    index_b = jnp.clip(index_b, 0, local - 1)
    rows = cache_c.shape[1 if is_kv else 0]
    for row in range(rows):
      if is_kv:  # [L, b, 1, k, D] -> this row's k [L, 1, k, 1, D] or v [L, 1, k, D, 1]
        value = new_b[:, row:row + 1, 0]
        value = value[..., None] if slots_last else value[:, :, :, None, :]
        start = [0, row, 0, 0, 0]
      else:
        value, start = new_b[row:row + 1, None], [row, 0]
      start[slot_axis] = index_b[row]
      held = lax.dynamic_slice(cache_c, start, value.shape)
      cache_c = lax.dynamic_update_slice(
          cache_c, jnp.where(mine_b[row], value.astype(cache_c.dtype), held), start)
    return cache_c

  return jax.shard_map(write, mesh=layout.mesh, in_specs=(spec, new_spec, P(DATA)),
                       out_specs=spec, check_vma=False)(cache, new, slots_B)


def decode_kernel_chosen(backend: str, on, q_shape, k_shape, dtype, *, v_layout: str,
                         strict: bool = True) -> bool:
  """Whether a decode step's partial attention over one device's cache shard (queries
  ``q_shape`` ``[b, Hkv, G, 1, D]``, keys ``k_shape``, v in ``v_layout``) runs our Mosaic GPU
  kernel: see the docstring of ``generate.attention``; ``strict``: raises for ``"mosaic"``
  where the kernel cannot run (else False)."""
  if backend not in DECODE_BACKENDS:
    raise ValueError(f"decode_backend must be one of {DECODE_BACKENDS}, got {backend!r}.")
  if backend == "xla":
    return False
  on_gpu = on is not None and on.on_gpu
  reason = decode_hopper.unsupported_reason(q_shape, k_shape, dtype, v_layout)
  if on_gpu and on.generation != "sm90":
    reason = f"it needs a Hopper GPU (sm90), not {on.device_kind}"
  if strict and backend == "mosaic" and reason is not None:
    raise ValueError(f"decode_backend='mosaic' cannot run: {reason}; use 'xla' or 'auto'.")
  return reason is None and (backend == "mosaic" or on_gpu)
