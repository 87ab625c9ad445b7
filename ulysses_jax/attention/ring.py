"""Ring attention (arXiv 2310.01889) with a load-balanced causal layout, and its zigzag layout.

R devices each hold S/R tokens of q, k, v. K/V blocks travel around the ring with
``ppermute`` (device i sends to i+1) while every device attends its queries to the block it
currently holds and merges the partial result into a float32 accumulator with log-sum-exp
statistics. After R steps each query has seen every key. The backward rotates K/V again, and
the dK/dV accumulated for a block travel with it, one last hop bringing them home; only the
local q, k, v, the output and the lse are saved, never one K/V block per step. Per-device
traffic is 2·(R−1)/R·B·S·Hkv·D elements forward (K and V), about O(S) whatever R is.

**Precision and memory.** The output and dQ are summed over the steps in float32, the lse in
float32; everything else is in the inputs' dtype: each step's partial output and gradients as
the kernels write them, and the dK/dV sums, which travel with their block (each device adds its
part and rounds once per hop). Float32 there would hold several more float32 blocks per device
(4 GiB each for Llama-3.1-8B at 8M tokens per ring device) and double the dK/dV traffic. With
bfloat16 inputs, R = 4 and packed segments, the relative error against a float32 dense
reference is 2.1e-3 (out), 2.8-2.9e-3 (dq), 3.4e-3 (dk), 3.2e-3 (dv), the XLA backend's own
(float32 partials) within 2 % (``python -m benchmarks.ring_cost``; float32 partials gave
2.6e-3, 3.1e-3, 3.0e-3 for dq, dk, dv).

**Zigzag layout.** With a causal mask and the sequence in natural order, device R−1's queries
see every key while device 0's see only its own: the ring would take as long as a non-causal
one. Instead the sequence is cut into 2R equal chunks and device r holds chunks r and
2R−1−r (``ulysses_jax.attention.zigzag``, where the permutation lives): at every step but the
first each device computes exactly half a block (the other half is masked and skipped), so no
device idles. The causal mask is defined by each token's global position, computed from the
layout, so the attention itself is layout-agnostic:

* ``layout="natural"`` (default): inputs and outputs in natural order; inside the sharded
  program two ``ppermute``s of half a shard each move q, k, v and the segment ids into the
  zigzag layout, and the output back: each of the four tensors crosses the ring once more.
* ``layout="zigzag"``: the caller already holds the sequence in zigzag order, produced once on
  the data side with ``zigzag.to_zigzag`` (tokens, labels, positions and segment ids alike: every
  operation outside attention is token-local, and RoPE takes the permuted global positions);
  ``from_zigzag`` inverts it. No exchange traffic.

Without a causal mask the ring is balanced as is and the layout does not matter.

**Sliding window** (``sliding_window=W``, causal). The ring distances some query's window
reaches are known statically from W, S/R, R and the layout (``_Ring.window_sources``); each
device fetches those K/V blocks directly, one ``ppermute`` of that shift from the owner's own
K/V, and no other step runs or moves data (the backward fetches them again and sends their
dK/dV back the same way). With W <= S/R the natural layout is kept (the window balances the
work) and needs shifts 0 and 1 only; there the flash kernels run too (``window_in_two_steps``,
``ring_steps``). With W > S/R (zigzag, every distance a window reaches)
the kernels would need positions they do not take, so only ``"xla"`` runs.

**Sinks** (gpt-oss' per-head softmax sinks, ``attention.sinks``) are applied once, to the
merged output and lse of all steps (a sink applied per step would be counted R times). The
backward then holds the output and lse with the sink: with them every step's flash backward of
the real keys is exact as it is (the sink lowers their probabilities, which ``exp(scores -
lse)`` reflects), and ``sinks.sinks_grad`` gives the sinks' gradient.

**Local attention** (``backend``): ``"xla"`` runs ``chunked.chunked_attention`` on each step's
whole block, masking by global positions. ``"pallas"`` (``"pallas_mosaic"``) runs the Triton
(Mosaic GPU) flash kernels, which know no positions: ``ring_steps`` cuts each step into calls
with the masks they have.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ulysses_jax.attention import backends, chunked, zigzag
from ulysses_jax.attention.ring_steps import (flash_step, flash_step_grads, flash_window_step,
                                              flash_window_step_grads, merge)
from ulysses_jax.attention.common import Layout, fori_loop, pad_sequence, validate_inputs
from ulysses_jax.kernels.variants import check_sliding_window
from ulysses_jax.kernels.variants import apply_sinks, name_kernel_residuals, sinks_grad
from ulysses_jax.mesh import DATA, sequence_axes

# --- The backend ------------------------------------------------------------------------

def resolve_backend(backend: str, *, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                    causal: bool, segment_ids_given: bool, mesh: Mesh | None = None,
                    sliding_window: int | None = None, layout: Layout = "natural",
                    local_len: int | None = None, sinks_given: bool = False) -> str:
  """The ring's local attention: ``"xla"``, ``"pallas"`` or ``"pallas_mosaic"`` (``"auto"``:
  ``choose_backend``'s pick for ring attention: our Mosaic kernels on Hopper GPUs, the Triton
  ones on other GPUs; ``"xla"`` for a ``sliding_window`` the kernels cannot run in a ring,
  see ``window_in_two_steps`` with ``layout`` and ``local_len``, the tokens per ring device)."""
  check_sliding_window(sliding_window, causal)
  if backend in backends.NOT_IN_RING:
    raise ValueError(f"ring attention supports backend 'auto', 'xla', 'pallas' or "
                     f"'pallas_mosaic', got {backend!r}: {backends.NOT_IN_RING[backend]}.")
  in_two_steps = window_in_two_steps(sliding_window, layout, local_len)
  if sliding_window is not None and not in_two_steps and backend not in ("auto", "xla"):
    raise ValueError(
        f"sliding_window ({sliding_window}) inside ring attention needs backend='xla' or "
        f"'auto', got {backend!r}: with a window over a ring device's {local_len} tokens or "
        f"the zigzag layout (here {layout!r}) {backends.NOT_IN_RING_WITH_WINDOW}. The kernels "
        f"run a window of at most {local_len} tokens in the natural layout.")
  if backend == "auto":
    return backends.choose_backend(
        dtype=dtype, head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        causal=causal, segment_ids_given=segment_ids_given, mesh=mesh, ring_attention=True,
        sliding_window=sliding_window, ring_window_in_two_steps=in_two_steps,
        sinks_given=sinks_given).backend
  return backends.resolve_backend(backend, dtype=dtype, head_dim=head_dim,
                                  num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                  causal=causal, segment_ids_given=segment_ids_given, mesh=mesh,
                                  sliding_window=sliding_window, sinks_given=sinks_given)


def window_in_two_steps(sliding_window: int | None, layout: Layout,
                        local_len: int | None) -> bool:
  """Whether a ring with ``sliding_window`` keeps the natural layout and needs only each
  device's own and previous block (W <= S/R = ``local_len``, inputs in natural order): the
  windowed rings the flash kernels run (module docstring)."""
  return (sliding_window is not None and layout == "natural" and local_len is not None
          and sliding_window <= local_len)


# --- The ring -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Ring:
  """Static settings of one ring (hashable: the custom_vjp's nondiff argument)."""
  axis_name: str | tuple[str, ...]
  size: int
  causal: bool
  scale: float | None
  block: int
  backend: str  # "xla", "pallas" or "pallas_mosaic"
  window: int | None = None  # sliding_window
  zigzag: bool = True  # the blocks are in zigzag layout (causal rings only)

  @property
  def kernel(self) -> str:
    """The flash kernels of a ``"pallas*"`` backend: ``"triton"`` or ``"mosaic"``."""
    return "mosaic" if self.backend == "pallas_mosaic" else "triton"

  def rotate(self, tree):
    """Every array of ``tree`` moves from device i to device i+1 of the ring."""
    perm = [(i, (i + 1) % self.size) for i in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)

  def positions(self, index, local_len):
    # Without a mask positions are unused.
    return zigzag.chunk_positions(index, self.size, local_len // 2,
                                  zigzag=self.causal and self.zigzag)

  def window_sources(self, local_len) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """The ring distances a window needs, ``((shift, perm), ...)``: device i needs the K/V of
    device i - shift iff some of its queries see some of those keys (decided from the chunk
    positions, statically); ``perm`` lists the ``(source, destination)`` pairs that do."""
    chunk = local_len // 2
    chunks = (zigzag.zigzag_order(self.size) if self.zigzag
              else np.arange(2 * self.size)).reshape(self.size, 2)

    def sees(q_chunk, kv_chunk):  # some distance in [0, window) between the two chunks
      return q_chunk >= kv_chunk and (q_chunk - kv_chunk - 1) * chunk + 1 < self.window

    sources = []
    for shift in range(self.size):
      perm = tuple(((i - shift) % self.size, i) for i in range(self.size)
                   if any(sees(a, b) for a in chunks[i] for b in chunks[(i - shift) % self.size]))
      if perm:
        sources.append((shift, perm))
    return tuple(sources)

  def fetch(self, tree, perm):
    """Every array of ``tree`` moves along ``perm``'s ``(source, destination)`` pairs (zeros
    where no pair arrives); the identity for a device's own block."""
    if all(i == j for i, j in perm):
      return tree
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, list(perm)), tree)

  def source(self, step):
    """The device whose K/V block this device holds at ``step``."""
    return (lax.axis_index(self.axis_name) - step) % self.size

  def source_is_earlier(self, step):
    return self.source(step) < lax.axis_index(self.axis_name)


