"""Does the model use its long context? RULER's tasks (``ruler.tasks``) and the user's own
exact-match probes (``--examples``), with RULER's scoring (``ruler.scoring``) and our strict one.

The strict score needs no decoder: an example is a prompt and a canonical answer of k tokens,
correct when, at each answer position, the model's top prediction given the prompt and the
answer tokens before it is the answer token: exactly the condition under which greedy decoding
from the prompt writes the answer. So one forward pass over prompt + answer scores it,
sequence-parallel like the rest of ``ulysses_jax.evaluate`` (the per-token predictions come
chunk by chunk, never as ``[B, S, V]`` logits), and the argmax at each answer position is kept
as ``predicted_ids``. RULER's own score reads generated answers (``generation.predict``,
``scoring.ruler_score``).
"""

import json

import numpy as np

from ulysses_jax.data.batches import Dataset
from ulysses_jax.data.corpus import resolve_paths
from ulysses_jax.data.packing import pack_row
from ulysses_jax.data.records import jsonl_lines
from ulysses_jax.ruler import prompts, qa
from ulysses_jax.ruler import tasks as tasks_lib
from ulysses_jax.ruler.scoring import THRESHOLD, summarize

__all__ = ["THRESHOLD", "Probe", "Rows", "dataset", "generate", "read_examples", "read_inputs",
           "score", "summarize"]


class Rows:
  """A fixed list of rows for ``batches.Dataset`` (the pass-key and RULER examples)."""

  def __init__(self, rows, seq_len):
    self.rows, self.seq_len, self.num_rows = rows, seq_len, len(rows)

  def __call__(self, row):
    return self.rows[row]


def dataset(examples, mesh, *, seq_len: int, batch_size: int, vocab_size: int) -> Dataset:
  """The examples as rows of ``seq_len`` tokens (prompt, answer, padding), labels on the
  answer only. Raises ``ValueError`` (naming the example) before any compute when one does
  not fit ``seq_len`` or holds an id outside the vocabulary."""
  rows = []
  for i, ex in enumerate(examples):
    tokens = np.concatenate([ex.prompt_ids, ex.answer_ids]).astype(np.int64)
    where = f"example {i + 1} ({ex.task})"
    if not len(ex.answer_ids) or not len(ex.prompt_ids):
      raise ValueError(f"{where}: needs a prompt and an answer of at least one token each, "
                       f"got {len(ex.prompt_ids)} and {len(ex.answer_ids)}")
    if len(tokens) > seq_len:
      raise ValueError(f"{where}: prompt and answer take {len(tokens)} tokens, more than "
                       f"--seq_len={seq_len}; raise --seq_len or shorten the example")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
      raise ValueError(f"{where}: token ids must be in [0, {vocab_size}) (the model's "
                       f"vocabulary), got {tokens.min()}..{tokens.max()}")
    targets = np.arange(len(tokens)) >= len(ex.prompt_ids)
    rows.append(pack_row(tokens, np.zeros(len(tokens), np.int64), seq_len, targets))
  return Dataset(Rows(rows, seq_len), mesh=mesh, batch_size=batch_size,
                 vocab_size=vocab_size, fingerprint="ruler")


def score(evaluator, params, examples, data: Dataset) -> list[dict]:
  """Per example: ``correct`` and ``predicted_ids`` (the argmax at each answer position).
  ``evaluator``: an ``evaluate.PositionEval``; ``data``: ``dataset(examples, ...)``."""
  sums = evaluator.sums(params, data)
  out = []
  for i, ex in enumerate(examples):
    predicted = [int(t) for t in sums["row_predicted"][i]]
    out.append({"correct": predicted == [int(t) for t in ex.answer_ids],
                "predicted_ids": predicted})
  return out


def generate(names, lengths, samples: int, tokenizer, *, seed: int = 0, essays=None,
             qa_sets=None, wrap=prompts.identity, add_special_tokens: bool = False,
             skipped: list | None = None) -> list[tasks_lib.Example]:
  """``samples`` examples of every task in ``names`` at every length (``tasks.generate``).
  With a list ``skipped``, a task that a length cannot hold is left out there (``{"task",
  "length", "reason"}``) instead of raising ``tasks.Unfit``."""
  out = []
  for name in names:
    for length in lengths:
      try:
        out += tasks_lib.generate(name, length, samples, tokenizer, seed=seed, essays=essays,
                                  qa_sets=qa_sets, wrap=wrap,
                                  add_special_tokens=add_special_tokens)
      except tasks_lib.Unfit as e:
        if skipped is None:
          raise
        skipped.append({"task": name, "length": length, "reason": str(e)})
  return out


