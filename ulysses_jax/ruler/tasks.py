"""RULER's tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv 2404.06654; NVIDIA/RULER ``scripts/synthetic.yaml``), generated
offline from a seed.

An example is a prompt (RULER's template filled in, in the model's chat turn, then RULER's
answer prefix), the strings a right answer contains (``outputs``) and a canonical answer (the
strict score's). As in RULER the prompt is tokenized once, whole, and its haystack is the
largest for which prompt + the task's generation budget <= L tokens. The same seed,
tokenizer, task and length give the same token ids on any machine: every random choice comes
from a generator seeded with (seed, task, length, sample).

What stays ours: names (RULER's ``vt``, ``cwe``, ``fwe`` are ``variable_tracking``,
``common_words``, ``frequent_words``), the needle depth swept from 0 to 100 % over the samples
(RULER draws it), the sentence cut (``haystacks``), and keys that never collide with an asked
one (``families``).
"""

import dataclasses
import zlib

import numpy as np

from ulysses_jax.ruler import families, haystacks, prompts, qa

FAMILIES = ("niah", "variable_tracking", "common_words", "frequent_words", "qa")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task of ``scripts/synthetic.yaml``. haystack: ``"noise"``, ``"essay"`` (the user's
  essays) or ``"needle"`` (distractor needles); keys, values: ``"words"``, ``"numbers"``,
  ``"uuids"``; needles: keys planted; value_count: values per key; queries: keys asked;
  hops: variable tracking's; dataset: QA's (``"squad"`` or ``"hotpotqa"``)."""
  family: str
  haystack: str = "noise"
  keys: str = "words"
  values: str = "numbers"
  needles: int = 1
  value_count: int = 1
  queries: int = 1
  hops: int = 4
  dataset: str = ""

  @property
  def metric(self) -> str:
    """RULER's metric: ``"part"`` (QA: any one answer) or ``"all"`` (every output)."""
    return "part" if self.family == "qa" else "all"


TASKS = {
    "niah_single_1": Task("niah", haystack="noise"),
    "niah_single_2": Task("niah", haystack="essay"),
    "niah_single_3": Task("niah", haystack="essay", values="uuids"),
    "niah_multikey_1": Task("niah", haystack="essay", needles=4),
    "niah_multikey_2": Task("niah", haystack="needle"),
    "niah_multikey_3": Task("niah", haystack="needle", keys="uuids", values="uuids"),
    "niah_multivalue": Task("niah", haystack="essay", value_count=4),
    "niah_multiquery": Task("niah", haystack="essay", needles=4, queries=4),
    "variable_tracking": Task("variable_tracking"),
    "common_words": Task("common_words"),
    "frequent_words": Task("frequent_words"),
    "qa_1": Task("qa", dataset="squad"),
    "qa_2": Task("qa", dataset="hotpotqa"),
}


@dataclasses.dataclass(frozen=True)
class Example:
  """A prompt and the canonical answer as token ids (int64), the strings RULER looks for in
  a generated answer (``outputs``), the answer's text, its generation budget and metric, and
  the depth of the swept needle (NIAH)."""
  task: str
  length: int
  sample: int
  prompt_ids: np.ndarray
  answer_ids: np.ndarray
  answer: str
  outputs: tuple[str, ...] = ()
  budget: int = 0
  metric: str = "all"
  depth: float | None = None


class Unfit(ValueError):
  """A task that cannot be generated at a length (too short, or beyond its word pool)."""


def needs(names) -> dict[str, list[str]]:
  """What the tasks among ``names`` need from the user: ``{"essays": [...], "qa_squad":
  [...], "qa_hotpotqa": [...]}`` (task names)."""
  out = {}
  for name in names:
    if name not in TASKS:
      raise ValueError(f"unknown RULER task {name!r}; choose from {', '.join(TASKS)}")
    task = TASKS[name]
    if task.haystack == "essay":
      out.setdefault("essays", []).append(name)
    if task.family == "qa":
      out.setdefault(f"qa_{task.dataset}", []).append(name)
  return out