def attend_shard(q_BsHD: jax.Array, k_BsKD: jax.Array, v_BsKD: jax.Array,
                 segment_ids_Bs: jax.Array | None, sinks_H: jax.Array | None = None, *,
                 axis_name: str | tuple[str, ...], ring_size: int, causal: bool,
                 scale: float | None, layout: Layout, backend: str,
                 sliding_window: int | None = None) -> jax.Array:
  """Ring attention inside ``shard_map``: local ``[B, S/R, H, D]`` in, same shape out.

  The local blocks are the ring's R sequence shards in ring order (axis ``axis_name``), in
  ``layout`` order; S/R must be even. ``segment_ids_Bs`` ``[B, S/R]`` or None; ``sinks_H``
  ``[H]`` (the sinks of the local heads) or None. ``backend``
  is resolved (``resolve_backend``: ``"xla"`` for a ``sliding_window`` unless
  ``window_in_two_steps``).

  With a ``sliding_window`` W each device fetches only the K/V blocks some of its queries
  see, each by one ``ppermute`` from its owner (``_Ring.window_sources``), and the natural
  layout stays natural when W <= S/R (the window balances the work already).
  """
  local_len = q_BsHD.shape[1]
  chunk = local_len // 2
  block = max(b for b in range(1, min(chunk, zigzag.MAX_BLOCK) + 1) if chunk % b == 0)
  natural = window_in_two_steps(sliding_window, layout, local_len)
  if sliding_window is not None and backend != "xla" and not natural:
    raise ValueError(f"ring attention with sliding_window ({sliding_window}) over "
                     f"{local_len} tokens per device in the {layout} layout needs backend "
                     f"'xla', got {backend!r} (resolve_backend).")
  ring = _Ring(axis_name, ring_size, causal, scale, block, backend, sliding_window,
               zigzag=not natural)
  exchange = causal and layout == "natural" and ring_size > 1 and ring.zigzag
  if exchange:
    q_BsHD, k_BsKD, v_BsKD, segment_ids_Bs = (
        None if x is None else zigzag.exchange(x, axis_name, ring_size, inverse=False)
        for x in (q_BsHD, k_BsKD, v_BsKD, segment_ids_Bs))
  out = _ring_attention_shard(ring, q_BsHD, k_BsKD, v_BsKD, segment_ids_Bs, sinks_H)
  return zigzag.exchange(out, axis_name, ring_size, inverse=True) if exchange else out


