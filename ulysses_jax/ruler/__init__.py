"""Does the model use its long context? RULER-style tasks (``ruler.tasks``) and the user's own
exact-match probes (``--examples``), scored exactly as greedy decoding would score them.

An example is a prompt and an answer of k tokens. It is correct when, at each answer position,
the model's top prediction given the prompt and the answer tokens before it is the answer token:
exactly the condition under which greedy decoding from the prompt reproduces the answer. So one
forward pass over prompt + answer scores it, sequence-parallel like the rest of
``ulysses_jax.evaluate`` (the per-token predictions come chunk by chunk, never as ``[B, S, V]``
logits), and the argmax at each answer position is kept as ``predicted_ids``.
"""

import json

import numpy as np

from ulysses_jax.batches import Dataset
from ulysses_jax.packing import pack_row
from ulysses_jax.ruler import tasks as tasks_lib

# RULER's threshold for "effective length": Llama-2-7B's average score at 4K tokens (85.6 %).
THRESHOLD = 0.856


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


def generate(names, lengths, samples: int, tokenizer, *, seed: int = 0,
             text_ids=None) -> list[tasks_lib.Example]:
  """``samples`` examples of every task in ``names`` at every length (``tasks.generate``)."""
  return [tasks_lib.generate(name, length, i, tokenizer, seed=seed, samples=samples,
                             text_ids=text_ids)
          for name in names for length in lengths for i in range(samples)]


def summarize(examples, results, threshold: float = THRESHOLD) -> dict:
  """JSON-able report: ``tasks[name].by_length[L]`` (accuracy, samples), ``mean_by_length[L]``
  (the mean over tasks), ``effective_length`` (the longest L up to which every mean is at
  least ``threshold``; None if the shortest already falls below) and the examples."""
  names = list(dict.fromkeys(ex.task for ex in examples))
  lengths = sorted({ex.length for ex in examples})
  hits = {}
  for ex, r in zip(examples, results):
    hits.setdefault((ex.task, ex.length), []).append(r["correct"])
  by_task = {name: {"by_length": {str(n): {"accuracy": float(np.mean(hits[name, n])),
                                           "samples": len(hits[name, n])} for n in lengths}}
             for name in names}
  means = {str(n): float(np.mean([by_task[t]["by_length"][str(n)]["accuracy"] for t in names]))
           for n in lengths}
  effective = None
  for n in lengths:
    if means[str(n)] < threshold:
      break
    effective = n
  return {"tasks": by_task, "mean_by_length": means, "effective_length": effective,
          "threshold": threshold, "lengths": lengths,
          "examples": [{"task": ex.task, "length": ex.length, "sample": ex.sample,
                        "depth": ex.depth, "answer": ex.answer, **r}
                       for ex, r in zip(examples, results)]}


def read_examples(path: str, tokenizer) -> list[tasks_lib.Example]:
  """The lines of a JSONL file, each ``{"prompt": str, "answer": str}`` (tokenized with
  ``tokenizer``, prompt and answer apart) or ``{"prompt_ids": [int], "answer_ids": [int]}``.
  Raises ``ValueError`` naming the file and line of a malformed one."""
  examples = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}, line {number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
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
      examples.append(tasks_lib.Example("examples", len(prompt) + len(answer), number - 1,
                                        np.asarray(prompt, np.int64),
                                        np.asarray(answer, np.int64), text))
  if not examples:
    raise ValueError(f"{path}: no examples (one JSON object per line)")
  return examples


class Probe:
  """RULER tasks scored at a trainer's eval steps (``TrainConfig.ruler_tasks``): the examples
  are made once (lengths S/2 and S, seed 0), each call scores them with the current
  parameters and returns the metrics ``ruler_mean``, ``ruler_<task>`` (mean over the lengths)
  and ``ruler_mean_<L>``."""

  def __init__(self, names, samples: int, tokenizer, mesh, *, seq_len: int, vocab_size: int):
    self.examples = generate(names, sorted({seq_len // 2, seq_len}), samples, tokenizer)
    self.data = dataset(self.examples, mesh, seq_len=seq_len, batch_size=mesh.shape["data"],
                        vocab_size=vocab_size)

  def __call__(self, evaluator, params) -> dict[str, float]:
    report = summarize(self.examples, score(evaluator, params, self.examples, self.data))
    metrics = {f"ruler_mean_{n}": a for n, a in report["mean_by_length"].items()}
    metrics["ruler_mean"] = float(np.mean(list(report["mean_by_length"].values())))
    for name, task in report["tasks"].items():
      metrics[f"ruler_{name}"] = float(np.mean([v["accuracy"]
                                                for v in task["by_length"].values()]))
    return metrics
