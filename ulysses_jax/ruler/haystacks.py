"""Haystacks and where needles go in them, as RULER builds them (NVIDIA/RULER,
``scripts/data/synthetic/niah.py`` and ``variable_tracking.py``).

* ``"noise"``: lines of the same paragraph (``prompts.NOISE``), needles as lines between them;
* ``"needle"``: lines of distractor needles, the asked ones as lines between them;
* ``"essay"``: the first n words of the user's essays (repeated from the start when n is
  larger), whitespace collapsed, cut into sentences, the needles inserted between sentences
  and everything joined with spaces.

RULER cuts sentences with NLTK's punkt; ``sentences`` is our rule-based cut (a ``.``, ``!`` or
``?`` and any closing quotes or brackets, then a space and a capital letter, digit or opening
quote; not after a one-letter word or a common abbreviation). The essay words end at the last
full sentence, so a needle placed last follows a sentence end too.
"""

import re

import numpy as np

DEPTHS = np.round(np.linspace(0, 100, num=40)).astype(int)  # RULER's needle depths, percent
_BOUNDARY = re.compile(r"""[.!?]["'\u2019\u201d)\]]*( +)(?=["'\u2018\u201c(\[]*[A-Z0-9])""")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc inc ltd co corp no vol fig e.g i.e approx".split())


def essay_words(text: str) -> list[str]:
  """The words of the essays, as RULER splits them (whitespace runs collapsed)."""
  words = re.sub(r"\s+", " ", text).strip().split(" ")
  return [w for w in words if w]


def sentences(text: str) -> list[str]:
  """``text`` (one line, whitespace collapsed) cut into sentences; ``" ".join`` gives it back."""
  out, start = [], 0
  for match in _BOUNDARY.finditer(text):
    last_word = text[:match.start() + 1].rsplit(" ", 1)[-1].lstrip("\"'(\u2018\u201c[")
    stem = last_word.rstrip(".!?").lower()
    if len(stem) <= 1 or stem in _ABBREVIATIONS:
      continue
    out.append(text[start:match.start(1)])
    start = match.end(1)
  out.append(text[start:])
  return [s for s in out if s]


def essay_sentences(words: list[str], n: int) -> list[str]:
  """The sentences of the first ``n`` words (the essays repeated as often as needed), up to the
  last one that ends."""
  repeats = -(-n // len(words))
  cut = sentences(" ".join((words * repeats)[:n]))
  if cut and not _ends_sentence(cut[-1]) and len(cut) > 1:
    cut = cut[:-1]
  return cut


def _ends_sentence(sentence: str) -> bool:
  return bool(re.search(r"""[.!?]["'\u2019\u201d)\]]*$""", sentence))


def insert(pieces: list[str], needles: list[tuple[float, str]]) -> list[str]:
  """``pieces`` (lines or sentences) with each needle ``(depth in [0, 1], text)`` inserted
  before piece ``int(len(pieces) * depth)`` (after the last at depth 1); needles at one place
  keep their order."""
  out, last = [], 0
  order = sorted(range(len(needles)), key=lambda i: needles[i][0])
  for i in order:
    cut = int(len(pieces) * needles[i][0])
    out += pieces[last:cut] + [needles[i][1]]
    last = max(last, cut)
  return out + pieces[last:]


def random_depths(rng: np.random.Generator, n: int) -> list[float]:
  """``n`` different depths from RULER's 40 (0 to 100 %), as fractions."""
  return [float(d) / 100 for d in rng.choice(DEPTHS, n, replace=False)]
