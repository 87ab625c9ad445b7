"""RULER's word pools and random needle parts.

The lists are the wonderwords package's (version 2.2.0; ``WORDS_LICENSE``), which RULER
(NVIDIA/RULER, ``scripts/data/synthetic/niah.py`` and ``common_words_extraction.py``) reads:
keys are adjective-noun pairs ("quizzical-aardvark", 912 x 6,786 of them), common-word lists
draw from the nouns, adjectives and verbs together (8,163 distinct words). The six entries
with a space ("contact lens") are left out, so that every key and listed word is one
whitespace-free token of text.
"""

import functools
import os
import string
import uuid

import numpy as np


@functools.cache
def _read(name: str) -> tuple[str, ...]:
  with open(os.path.join(os.path.dirname(__file__), name), encoding="utf-8") as f:
    return tuple(w for w in (line.rstrip("\n") for line in f) if w and " " not in w)


def nouns() -> tuple[str, ...]:
  return _read("nouns.txt")


def adjectives() -> tuple[str, ...]:
  return _read("adjectives.txt")


@functools.cache
def common_word_pool() -> tuple[str, ...]:
  """The distinct nouns, adjectives and verbs, sorted (RULER's common-word pool)."""
  return tuple(sorted(set(nouns()) | set(adjectives()) | set(_read("verbs.txt"))))


def random_token(kind: str, rng: np.random.Generator) -> str:
  """A key or value of ``kind``: ``"words"`` (an adjective-noun pair), ``"numbers"`` (7
  digits) or ``"uuids"`` (a version-4 UUID), as RULER draws them."""
  if kind == "numbers":
    return str(int(rng.integers(1_000_000, 10_000_000)))
  if kind == "words":
    adjective, noun = adjectives(), nouns()
    return f"{adjective[rng.integers(len(adjective))]}-{noun[rng.integers(len(noun))]}"
  if kind == "uuids":
    bits = int.from_bytes(rng.bytes(16), "big")
    return str(uuid.UUID(int=bits, version=4))
  raise ValueError(f"unknown needle part {kind!r}; choose numbers, words or uuids")


def distinct_tokens(kind: str, rng: np.random.Generator, n: int,
                    avoid: tuple[str, ...] = ()) -> list[str]:
  """``n`` tokens of ``kind``, none of which contains or is contained in another or in one of
  ``avoid`` (so that a text search for an asked key finds only its own needles)."""
  out = []
  while len(out) < n:
    token = random_token(kind, rng)
    if not any(token in a or a in token for a in (*avoid, *out)):
      out.append(token)
  return out


def letters(rng: np.random.Generator, k: int, upper: bool = True) -> str:
  """``k`` random ASCII letters (variable names, FWE's coded words)."""
  alphabet = string.ascii_uppercase if upper else string.ascii_lowercase
  return "".join(alphabet[i] for i in rng.integers(0, 26, k))
