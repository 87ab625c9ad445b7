"""The doctor's check of our split-K decode kernel (``kernels.decode_hopper``) on a Hopper GPU.

One device's partial attention of a decode step as ``decode_backend="auto"`` runs it there:
Llama-3.1-8B's group (4 query heads per KV head, head dim 128, bfloat16) over ``slots`` cache
slots at shuffled positions, a tenth of them empty. The kernel and XLA's path
(``generate.attention.partial_attention``, fused as on GPUs) are each compared with the same
computation in float32, then timed (median of ``iters`` samples after ``warmup``, each
``BURST`` calls dispatched back to back: the device's time per call, not the host's dispatch
of a program that runs for microseconds), with the HBM bandwidth each reached reading k and
v: the measurement that the compiled comparison behind ``auto``'s choice
(``benchmarks/decode_compiled.py``) predicts. ``decode_rows`` does this over
``SLOT_COUNTS`` (8K to 1M slots: a device's share of the cache shrinks as the mesh grows) and
states each bandwidth as a share of a device-to-device copy timed on the same device
(``doctor.timing.copy_bandwidth``, bytes read and written counted): what the memory can give.
Beside the kernel's defaults it times the ``VARIANTS`` of its block, ring slots and splits
(``variant_ms``), the measurements that choose its defaults (``decode_hopper.default_*``); the
``WIDE_ROWS`` check and time head dim 256 (Gemma 3) too.
"""

import jax
import jax.numpy as jnp

from ulysses_jax.doctor.timing import copy_bandwidth, time_fn
from ulysses_jax.doctor.kernels import TOLERANCE, relative_error
from ulysses_jax.generate.attention import partial_attention
from ulysses_jax.kernels import decode_hopper
from ulysses_jax.kernels import target as target_lib

SLOTS = 1 << 20
SLOT_COUNTS = (1 << 13, 1 << 15, 1 << 17, SLOTS)
COPY_BYTES = 1 << 30
GROUP, HEAD_DIM = 4, 128
# Rows beside those of ``SLOT_COUNTS``, each (head dim, slots), without variants: Gemma 3's
# head dim, which the kernel takes with its output leaving in two chunks.
WIDE_ROWS = ((256, 1 << 17),)
BURST = 10  # calls per timed sample (``timing.time_fn``)
# Options of ``decode_hopper.decode_attention`` timed beside its defaults (128-slot blocks, two
# ring slots at head dim 128, one CTA per SM): finer blocks with the deeper ring they allow, the
# same blocks through two slots only, twice the CTAs (two waves), two compute warpgroups
# taking the blocks in turn (64-slot blocks, two slots: what fits at head dim 128), and the
# values slots last (``v_layout="DC"``, XLA's layout, which the cache had for the kernel too
# until its first GPU run: a block's values are 128 runs of 256 bytes, 2 MiB apart at 1M
# slots, where the default "CD" reads one run).
VARIANTS = {"64-slot blocks": dict(block=64), "64-slot blocks, 2 slots": dict(block=64,
                                                                              num_stages=2),
            "2 waves": dict(waves=2), "2 compute warpgroups": dict(consumers=2),
            "values slots last": dict(v_layout="DC")}


def _inputs(device, slots, head_dim):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (1, 1, GROUP, 1, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, 1, slots, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, 1, head_dim, slots), jnp.bfloat16)
  k_pos = jax.random.permutation(keys[3], slots)[None].astype(jnp.int32)
  k_pos = jnp.where(k_pos % 10 == 9, -1, k_pos)  # empty slots
  q_pos = jnp.array([[slots]], jnp.int32)
  return jax.device_put((q, k, v, q_pos, k_pos), device)


def decode_rows(device, *, slot_counts=SLOT_COUNTS, warmup: int = 2, iters: int = 10,
                burst: int = BURST, interpret: bool = False, copy_bytes: int = COPY_BYTES,
                variants=VARIANTS, wide_rows=WIDE_ROWS, on_row=None) -> list[dict]:
  """``decode_row`` at each of ``slot_counts`` (head dim ``HEAD_DIM``, with ``variants``) and
  of ``wide_rows``, with the copy bandwidth of ``device`` timed once (``copy_bytes`` each
  way); one row saying why where the kernel cannot run. ``on_row(row)`` is called as each
  row is done (a row with its variants takes seconds on a GPU)."""
  if not interpret and target_lib.of_device(device).generation != "sm90":
    shapes = [dict()]
  else:
    copy = copy_bandwidth(device, copy_bytes, warmup=warmup, iters=iters, burst=burst)
    common = dict(warmup=warmup, iters=iters, burst=burst, interpret=interpret,
                  copy_gb_per_s=copy / 1e9)
    shapes = ([dict(slots=slots, variants=variants, **common) for slots in slot_counts] +
              [dict(slots=slots, head_dim=head_dim, variants={}, **common)
               for head_dim, slots in wide_rows])
  rows = []
  for shape in shapes:
    rows.append(decode_row(device, **shape))
    if on_row:
      on_row(rows[-1])
  return rows


