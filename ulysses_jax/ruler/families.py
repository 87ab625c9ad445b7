"""The task families as RULER writes them (NVIDIA/RULER ``scripts/data/synthetic/``): each
``build`` turns a haystack size n (lines, essay words, list words or documents) and a seeded
generator into a ``Draft``, the prompt's parts before tokenization. ``tasks.generate`` looks
for the largest n whose prompt fits.

* ``niah`` (``niah.py``): keys and values as ``words.random_token`` draws them; all keys of an
  example differ and none contains another; in the ``"needle"`` haystack no distractor key
  contains or is contained in an asked one, so every asked key stands only with its own
  values. The first needle of the first asked key sits at the example's swept depth.
* ``variable_tracking`` (``variable_tracking.py``): one chain of 4 hops, five-letter names and
  a five-digit value in lines of noise, after a one-shot example of three-letter names that
  fits in 500 tokens.
* ``common_words`` (``common_words_extraction.py``): a numbered list, 10 words 30 times and the
  others 3 times (6 and 1 below 4,096 tokens), after a one-shot example of 40 words (20).
* ``frequent_words`` (``freq_words_extraction.py``): six-letter coded words in Zipf counts
  (exponent 2) over a vocabulary of (L - 50) // 50, the top one ``...``: the answer is ranks 2
  to 4.
* ``qa`` (``qa.py``, ``ruler.qa``): the question's documents among others.
"""

import dataclasses
import math

import numpy as np

from ulysses_jax.ruler import haystacks, prompts, words


@dataclasses.dataclass(frozen=True)
class Draft:
  """A prompt before tokenization. ``user``: the task text (inside the chat turn);
  ``prefix``: RULER's answer prefix; ``shots``: one-shot examples as whole turns;
  ``outputs``: the strings RULER looks for in the answer; ``answer``: the canonical
  completion (the strict score's); ``depth``: of the swept needle (NIAH)."""
  user: str
  prefix: str
  outputs: tuple[str, ...]
  answer: str
  shots: tuple[tuple[str, str], ...] = ()
  depth: float | None = None


def niah(task, n: int, rng: np.random.Generator, ctx) -> Draft:
  keys = words.distinct_tokens(task.keys, rng, max(task.needles, task.queries))
  values = {k: words.distinct_tokens(task.values, rng, task.value_count) for k in keys}
  needles = [prompts.NEEDLE.format(type_needle_v=task.values, key=k, value=v)
             for k in keys for v in values[k]]
  order = rng.permutation(len(keys))
  asked = [keys[i] for i in order[:task.queries]]
  swept = needles.index(prompts.NEEDLE.format(type_needle_v=task.values, key=asked[0],
                                              value=values[asked[0]][0]))
  if task.haystack == "essay":
    pieces = haystacks.essay_sentences(ctx.essay_words, n)
    depths = haystacks.random_depths(rng, len(needles))
  else:
    pieces = ([prompts.NOISE] * n if task.haystack == "noise" else
              [_distractor(task, rng, keys) for _ in range(n)])
    depths = [float(i) / max(n, 1) for i in rng.integers(0, max(n, 1), len(needles))]
  depths[swept] = ctx.depth
  placed = haystacks.insert(pieces, list(zip(depths, needles)))
  context = (" " if task.haystack == "essay" else "\n").join(placed)
  template, prefix, _ = prompts.TEMPLATES["niah"]
  type_needle_v = task.values
  if task.queries * task.value_count == 1:
    template, prefix, type_needle_v = (prompts.singular(template), prompts.singular(prefix),
                                       task.values[:-1])
  query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
  where = {text: i for i, text in enumerate(placed)}
  outputs = tuple(v for k in asked for v in sorted(values[k], key=lambda v, k=k: where[
      prompts.NEEDLE.format(type_needle_v=task.values, key=k, value=v)]))  # as they appear
  return Draft(template.format(type_needle_v=type_needle_v, context=context, query=query),
               prefix.format(type_needle_v=type_needle_v, query=query), outputs,
               " " + ", ".join(outputs), depth=ctx.depth)