def generate(name: str, length: int, samples: int, tokenizer, *, seed: int = 0,
             essays: str | None = None, qa_sets: dict | None = None,
             wrap=prompts.identity, add_special_tokens: bool = False) -> list[Example]:
  """``samples`` examples of task ``name`` at ``length`` tokens: prompt + budget <= length, and
  prompt + canonical answer too (the strict score's row).

  ``essays``: the text of the essay haystack; ``qa_sets``: ``{"squad" | "hotpotqa":
  qa.QASet}``; ``wrap``: the model's chat turn around the task text; ``add_special_tokens``:
  the prompt tokenized with the tokenizer's special tokens (BOS), as for a model without a
  chat template (a rendered template writes its own). Raises ``Unfit`` when
  the length cannot hold the task and ``ValueError`` for a missing input."""
  if name not in TASKS:
    raise ValueError(f"unknown RULER task {name!r}; choose from {', '.join(TASKS)}")
  task = TASKS[name]
  if task.haystack == "essay" and not (essays and essays.strip()):
    raise ValueError(f"task {name} hides its needles in essays: give text files with --data "
                     "(RULER uses Paul Graham's essays)")
  if task.family == "qa" and task.dataset not in (qa_sets or {}):
    file = {"squad": "SQuAD's dev-v2.0.json", "hotpotqa": "hotpot_dev_distractor_v1.json"}
    raise ValueError(f"task {name} needs {file[task.dataset]}: give it with --qa_data")
  build = {"niah": families.niah, "variable_tracking": families.variable_tracking,
           "common_words": families.common_words, "frequent_words": families.frequent_words,
           "qa": qa.build}[task.family]
  budget = prompts.budget(task.family)
  ctx = _Context(name, length, tokenizer, essays, qa_sets)
  encode = lambda text, special=False: np.asarray(
      tokenizer.encode_batch([text.encode()], add_special_tokens=special)[0], np.int64)
  questions = (np.random.default_rng([seed, zlib.crc32(name.encode())])
               .permutation(len(qa_sets[task.dataset].questions)) if task.family == "qa"
               else None)
  examples, size = [], None
  for sample in range(samples):
    ctx.depth = sample / (samples - 1) if samples > 1 else 0.5
    ctx.question = int(questions[sample % len(questions)]) if questions is not None else 0
    attempts = {}  # n -> (draft, prompt ids, answer ids)
    rng_key = (seed, zlib.crc32(name.encode()), length, sample)

    def fits(n, rng_key=rng_key, tried=attempts):
      draft = build(task, n, np.random.default_rng(rng_key), ctx)
      ids = encode(prompts.assemble(wrap, draft.user, draft.prefix, draft.shots),
                   add_special_tokens)
      tried[n] = draft, ids, encode(draft.answer)
      return len(ids) + max(budget, len(tried[n][2])) <= length  # the strict row fits too
    if size is None or not fits(size):  # RULER sizes the haystack once, shrinks it if need be
      low = _minimum(task, ctx)
      if not fits(low):
        raise Unfit(f"RULER task {name} does not fit {length:,} tokens: its smallest prompt "
                    f"takes {len(attempts[low][1]):,} and generation {budget}; use longer "
                    "--lengths / --seq_len")
      size = _largest(fits, low, size)
    draft, ids, answer_ids = attempts[size]
    examples.append(Example(name, length, sample, ids, answer_ids, draft.answer,
                            draft.outputs, budget, task.metric, draft.depth))
  return examples


def _minimum(task, ctx) -> int:
  if task.family == "qa":
    return qa.minimum_documents(task, ctx)
  return {"common_words": 11, "frequent_words": 100}.get(task.family, 1)


def _largest(fits, low: int, high: int | None) -> int:
  """The largest n >= ``low`` with ``fits(n)`` (which grows with n; ``fits(low)`` holds),
  below ``high`` when given (``fits(high)`` does not)."""
  if high is None:
    high = 2 * low
    while fits(high):
      low, high = high, 2 * high
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low


class _Context:
  """What a family's ``build`` reads besides the task: the length, the essays' words, the
  QA sets, the sample's depth and question, a token counter and a cache."""

  def __init__(self, name, length, tokenizer, essays, qa_sets):
    self.name, self.length, self.qa = name, length, qa_sets or {}
    self.essay_words = haystacks.essay_words(essays) if essays else []
    self.tokenizer, self.depth, self.question, self._cache = tokenizer, 0.5, 0, {}

  def count(self, text: str) -> int:
    return len(self.tokenizer.encode_batch([text.encode()])[0])

  def cached(self, key, make):
    if key not in self._cache:
      self._cache[key] = make()
    return self._cache[key]

  def unfit(self, why: str) -> Unfit:
    return Unfit(f"RULER task {self.name} at {self.length:,} tokens: {why}")
