"""Flash attention in Pallas: the ``"pallas"`` backend of ``ulysses_attention``.

``flash_attention`` computes exact attention with an online softmax, never materialising the
``[S, S]`` scores, and returns the log-sum-exp for the backward and for merging partial
results (ring / hybrid). A ``custom_vjp`` runs two backward kernels: dq (one program per query
block) and dk/dv (one program per key block of a KV head, summing over the query heads that
share it, so GQA/MQA never repeats K/V in memory and needs no atomics).

On GPU the kernels go through the Pallas Triton lowering (one code path for Ampere and Hopper;
Triton picks the tensor-core instructions of the generation); block sizes, warps and pipeline
stages come from a table per head dim and GPU generation (``choose_tiles``). On Hopper the forward
and the backward can instead run Pallas Mosaic GPU kernels (TMA, wgmma, a copy warpgroup
feeding two compute warpgroups): ``forward_kernel="mosaic"`` (``flash_hopper``) and
``backward_kernel="mosaic"`` (``flash_hopper_backward``), in any combination. Elsewhere the
same kernels run in Pallas interpret mode (slow; for tests), the Mosaic ones in Pallas' GPU
interpret mode. "On GPU" and the generation are those of the devices the call is built for
(``ulysses_jax.kernels.target``: the enclosing mesh, else the arrays' devices), so a program
compiled for GPUs from a CPU-only machine gets the real kernels (with JAX 0.11, whose Triton
lowering reads the GPU from the mesh context, lowered under ``jax.set_mesh``, as
``ulysses_attention`` and the trainer are).

Masking is that of ``ulysses_jax.attention.reference.dense_attention``: causal means query i
sees key j iff i >= j; with segment ids a query sees only keys with its id; a query that sees
no key returns 0 and lse -inf, never NaN. Any sequence length works: inputs are padded to a
multiple of the block size and padded keys are masked. Attention sinks (one logit per query
head, ``ulysses_jax.kernels.variants``) are applied to the kernels' output and lse, outside
them: the kernels already return the lse and take its cotangent, so every kernel (Triton and
Mosaic, forward and backward) serves models with sinks unchanged.
"""

import functools
import math

import jax
import jax.numpy as jnp

from ulysses_jax.kernels import flash_hopper, flash_hopper_backward, flash_kernels, mosaic_tiles
from ulysses_jax.kernels.variants import check_sliding_window
from ulysses_jax.kernels.variants import check_sinks, name_kernel_residuals
from ulysses_jax.kernels.variants import apply_sinks
from ulysses_jax.kernels import target as target_lib
from ulysses_jax.kernels.flash_kernels import LOG2E, KernelSpec, Tile

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MIN_BLOCK = 16  # smallest tile a Triton dot accepts

# (block_q, block_kv, num_warps, num_stages) of the forward, dq and dk/dv kernels per head dim.
# Shared memory per program stays under ~160 KiB (Hopper: 228 KiB, A100: 164 KiB). These are
# starting points: `python -m benchmarks.attention_kernels --sweep` measures alternatives.
# Every tile compiles without register spills (`python -m benchmarks.kernel_resources`, Triton
# 3.9: for sm_90a the forward at D=64 and dk/dv at all head dims spilled before; for sm_80 with
# `--capability 80` the forward at D=128/256 and dk/dv at all head dims), and the "other" tiles
# fit the 99 KiB of shared memory of sm_86/sm_89 GPUs as well as the A100's 163 KiB.
_TILES = {
    "sm90": {
        64: ((128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 8, 3)),
        128: ((128, 128, 8, 2), (128, 64, 8, 2), (32, 128, 8, 2)),
        256: ((64, 64, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2)),
    },
    "other": {
        64: ((128, 64, 4, 3), (64, 64, 4, 2), (32, 128, 8, 2)),
        128: ((128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 8, 2)),
        256: ((64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2)),
    },
}
_MOSAIC_MIN_ROWS = 2 * flash_hopper.WGMMA_ROWS  # blocks a caller gives: two compute warpgroups
KERNELS = ("triton", "mosaic")


