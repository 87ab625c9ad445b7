"""RULER's QA tasks (NVIDIA/RULER ``scripts/data/synthetic/qa.py``): a question over many
documents, its own among them. ``qa_1`` reads SQuAD 2.0's dev set (``dev-v2.0.json``, from
the SQuAD explorer site), ``qa_2`` HotpotQA's distractor dev set
(``hotpot_dev_distractor_v1.json``); the user gives the files (``--qa_data``), nothing is
downloaded.

SQuAD: every answerable question; its documents are its paragraph, then the other paragraphs
of its article, then others. HotpotQA: every question; its documents are the ten paragraphs
(title, newline, sentences) that come with it. Documents are "Document i:\\n" + text, joined by
blank lines, in a random order; an example has as many as fit.
"""

import dataclasses
import json

import numpy as np

from ulysses_jax.ruler import families, prompts


@dataclasses.dataclass(frozen=True)
class Question:
  query: str
  outputs: tuple[str, ...]  # the accepted answers
  documents: tuple[int, ...]  # its own documents (indices into the set's documents)
  related: tuple[int, ...] = ()  # others to prefer (SQuAD: its article's other paragraphs)


@dataclasses.dataclass(frozen=True)
class QASet:
  kind: str  # "squad" or "hotpotqa"
  questions: tuple[Question, ...]
  documents: tuple[str, ...]


def read(path: str) -> QASet:
  """A SQuAD- or HotpotQA-format JSON file; which one is read from its shape. Raises
  ``ValueError`` naming the file when it is neither."""
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"--qa_data {path}: not JSON ({e.msg})") from None
  if isinstance(data, dict) and isinstance(data.get("data"), list):
    return _squad(data["data"])
  if isinstance(data, list) and data and isinstance(data[0], dict) and {
      "question", "answer", "context"} <= data[0].keys():
    return _hotpotqa(data)
  raise ValueError(f"--qa_data {path}: neither SQuAD ({{'data': [articles]}}, e.g. "
                   "dev-v2.0.json) nor HotpotQA ([{'question', 'answer', 'context'}], e.g. "
                   "hotpot_dev_distractor_v1.json)")


def _squad(articles) -> QASet:
  documents = sorted({p["context"] for a in articles for p in a["paragraphs"]})
  index = {d: i for i, d in enumerate(documents)}
  questions = []
  for article in articles:
    own = [index[p["context"]] for p in article["paragraphs"]]
    for paragraph in article["paragraphs"]:
      doc = index[paragraph["context"]]
      for qa in paragraph["qas"]:
        if not qa.get("is_impossible", False):
          questions.append(Question(qa["question"], tuple(a["text"] for a in qa["answers"]),
                                    (doc,), tuple(i for i in own if i != doc)))
  return QASet("squad", tuple(questions), tuple(documents))


def _hotpotqa(records) -> QASet:
  text = lambda title, sentences: f"{title}\n{''.join(sentences)}"
  documents = sorted({text(t, s) for r in records for t, s in r["context"]})
  index = {d: i for i, d in enumerate(documents)}
  questions = tuple(Question(r["question"], (r["answer"],),
                             tuple(index[text(t, s)] for t, s in r["context"]))
                    for r in records)
  return QASet("hotpotqa", questions, tuple(documents))


def build(task, n: int, rng: np.random.Generator, ctx) -> families.Draft:
  """The example of ``ctx.question`` with ``n`` documents (at least its own)."""
  qa: QASet = ctx.qa[task.dataset]
  question = qa.questions[ctx.question % len(qa.questions)]
  own, related = list(question.documents), list(question.related)
  if n < len(qa.documents):
    if n - len(own) > len(related):
      taken = set(own) | set(related)
      others = np.array([i for i in range(len(qa.documents)) if i not in taken])
      extra = rng.choice(others, min(len(others), n - len(own) - len(related)), replace=False)
      chosen = own + related + [int(i) for i in extra]
    else:
      chosen = own + [related[i] for i in rng.choice(len(related), n - len(own), replace=False)]
  else:  # RULER repeats the whole set
    chosen = (list(range(len(qa.documents))) * -(-n // len(qa.documents)))[:n]
  chosen = [chosen[i] for i in rng.permutation(len(chosen))]
  context = "\n\n".join(f"Document {i + 1}:\n{qa.documents[d]}" for i, d in enumerate(chosen))
  template, prefix, _ = prompts.TEMPLATES["qa"]
  return families.Draft(template.format(context=context, query=question.query), prefix,
                        question.outputs, " " + question.outputs[0])


def minimum_documents(task, ctx) -> int:
  qa: QASet = ctx.qa[task.dataset]
  return len(qa.questions[ctx.question % len(qa.questions)].documents)
