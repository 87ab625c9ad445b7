"""Where training text comes from: tokenizers, source files and the train/eval split.

A corpus is a list of documents, each a slice of a 1-D token array (token files stay
memory-mapped), and optionally a parallel 1-D bool array per token array saying which tokens
are targets (prompt/completion JSONL: only completion tokens are). ``data.py`` packs corpora
into rows.
"""

import dataclasses
import glob
import os
import sysconfig
from collections.abc import Sequence

import numpy as np

from ulysses_jax.data import records

SPLIT_SEED = 20250101  # fixes the train/eval split independently of the training seed
TOKEN_DIR_INDEX = "ulysses_tokens.json"  # marks a directory of tokens ulysses_jax.preprocess wrote


# ----------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
  """UTF-8 bytes as ids 0..255; lossless for any file."""
  vocab_size = 256

  def encode_batch(self, docs: Sequence[bytes], add_special_tokens: bool = False
                   ) -> list[np.ndarray]:
    """The bytes of each document (there are no special tokens to add)."""
    return [np.frombuffer(d, np.uint8) for d in docs]

  def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per text: its ids and each one's ``[start, end)`` character range ``[n, 2]``."""
    out = []
    for text in texts:
      char_of_byte = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
      out.append((np.frombuffer(text.encode("utf-8"), np.uint8),
                  np.stack([char_of_byte, char_of_byte + 1], axis=1)))
    return out

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """The bytes as UTF-8 text; ids past 255 (a model's extra ids, e.g. its EOS) are not
    bytes: skipped as special tokens, else a ``ValueError``."""
    ids = np.asarray(ids, np.int64)
    extra = (ids < 0) | (ids > 255)
    if extra.any() and not skip_special_tokens:
      raise ValueError(f"byte tokenizer: ids must be bytes 0..255, got {ids[extra][0]}")
    return bytes(ids[~extra].astype(np.uint8)).decode("utf-8", errors="replace")


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

  def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per text: its ids (no added special tokens) and each one's ``[start, end)`` character
    range ``[n, 2]``."""
    return [(np.asarray(e.ids, np.uint32), np.asarray(e.offsets, np.int64).reshape(-1, 2))
            for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def make_tokenizer(name: str = "byte") -> ByteTokenizer | HFTokenizer:
  return ByteTokenizer() if name == "byte" else HFTokenizer(name)


# ----------------------------------------------------------------------------- sources

@dataclasses.dataclass
class Corpus:
  """Documents as (array, start, length) over a list of 1-D token arrays (maybe memmaps).

  ``targets``: None (every token is a target), or one bool array (or None: all targets) per
  token array, True where the token may be a label (a completion token, an assistant turn)
  and False where it is only context (a prompt token, a user turn).
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
    if self.targets is None or self.targets[a] is None:
      return tokens, np.ones(len(tokens), bool)
    return tokens, np.asarray(self.targets[a][start:start + n], bool)


def concat(parts: Sequence[Corpus]) -> Corpus:
  """The documents of ``parts`` in order (which share one list of arrays)."""
  return Corpus(parts[0].arrays, *(np.concatenate([getattr(p, f) for p in parts])
                                    for f in ("doc_array", "doc_start", "doc_len")),
                parts[0].targets)


def merge(parts: Sequence[Corpus]) -> Corpus:
  """The documents of ``parts`` in order, each with its own arrays (sources of a mixture)."""
  arrays, targets, doc_arrays = [], [], []
  for part in parts:
    doc_arrays.append(part.doc_array + len(arrays))
    arrays += part.arrays
    targets += part.targets or [None] * len(part.arrays)
  return Corpus(arrays, np.concatenate(doc_arrays),
                *(np.concatenate([getattr(p, f) for p in parts]) for f in ("doc_start", "doc_len")),
                None if all(t is None for t in targets) else targets)


def resolve_paths(paths: str | Sequence[str]) -> list[str]:
  """Expands globs and dataset directories; every entry must name at least one existing file.

  A directory is a dataset when it is a ``save_to_disk`` directory or holds ``*.parquet``
  files (``records.data_files``: its files in order), or a token directory that
  ``ulysses_jax.preprocess`` wrote (kept whole: ``TOKEN_DIR_INDEX``)."""
  files = []
  for pattern in [paths] if isinstance(paths, str) else paths:
    if glob.has_magic(pattern):
      found = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
      if not found:
        raise FileNotFoundError(f"data pattern {pattern!r} matched no files")
      files += found
    elif os.path.isfile(os.path.join(pattern, TOKEN_DIR_INDEX)):
      files.append(pattern)
    elif os.path.isdir(pattern):
      dataset = records.data_files(pattern)
      if dataset is None:
        raise IsADirectoryError(f"data path {pattern!r} is a directory but no dataset (no "
                                "state.json, *.parquet or preprocessed tokens); give files or "
                                f"a glob such as {os.path.join(pattern, '**', '*.txt')!r}")
      files += dataset
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