def _kernel_options(options, slots, device, head_dim=HEAD_DIM):
  """``decode_attention``'s keyword arguments for a ``VARIANTS`` entry at ``slots`` slots."""
  options = dict(options)
  waves = options.pop("waves", 1)
  if waves > 1:
    block = options.get("block") or decode_hopper.default_block(
        slots, head_dim, options.get("consumers", 1))
    sms = target_lib.of_device(device).core_count or decode_hopper.H100_SMS
    options["num_splits"] = waves * decode_hopper.default_splits(1, 1, -(-slots // block), sms)
  return options


def decode_row(device, *, slots: int = SLOTS, head_dim: int = HEAD_DIM, warmup: int = 2,
               iters: int = 10, burst: int = BURST, interpret: bool = False,
               copy_gb_per_s: float | None = None, variants=VARIANTS) -> dict:
  """The kernel's check and timing beside XLA's on ``device`` (``passed`` None where it cannot
  run: not a Hopper GPU), and each of ``variants`` timed (ms, None where it failed).
  ``interpret``: the kernel in GPU interpret mode (tests, on a CPU). With ``copy_gb_per_s``
  (the device's copy bandwidth) each bandwidth's share of it too."""
  row = {"kernel": "ours mosaic decode", "slots": slots, "group": GROUP, "head_dim": head_dim}
  if not interpret and target_lib.of_device(device).generation != "sm90":
    return {**row, "status": "needs a Hopper GPU (sm90)", "passed": None}
  args = _inputs(device, slots, head_dim)  # v slots last, as XLA's decode reads it
  scale = head_dim ** -0.5
  kernel = jax.jit(lambda *x: decode_hopper.decode_attention(
      *x, scale=scale, window=None, interpret=interpret))
  xla = jax.jit(lambda *x: partial_attention(*x, scale=scale, window=None, fused=True))
  f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
  with jax.default_matmul_precision("highest"):
    reference = jax.jit(lambda *x: partial_attention(*x, scale=scale, window=None))(*f32)
  kernel_args = _laid_out(args, "CD")
  errors = {name: max(relative_error(o, reference[0]), relative_error(lse, reference[1]))
            for name, (o, lse) in (("kernel", kernel(*kernel_args)), ("xla", xla(*args)))}
  row.update(error=errors["kernel"], xla_error=errors["xla"],
             passed=bool(errors["kernel"] <= TOLERANCE))
  row["status"] = "ok" if row["passed"] else (
      f"relative error {errors['kernel']:.2e} > {TOLERANCE} (XLA's: {errors['xla']:.2e})")
  if row["passed"]:
    cache_gb = 2 * slots * head_dim * 2 / 1e9  # k and v, bfloat16
    timing = dict(warmup=warmup, iters=iters, burst=burst)
    row["kernel_ms"] = 1e3 * time_fn(kernel, *kernel_args, **timing)["median_s"]
    row["xla_ms"] = 1e3 * time_fn(xla, *args, **timing)["median_s"]
    row["kernel_gb_per_s"] = cache_gb / row["kernel_ms"] * 1e3
    row["xla_gb_per_s"] = cache_gb / row["xla_ms"] * 1e3
    row["variant_ms"] = {name: _time_variant(_kernel_options(options, slots, device, head_dim),
                                             args, reference, scale, interpret, timing)
                         for name, options in variants.items()}
    if copy_gb_per_s:
      row.update(copy_gb_per_s=copy_gb_per_s,
                 kernel_pct_of_copy=100 * row["kernel_gb_per_s"] / copy_gb_per_s,
                 xla_pct_of_copy=100 * row["xla_gb_per_s"] / copy_gb_per_s)
  return row


def _time_variant(options, args, reference, scale, interpret, timing):
  """Milliseconds of the kernel with ``options``, None where it fails or its check does."""
  kernel = jax.jit(lambda *x: decode_hopper.decode_attention(
      *x, scale=scale, window=None, interpret=interpret, **options))
  args = _laid_out(args, options.get("v_layout", "CD"))
  try:
    o, lse = kernel(*args)
    if max(relative_error(o, reference[0]), relative_error(lse, reference[1])) > TOLERANCE:
      return None
    return 1e3 * time_fn(kernel, *args, **timing)["median_s"]
  except Exception:  # noqa: BLE001 - a variant that does not compile or run is not timed
    return None


def _laid_out(args, v_layout):
  """The inputs (v slots last) with v in ``v_layout``."""
  q, k, v, *positions = args
  return (q, k, v if v_layout == "DC" else v.swapaxes(2, 3), *positions)


def check(row: dict) -> dict:
  """The doctor's check line of ``decode_row``'s row."""
  detail, name = row["status"], "decode kernel vs XLA"
  if row["passed"] is not None:
    name += f", {row['slots']:,} slots" + (
        f", head dim {row['head_dim']}" if row["head_dim"] != HEAD_DIM else "")
  if row.get("kernel_ms") is not None:
    def share(who):
      return (f", {row[f'{who}_pct_of_copy']:.0f} % of the copy's {row['copy_gb_per_s']:.0f}"
              if "copy_gb_per_s" in row else "")

    detail += (f"; {row['slots']:,} slots: kernel {row['kernel_ms']:.3f} ms "
               f"({row['kernel_gb_per_s']:.0f} GB/s{share('kernel')}), XLA "
               f"{row['xla_ms']:.3f} ms ({row['xla_gb_per_s']:.0f} GB/s{share('xla')})")
    timed = {name: ms for name, ms in row.get("variant_ms", {}).items() if ms is not None}
    if timed:
      fastest = min(timed, key=timed.get)
      detail += f"; fastest variant: {fastest}, {timed[fastest]:.3f} ms"
  return {"name": name, "passed": row["passed"], "detail": detail}
