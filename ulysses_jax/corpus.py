"""Where training text comes from: tokenizers, source files and the train/eval split.

A corpus is a list of documents, each a slice of a 1-D token array (token files stay
memory-mapped), and optionally a parallel 1-D bool array per token array saying which tokens
are targets (prompt/completion JSONL: only completion tokens are). ``data.py`` packs corpora
into rows.
"""

import dataclasses
import glob
import json
import os
import sysconfig
from collections.abc import Sequence

import numpy as np

SPLIT_SEED = 20250101  # fixes the train/eval split independently of the training seed


# ----------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
  """UTF-8 bytes as ids 0..255; lossless for any file."""
  vocab_size = 256

  def encode_batch(self, docs: Sequence[bytes], add_special_tokens: bool = False
                   ) -> list[np.ndarray]:
    """The bytes of each document (there are no special tokens to add)."""
    return [np.frombuffer(d, np.uint8) for d in docs]

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
  """A local Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path!r} (give 'byte' or the path "
                              "of a Hugging Face tokenizer.json)")
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("a tokenizer.json needs the `tokenizers` package: "
                        "pip install tokenizers") from e
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()

  def encode_batch(self, docs: Sequence[bytes], add_special_tokens: bool = False
                   ) -> list[np.ndarray]:
    """Each document's ids; ``add_special_tokens`` adds what the tokenizer's post-processor
    adds (a BOS, as transformers' tokenizer does for a prompt), else none (training text)."""
    texts = [d.decode("utf-8", errors="replace") for d in docs]
    return [np.asarray(e.ids, np.uint32)
            for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids])


def make_tokenizer(name: str = "byte") -> ByteTokenizer | HFTokenizer:
  return ByteTokenizer() if name == "byte" else HFTokenizer(name)


# ----------------------------------------------------------------------------- sources