def flash_attention(q_BSHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, *,
                    causal: bool = True, segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, scale: float | None = None,
                    block_q: int | None = None, block_kv: int | None = None,
                    interpret: bool | None = None, return_lse: bool = False,
                    forward_kernel: str = "triton", backward_kernel: str = "triton",
                    sliding_window: int | None = None, sinks: jax.Array | None = None,
                    tiles: tuple[Tile, Tile, Tile] | None = None,
                    ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Exact attention with Pallas kernels; differentiable, including through the lse.

  Args:
    q_BSHD: queries ``[B, S, Hq, D]``, bfloat16 / float16 / float32.
    k_BSKD, v_BSKD: keys and values ``[B, S, Hkv, D]``, same dtype; ``Hq % Hkv == 0`` and query
      head ``h`` uses KV head ``h // (Hq // Hkv)``.
    causal: query i sees key j only if i >= j.
    segment_ids: int ``[B, S]`` or None; a query sees only keys with the same id.
    kv_segment_ids: int ``[B, S]`` ids of the keys when they differ from the queries' (then
      some queries may see no key); defaults to ``segment_ids``.
    scale: score scale, default ``D ** -0.5``.
    block_q, block_kv: override the query / key block sizes of all three kernels (powers of
      two >= 16); default from the table for this head dim and GPU generation.
    interpret: run in Pallas interpret mode; default: unless the call is built for GPUs (the
      enclosing mesh's devices, else the inputs', ``ulysses_jax.kernels.target.current``).
    return_lse: also return the log-sum-exp of the scaled scores.
    forward_kernel: ``"triton"``, or ``"mosaic"`` for the Hopper kernel of ``flash_hopper``
      (bfloat16 / float16, head dims 64 / 128 / 256; ``block_q`` a multiple of 128 and
      ``block_kv`` of 64 when given).
    backward_kernel: ``"triton"``, or ``"mosaic"`` for the Hopper kernels of
      ``flash_hopper_backward`` (bfloat16 / float16, head dims 64 / 128; ``block_q`` and
      ``block_kv`` multiples of 128 when given).
    sliding_window: with ``causal``, query i sees only keys i - W < j <= i (transformers'
      window; ``reference.dense_attention``); every kernel (Triton and Mosaic, forward and
      backward) skips the blocks it hides.
    sinks: None, or ``[Hq]`` float logits, one more softmax column per query head with no value
      (gpt-oss; ``ulysses_jax.kernels.variants``), applied through the lse.
    tiles: the forward, dq and dk/dv kernels' ``Tile``s as given, instead of the table's
      (``benchmarks.attention_kernels --sweep`` times ``mosaic_tiles.candidates`` so); not with
      ``block_q`` / ``block_kv``. A Mosaic dk/dv tile with ``accumulate_dq=True`` computes dq
      too, and the dq tile is not used (jax 0.11 or newer).

  Returns:
    ``[B, S, Hq, D]`` in q's dtype; with ``return_lse`` also lse ``[B, Hq, S]`` float32 (the
    sink included).
  """
  _validate(q_BSHD, k_BSKD, v_BSKD, segment_ids, kv_segment_ids, block_q, block_kv)
  check_sinks(sinks, q_BSHD.shape[2], "flash_attention")
  _validate_kernels(forward_kernel, backward_kernel, q_BSHD, block_q, block_kv, sliding_window,
                    causal)
  _validate_tiles(tiles, forward_kernel, backward_kernel, q_BSHD.shape[3], block_q, block_kv)
  plan = _plan_for(q_BSHD, causal, scale, block_q, block_kv, interpret, forward_kernel,
                   backward_kernel, sliding_window, tiles)
  q_seg, kv_seg = _padded_segment_ids(plan, segment_ids, kv_segment_ids)
  out, lse = _flash(plan, *(_pad(plan, x) for x in (q_BSHD, k_BSKD, v_BSKD)), q_seg, kv_seg)
  s = plan.seq_len
  out, lse = out[:, :s], lse[:, :, :s]
  if sinks is not None:
    out, lse = apply_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


def flash_attention_backward(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BHS, d_out_BSHD, *,
                             causal=True, segment_ids=None, kv_segment_ids=None, scale=None,
                             block_q=None, block_kv=None, interpret=None,
                             grad_dtype=jnp.float32, kernel="triton", sliding_window=None):
  """``(dq, dk, dv)`` of one attention given an output and lse computed elsewhere.

  Arguments as ``flash_attention``; ``out_BSHD`` ``[B, S, Hq, D]``, ``lse_BHS`` ``[B, Hq, S]``
  float32 and the output cotangent ``d_out_BSHD``. With the output and lse of a larger
  attention over more keys (ring attention passes the global ones), ``exp(scores - lse)`` are
  the true probabilities of these keys, so summing the results over key blocks gives the
  exact gradient. Returns ``dq`` ``[B, S, Hq, D]`` and ``dk``, ``dv`` ``[B, S, Hkv, D]`` in
  ``grad_dtype`` (the kernels sum in float32 and round once when writing), from the Triton
  kernels or, with ``kernel="mosaic"``, the Hopper ones (which write the inputs' dtype only).
  """
  _validate(q_BSHD, k_BSKD, v_BSKD, segment_ids, kv_segment_ids, block_q, block_kv)
  _validate_kernels("triton", kernel, q_BSHD, block_q, block_kv, sliding_window, causal)
  if kernel == "mosaic" and jnp.dtype(grad_dtype) != q_BSHD.dtype:
    raise ValueError(f"flash_attention_backward: kernel='mosaic' writes the inputs' dtype "
                     f"({q_BSHD.dtype}), got grad_dtype={jnp.dtype(grad_dtype)}; pass "
                     f"grad_dtype={q_BSHD.dtype} or kernel='triton'.")
  plan = _plan_for(q_BSHD, causal, scale, block_q, block_kv, interpret, "triton", kernel,
                   sliding_window)
  q_seg, kv_seg = _padded_segment_ids(plan, segment_ids, kv_segment_ids)
  pad = functools.partial(_pad, plan)
  lse = jnp.pad(lse_BHS, [(0, 0), (0, 0), (0, plan.padded_len - plan.seq_len)])
  grads = _backward(plan, pad(q_BSHD), pad(k_BSKD), pad(v_BSKD), q_seg, kv_seg, pad(out_BSHD),
                    lse, pad(d_out_BSHD), jnp.zeros_like(lse), grad_dtype)
  return tuple(g[:, :plan.seq_len] for g in grads)


def _plan_for(q, causal, scale, block_q, block_kv, interpret, forward_kernel, backward_kernel,
              sliding_window, tiles=None):
  d = q.shape[3]
  target = target_lib.current(arrays=(q,))
  if interpret is None:
    interpret = not target.on_gpu
  if not interpret and "triton" in (forward_kernel, backward_kernel):
    _check_triton_finds_the_gpu(target)
  return choose_tiles(q.shape[1], d, causal=causal,
                      scale=d ** -0.5 if scale is None else float(scale), block_q=block_q,
                      block_kv=block_kv, interpret=bool(interpret),
                      generation="other" if interpret else target.generation,
                      forward_kernel=forward_kernel, backward_kernel=backward_kernel,
                      sliding_window=sliding_window, tiles=tiles)


def _check_triton_finds_the_gpu(target):
  """JAX 0.11 lowers Pallas Triton kernels for the GPU of the enclosing mesh context (its
  abstract device), else of the process's default device; JAX 0.10 for the process's GPU, else
  compute capability 9.0. A call built for compile-only GPUs (``ulysses_jax.aot``) by a CPU
  process outside any mesh context would stop there with a message about ``AbstractDevice``:
  say instead what to do, before tracing the kernels."""
  if jax.__version_info__ < (0, 11) or target_lib.of_mesh(jax.sharding.get_abstract_mesh()):
    return
  default = target_lib.of_device(jax.devices()[0])
  if not default.on_gpu:
    raise ValueError(
        f"flash_attention is built for {target.device_kind} GPUs (the devices of q's sharding),"
        f" but JAX {jax.__version__} lowers its Triton kernels for the GPU of the enclosing mesh"
        f" context, and there is none (this process's default device is a {default.platform} "
        "device): lower the call inside `with jax.set_mesh(mesh):` for the mesh of those GPUs "
        "(ulysses_attention and the trainer do), or pass forward_kernel='mosaic', "
        "backward_kernel='mosaic'.")


def _pad(plan, x_BS):
  """Pads the sequence axis (1) to ``plan.padded_len`` with zeros."""
  tail = plan.padded_len - plan.seq_len
  return jnp.pad(x_BS, [(0, 0), (0, tail)] + [(0, 0)] * (x_BS.ndim - 2))


def _padded_segment_ids(plan, segment_ids, kv_segment_ids):
  if segment_ids is None:
    return None, None
  q_seg = _pad(plan, segment_ids.astype(jnp.int32))
  kv_seg = q_seg if kv_segment_ids is None else _pad(plan, kv_segment_ids.astype(jnp.int32))
  return q_seg, kv_seg


def choose_tiles(seq_len: int, head_dim: int, *, causal: bool, scale: float,
                 block_q: int | None = None, block_kv: int | None = None,
                 interpret: bool = False, generation: str | None = None,
                 forward_kernel: str = "triton", backward_kernel: str = "triton",
                 sliding_window: int | None = None,
                 tiles: tuple[Tile, Tile, Tile] | None = None) -> KernelSpec:
  """Block sizes and launch parameters of the three kernels for one problem shape.

  ``generation`` is ``"sm90"`` (Hopper and newer) or ``"other"``; by default that of the
  devices the call is built for (``target.current``; ``"other"`` in interpret mode). The
  Mosaic kernels' tiles are the Hopper rows of ``mosaic_tiles.TABLE`` in any case. ``tiles``
  (forward, dq, dk/dv) replace the table's as given.
  """
  if tiles is None:
    if generation is None:
      generation = "other" if interpret else target_lib.current().generation
    # Blocks never exceed the (power-of-two rounded) sequence, so short sequences pad little.
    cap = max(_MIN_BLOCK, 1 << (seq_len - 1).bit_length())
    tiles = [Tile(min(block_q or bq, cap), min(block_kv or bk, cap), warps, stages)
             for bq, bk, warps, stages in _TILES[generation][max(64, head_dim)]]
    mosaic = mosaic_tiles.TABLE[("sm90", head_dim, bool(causal))] if head_dim in (
        flash_hopper.HEAD_DIMS) else (None,) * 3
    kernels = (forward_kernel, backward_kernel, backward_kernel)
    tiles = [mosaic_tiles.fit(mosaic_tile, name, cap, block_q, block_kv)
             if kernel == "mosaic" else tile
             for tile, mosaic_tile, name, kernel in zip(tiles, mosaic, mosaic_tiles.KERNELS,
                                                        kernels)]
  # Every kernel's grid divides the padded length (blocks are powers of two, or 192 rows).
  step = math.lcm(*(block for tile in tiles for block in (tile.block_q, tile.block_kv)))
  return KernelSpec(causal=bool(causal), scale=float(scale), seq_len=seq_len,
                    padded_len=-(-seq_len // step) * step, interpret=interpret,
                    forward=tiles[0], dq=tiles[1], dkv=tiles[2], forward_kernel=forward_kernel,
                    backward_kernel=backward_kernel, sliding_window=sliding_window)


def _validate_tiles(tiles, forward_kernel, backward_kernel, head_dim, block_q, block_kv):
  if tiles is None:
    return
  if block_q or block_kv:
    raise ValueError("flash_attention: pass tiles or block_q / block_kv, not both.")
  if len(tiles) != 3 or not all(isinstance(t, Tile) for t in tiles):
    raise ValueError(f"flash_attention: tiles must be three Tiles (forward, dq, dk/dv), got "
                     f"{tiles!r}.")
  kernels = (forward_kernel, backward_kernel, backward_kernel)
  for name, tile, kernel in zip(mosaic_tiles.KERNELS, tiles, kernels):
    if kernel == "mosaic":
      mosaic_tiles.check(name, tile, head_dim)
    else:
      _validate_blocks(tile.block_q, tile.block_kv)


def _validate(q, k, v, segment_ids, kv_segment_ids, block_q, block_kv):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"flash_attention: {name} must be [B, S, H, D] (rank 4), got shape "
                       f"{x.shape}; add the missing batch/head axes with x[None] / x[:, :, None].")
    if x.dtype not in _DTYPES:
      raise ValueError(f"flash_attention: {name}.dtype must be one of bfloat16, float16, "
                       f"float32, got {x.dtype}; cast with {name}.astype(jnp.bfloat16).")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}; cast k and v to {q.dtype}.")
  if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
    raise ValueError(f"flash_attention: expected k and v of shape [B, S, Hkv, D] = "
                     f"[{q.shape[0]}, {q.shape[1]}, Hkv, {q.shape[3]}] matching q {q.shape}, "
                     f"got k {k.shape}, v {v.shape}.")
  hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
  if hq % hkv:
    raise ValueError(f"flash_attention: query heads ({hq}) must be a multiple of KV heads "
                     f"({hkv}); use a number of KV heads that divides {hq}.")
  if d not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"flash_attention: head dim {d} is not supported, expected one of "
                     f"{SUPPORTED_HEAD_DIMS}; zero-pad q, k, v to the next supported size, "
                     f"pass scale={d}**-0.5 and drop the extra output columns.")
  if kv_segment_ids is not None and segment_ids is None:
    raise ValueError("flash_attention: kv_segment_ids needs segment_ids (the queries' ids).")
  for name, ids in (("segment_ids", segment_ids), ("kv_segment_ids", kv_segment_ids)):
    if ids is not None and (ids.shape != q.shape[:2] or not jnp.issubdtype(ids.dtype, jnp.integer)):
      raise ValueError(f"flash_attention: {name} must be integers of shape [B, S] = "
                       f"{q.shape[:2]}, got {ids.dtype}{list(ids.shape)}.")
  _validate_blocks(block_q, block_kv)


def _validate_blocks(block_q, block_kv):
  for name, block in (("block_q", block_q), ("block_kv", block_kv)):
    if block is not None and (block < _MIN_BLOCK or block & (block - 1)):
      raise ValueError(f"flash_attention: {name} must be a power of two >= {_MIN_BLOCK}, got "
                       f"{block}; try 64 or 128, or None for the tuned default.")


def _validate_kernels(forward_kernel, backward_kernel, q, block_q, block_kv, sliding_window,
                      causal):
  check_sliding_window(sliding_window, causal)
  for name, kernel in (("forward_kernel", forward_kernel), ("backward_kernel", backward_kernel)):
    if kernel not in KERNELS:
      raise ValueError(f"flash_attention: {name} must be one of {KERNELS}, got {kernel!r}.")
  d = q.shape[3]
  # (argument, head dims, required multiple of block_q, of block_kv) of each Mosaic kernel
  mosaic = [("forward_kernel", flash_hopper.HEAD_DIMS, _MOSAIC_MIN_ROWS, 64)] * (
      forward_kernel == "mosaic")
  mosaic += [("backward_kernel", flash_hopper_backward.HEAD_DIMS, _MOSAIC_MIN_ROWS,
              _MOSAIC_MIN_ROWS)] * (backward_kernel == "mosaic")
  for name, head_dims, q_multiple, kv_multiple in mosaic:
    if q.dtype not in flash_hopper.DTYPES or d not in head_dims:
      raise ValueError(f"flash_attention: {name}='mosaic' needs bfloat16 or float16 inputs "
                       f"and head dim in {head_dims}, got {q.dtype} and {d}; use "
                       f"{name}='triton'.")
    if (block_q or 0) % q_multiple or (block_kv or 0) % kv_multiple:
      raise ValueError(f"flash_attention: {name}='mosaic' needs block_q a multiple of "
                       f"{q_multiple} and block_kv a multiple of {kv_multiple}, got {block_q} "
                       f"and {block_kv}; pass None for the default.")


# The kernels' calls are jitted (the plan static): a program that calls the same kernel at
# several sites (a ring's step cases, the forward recomputed by a remat policy) traces and
# lowers it once, where it lowered it at every site. The hybrid's gradient (ring 2 x seq 4
# H100s) compiled twice, with and without the kept residuals
# (test_rematerialised_attention_backward_runs_no_forward_kernel[hybrid], jax 0.12.0.1, -n 2):
# 32.1 -> 14.7 s.
@functools.partial(jax.jit, static_argnums=0)
def _forward(plan, q, k, v, q_seg, kv_seg):
  if plan.forward_kernel == "mosaic":
    with _named_like_triton("forward", plan):
      return flash_hopper.forward(plan, q, k, v, q_seg, kv_seg)
  return flash_kernels.forward(plan, q, k, v, q_seg, kv_seg)


def _named_like_triton(kernel, plan):
  """A Mosaic kernel's call gets no name in the HLO: this scope gives it the Triton kernel's,
  from which ``ulysses_jax.aot.cost`` reads its FLOPs."""
  return jax.named_scope(flash_kernels.kernel_name(kernel, plan))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, q, k, v, q_seg, kv_seg):
  return _forward(plan, q, k, v, q_seg, kv_seg)


def _flash_forward(plan, q, k, v, q_seg, kv_seg):
  out, lse = name_kernel_residuals(*_forward(plan, q, k, v, q_seg, kv_seg))
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _flash_backward(plan, residuals, cotangents):
  q, k, v, q_seg, kv_seg, out, lse = residuals
  return (*_backward(plan, q, k, v, q_seg, kv_seg, out, lse, *cotangents, q.dtype), None, None)


@functools.partial(jax.jit, static_argnums=(0, 10))
def _backward(plan, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse, grad_dtype):
  """(dq, dk, dv) in ``grad_dtype`` on padded inputs; ``d_lse`` is the lse's cotangent."""
  # dS_ij = P_ij (dP_ij - delta_i) with delta_i = rowsum(dO * O)_i - dlse_i: the lse cotangent
  # reaches the scores as + P_ij dlse_i.
  delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta - d_lse
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  d_out = d_out.astype(q.dtype)
  if plan.backward_kernel == "triton":
    dq = flash_kernels.backward_dq(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg, grad_dtype)
    dk, dv = flash_kernels.backward_dkv(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg,
                                        grad_dtype)
    return dq, dk, dv
  if plan.dkv.accumulate_dq:  # one kernel
    with _named_like_triton("dkv_dq", plan):
      dk, dv, dq = flash_hopper_backward.backward_dkv(plan, q, k, v, d_out, lse2, delta, q_seg,
                                                      kv_seg, grad_dtype)
    return dq, dk, dv
  with _named_like_triton("dq", plan):
    dq = flash_hopper_backward.backward_dq(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg,
                                           grad_dtype)
  with _named_like_triton("dkv", plan):
    dk, dv = flash_hopper_backward.backward_dkv(plan, q, k, v, d_out, lse2, delta, q_seg, kv_seg,
                                                grad_dtype)
  return dq, dk, dv


_flash.defvjp(_flash_forward, _flash_backward)
