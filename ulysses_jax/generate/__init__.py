"""Generation from long prompts: a sequence-parallel prefill, a KV cache sharded over the mesh,
and decoding that attends each device's shard of the cache and combines the partial results
(distributed flash-decoding).

    from ulysses_jax.generate import Sampling, generate
    outputs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16)      # greedy
    outputs = generate(model, prompts, max_new_tokens=16, eos_ids=(2,),
                       sampling=Sampling(temperature=0.7, top_p=0.9, seed=1))

Prompt token ids in (any number of prompts of any lengths, batched together), generated ids
out, in the prompts' order: each list ends at the first EOS id (included) or after
``max_new_tokens`` tokens. The model is a ``Llama`` on its mesh (``hf.load_llama``,
``finetune.load_model``; with ``rules=PARAM_RULES`` its weights are replicated, which decoding
reads fastest, where the training layout all-gathers them every step); the mesh's axes decide
where the prefill and the cache run.

* ``cache``: the cache's layout on the mesh and its memory per device (``plan_cache``,
  ``CacheLayout.bytes_per_device``); sliding-window layers keep rolling buffers.
* ``attention``: the decode attention, partial outputs with float32 log-sum-exps combined over
  the devices (an empty shard is the neutral state).
* ``steps``: the jitted prefill and decode programs, from the model's own layers
  (``experts``: a decode step's mixture-of-experts layer over the whole stack of experts).
* ``sampling``: greedy, temperature, top-k, top-p; one key per step on every device.

The command line is ``ulysses-generate`` (``python -m ulysses_jax.generate``,
``ulysses_jax.cli.generate``).
"""

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax import sharding
from ulysses_jax.generate import steps
from ulysses_jax.generate.cache import CacheLayout, KVCache, empty_cache, plan_cache
from ulysses_jax.generate.sampling import Sampling
from ulysses_jax.mesh import DATA, sequence_axes

GREEDY = Sampling()
# Parameters replicated on every device (the training rules less FSDP's split of the embed
# axis): a decode step reads each weight once where it lies, where the FSDP layout would
# all-gather every weight for every token (Llama-3.1-8B: 15 GiB per device per step).
PARAM_RULES = tuple((name, None if name == "embed" else axes)
                    for name, axes in sharding.DEFAULT_RULES)

