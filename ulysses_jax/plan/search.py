"""The planner's search: which layout, and which of the knobs a user would otherwise guess, to
train a model at a sequence length on some GPUs (the predictions are ``plan.memory``'s and
``plan.step``'s).

For every factorisation ``devices = data x seq x ring`` (``seq`` = Ulysses all-to-all degree,
innermost; ``ring`` = ring-attention degree; see ``ulysses_jax.mesh``), every activation
policy, the state's placement (``OFFLOADS``: on the device; the optimizer state on the host;
with it the layer parameters and gradients), with the ``full`` policies every remat group
and attention head chunk count, and every parameter precision (``PRECISIONS``), it keeps
the largest MLP tile (``MLP_CHUNKS``, untiled first) with which the step fits the device
budget and the host memory, and predicts the step's time. Only layouts the trainer accepts
are tried: ``seq·ring`` divides the sequence length, ``data·accum_steps`` divides the batch,
head chunks divide ``num_kv_heads``, layer parameters on the host only without gradient
accumulation; and ``seq`` at most the query heads (unless the mesh is given). A knob the
user gives has one candidate (``Knobs``).

The recommendation is the row with the best numerics (``PRECISIONS`` order) among those
predicted within ``NEAR`` of the fastest: the time model is not finer than that, the
numerics differ for sure. When nothing fits, ``longest_seq_len`` and ``fewest_devices`` say
how far from fitting the question is.
"""

import dataclasses
import itertools

from ulysses_jax.plan import moe
from ulysses_jax.plan.hardware import Hardware
from ulysses_jax.plan.memory import predict_memory
from ulysses_jax.plan.model import Layout, Model
from ulysses_jax.plan.step import predict_step

REMATS = ("full", "full_offload", "save_names", "offload", "save_dots", "none")
REMAT_GROUPS = (1, 2, 4, 8)  # layers per rematerialised group
# Attention head chunks. Not 8: for Llama-3.1-8B on one H100 (1,048,576 tokens) 8 chunks
# compiled to more memory than 4 (65.9 vs 63.2 GiB), where the model predicts less.
HEAD_CHUNKS = (1, 2, 4)
# Tokens per device per MLP tile, 0 = untiled; larger tiles first (fewer, larger matmuls).
MLP_CHUNKS = (0, 8192, 4096, 2048, 1024)
# Where the state lives: (optimizer state on the host, layer parameters and gradients too).
OFFLOADS = {"none": (False, False), "optimizer": (True, False), "params": (True, True)}
NEAR = 1.02
# The longest-sequence search's step, in tokens per device.
LENGTH_STEP = 1024
MAX_DEVICES = 65536


@dataclasses.dataclass(frozen=True)
class Precision:
  """Parameters' dtype and whether the optimizer updates float32 master weights."""
  param_dtype: str
  master_weights: bool
  trade_off: str


PRECISIONS = (
    Precision("float32", False, "float32 parameters and Adam moments"),
    Precision("bfloat16", True, "bf16 parameters, float32 master weights and moments"),
    Precision("bfloat16", False, "bf16 parameters and moments, no master weights: updates "
              "below bf16's resolution (1/256 of a weight) are lost"),
)


def precisions(param_dtype: str | None = None,
               master_weights: bool | None = None) -> tuple[Precision, ...]:
  """The precisions a given ``param_dtype`` / ``master_weights`` pin (None: not given)."""
  if master_weights and param_dtype == "float32":
    raise ValueError("master weights are a float32 copy of lower-precision parameters; with "
                     "master_weights give param_dtype='bfloat16' (or 'float16').")
  found = tuple(p for p in PRECISIONS
                if param_dtype in (None, p.param_dtype)
                and master_weights in (None, p.master_weights))
  if found:
    return found
  return (Precision(param_dtype, bool(master_weights),
                    f"{param_dtype} parameters" + (", float32 master weights"
                                                   if master_weights else "")),)


@dataclasses.dataclass(frozen=True)
class Knobs:
  """The candidates the search tries for each knob; a knob the user gave has one.
  ``mesh``: ``(data, seq, ring)``, or None for every factorisation of the devices;
  ``attention``: ``Layout.attention`` (the all-gather-KV baseline only when asked)."""
  precisions: tuple[Precision, ...] = PRECISIONS
  mlp_chunks: tuple[int, ...] = MLP_CHUNKS
  remats: tuple[str, ...] = REMATS
  remat_groups: tuple[int, ...] = REMAT_GROUPS
  head_chunks: tuple[int, ...] = HEAD_CHUNKS
  offloads: tuple[str, ...] = tuple(OFFLOADS)
  mesh: tuple[int, int, int] | None = None
  attention: str = "ulysses"