@dataclasses.dataclass
class Corpus:
  """Documents as (array, start, length) over a list of 1-D token arrays (maybe memmaps).

  ``targets``: None (every token is a target), or one bool array per token array, True where
  the token may be a label (a completion token) and False where it is only context (a
  prompt token).
  """
  arrays: list[np.ndarray]
  doc_array: np.ndarray  # int64 [n]
  doc_start: np.ndarray  # int64 [n]
  doc_len: np.ndarray  # int64 [n]
  targets: list[np.ndarray] | None = None

  @property
  def num_tokens(self) -> int:
    return int(self.doc_len.sum())

  def take(self, idx) -> "Corpus":
    return Corpus(self.arrays, self.doc_array[idx], self.doc_start[idx], self.doc_len[idx],
                  self.targets)

  def truncated(self, max_len: int) -> "Corpus":
    """The same documents cut to their first ``max_len`` tokens."""
    return Corpus(self.arrays, self.doc_array, self.doc_start,
                  np.minimum(self.doc_len, max_len), self.targets)

  def read(self, doc: int, begin: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[begin, begin + n)`` of document ``doc`` (int64) and their target flags."""
    a, start = self.doc_array[doc], self.doc_start[doc] + begin
    tokens = np.asarray(self.arrays[a][start:start + n], np.int64)
    if self.targets is None:
      return tokens, np.ones(len(tokens), bool)
    return tokens, np.asarray(self.targets[a][start:start + n], bool)


def concat(parts: Sequence[Corpus]) -> Corpus:
  return Corpus(parts[0].arrays, *(np.concatenate([getattr(p, f) for p in parts])
                                    for f in ("doc_array", "doc_start", "doc_len")),
                parts[0].targets)


def resolve_paths(paths: str | Sequence[str]) -> list[str]:
  """Expands globs; every entry must name at least one existing file."""
  files = []
  for pattern in [paths] if isinstance(paths, str) else paths:
    if glob.has_magic(pattern):
      found = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
      if not found:
        raise FileNotFoundError(f"data pattern {pattern!r} matched no files")
      files += found
    elif os.path.isdir(pattern):
      raise IsADirectoryError(f"data path {pattern!r} is a directory; give files or a glob "
                              f"such as {os.path.join(pattern, '**', '*.txt')!r}")
    elif not os.path.isfile(pattern):
      raise FileNotFoundError(f"data file not found: {pattern!r}")
    else:
      files.append(pattern)
  if not files:
    raise ValueError("source='files' needs DataConfig.paths (files or globs)")
  return list(dict.fromkeys(files))


def stdlib_files() -> list[str]:
  root = sysconfig.get_paths()["stdlib"]
  return sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                if "site-packages" not in os.path.relpath(f, root).split(os.sep))


def read_docs(path: str, text_field: str = "text") -> list[tuple[bytes, bytes]]:
  """(prompt, text) pairs: one per plain-text file (no prompt), one per line of a ``.jsonl``.

  A JSONL record holds either string fields ``"prompt"`` and ``"completion"`` (the loss
  falls on the completion only) or the string field ``text_field`` (prompt ``b""``).
  """
  if not path.endswith(".jsonl"):
    with open(path, "rb") as f:
      return [(b"", f.read())]
  docs = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
      if not isinstance(record, dict):
        raise ValueError(f"{path}:{lineno}: not a JSON object: {line.strip()[:40]!r}")
      if "prompt" in record or "completion" in record:
        fields = ("prompt", "completion")
      else:
        fields = (text_field,)
      values = [record.get(k) for k in fields]
      if not all(isinstance(v, str) for v in values):
        raise ValueError(f"{path}:{lineno}: JSONL record has no string "
                         f"{' and '.join(repr(k) for k in fields)} field (records hold a "
                         f"{text_field!r} field, set by DataConfig.text_field, or 'prompt' "
                         f"and 'completion'); it has {sorted(record)}")
      encoded = [v.encode("utf-8") for v in values]
      docs.append(tuple(encoded) if len(encoded) == 2 else (b"", encoded[0]))
  return docs


def text_corpus(files: Sequence[str], tokenizer, text_field: str = "text") -> Corpus:
  """Documents in file order; with any prompt/completion record, target flags (prompts
  False)."""
  pairs = [d for f in files for d in read_docs(f, text_field)]
  prompts = tokenizer.encode_batch([p for p, _ in pairs])
  texts = tokenizer.encode_batch([t for _, t in pairs])
  docs = [(p, t) for p, t in zip(prompts, texts) if p.size + t.size]
  lengths = np.array([p.size + t.size for p, t in docs], np.int64)
  tokens = np.concatenate([x for d in docs for x in d]) if docs else np.zeros(0, np.uint8)
  starts = np.cumsum(lengths) - lengths
  targets = None
  if any(p.size for p, _ in docs):
    targets = [np.concatenate([np.full(x.size, i == 1) for d in docs
                               for i, x in enumerate(d)])]
  return Corpus([tokens], np.zeros(len(docs), np.int64), starts, lengths, targets)


def split_corpus(corpus: Corpus, eval_fraction: float) -> tuple[Corpus, Corpus | None]:
  """Shuffles documents with a fixed seed and holds out the last ``eval_fraction`` tokens.

  The document straddling the cut is split in two, so both sides are non-empty for any
  fraction in (0, 1) and a corpus of a single document.
  """
  corpus = corpus.take(np.random.default_rng(SPLIT_SEED).permutation(len(corpus.doc_len)))
  if not eval_fraction:
    return corpus, None
  ends = np.cumsum(corpus.doc_len)
  cut = int(round(ends[-1] * (1 - eval_fraction)))
  k = int(np.searchsorted(ends, cut))  # the first document ending at or after the cut
  head = cut - (ends[k] - corpus.doc_len[k])
  train, eval_ = corpus.take(slice(0, k + 1)), corpus.take(slice(k, None))
  train.doc_len = train.doc_len.copy()
  train.doc_len[-1] = head
  eval_.doc_start, eval_.doc_len = eval_.doc_start.copy(), eval_.doc_len.copy()
  eval_.doc_start[0] += head
  eval_.doc_len[0] -= head
  return tuple(c.take(c.doc_len > 0) for c in (train, eval_))