__all__ = ["GREEDY", "PARAM_RULES", "CacheLayout", "Generator", "KVCache", "Sampling",
           "check_prompts", "generate", "plan_cache"]


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_new_tokens: int,
                  max_positions: int | None = None) -> list[np.ndarray]:
  """The prompts as int32 arrays; raises ``ValueError`` naming the prompt for an empty one,
  ids outside the vocabulary, or one that with ``max_new_tokens`` exceeds ``max_positions``."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  if not len(prompts):
    raise ValueError("no prompts: give at least one list of token ids.")
  arrays = []
  for i, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not len(ids):
      raise ValueError(f"prompt {i + 1} is empty (or not a flat list of token ids): every "
                       "prompt needs at least one token.")
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size:
      raise ValueError(f"prompt {i + 1}: token ids must be integers in [0, {vocab_size}) (the "
                       f"model's vocabulary), got {ids.min()}..{ids.max()} ({ids.dtype}).")
    if max_positions is not None and len(ids) + max_new_tokens > max_positions:
      raise ValueError(f"prompt {i + 1} has {len(ids)} tokens; with max_new_tokens="
                       f"{max_new_tokens} it needs {len(ids) + max_new_tokens} positions but "
                       f"the model has {max_positions}; shorten it or lower max_new_tokens.")
    arrays.append(ids.astype(np.int32))
  return arrays


@functools.lru_cache(maxsize=16)
def _programs(graphdef, layout: CacheLayout, sampling: Sampling):
  """The jitted prefill, first-token and decode programs (the cache donated), kept for the
  next ``Generator`` of the same model structure, layout and sampling: a second
  ``generate`` call with prompts that fit the same layout compiles nothing."""
  cache_shardings = layout.shardings()
  rows = steps.rows_sharding(layout)
  return (jax.jit(functools.partial(steps.prefill, graphdef, layout), donate_argnums=(1, 5),
                  out_shardings=(cache_shardings, steps.rows_sharding(layout, 2))),
          jax.jit(functools.partial(steps.first_token, graphdef, sampling),
                  out_shardings=rows),
          jax.jit(functools.partial(steps.decode, graphdef, layout, sampling),
                  donate_argnums=(1,), out_shardings=(cache_shardings, rows)))


class Generator:
  """The compiled prefill and decode programs of one model, cache layout and sampling.

  ``prefill(tokens_BS, lengths_B, progress)`` -> the first new tokens (int ``[B]`` on the
  host), the cache filled; ``decode()`` -> the next tokens, one step further;
  ``decode_async()`` the same left on the device, not waited for; ``stream(steps)`` yields the
  tokens of ``steps`` decode steps, each step queued before the tokens of the one before are
  fetched (the next step reads them on the device), so the device runs the steps back to back
  while the caller looks at each (stopping early leaves at most one more step run).
  ``tokens_BS``:
  int ``[B, S]`` prompts (B = ``layout.batch``, S = ``layout.prompt_len``), padded at the end;
  ``progress(chunks_done)`` is called after each prefill chunk. ``decode_step`` is the jitted
  decode program (its cache argument donated) for inspection: ``decode_step.lower(...)``.
  """

  def __init__(self, model, layout: CacheLayout, sampling: Sampling = GREEDY):
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.layout, self.sampling = layout, sampling
    self.prefill_step, self.first_token_step, self.decode_step = _programs(
        self.graphdef, layout, sampling)
    self.cache = self.tokens = self.lengths = None
    self.step = 0

  def prefill(self, tokens_BS, lengths_B, progress: Callable[[int], None] | None = None):
    layout = self.layout
    tokens_BS = np.asarray(tokens_BS, np.int32)
    expected = (layout.batch, layout.prompt_len)
    if tokens_BS.shape != expected:
      raise ValueError(f"tokens must be [batch, prompt_len] = {expected} (the cache layout's), "
                       f"got {tokens_BS.shape}.")
    chunk_spec = NamedSharding(layout.mesh, P(DATA, sequence_axes(layout.mesh)))
    self.lengths = jax.device_put(np.asarray(lengths_B, np.int32), steps.rows_sharding(layout))
    self.cache = empty_cache(layout)
    last_BE = jax.device_put(np.zeros((layout.batch, self.config.hidden_dim),
                                      np.float32), steps.rows_sharding(layout, 2))
    t = layout.chunk_len
    for n in range(layout.chunks):
      chunk = jax.device_put(tokens_BS[:, n * t:(n + 1) * t], chunk_spec)
      self.cache, last_BE = self.prefill_step(self.params, self.cache, chunk, np.int32(n),
                                              self.lengths, last_BE)
      if progress is not None:
        jax.block_until_ready(last_BE)
        progress(n + 1)
    self.tokens = self.first_token_step(self.params, last_BE)
    self.step = 0
    return np.asarray(jax.device_get(self.tokens))

  def decode(self):
    return np.asarray(jax.device_get(self.decode_async()))

  def decode_async(self):
    if self.step >= self.layout.gen_slots:
      raise ValueError(f"the cache has {self.layout.gen_slots} slots for new tokens, all "
                       "used; plan the cache for more max_new_tokens.")
    self.cache, self.tokens = self.decode_step(self.params, self.cache, self.tokens,
                                               np.int32(self.step), self.lengths)
    self.step += 1
    return self.tokens

  def stream(self, steps: int):
    queued = self.decode_async() if steps else None
    for i in range(steps):
      fetched, queued = queued, (self.decode_async() if i + 1 < steps else None)
      yield np.asarray(jax.device_get(fetched))


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = GREEDY, eos_ids: Sequence[int] = (),
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             max_positions: int | None = None, chunk_len: int | None = None,
             progress: Callable[[int, int], None] | None = None,
             layout: CacheLayout | None = None) -> list[list[int]]:
  """Generates from every prompt (token ids) at once; returns the new ids of each, in order.

  A row stops after an id in ``eos_ids`` (kept), when ``stop(row, ids_so_far)`` returns True
  (e.g. a stop string found in the decoded text; the ids are kept), or after
  ``max_new_tokens``. ``on_token(row, id)`` sees each kept id as it comes (streaming). The
  decode steps run as ``Generator.stream`` queues them: back to back on the device while the
  host looks at each step's tokens.
  ``max_positions``: the model's position limit (prompt + new tokens), checked before any
  work. ``chunk_len``: prefill in chunks of this many tokens (default: the whole prompt in
  one pass); ``progress(chunks_done, chunks)`` after each chunk. ``layout``: the cache's
  layout (default ``plan_cache`` for these prompts; ``Generator`` and ``plan_cache`` give the
  pieces, for callers that keep compiled programs between calls).
  """
  config = model.config
  arrays = check_prompts(prompts, vocab_size=config.vocab_size, max_new_tokens=max_new_tokens,
                         max_positions=max_positions)
  lengths = [len(a) for a in arrays]
  if layout is None:
    layout = plan_cache(model.mesh, batch=len(arrays), prompt_len=max(lengths),
                        max_new_tokens=max_new_tokens, kv_heads=config.num_kv_heads,
                        head_dim=config.head_dim, dtype=config.dtype,
                        layer_windows=config.layer_windows(), chunk_len=chunk_len)
  check_layout(layout, len(arrays), max(lengths), max_new_tokens)
  tokens = np.zeros((layout.batch, layout.prompt_len), np.int32)
  for row, ids in enumerate(arrays):
    tokens[row, :len(ids)] = ids
  # Rows that only pad the batch to the data axis hold one token and are dropped.
  all_lengths = np.array(lengths + [1] * (layout.batch - len(arrays)), np.int32)
  generator = Generator(model, layout, sampling)
  report = None if progress is None else (lambda n: progress(n, layout.chunks))
  new = generator.prefill(tokens, all_lengths, report)
  decoded = generator.stream(max_new_tokens - 1)
  outputs = [[] for _ in arrays]
  done = [False] * len(arrays)
  eos = set(int(i) for i in eos_ids)
  for step in range(max_new_tokens):
    if step:
      new = next(decoded)
    for row in range(len(arrays)):
      if done[row]:
        continue
      outputs[row].append(int(new[row]))
      if on_token is not None:
        on_token(row, int(new[row]))
      done[row] = int(new[row]) in eos or (stop is not None and stop(row, outputs[row]))
    if all(done):
      break
  return outputs


def check_layout(layout: CacheLayout, batch: int, prompt_len: int, max_new_tokens: int):
  """Raises ``ValueError`` unless ``layout`` holds ``batch`` prompts of up to ``prompt_len``
  tokens and ``max_new_tokens`` new ones."""
  needs = dict(batch=batch, prompt_len=prompt_len, gen_slots=max_new_tokens - 1)
  short = {k: (getattr(layout, k), v) for k, v in needs.items() if getattr(layout, k) < v}
  if short:
    sizes = ", ".join(f"{k}={have} < {need}" for k, (have, need) in short.items())
    raise ValueError(f"the cache layout is too small: {sizes}; plan it with plan_cache for "
                     "these prompts.")


def describe_memory(layout: CacheLayout) -> str:
  """One line: the cache's size per device and the formula's terms."""
  gib = layout.bytes_per_device() / 2**30
  return (f"KV cache: {gib:.3f} GiB per device (k and v of {len(layout.layer_windows)} layers,"
          f" {math.ceil(layout.kv_heads / layout.head_shards)} of {layout.kv_heads} KV heads x "
          f"1/{layout.slot_shards} of the slots x {-(-layout.batch // layout.mesh.shape[DATA])}"
          f" of {layout.batch} rows per device, {jnp.dtype(layout.dtype).name}; slots: "
          f"{layout.full_capacity} per full layer" +
          "".join(f", {layout.capacity(w)} per layer with window {w}"
                  for w in layout.kinds if w is not None) + ")")
