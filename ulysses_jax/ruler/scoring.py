"""RULER's scores and the report over tasks x lengths.

Two scorings, each named in the report:

* ``"strict"``: the canonical answer (``Example.answer``) exactly, token by token, under
  teacher forcing: what greedy decoding would write first, all or nothing, in a fixed order
  (one forward pass per example; ``ruler.score``). Ours; a lower bound on the other.
* ``"ruler"``: RULER's own (NVIDIA/RULER ``scripts/eval/``): the generated answer cleaned up
  (``postprocess``), then ``string_match_all`` (the share of the expected strings found in it,
  case-insensitively, in any order) or, for QA, ``string_match_part`` (1 when any accepted
  answer is in it). Needs a generated answer per example (``"prediction"`` in its result).

Scores are percentages; each task x length cell has its mean, standard error and sample count,
and the mean over tasks is RULER's average. The effective length (the longest length up to
which the average stays at or above RULER's 85.6) is given only for the ``"ruler"`` scoring
of the whole suite, where it means what the paper's does.
"""

import re

import numpy as np

THRESHOLD = 85.6  # RULER's threshold: Llama-2-7B's average at 4K tokens, percent
_NON_PRINTABLE = re.compile(r"[\x00-\x1f]")
DESCRIPTIONS = {
    "strict": "ours: the canonical answer's tokens exactly under teacher forcing (greedy "
              "decoding's first tokens), all or nothing, percent",
    "ruler": "RULER's: greedy generation within the task's budget, string_match_all "
             "(string_match_part for QA) after RULER's clean-up, percent",
}


def postprocess(prediction: str) -> str:
  """RULER's clean-up of a generated answer: stripped, control characters as newlines."""
  return _NON_PRINTABLE.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, outputs) -> float:
  """The share of ``outputs`` found in ``prediction``, case-insensitively."""
  text = prediction.lower()
  return sum(o.lower() in text for o in outputs) / len(outputs)


def string_match_part(prediction: str, outputs) -> float:
  """1.0 when any of ``outputs`` is in ``prediction``, case-insensitively."""
  text = prediction.lower()
  return float(any(o.lower() in text for o in outputs))


def ruler_score(example, prediction: str) -> float:
  """RULER's score of one generated answer, percent."""
  match = string_match_part if example.metric == "part" else string_match_all
  return 100.0 * match(postprocess(prediction), example.outputs)


def summarize(examples, results, names=None, threshold: float = THRESHOLD) -> dict:
  """JSON-able report. ``results[i]``: ``{"correct": bool, ...}`` when scored strictly and
  ``"prediction"`` (str) when generated (one or both). ``names``: the whole suite's task names
  (``tasks.TASKS``): only a report over all of them has an effective length."""
  tasks = list(dict.fromkeys(ex.task for ex in examples))
  lengths = sorted({ex.length for ex in examples})
  scorings = [s for s, key in (("strict", "correct"), ("ruler", "prediction"))
              if all(key in r for r in results)]
  if not scorings:
    raise ValueError("nothing to score: every result needs 'correct' (strict) or 'prediction' "
                     "(generated)")
  scores = {}
  for ex, r in zip(examples, results):
    cell = scores.setdefault((ex.task, ex.length), {s: [] for s in scorings})
    if "strict" in scorings:
      cell["strict"].append(100.0 * bool(r["correct"]))
    if "ruler" in scorings:
      cell["ruler"].append(ruler_score(ex, r["prediction"]))
  by_task = {t: {"by_length": {str(n): _cell(scores[t, n]) for n in lengths
                               if (t, n) in scores}} for t in tasks}
  means = {}
  for n in lengths:
    cells = [by_task[t]["by_length"][str(n)] for t in tasks if str(n) in by_task[t]["by_length"]]
    means[str(n)] = {"tasks": len(cells)}
    for s in scorings:
      errors = [c[f"{s}_stderr"] for c in cells]
      means[str(n)][s] = float(np.mean([c[s] for c in cells]))
      means[str(n)][f"{s}_stderr"] = (None if None in errors else
                                      float(np.sqrt(np.sum(np.square(errors)))) / len(cells))
  full = names is not None and set(tasks) == set(names) and all(
      m["tasks"] == len(tasks) for m in means.values())
  effective, note = None, None
  if "ruler" not in scorings:
    note = "no generated answers: the strict score has no effective length"
  elif not full:
    note = "not the whole RULER suite at every length: no effective length"
  else:
    for n in lengths:
      if means[str(n)]["ruler"] < threshold:
        break
      effective = n
  return {"scoring": {s: DESCRIPTIONS[s] for s in scorings}, "tasks": by_task,
          "mean_by_length": means, "effective_length": effective,
          "effective_length_note": note, "threshold": threshold, "lengths": lengths,
          "examples": [{"task": ex.task, "length": ex.length, "sample": ex.sample,
                        "depth": ex.depth, "prompt_tokens": len(ex.prompt_ids),
                        "answer": ex.answer, "outputs": list(ex.outputs), **r}
                       for ex, r in zip(examples, results)]}


def _cell(scores: dict[str, list[float]]) -> dict:
  out = {"samples": len(next(iter(scores.values())))}
  for s, values in scores.items():
    out[s] = float(np.mean(values))
    out[f"{s}_stderr"] = (float(np.std(values, ddof=1) / np.sqrt(len(values)))
                          if len(values) > 1 else None)
  return out
