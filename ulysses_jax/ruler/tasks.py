"""RULER-style long-context tasks (Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654), generated offline from a seed.

Each example is a prompt (a haystack of a given total length in tokens with facts hidden in it,
then a question ending where the answer starts) and the answer's tokens. The same seed,
tokenizer, task and length give the same token ids on any machine: every random choice comes
from a generator seeded with (seed, task, length, sample), and the pieces are tokenized one by
one and concatenated, so lengths are exact for any tokenizer.

Families (``TASKS`` names the configurations):

* needle in a haystack: hidden "The secret <kind> for <key> is <value>." sentences; one
  needle (its depth swept from 0 to 100 % over the samples), distractor needles with other
  keys (multi-key), several values of one key (multi-value, all asked in order), several keys
  asked at once (multi-query). Haystacks: a repeated filler paragraph, natural text from the
  user's documents (``text_ids``), or lines of distractor key-value facts. Keys and values are
  words, 7-digit numbers or UUID-like hex strings.
* variable tracking: a chain ``VAR A = 1234567``, ``VAR B = VAR A``, ... hidden at increasing
  depths; asked for every name bound to the value, in chain order.
* common-word extraction: a word list in which ten words occur 30 times (fewer, at least 5,
  in short contexts) and the others 3 times, as many as fill the context; asked for the ten,
  alphabetically.
* frequent-word extraction: made-up words drawn from a Zipf distribution; asked for the three
  most frequent, most frequent first.
"""

import dataclasses
import os
import zlib

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
INTRO = ("Some facts are hidden in the text below. Read all of it: a question about them comes "
         "at the end.\n")
