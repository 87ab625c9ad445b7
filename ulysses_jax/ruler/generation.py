"""RULER's answers by generation: every example's prompt decoded greedily within its task's
budget (``Example.budget``, RULER's ``tokens_to_generate``), stopped at an EOS id, the new
tokens decoded to text for ``scoring.ruler_score``.

The examples of one task and length run together, ``batch_size`` prompts a call of
``ulysses_jax.generate.generate``; every call at one length shares one cache layout (the
length's longest prompt, its largest budget), so its prefill and decode programs compile once
per length (``generate._programs`` keeps them).
"""

from collections.abc import Callable, Sequence

from ulysses_jax import generate as generate_lib


def predict(model, examples, tokenizer, *, batch_size: int, eos_ids: Sequence[int] = (),
            progress: Callable[[int], None] | None = None) -> list[dict]:
  """Per example, in order: ``{"prediction": text, "generated_tokens": n}`` (n with the EOS,
  the text without it). ``model``: a ``Llama`` on its mesh; ``tokenizer`` decodes (special
  tokens skipped, as RULER's reader sees the text); ``progress(n)`` after each batch of n
  examples."""
  config = model.config
  out = [None] * len(examples)
  groups = {}  # (length, task) -> indices, in order
  for i, ex in enumerate(examples):
    groups.setdefault((ex.length, ex.task), []).append(i)
  layouts = {}
  for length in sorted({ex.length for ex in examples}):
    at_length = [ex for ex in examples if ex.length == length]
    layouts[length] = generate_lib.plan_cache(
        model.mesh, batch=batch_size, prompt_len=max(len(ex.prompt_ids) for ex in at_length),
        max_new_tokens=max(ex.budget for ex in at_length), kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, dtype=config.dtype, layer_windows=config.layer_windows())
  for (length, _), indices in groups.items():
    for start in range(0, len(indices), batch_size):
      batch = indices[start:start + batch_size]
      outputs = generate_lib.generate(
          model, [examples[i].prompt_ids for i in batch],
          max_new_tokens=examples[batch[0]].budget, eos_ids=eos_ids, layout=layouts[length])
      for i, ids in zip(batch, outputs):
        text_ids = ids[:-1] if ids and ids[-1] in eos_ids else ids
        out[i] = {"prediction": tokenizer.decode(text_ids), "generated_tokens": len(ids)}
      if progress is not None:
        progress(len(batch))
  return out
