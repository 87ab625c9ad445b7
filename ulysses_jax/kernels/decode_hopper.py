"""Split-K (flash-decoding) attention of a few queries over one device's KV cache shard, in
Pallas Mosaic GPU for Hopper: the kernel form of ``generate.attention.partial_attention``.

Inputs in the generation cache's layout (``generate.cache``): queries ``q [b, Hkv, G, T, D]``
(G query heads per KV head, T new tokens: 1 at decode), keys ``k [b, Hkv, C, D]``, values
``v`` as ``v_layout`` says (``V_LAYOUTS``: ``"CD"`` ``[b, Hkv, C, D]``, like k, the cache's
layout where decode steps run this kernel: a block's values are one contiguous run of memory;
``"DC"`` ``[b, Hkv, D, C]``, slots last, the layout XLA's decode reads best, of which a block
is D runs of ``2 * block`` bytes, ``2 * C`` bytes apart) and the slots' positions ``[b, C]``
(-1: empty). A slot at position p is visible to a query at position q when ``0 <= p <= q``
and, with a sliding window W, ``q - p < W`` (the rule of ``generate.attention``; slots need not
be in position order, as in a rolling window buffer). Returns ``(o, lse)``, o
``[b, Hkv, G, T, D]`` and lse ``[b, Hkv, G, T]`` float32, the neutral (0, -inf) where a query
sees no slot.

The grid is ``(split, batch, kv_head)``. A CTA takes the ``G * T`` query rows of one (batch, KV
head), padded to one warpgroup's 64 wgmma rows (padding rows have position -1 and see nothing),
and the slot blocks of its split: the C slots form ``ceil(C / block)`` blocks, the last one
starting at ``C - block`` so that every TMA window lies inside the cache (its slots before the
block's nominal start are masked, so none counts twice), and split s takes blocks
``[s * n, (s + 1) * n)`` (n = ceil(blocks / splits); the last splits may get none: their
state stays neutral). One compute warpgroup runs the online softmax over its blocks with wgmma
(``q @ k.T`` from shared memory; ``probs @ v`` with the probabilities from registers and v's
tile, read transposed in the ``"DC"`` layout); another streams K, V and the positions through a
ring of ``num_stages`` slots (``flash_hopper.produce``). With ``consumers=2`` two compute
warpgroups take the split's blocks in turn, each with its own online softmax and partial, so
that one's softmax overlaps the other's matmuls and twice the copies can be in flight (a
variant the doctor times; not yet measured on a GPU). Each split (each warpgroup of it)
writes its partial output and lse in float32; the partials combine in float32 outside the
kernel, as the devices do across the mesh (``generate.attention.combine``); a partial keeps
the G * T real rows, to a multiple of 8.

A decode step is bound by reading the cache; the 64-row wgmma wastes compute (G * T of 64
rows are real) that the memory traffic hides: 64 rows x 2 flops per cache element against
2 bytes read is 64 flops per byte, below the H100's ~295 (989 TFLOP/s over 3.35 TB/s).

16-bit caches only (wgmma), head dims 64, 128 and 256 (256 with v like k), at most 64 query
rows per KV head, at least one block of slots, slot counts a multiple of
``SLOT_MULTIPLE[v_layout]`` (8 for ``"CD"``, the rows of the k and v tiles; 64 for ``"DC"``,
whose v tile is swizzled along the slots; Mosaic GPU's lowering rejects other counts):
``unsupported_reason`` says which is not met. Runs in GPU interpret mode on a CPU
(``interpret=True``; what that mode executes: ``hopper_interpret``).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ulysses_jax.kernels import flash_hopper
from ulysses_jax.kernels import target as target_lib
from ulysses_jax.kernels import wgmma_forms
from ulysses_jax.kernels.flash_kernels import LOG2E, dot

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.bfloat16, jnp.float16)
ROWS = flash_hopper.WGMMA_ROWS  # query rows of a CTA: G * T of them are real
MIN_BLOCK = 64  # slots per block; the "DC" layout's v tile is swizzled in tiles of 64 slots
V_LAYOUTS = ("DC", "CD")  # v [b, Hkv, D, C] (slots last) or [b, Hkv, C, D] (like k)
SLOT_MULTIPLE = {"CD": 8, "DC": MIN_BLOCK}  # the slot counts Mosaic GPU lowers, per v layout
SHARED_MEMORY = 200 * 1024  # of Hopper's 227 KiB per CTA, leaving room for alignment, barriers
H100_SMS = 132  # SMs of an H100 SXM or H200: default splits fill them, when the GPU does not say
# The float32 output leaves through shared memory in column chunks of at most this many: at head
# dim 256 a whole [64, 256] tile (64 KiB) would leave room for one ring slot only.
OUT_COLUMNS = 128


def unsupported_reason(q_shape, cache_shape, dtype, v_layout: str = "CD") -> str | None:
  """Why the kernel cannot take queries ``[b, Hkv, G, T, D]`` over a cache ``k [b, Hkv, C,
  D]`` of ``dtype`` with v in ``v_layout``; None if it can."""
  *_, g, t, d = q_shape
  c = cache_shape[2]
  if jnp.dtype(dtype) not in [jnp.dtype(x) for x in DTYPES]:
    return f"the cache's dtype is {jnp.dtype(dtype).name}; the kernel takes bfloat16 or float16"
  if d not in HEAD_DIMS:
    return f"head dim {d}; the kernel takes {HEAD_DIMS}"
  if d > 128 and v_layout == "DC":
    return f"head dim {d} with v slots last; the kernel takes it with v like k ('CD')"
  if g * t > ROWS:
    return f"{g} query heads per KV head x {t} tokens = {g * t} rows; the kernel takes <= {ROWS}"
  multiple = SLOT_MULTIPLE[v_layout]
  if c < MIN_BLOCK or c % multiple:
    return (f"{c} cache slots per device; the kernel takes a multiple of {multiple}, at least "
            f"{MIN_BLOCK}" + (" (v slots last)" if v_layout == "DC" else ""))
  return None


def default_block(c: int, d: int, consumers: int = 1) -> int:
  """Slots per block: 128 (64 when the cache holds fewer, at head dim 256, or at head dim 128
  with two consumer warpgroups, whose own q and o buffers leave no room for two 128-slot
  slots), in multiples of ``MIN_BLOCK``."""
  widest = 128 if d * consumers <= 128 else 64
  return min(widest, c // MIN_BLOCK * MIN_BLOCK)


def default_splits(b: int, kv_heads: int, num_blocks: int, sms: int = H100_SMS) -> int:
  """Splits per (batch, KV head): as many as ``sms`` SMs run at once, one CTA each (a CTA's
  shared memory and registers hold an SM). Never more: one CTA past a wave costs a second
  wave, e.g. 17 splits of 8 KV heads are 136 CTAs on 132 SMs, two waves' time for 3 % more
  CTAs, where 16 splits (128 CTAs) take one."""
  return max(1, min(num_blocks, sms // (b * kv_heads)))


def default_stages(block: int, d: int, consumers: int = 1) -> int:
  """Ring slots: as many as fit in shared memory (two to four; a multiple of ``consumers``,
  see ``decode_attention``), so the copies in flight are what the SM's shared memory can
  hold: four of 64 or 128 slots at head dim 64 and of 64 at 128; two of 128 slots at 128;
  two of 64 at 256."""
  stages = min(4, (SHARED_MEMORY - _fixed_bytes(d, consumers)) // _slot_bytes(block, d))
  return max(2, stages // consumers * consumers)


def _fixed_bytes(d, consumers):
  """Each consumer warpgroup's own q (16-bit) and o (float32, ``OUT_COLUMNS`` at most),
  their positions and lse."""
  return consumers * (ROWS * (d * 2 + min(d, OUT_COLUMNS) * 4) + ROWS * 8)


def _slot_bytes(block, d):
  return 2 * block * d * 2 + block * 4  # k and v (16-bit), the slots' positions


def decode_attention(q_bKGTD, k_bKCD, v, q_pos_bT, k_pos_bC, *, scale: float,
                     window: int | None, v_layout: str = "CD", layer: int | None = None,
                     num_splits: int | None = None, block: int | None = None,
                     num_stages: int | None = None, consumers: int = 1,
                     interpret: bool = False):
  """One device's partial attention ``(o, lse)`` (module docstring). ``v_layout``: one of
  ``V_LAYOUTS``. ``layer``: k and v are stacks of layers (``[L, b, Hkv, C, D]``, v likewise in
  its layout) and the kernel reads layer ``layer`` of them where it lies (a slice of the stack
  passed to the kernel would be copied first: XLA hands a custom call whole buffers).
  ``num_splits``: splits of the slots per (batch, KV head) (default: ``default_splits`` for
  the SMs of the GPU it runs on, else an H100's); ``block``: slots per pipeline step, a
  multiple of 64 at most C (default: ``default_block``); ``num_stages``: ring slots (default:
  ``default_stages``); ``consumers``: compute warpgroups of a CTA, 1 or 2, taking its blocks
  in turn, each its own partial (as if a split of its own), so that one's softmax runs while
  the other's matmuls and copies do. A warpgroup must see every phase of the barriers of the
  slots it reads, so with two each slot serves one of them: ``num_stages`` must be even."""
  b, kv_heads, g, t, d = q_bKGTD.shape
  if v_layout not in V_LAYOUTS:
    raise ValueError(f"decode kernel: v_layout {v_layout!r}: one of {V_LAYOUTS}.")
  if layer is not None:
    if not 0 <= layer < k_bKCD.shape[0] or k_bKCD.shape[0] != v.shape[0]:
      raise ValueError(f"decode kernel: layer {layer} of stacks of {k_bKCD.shape[0]} (k) and "
                       f"{v.shape[0]} (v) layers.")
  k_shape, v_shape = (x.shape[0 if layer is None else 1:] for x in (k_bKCD, v))
  c = k_shape[2]
  reason = unsupported_reason(q_bKGTD.shape, k_shape, k_bKCD.dtype, v_layout)
  if reason is not None:
    raise ValueError(f"decode kernel: {reason}; use decode_backend='xla'.")
  if not q_bKGTD.dtype == k_bKCD.dtype == v.dtype:
    raise ValueError(f"decode kernel: q, k and v must share a dtype, got {q_bKGTD.dtype}, "
                     f"{k_bKCD.dtype}, {v.dtype}.")
  v_expected = (b, kv_heads, *((d, c) if v_layout == "DC" else (c, d)))
  if k_shape != (b, kv_heads, c, d) or v_shape != v_expected:
    raise ValueError(f"decode kernel: a layer's k must be [b, Hkv, C, D] = {(b, kv_heads, c, d)}"
                     f" and v ({v_layout} layout) {v_expected}; got {k_shape} and {v_shape}.")
  if consumers not in (1, 2):
    raise ValueError(f"decode kernel: consumers {consumers}: 1 or 2 compute warpgroups.")
  block = block or default_block(c, d, consumers)
  if block % MIN_BLOCK or not MIN_BLOCK <= block <= c:
    raise ValueError(f"decode kernel: block {block} must be a multiple of {MIN_BLOCK} in "
                     f"[{MIN_BLOCK}, {c}] (the cache's slots).")
  num_blocks = -(-c // block)
  sms = target_lib.current(arrays=(q_bKGTD,)).core_count or H100_SMS
  num_splits = num_splits or default_splits(b, kv_heads, num_blocks, sms)
  num_stages = num_stages or default_stages(block, d, consumers)
  if num_stages % consumers:
    raise ValueError(f"decode kernel: num_stages {num_stages} must be a multiple of consumers "
                     f"{consumers} (each ring slot serves one warpgroup).")
  shared = _fixed_bytes(d, consumers) + num_stages * _slot_bytes(block, d)
  if shared > SHARED_MEMORY:
    raise ValueError(f"decode kernel: {consumers} consumer warpgroup(s) and {num_stages} slots "
                     f"of {block} slots at head dim {d} need {shared // 1024} KiB of shared "
                     f"memory, over {SHARED_MEMORY // 1024}; use fewer slots or a smaller block.")

  # Rows g * T + t, padded to ROWS; a padding row's position -1 sees nothing.
  q_bKRD = jnp.pad(q_bKGTD.reshape(b, kv_heads, g * t, d),
                   ((0, 0), (0, 0), (0, ROWS - g * t), (0, 0)))
  q_pos_bR = jnp.pad(jnp.tile(q_pos_bT.astype(jnp.int32), (1, g)), ((0, 0), (0, ROWS - g * t)),
                     constant_values=-1)
  kernel = functools.partial(_kernel, scale=scale, window=window, block=block,
                             blocks_per_split=-(-num_blocks // num_splits),
                             num_blocks=num_blocks, num_stages=num_stages,
                             consumers=consumers, v_layout=v_layout, interpret=interpret,
                             layer=() if layer is None else (layer,))
  partials = num_splits * consumers
  # Each partial keeps its real rows (to a multiple of 8): with one KV head and 4 query heads
  # all 64 would be 16 times the bytes, as many as the cache's own at a few thousand slots.
  rows = -(-(g * t) // 8) * 8
  o_split, lse_split = plgpu.kernel(
      kernel, out_type=(jax.ShapeDtypeStruct((b, kv_heads, partials, rows, d), jnp.float32),
                        jax.ShapeDtypeStruct((b, kv_heads, partials, rows), jnp.float32)),
      grid=(num_splits, b, kv_heads), grid_names=("split", "batch", "kv_head"),
      num_threads=consumers + 1, thread_name="wg", kernel_name="decode_attention",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=flash_hopper.interpret_params() if interpret else None,
  )(q_bKRD, k_bKCD, v, q_pos_bR, k_pos_bC.astype(jnp.int32))
  o, lse = combine_splits(o_split[:, :, :, :g * t], lse_split[..., :g * t])
  return o.reshape(b, kv_heads, g, t, d), lse.reshape(b, kv_heads, g, t)


def combine_splits(o_bKSRD, lse_bKSR):
  """The splits' partials (axis 2) combined in float32: ``(o [b, Hkv, R, D], lse [b, Hkv,
  R])``, (0, -inf) where no split saw a slot.

  One variadic reduce whose reducer merges two partials as online softmax does, so that the
  combine compiles to one fusion: as max, weights and weighted sum (``generate.attention``'s
  form) XLA's GPU compiler made it three, each a kernel launch and tail in a decode step
  whose kernel itself may take a few microseconds (llama3.2-1b's step, compiled for an H100:
  16 kernels a layer, now 15). The lse rides along broadcast to o's shape, as a variadic
  reduce's operands share one shape."""
  def merge(a, b):
    (lse_a, o_a), (lse_b, o_b) = a, b
    top = jnp.maximum(lse_a, lse_b)
    ref = jnp.where(top == -jnp.inf, 0.0, top)
    w_a, w_b = jnp.exp(lse_a - ref), jnp.exp(lse_b - ref)
    total = w_a + w_b
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    return (jnp.where(seen, ref + jnp.log(safe), -jnp.inf),
            (w_a * o_a + w_b * o_b) / safe)
  lse_bKSRD = jnp.broadcast_to(lse_bKSR[..., None], o_bKSRD.shape)
  lse, o = lax.reduce((lse_bKSRD, o_bKSRD), (jnp.float32(-jnp.inf), jnp.float32(0)), merge, (2,))
  return o, lse[..., 0]