KINDS = ("niah", "variable_tracking", "common_words", "frequent_words")
HAYSTACKS = ("repeat", "text", "kv")
TOKEN_TYPES = ("words", "numbers", "uuids")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task configuration.

  kind: one of ``KINDS``. haystack: ``"repeat"`` (the filler paragraph), ``"text"`` (the
  user's documents) or ``"kv"`` (distractor facts). keys, values: ``TOKEN_TYPES``.
  needles: keys planted (the asked ones and distractors); values: per asked key; queries:
  keys asked; hops: assignments after the first in variable tracking.
  """
  kind: str
  haystack: str = "repeat"
  keys: str = "words"
  values: str = "numbers"
  needles: int = 1
  value_count: int = 1
  queries: int = 1
  hops: int = 4


TASKS = {
    "niah_single_1": Task("niah", haystack="repeat"),
    "niah_single_2": Task("niah", haystack="text"),
    "niah_single_3": Task("niah", haystack="text", values="uuids"),
    "niah_multikey_1": Task("niah", haystack="text", needles=4),
    "niah_multikey_2": Task("niah", haystack="kv"),
    "niah_multikey_3": Task("niah", haystack="kv", keys="uuids", values="uuids"),
    "niah_multivalue": Task("niah", haystack="text", needles=4, value_count=4),
    "niah_multiquery": Task("niah", haystack="text", needles=4, queries=4),
    "variable_tracking": Task("variable_tracking"),
    "common_words": Task("common_words"),
    "frequent_words": Task("frequent_words"),
}


@dataclasses.dataclass(frozen=True)
class Example:
  """A prompt and its answer as token ids (int64); ``depth`` of the asked needle (niah)."""
  task: str
  length: int
  sample: int
  prompt_ids: np.ndarray
  answer_ids: np.ndarray
  answer: str
  depth: float | None = None


def words() -> list[str]:
  """The shipped word list (``words.txt``: common English nouns, one per line)."""
  with open(os.path.join(os.path.dirname(__file__), "words.txt"), encoding="utf-8") as f:
    return f.read().split()


def needs_text(names) -> list[str]:
  """The tasks among ``names`` whose haystack is the user's documents."""
  return [n for n in names if TASKS[n].haystack == "text"]


def generate(name: str, length: int, sample: int, tokenizer, *, seed: int = 0,
             samples: int = 1, text_ids: np.ndarray | None = None) -> Example:
  """Example ``sample`` (of ``samples``: the needle depth sweeps over them) of task ``name``,
  ``length`` tokens of prompt and answer together. ``text_ids``: the user's documents as one
  token array (the ``"text"`` haystack). Raises ``ValueError`` when the length cannot hold the
  task's facts and question."""
  if name not in TASKS:
    raise ValueError(f"unknown RULER task {name!r}; choose from {', '.join(TASKS)}")
  task = TASKS[name]
  if task.haystack == "text" and (text_ids is None or not len(text_ids)):
    raise ValueError(f"task {name} hides its facts in natural text: give documents with "
                     f"--data (or pick tasks without them: {', '.join(_without_text())})")
  rng = np.random.default_rng([seed, zlib.crc32(name.encode()), length, sample])
  depth = sample / (samples - 1) if samples > 1 else 0.5
  build = {"niah": _niah, "variable_tracking": _variable_tracking,
           "common_words": _common_words, "frequent_words": _frequent_words}[task.kind]
  content, question, answer, depth = build(task, rng, depth)
  enc = _Encoder(tokenizer)
  question_ids, answer_ids = enc("\n" + question), enc(answer)
  room = length - len(enc(INTRO)) - len(question_ids) - len(answer_ids)
  if callable(content):  # the word tasks: a list sized to the room, filler in front
    newline = enc("\n")
    ids = np.concatenate([newline, *enc.many(content(room - len(newline), enc))])
    if len(ids) > room:
      raise _too_short(name, room, len(ids))
    body = np.concatenate([np.resize(enc(FILLER), room - len(ids)), ids])
  else:
    body = _hide(task, content, room, rng, enc, text_ids, name)
  prompt = np.concatenate([enc(INTRO), body, question_ids])
  return Example(name, length, sample, prompt, answer_ids, answer,
                 depth if task.kind == "niah" else None)


class _Encoder:
  """Text -> int64 token ids, each distinct text tokenized once."""

  def __init__(self, tokenizer):
    self.tokenizer, self.cache = tokenizer, {}

  def __call__(self, text: str) -> np.ndarray:
    if text not in self.cache:
      self.cache[text] = np.asarray(self.tokenizer.encode_batch([text.encode()])[0], np.int64)
    return self.cache[text]

  def many(self, texts: list[str]) -> list[np.ndarray]:
    new = sorted({t for t in texts if t not in self.cache})
    for text, ids in zip(new, self.tokenizer.encode_batch([t.encode() for t in new])):
      self.cache[text] = np.asarray(ids, np.int64)
    return [self.cache[t] for t in texts]


def _hide(task, facts, room, rng, enc, text_ids, name) -> np.ndarray:
  """``room`` tokens of haystack with the ``facts`` ((depth in [0, 1] or None for a random
  one, text)) in it at their depths."""
  needles = [(d if d is not None else rng.random(), enc(text)) for d, text in facts]
  fill = room - sum(len(ids) for _, ids in needles)
  if fill < 0:
    raise _too_short(name, room, room - fill)
  hay = _haystack(task, fill, rng, enc, text_ids)
  cuts = [int(round(d * fill)) for d, _ in needles]
  parts, last = [], 0
  for i in np.argsort(cuts, kind="stable"):
    parts += [hay[last:cuts[i]], needles[i][1]]
    last = cuts[i]
  return np.concatenate(parts + [hay[last:]])


def _haystack(task, fill, rng, enc, text_ids) -> np.ndarray:
  if task.haystack == "repeat":
    return np.resize(enc(FILLER), fill)
  if task.haystack == "text":
    start = int(rng.integers(0, len(text_ids)))
    return np.resize(np.roll(np.asarray(text_ids, np.int64), -start), fill)
  # "kv": distractor facts, generated until they fill the haystack (the last one cut).
  parts, n = [], 0
  while n < fill:
    batch = [_fact(_token(task.keys, rng), "number" if task.values == "numbers" else task.values,
                   _token(task.values, rng)) for _ in range(64)]
    for ids in enc.many(batch):
      parts.append(ids)
      n += len(ids)
  return np.concatenate(parts)[:fill] if parts else np.zeros(0, np.int64)


def _niah(task, rng, depth):
  kind = {"numbers": "number", "words": "word", "uuids": "code"}[task.values]
  keys = _distinct(task.keys, rng, task.needles)
  values = {k: [_token(task.values, rng) for _ in range(task.value_count)] for k in keys}
  asked = keys[:task.queries]
  pieces = [(depth if (k == keys[0] and j == 0) else None, _fact(k, kind, v))
            for k in keys for j, v in enumerate(values[k])]
  if task.value_count > 1:
    question = (f"What are all the secret {kind}s for {asked[0]}, in the order they appear? "
                f"Answer: the secret {kind}s for {asked[0]} are ")
    answer = ", ".join(values[asked[0]])
  elif task.queries > 1:
    question = (f"What are the secret {kind}s for {', '.join(asked)}? Answer: in that order, "
                "they are ")
    answer = ", ".join(values[k][0] for k in asked)
  else:
    question = f"What is the secret {kind} for {asked[0]}? Answer: the secret {kind} is "
    answer = values[asked[0]][0]
  return pieces, question, answer, depth


def _variable_tracking(task, rng, _):
  names = _distinct("names", rng, task.hops + 1)
  value = _token("numbers", rng)
  lines = [f"VAR {names[0]} = {value}. "] + [f"VAR {b} = VAR {a}. "
                                              for a, b in zip(names, names[1:])]
  depths = np.sort(rng.random(len(lines)))
  question = (f"Which variables hold the value {value}, directly or through other variables? "
              "Answer: in the order they were assigned, they are ")
  return list(zip(depths, lines)), question, " ".join(names), None


def _common_words(task, rng, _):
  """Ten words k times each (k = 30, or as many as half the room holds, at least 5) among
  others 3 times each, as many as fill the room."""
  common = [str(w) for w in rng.choice(words(), 10, replace=False)]

  def items(room, enc):
    cost = lambda w: len(enc(f"- {w}\n"))
    repeats = min(30, max(5, room // (2 * sum(cost(w) for w in common))))
    budget = room - repeats * sum(cost(w) for w in common)
    rare, pool = [], [w for w in words() if w not in common]
    while True:
      if not pool:
        pool = _made_up(rng, 256, exclude=set(rare))
      word = pool.pop(int(rng.integers(0, len(pool))))
      if 3 * cost(word) > budget:
        break
      rare.append(word)
      budget -= 3 * cost(word)
    listed = common * repeats + rare * 3
    rng.shuffle(listed)
    return [f"- {w}\n" for w in listed]

  question = ("Which ten words occur most often in the list above? Answer: in alphabetical "
              "order, they are ")
  return items, question, ", ".join(sorted(common)), None


def _frequent_words(task, rng, _):
  """Made-up words, the k-th most frequent about c / k^2 times (Zipf, exponent 2), c as large
  as the room allows; the top three counts strictly apart."""
  made_up = _made_up(rng, 4)

  def items(room, enc):
    per_word = max(len(enc(f"{w} ")) for w in made_up)
    top = max(9, int(room / (per_word * 1.7)))  # sum of 1/k^2 < 1.65
    vocabulary = made_up + _made_up(rng, max(0, int(top ** 0.5) - 4), exclude=set(made_up))
    counts = [max(1, top // (k * k)) for k in range(1, len(vocabulary) + 1)]
    listed = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
    rng.shuffle(listed)
    return [f"{w} " for w in listed]  # at most per_word * 1.65 * top <= room tokens

  question = ("Which three made-up words occur most often in the text above? Answer: most "
              "frequent first, they are ")
  return items, question, ", ".join(made_up[:3]), None


def _fact(key: str, kind: str, value: str) -> str:
  return f"The secret {kind} for {key} is {value}. "


def _token(kind: str, rng) -> str:
  if kind == "numbers":
    return str(int(rng.integers(1_000_000, 10_000_000)))
  if kind == "words":
    return str(rng.choice(words()))
  if kind == "uuids":
    digits = "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, 32))
    return "-".join(digits[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
  # "names": variable names of five capital letters
  return "".join(chr(ord("A") + i) for i in rng.integers(0, 26, 5))


def _distinct(kind: str, rng, n: int) -> list[str]:
  out = []
  while len(out) < n:
    token = _token(kind, rng)
    if token not in out:
      out.append(token)
  return out


def _made_up(rng, n: int, exclude=frozenset()) -> list[str]:
  """``n`` distinct pronounceable made-up words of four syllables, none in the word list or
  ``exclude``."""
  consonants, vowels = list("bdfgklmnprstvz"), list("aeiou")
  taken, out = set(words()) | set(exclude), []
  while len(out) < n:
    word = "".join(str(rng.choice(consonants)) + str(rng.choice(vowels)) for _ in range(4))
    if word not in taken:
      taken.add(word)
      out.append(word)
  return out


def _without_text() -> list[str]:
  return [n for n, t in TASKS.items() if t.haystack != "text"]


def _too_short(name: str, room: int, need: int) -> ValueError:
  return ValueError(f"RULER task {name}: {room} tokens of haystack room, but its facts need "
                    f"{need}; use longer --lengths / --seq_len")