def _attend_step(ring, q, k, v, q_seg, kv_seg, step):
  """Local attention of this device's queries to the K/V block held at ``step``: the partial
  output ``[B, S/R, H, D]`` and its lse ``[B, H, S/R]``."""
  if ring.backend != "xla" and ring.window is not None:
    return flash_window_step(ring, q, k, v, q_seg, kv_seg, step)
  if ring.backend != "xla":
    return flash_step(ring, q, k, v, q_seg, kv_seg, step)
  local_len = q.shape[1]
  return chunked.chunked_attention(
      q, k, v, causal=ring.causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
      q_positions=ring.positions(lax.axis_index(ring.axis_name), local_len),
      kv_positions=ring.positions(ring.source(step), k.shape[1]), scale=ring.scale,
      sliding_window=ring.window, block_q=ring.block, block_kv=ring.block, return_lse=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention_shard(ring, q, k, v, segment_ids, sinks):
  return _forward(ring, q, k, v, segment_ids, sinks)[0]


def _forward(ring, q_BSHD, k_BSKD, v_BSKD, segment_ids, sinks_H):
  """Output (q's dtype) and lse of the whole ring, the sinks applied once, after the merge."""
  merged = _windowed_merged_steps if ring.window is not None else _merged_steps
  out, lse = merged(ring, q_BSHD, k_BSKD, v_BSKD, segment_ids)
  if sinks_H is not None:
    out, lse = apply_sinks(out, lse, sinks_H)
  return out.astype(q_BSHD.dtype), lse


def _merged_steps(ring, q_BSHD, k_BSKD, v_BSKD, segment_ids):
  """Every step's partial result merged: output (float32) and lse, without sinks."""
  b, s, h, d = q_BSHD.shape

  def step(t, carry):
    k, v, kv_seg, out, lse = carry
    incoming = ring.rotate((k, v, kv_seg))  # in flight while this step computes
    out, lse = merge(out, lse, *_attend_step(ring, q_BSHD, k, v, segment_ids, kv_seg, t))
    return (*incoming, out, lse)

  init = (k_BSKD, v_BSKD, segment_ids, jnp.zeros((b, s, h, d), jnp.float32),
          jnp.full((b, h, s), -jnp.inf, jnp.float32))
  k, v, kv_seg, out, lse = fori_loop(0, ring.size - 1, step, init)  # a while loop: see there
  last = ring.size - 1
  return merge(out, lse, *_attend_step(ring, q_BSHD, k, v, segment_ids, kv_seg, last))


def _windowed_merged_steps(ring, q_BSHD, k_BSKD, v_BSKD, segment_ids):
  """``_merged_steps`` with a window: only the needed blocks, each fetched from its owner."""
  b, s, h, d = q_BSHD.shape
  out, lse = jnp.zeros((b, s, h, d), jnp.float32), jnp.full((b, h, s), -jnp.inf, jnp.float32)
  for shift, perm in ring.window_sources(s):
    k, v, kv_seg = ring.fetch((k_BSKD, v_BSKD, segment_ids), perm)
    out, lse = merge(out, lse, *_attend_step(ring, q_BSHD, k, v, segment_ids, kv_seg, shift))
  return out, lse


def _forward_rule(ring, q, k, v, segment_ids, sinks):
  out, lse = name_kernel_residuals(*_forward(ring, q, k, v, segment_ids, sinks))
  return out, (q, k, v, segment_ids, sinks, out, lse)


def _step_grads(ring, q, k, v, q_seg, kv_seg, out, lse, d_out, step):
  """(dq, dk, dv) of one step's tile given the GLOBAL out and lse (summed over steps: exact)."""
  if ring.backend != "xla" and ring.window is not None:
    return flash_window_step_grads(ring, q, k, v, q_seg, kv_seg, out, lse, d_out, step)
  if ring.backend != "xla":
    return flash_step_grads(ring, q, k, v, q_seg, kv_seg, out, lse, d_out, step)
  b, s = q.shape[:2]
  if q_seg is None:
    q_seg = kv_seg = jnp.zeros((b, s), jnp.int32)
  return chunked.chunked_attention_backward(
      q, k, v, out, lse, d_out, causal=ring.causal,
      scale=q.shape[-1] ** -0.5 if ring.scale is None else ring.scale,
      q_segment_ids=q_seg, kv_segment_ids=kv_seg,
      q_positions=ring.positions(lax.axis_index(ring.axis_name), s),
      kv_positions=ring.positions(ring.source(step), k.shape[1]),
      block_q=ring.block, block_kv=ring.block, sliding_window=ring.window)


def _windowed_backward(ring, residuals, d_out):
  """``_ring_backward`` with a window: each needed block fetched again, its dK/dV sent back
  to its owner by the inverse permutation."""
  q, k, v, segment_ids, out, lse = residuals
  dq = jnp.zeros(q.shape, jnp.float32)
  dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for shift, perm in ring.window_sources(q.shape[1]):
    k_t, v_t, kv_seg = ring.fetch((k, v, segment_ids), perm)
    dq_t, dk_t, dv_t = _step_grads(ring, q, k_t, v_t, segment_ids, kv_seg, out, lse, d_out,
                                   shift)
    dk_t, dv_t = ring.fetch((dk_t, dv_t), tuple((j, i) for i, j in perm))
    dq, dk, dv = dq + dq_t, dk + dk_t, dv + dv_t
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _backward_rule(ring, residuals, d_out):
  """(dq, dk, dv, None, d_sinks): every step's gradients given the final output and lse (the
  sinks' included, module docstring), and the sinks' own."""
  q, k, v, segment_ids, sinks, out, lse = residuals
  d_sinks = None if sinks is None else sinks_grad(out, lse, d_out, sinks)
  steps = _windowed_backward if ring.window is not None else _ring_backward
  return (*steps(ring, (q, k, v, segment_ids, out, lse), d_out), None, d_sinks)


def _ring_backward(ring, residuals, d_out):
  """(dq, dk, dv) of the whole ring: K/V rotate again, their dK/dV travelling with them."""
  q, k, v, segment_ids, out, lse = residuals

  def accumulate(t, k, v, kv_seg, dq, dk, dv):
    dq_t, dk_t, dv_t = _step_grads(ring, q, k, v, segment_ids, kv_seg, out, lse, d_out, t)
    add = lambda total, part, dtype: (total.astype(jnp.float32) + part).astype(dtype)
    return add(dq, dq_t, jnp.float32), add(dk, dk_t, k.dtype), add(dv, dv_t, v.dtype)

  def step(t, carry):
    k, v, kv_seg, dq, dk, dv = carry
    incoming = ring.rotate((k, v, kv_seg))
    dq, dk, dv = accumulate(t, k, v, kv_seg, dq, dk, dv)
    # dK/dV of a block travel with it, in the inputs' dtype (module docstring).
    return (*incoming, dq, *ring.rotate((dk, dv)))

  k_last, v_last, seg_last, dq, dk, dv = lax.fori_loop(
      0, ring.size - 1, step,
      (k, v, segment_ids, jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v)))
  dq, dk, dv = accumulate(ring.size - 1, k_last, v_last, seg_last, dq, dk, dv)
  dk, dv = ring.rotate((dk, dv))  # the last hop home
  return dq.astype(q.dtype), dk, dv