def _kernel(q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref, o_ref, lse_ref, *, scale, window, block,
            blocks_per_split, num_blocks, num_stages, consumers, v_layout, interpret, layer):
  d, dtype = q_ref.shape[-1], q_ref.dtype
  slots_last = v_layout == "DC"
  # Each slot is read by one consumer warpgroup (step t by warpgroup t % consumers): one
  # arrival frees it.
  buffers = dict(
      **flash_hopper.own_buffers(dict(q=((ROWS, d), dtype), q_pos=((ROWS,), jnp.int32)),
                                 consumers),
      o=wgmma_forms.smem_tile((consumers, ROWS, min(d, OUT_COLUMNS)), jnp.float32),
      lse=wgmma_forms.smem_tile((consumers, ROWS), jnp.float32),
      **flash_hopper.ring_buffers(num_stages, dict(k=((block, d), dtype),
                                                   v=((d, block) if slots_last else (block, d),
                                                      dtype),
                                                   k_pos=((block,), jnp.int32)),
                                  ("k", "v"), consumers=1))

  def body(smem):
    split, batch, head = (lax.axis_index(name) for name in ("split", "batch", "kv_head"))
    first = split * blocks_per_split
    end = jnp.minimum(first + blocks_per_split, num_blocks)
    num_steps = jnp.maximum(end - first, 0)
    start_of = lambda j: jnp.minimum(j * block, k_pos_ref.shape[1] - block)

    def groups_of_step(t):
      slots = pl.ds(start_of(first + t), block)
      v_tile = (slice(None), slots) if slots_last else (slots,)
      return [("k", dict(k=k_ref.at[(*layer, batch, head, slots)])),
              ("v", dict(v=v_ref.at[(*layer, batch, head, *v_tile)],
                         k_pos=k_pos_ref.at[batch, slots]))]

    def compute(w):
      plgpu.set_max_registers(flash_hopper.REGISTERS[2][0], action="increase")
      own = flash_hopper.load_own(smem, w, dict(q=q_ref.at[batch, head],
                                                q_pos=q_pos_ref.at[batch]))
      tile = wgmma_forms.TileLayout((ROWS, block), interpret=interpret)
      q_pos = tile.rows_of(own["q_pos"])
      qk_scale = scale * LOG2E

      def visit(i, carry):
        acc, row_max, denom = carry
        step = w + i * consumers
        j = first + step
        slot = lax.rem(step, num_stages)
        scores = wgmma_forms.a_times_bt(own["q"], flash_hopper.wait_ready(smem, "k", slot),
                                         interpret=interpret) * qk_scale
        flash_hopper.release(smem, "k", slot,
                             fence=wgmma_forms.stand_in_reads(interpret, "a_times_bt"))
        k_pos = tile.cols_of(flash_hopper.wait_ready(smem, "k_pos", slot))
        distance = q_pos - k_pos
        # Slots before the block's nominal start belong to the block before (the last block
        # starts early to stay inside the cache).
        fresh = start_of(j) + tile.iota(1) >= j * block
        mask = (k_pos >= 0) & (distance >= 0) & fresh
        if window is not None:
          mask = mask & (distance < window)
        scores = jnp.where(mask, scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        ref_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # a row that saw nothing yet
        correction = jnp.exp2(row_max - ref_max)
        probs = jnp.exp2(scores - tile.per_row(ref_max))
        denom = denom * correction + probs.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        plus_probs_times_v = _plus_a_times_bt if slots_last else wgmma_forms.plus_a_times_b
        acc = plus_probs_times_v(acc, probs.astype(dtype), flash_hopper.wait_ready(smem, "v", slot),
                                 interpret=interpret)
        # The positions were read through the generic proxy: always fenced.
        flash_hopper.release(smem, "v", slot, fence=True)
        return acc, new_max, denom

      row_layout = plgpu.Layout.WGMMA.reduce(1)
      init = (tile.zeros((ROWS, d)),
              tile.cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
              tile.cast(jnp.zeros((ROWS,), jnp.float32), row_layout))
      acc, row_max, denom = lax.fori_loop(0, (num_steps + consumers - 1 - w) // consumers,
                                          visit, init)
      empty = denom == 0.0
      denom = jnp.where(empty, 1.0, denom)
      lse = jnp.where(empty, -jnp.inf, row_max / LOG2E + jnp.log(denom))
      partial = split * consumers + w
      o = acc / lax.broadcast_in_dim(denom, acc.shape, [0])
      width = min(d, OUT_COLUMNS)
      for column in range(0, d, width):  # store_own waits for each chunk's copy to finish
        flash_hopper.store_own([
            (o[:, column:column + width], smem["o"].at[w],
             o_ref.at[batch, head, partial, :, pl.ds(column, width)]),
            *([(lse, smem["lse"].at[w], lse_ref.at[batch, head, partial])] if column == 0
              else [])])

    wg = lax.axis_index("wg")
    for w in range(consumers):
      pl.when(wg == w)(functools.partial(compute, w))
    pl.when(wg == consumers)(functools.partial(
        flash_hopper.produce, smem, num_stages, num_steps, groups_of_step))

  flash_hopper.with_shared_memory(buffers, body)


def _plus_a_times_bt(acc, a, b_smem, *, interpret):
  """``acc + a @ b.T``: wgmma reads ``a`` ``[m, k]`` from registers and ``b`` ``[n, k]`` from
  shared memory, transposed; in interpret mode a plain dot (``flash_hopper``: no JAX version's
  interpreter runs a register-A wgmma)."""
  if wgmma_forms.stand_in("plus_a_times_b", interpret):
    return acc + dot(a, b_smem[...], 1, 1)

  def accumulate(acc_ref):
    plgpu.wgmma(acc_ref, a, b_smem.transpose((1, 0)))
  return pl.run_state(accumulate)(plgpu.ACC.init(acc))