def read_inputs(names, data_paths=(), qa_paths=()) -> tuple[str | None, dict]:
  """(essays, QA sets) for the tasks ``names``, read only when they need them: ``essays`` the
  text of the ``data_paths`` files (text or ``.jsonl``, in order), ``{"squad" | "hotpotqa":
  qa.QASet}`` from ``qa_paths``. Raises ``ValueError`` when a task's input is missing."""
  need = tasks_lib.needs(names)
  essays = None
  if "essays" in need and data_paths:
    files = resolve_paths(list(data_paths))
    tokens = [f for f in files if f.endswith((".bin", ".npy"))]
    if tokens:
      raise ValueError(f"the essay haystack ({', '.join(need['essays'])}) needs text files; "
                       f"{tokens[0]} holds tokens")
    essays = "\n".join(_essay_text(f) for f in files)
  qa_sets = {}
  if any(k.startswith("qa_") for k in need):
    for path in resolve_paths(list(qa_paths)) if qa_paths else []:
      qa_set = qa.read(path)
      qa_sets[qa_set.kind] = qa_set
  return essays, qa_sets


def _essay_text(path: str) -> str:
  """A text file's text, or a ``.jsonl`` file's ``"text"`` fields one after another."""
  with open(path, encoding="utf-8", errors="replace") as f:
    if not path.endswith(".jsonl"):
      return f.read()
    texts = [json.loads(line).get("text") for line in f if line.strip()]
  if not all(isinstance(t, str) for t in texts):
    raise ValueError(f"{path}: the essay haystack reads each line's string field 'text'")
  return "\n".join(texts)


def read_examples(path: str, tokenizer) -> list[tasks_lib.Example]:
  """The lines of a JSONL file, each ``{"prompt": str, "answer": str}`` (tokenized with
  ``tokenizer``, prompt and answer apart) or ``{"prompt_ids": [int], "answer_ids": [int]}``.
  Raises ``ValueError`` naming the file and line of a malformed one."""
  examples = []
  for where, record, line in jsonl_lines(path):
    if isinstance(record, dict) and {"prompt_ids", "answer_ids"} <= record.keys():
      prompt, answer = record["prompt_ids"], record["answer_ids"]
      if not all(isinstance(t, int) for t in [*prompt, *answer]):
        raise ValueError(f"{where}: prompt_ids and answer_ids must be lists of integers")
      text = None
    elif (isinstance(record, dict) and isinstance(record.get("prompt"), str)
          and isinstance(record.get("answer"), str)):
      prompt, answer = tokenizer.encode_batch([record["prompt"].encode(),
                                               record["answer"].encode()])
      text = record["answer"]
    else:
      raise ValueError(f'{where}: expected {{"prompt": str, "answer": str}} or '
                       f'{{"prompt_ids": [int], "answer_ids": [int]}}, got {line.strip()[:80]}')
    examples.append(tasks_lib.Example("examples", len(prompt) + len(answer), len(examples),
                                      np.asarray(prompt, np.int64),
                                      np.asarray(answer, np.int64), text))
  if not examples:
    raise ValueError(f"{path}: no examples (one JSON object per line)")
  return examples


class Probe:
  """RULER tasks scored (strict) at a trainer's eval steps (``TrainConfig.ruler_tasks``): the
  examples are made once (lengths S/2 and S, seed 0; a task that S/2 cannot hold is scored at
  S only), each call scores them with the current parameters and returns the metrics
  ``ruler_mean``, ``ruler_<task>`` (mean over the lengths) and ``ruler_mean_<L>``, percent.
  Raises ``tasks.Unfit`` when a task fits neither length."""

  def __init__(self, names, samples: int, tokenizer, mesh, *, seq_len: int, vocab_size: int):
    self.examples = generate(names, [seq_len], samples, tokenizer)
    if seq_len // 2 < seq_len:
      self.examples = generate(names, [seq_len // 2], samples, tokenizer,
                               skipped=[]) + self.examples
    self.data = dataset(self.examples, mesh, seq_len=seq_len, batch_size=mesh.shape["data"],
                        vocab_size=vocab_size)

  def __call__(self, evaluator, params) -> dict[str, float]:
    report = summarize(self.examples, score(evaluator, params, self.examples, self.data))
    means = {n: m["strict"] for n, m in report["mean_by_length"].items()}
    metrics = {f"ruler_mean_{n}": a for n, a in means.items()}
    metrics["ruler_mean"] = float(np.mean(list(means.values())))
    for name, task in report["tasks"].items():
      metrics[f"ruler_{name}"] = float(np.mean([v["strict"] for v in task["by_length"].values()]))
    return metrics