_ring_attention_shard.defvjp(_forward_rule, _backward_rule)


# --- Public entry point --------------------------------------------------------------------

def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh,
                   causal: bool = True, segment_ids: jax.Array | None = None,
                   backend: str = "auto", scale: float | None = None,
                   layout: Layout = "natural", sliding_window: int | None = None,
                   sinks: jax.Array | None = None) -> jax.Array:
  """Exact attention by ring over all the mesh's sequence axes; ``ulysses_attention``'s contract.

  Args:
    q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]`` with Hq % Hkv == 0 (no head constraint: heads
      are never split). Sharded ``(data, sequence_axes(mesh))`` or not.
    mesh: from ``ulysses_jax.make_mesh``; the ring runs over ``("seq",)`` or ``("ring", "seq")``
      (R devices in all).
    causal: causal mask over global positions; balanced with the zigzag layout.
    segment_ids: int ``[B, S]`` or None (any ids above ``common.MIN_SEGMENT_ID``, negative
      ones included); packed segments may cross shards.
    backend: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"pallas_mosaic"`` (see
      ``resolve_backend`` and the module
      docstring).
    scale: score scale, default ``1/sqrt(D)``.
    layout: ``"natural"`` or ``"zigzag"`` (see the module docstring); with ``"zigzag"`` the
      inputs and output are in ``zigzag.to_zigzag(., R)`` order and S must be a multiple of 2R.
    sliding_window: None, or W >= 1 with ``causal`` (transformers' definition): the query at
      global position p sees the keys at p' with ``0 <= p - p' < W``; the ring then moves only
      the K/V blocks some window reaches. The flash kernels run it for W <= S/R in the natural
      layout (``window_in_two_steps``), else it needs ``"xla"`` (``"auto"`` picks it).
    sinks: None, or float ``[Hq]``: one learnable logit per query head in every row's softmax,
      applied once to the merged result (module docstring); differentiable.

  Returns:
    ``[B, S, Hq, D]`` in q's dtype and the inputs' layout. S is padded inside to
    ``zigzag.padded_length(S, R)`` (natural layout) and the padding masked.
  """
  validate_inputs(q, k, v, mesh=mesh, segment_ids=segment_ids, scale=scale, layout=layout,
                  sinks=sinks)
  axes = sequence_axes(mesh)
  ring_size = math.prod(mesh.shape[a] for a in axes)
  zigzag.check_layout(layout, q.shape[1], ring_size)
  padded = zigzag.padded_length(q.shape[1], ring_size) if layout == "natural" else q.shape[1]
  backend = resolve_backend(backend, dtype=q.dtype, head_dim=q.shape[3], num_q_heads=q.shape[2],
                            num_kv_heads=k.shape[2], causal=causal,
                            segment_ids_given=segment_ids is not None, mesh=mesh,
                            sliding_window=sliding_window, layout=layout,
                            local_len=padded // ring_size, sinks_given=sinks is not None)
  return _ring_attention(q, k, v, segment_ids, sinks, mesh=mesh, causal=causal,
                         scale=None if scale is None else float(scale), layout=layout,
                         backend=backend, sliding_window=sliding_window)


@functools.partial(jax.jit, static_argnames=("mesh", "causal", "scale", "layout", "backend",
                                             "sliding_window"))
def _ring_attention(q, k, v, segment_ids, sinks, *, mesh, causal, scale, layout, backend,
                    sliding_window):
  s = q.shape[1]
  axes = sequence_axes(mesh)
  ring_size = math.prod(mesh.shape[a] for a in axes)
  if layout == "natural":
    # padded_length(s, .) >= s is the next multiple of itself: pads to exactly that length.
    q, k, v, segment_ids = pad_sequence(zigzag.padded_length(s, ring_size), q, k, v, segment_ids,
                                        causal=causal)
  attend = functools.partial(attend_shard, axis_name=axes, ring_size=ring_size, causal=causal,
                             scale=scale, layout=layout, backend=backend,
                             sliding_window=sliding_window)
  act = P(DATA, axes, None, None)
  seg_spec = None if segment_ids is None else P(DATA, axes)
  sinks_spec = None if sinks is None else P()  # every device holds every head
  out = jax.shard_map(attend, mesh=mesh, in_specs=(act, act, act, seg_spec, sinks_spec),
                      out_specs=act, check_vma=False)(q, k, v, segment_ids, sinks)
  return out[:, :s]