def layouts(devices: int, batch: int, *, seq_len: int | None = None, accum_steps: int = 1,
            remats=REMATS, offloads=tuple(OFFLOADS), remat_groups=(1,), head_chunks=(1,),
            mesh=None, attention="ulysses"):
  """Every ``Layout`` the trainer accepts with data·seq·ring = devices: data·accum_steps
  dividing the batch, seq·ring dividing ``seq_len`` (when given), remat groups and head
  chunks (give only divisors of ``num_kv_heads``) with the ``full`` policies only, layer
  parameters on the host only without gradient accumulation; ``mesh`` (data, seq, ring)
  if given; ``attention`` as ``Layout.attention`` (the all-gather-KV baseline: no ring)."""
  for data in range(1, devices + 1):
    if devices % data or batch % (data * accum_steps):
      continue
    for seq in range(1, devices // data + 1):
      ring = devices // data // seq
      if (devices // data) % seq or (seq_len is not None and seq_len % (seq * ring)):
        continue
      if mesh is not None and (data, seq, ring) != tuple(mesh):
        continue
      if attention == "allgather_kv" and ring > 1:
        continue
      for remat in remats:
        full = remat in ("full", "full_offload")
        groups, chunks = (remat_groups, head_chunks) if full else ((1,), (1,))
        for offload, group, chunk in itertools.product(offloads, groups, chunks):
          opt, params = OFFLOADS[offload]
          if not (params and accum_steps > 1):
            yield Layout(data, seq, ring, remat, opt, group, params, chunk, attention)


def _candidates(model, devices, batch, seq_len, accum_steps, knobs):
  groups = tuple(k for k in knobs.remat_groups if model.num_layers % k == 0)
  chunks = tuple(k for k in knobs.head_chunks if model.num_kv_heads % k == 0)
  # Not seq beyond the query heads: the all-to-all would pad heads that compute nothing (and
  # planning them grows fast with seq); a ring over the rest does the same work. The expert
  # placement, when set, needs a seq that divides the experts.
  return (layout for layout in layouts(devices, batch, seq_len=seq_len,
                                       accum_steps=accum_steps, remats=knobs.remats,
                                       offloads=knobs.offloads, remat_groups=groups,
                                       head_chunks=chunks, mesh=knobs.mesh,
                                       attention=knobs.attention)
          if (layout.seq <= model.num_heads or knobs.mesh is not None)
          and (model.expert_placement != "expert" or moe.splits(model, layout.seq)))


def _fits(memory, hardware):
  return memory["total"] <= hardware.budget_bytes and memory["host"] <= hardware.host_bytes


def _fitting(model, layout, hardware, **sizes):
  """``(layout, its memory)`` for ``layout`` keeping attention's residuals when that fits, else
  for the same layout recomputing them (``Layout.keep_attention=False``) when that does;
  None when neither fits."""
  tries = [layout] + [dataclasses.replace(layout, keep_attention=False)] * layout.keeps_attention
  for candidate in tries:
    memory = predict_memory(model, candidate, **sizes)
    if _fits(memory, hardware):
      return candidate, memory
  return None


def _check(sizes, knobs):
  if min(sizes.values()) < 1:
    raise ValueError(f"seq_len, devices, batch and accum_steps must be >= 1, got {sizes}.")
  if not knobs.precisions or not knobs.mlp_chunks:
    raise ValueError("give at least one precision and one MLP tile to search.")


def plan(model: Model, *, seq_len: int, devices: int, hardware: Hardware, batch: int = 1,
         dtype: str = "bfloat16", accum_steps: int = 1, knobs: Knobs = Knobs()) -> list[dict]:
  """Feasible layouts, the recommendation first, then the others fastest first; each row
  has ``layout``, ``precision``, ``mlp_chunk``, ``memory`` and ``step``."""
  _check(dict(seq_len=seq_len, devices=devices, batch=batch, accum_steps=accum_steps), knobs)
  sizes = dict(batch=batch, seq_len=seq_len, dtype=dtype, accum_steps=accum_steps)
  rows = []
  for layout in _candidates(model, devices, batch, seq_len, accum_steps, knobs):
    for precision in knobs.precisions:
      numerics = dict(param_dtype=precision.param_dtype,
                      master_weights=precision.master_weights)
      for tile in knobs.mlp_chunks:
        tiled = dataclasses.replace(model, mlp_chunk=tile)
        fitting = _fitting(tiled, layout, hardware, **sizes, **numerics)
        if fitting:
          chosen, memory = fitting
          step = predict_step(tiled, chosen, hardware=hardware, **sizes, **numerics)
          rows.append({"layout": chosen, "precision": precision, "mlp_chunk": tile,
                       "memory": memory, "step": step})
          break
  rows.sort(key=lambda r: (r["step"]["step_s"], r["memory"]["total"]))
  if rows:
    near = [r for r in rows if r["step"]["step_s"] <= NEAR * rows[0]["step"]["step_s"]]
    best = min(near, key=lambda r: (_numerics_rank(r["precision"]), r["step"]["step_s"]))
    rows.remove(best)
    rows.insert(0, best)
  return rows


def _numerics_rank(precision):
  return PRECISIONS.index(precision) if precision in PRECISIONS else 0


def fits(model: Model, *, seq_len: int, devices: int, hardware: Hardware, batch: int = 1,
         dtype: str = "bfloat16", accum_steps: int = 1, knobs: Knobs = Knobs()) -> bool:
  """Whether any layout fits (``plan`` without the step times: stops at the first)."""
  sizes = dict(batch=batch, seq_len=seq_len, dtype=dtype, accum_steps=accum_steps)
  smallest_tile = min(knobs.mlp_chunks, key=lambda k: k or float("inf"))
  tiled = dataclasses.replace(model, mlp_chunk=smallest_tile)
  return any(_fitting(tiled, layout, hardware, **sizes, param_dtype=p.param_dtype,
                      master_weights=p.master_weights)
             for layout in _candidates(model, devices, batch, seq_len, accum_steps, knobs)
             for p in knobs.precisions)


def longest_seq_len(model: Model, *, devices: int, **kwargs) -> int:
  """The longest sequence, in steps of ``LENGTH_STEP`` tokens per device, with which some
  layout fits on ``devices`` (0: not even one step); ``kwargs`` as ``fits``'s."""
  unit = devices * LENGTH_STEP
  fit = lambda k: fits(model, seq_len=k * unit, devices=devices, **kwargs)
  if not fit(1):
    return 0
  low, high = 1, 2
  while fit(high):  # memory grows with the length: double, then bisect
    low, high = high, 2 * high
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fit(mid) else (low, mid)
  return low * unit


def splits(devices: int, *, batch: int, seq_len: int, accum_steps: int = 1) -> bool:
  """Whether some data x (seq·ring) of ``devices`` splits the work as the trainer needs."""
  return any(devices % data == 0 and seq_len % (devices // data) == 0
             for data in range(1, batch // accum_steps + 1) if batch % (data * accum_steps) == 0)


def fewest_devices(model: Model, *, seq_len: int, hardware: Hardware, batch: int = 1,
                   accum_steps: int = 1, **kwargs) -> int | None:
  """The fewest devices of ``hardware``'s kind (1 to a node, then whole nodes, up to
  ``MAX_DEVICES``; counts that split the work as the trainer needs) with which some layout
  fits ``seq_len`` (None if none); ``kwargs`` as ``fits``'s. Assumes more devices never
  hurt: doubles, then bisects."""
  node = hardware.intra_node
  counts = [d for d in list(range(1, node + 1)) + list(range(2 * node, MAX_DEVICES + 1, node))
            if splits(d, batch=batch, seq_len=seq_len, accum_steps=accum_steps)]
  if not counts:
    return None
  kwargs.update(batch=batch, accum_steps=accum_steps)
  fit = lambda i: fits(model, seq_len=seq_len, devices=counts[i], hardware=hardware, **kwargs)
  low, high = -1, 0
  while not fit(high):
    if high == len(counts) - 1:
      return None
    low, high = high, min(2 * high + 1, len(counts) - 1)
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (low, mid) if fit(mid) else (mid, high)
  return counts[high]