def _distractor(task, rng, keys) -> str:
  key = words.distinct_tokens(task.keys, rng, 1, avoid=tuple(keys))[0]
  return prompts.NEEDLE.format(type_needle_v=task.values, key=key,
                               value=words.random_token(task.values, rng))


def variable_tracking(task, n: int, rng: np.random.Generator, ctx) -> Draft:
  example = ctx.cached("vt_example_noise", lambda: _fit_example_noise(task, ctx))
  example_user, example_prefix, example_names = _chain_text(task, example, rng, 3)
  shot = f"{example_user}{example_prefix} {' '.join(example_names)}\n"
  user, prefix, names = _chain_text(task, n, rng, 5)
  return Draft(shot + "\n" + user, prefix, tuple(names), " ".join(names))


def _chain_text(task, n: int, rng, name_length: int):
  """(task text, answer prefix, names) of one chain hidden in ``n`` noise lines."""
  names = []
  while len(names) < task.hops + 1:
    name = words.letters(rng, name_length)
    if name not in names:
      names.append(name)
  value = str(int(rng.integers(10000, 99999)))
  chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} "
                                           for a, b in zip(names, names[1:])]
  lines = [prompts.NOISE] * n
  for offset, slot in enumerate(sorted(rng.choice(n, len(chain), replace=n < len(chain)))):
    lines.insert(int(slot) + offset, chain[offset])
  template, prefix, _ = prompts.TEMPLATES["variable_tracking"]
  return (template.format(context="\n".join(lines), query=value),
          prefix.format(num_v=task.hops + 1, query=value), names)


def _fit_example_noise(task, ctx) -> int:
  """RULER's one-shot example: the most noise lines (at least 5) whose example (without its
  answer) fits in 500 tokens."""
  rng = np.random.default_rng(0)

  def tokens(n):
    user, prefix, _ = _chain_text(task, n, rng, 3)
    return ctx.count(user + prefix)
  n = 5
  while tokens(n + 1) <= 500:
    n += 1
  return n


def common_words(task, n: int, rng: np.random.Generator, ctx) -> Draft:
  short = ctx.length < 4096
  pool = words.common_word_pool()
  if n > len(pool):
    raise ctx.unfit(f"needs {n} different words, more than the {len(pool):,} of its word pool "
                    "(RULER then draws from a larger list we do not ship)")
  example_words, example_common = _word_list(rng, pool, 20 if short else 40,
                                             *((3, 1) if short else (10, 3)))
  listed, common = _word_list(rng, pool, n, *((6, 1) if short else (30, 3)))
  template, prefix, _ = prompts.TEMPLATES["common_words"]
  numbered = lambda ws: " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws))
  shot = (template.format(context=numbered(example_words)), numbered(example_common))
  first_seen = sorted(common, key=listed.index)
  return Draft(template.format(context=numbered(listed)), prefix, tuple(common),
               " " + numbered(first_seen), shots=(shot,))


def _word_list(rng, pool, n: int, common_count: int, other_count: int):
  chosen = [pool[i] for i in rng.choice(len(pool), n, replace=False)]
  listed = chosen[:10] * common_count + chosen[10:] * other_count
  return [listed[i] for i in rng.permutation(len(listed))], chosen[:10]


def frequent_words(task, n: int, rng: np.random.Generator, ctx) -> Draft:
  size = (ctx.length - prompts.budget("frequent_words")) // 50
  if size < 5:
    raise ctx.unfit(f"its vocabulary of (L - 50) // 50 = {size} words needs at least 5 (ranks "
                    "2 to 4 are the answer, rank 5 the first below it)")
  vocabulary = []
  while len(vocabulary) < size:
    word = words.letters(rng, 6, upper=False)
    if word not in vocabulary:
      vocabulary.append(word)
  vocabulary[0] = "..."  # RULER: the top-ranked word is noise
  zeta2 = math.pi ** 2 / 6
  counts = [int(n * k ** -2.0 / zeta2) for k in range(1, size + 1)]
  text = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
  text = [text[i] for i in rng.permutation(len(text))]
  template, prefix, _ = prompts.TEMPLATES["frequent_words"]
  answer = tuple(vocabulary[1:4])
  return Draft(template.format(context=" ".join(text)), prefix, answer, " " + " ".join(answer))
