"""Pre-tokenized token files: ``.npy`` arrays and raw ``.bin`` streams of any integer dtype, and
token directories (``TokenDirWriter``: what ``ulysses_jax.preprocess --out`` writes).

Files stay memory-mapped: they are checked in chunks of ``SCAN_CHUNK`` tokens (ids within
``[0, vocab_size)``, document ends) and converted to int64 one row window at a time
(``Corpus.read``), so a file larger than the host's memory trains. A damaged file (truncated,
not a ``.npy``, not a 1-D integer array) is a ``ValueError`` naming the file and the fault.
"""

import json
import os
from collections.abc import Sequence

import numpy as np

from ulysses_jax.data.corpus import TOKEN_DIR_INDEX, Corpus, concat

TOKEN_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")
SCAN_CHUNK = 1 << 24
_SAVE_HINT = "write token files with np.save(path, tokens) of a 1-D integer array"


def _open_npy(path: str) -> np.ndarray:
  """The array of a ``.npy`` file, memory-mapped, after checking its header and size."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    try:
      version = np.lib.format.read_magic(f)
      read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                     else np.lib.format.read_array_header_2_0)
      shape, _, dtype = read_header(f)
    except (ValueError, EOFError, SyntaxError) as e:
      raise ValueError(f"token file {path}: not a NumPy .npy file or its header is damaged "
                       f"({e}); {_SAVE_HINT}") from None
    offset = f.tell()
  if len(shape) != 1:
    raise ValueError(f"token file {path}: holds a {len(shape)}-D array of shape {shape}, "
                     f"need a 1-D array of token ids (flatten it: tokens.reshape(-1))")
  if dtype.kind not in "iu":
    raise ValueError(f"token file {path}: holds {dtype.name} values, need an integer dtype "
                     f"({'/'.join(TOKEN_DTYPES)}); convert with tokens.astype(np.int32)")
  need = offset + shape[0] * dtype.itemsize
  if size < need:
    raise ValueError(f"token file {path}: truncated: its header promises {shape[0]} "
                     f"{dtype.name} tokens ({need} bytes) but the file has {size} bytes; "
                     "write it again")
  if not shape[0]:
    return np.zeros(0, dtype)
  return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def load_token_file(path: str, dtype: str) -> np.ndarray:
  """A token file as a 1-D memory-mapped array; ``dtype`` is that of ``.bin`` files."""
  if path.endswith(".npy"):
    return _open_npy(path)
  if dtype not in TOKEN_DTYPES:
    raise ValueError(f"token_dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")
  size, item = os.path.getsize(path), np.dtype(dtype).itemsize
  if size % item:
    raise ValueError(f"token file {path}: {size} bytes is not a whole number of {dtype} tokens "
                     f"({item} bytes each): truncated, or DataConfig.token_dtype is not the "
                     "dtype it was written with")
  return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _first_outside(path: str, chunk: np.ndarray, lo: int, vocab_size: int | None):
  """Raises for the first id of ``chunk`` (tokens ``lo``... of ``path``) that is negative or
  not below ``vocab_size``."""
  bad = chunk < 0 if vocab_size is None else (chunk < 0) | (chunk >= vocab_size)
  if not bad.any():
    return
  i = int(np.argmax(bad))
  allowed = ("token ids are >= 0" if vocab_size is None
             else f"the model's vocab_size is {vocab_size}, so ids are in [0, {vocab_size})")
  raise ValueError(f"token file {path}: token {lo + i} is {int(chunk[i])}; {allowed}. "
                   "Tokenize with the model's own tokenizer, or use a model whose vocabulary "
                   "holds these ids")


def token_corpus(files: Sequence[str], dtype: str, eos_id: int | None,
                 vocab_size: int | None) -> tuple[Corpus, int]:
  """Memory-maps token files (one chunked scan: ids in range, document ends); returns the
  corpus and max id + 1."""
  arrays, parts, top = [], [], -1
  for i, path in enumerate(files):
    arr = load_token_file(path, dtype)
    ends = []
    for lo in range(0, len(arr), SCAN_CHUNK):
      chunk = np.asarray(arr[lo:lo + SCAN_CHUNK])
      _first_outside(path, chunk, lo, vocab_size)
      top = max(top, int(chunk.max()))
      if eos_id is not None:
        ends.append(lo + 1 + np.flatnonzero(chunk == eos_id))
    bounds = np.unique(np.concatenate([[0, len(arr)], *ends]).astype(np.int64))
    starts, lengths = bounds[:-1], np.diff(bounds)
    arrays.append(arr)
    parts.append(Corpus(arrays, np.full(len(starts), i, np.int64), starts, lengths))
  return concat(parts), top + 1


class TokenDirWriter:
  """Writes documents as they come (``add(tokens, targets)``, the sink of
  ``documents.read_documents``) into a token directory; ``finish(description)`` completes it and
  returns its index. Only the documents' starts and lengths stay in memory.

  Files: ``tokens.bin`` (uint32 ids, the documents in order), ``targets.bin`` (one byte per
  token: may it be a label; removed when every token may), ``documents.npy`` (int64 ``[n, 2]``:
  start and length) and ``TOKEN_DIR_INDEX`` (JSON, written last: a directory without it was
  not finished).
  """

  def __init__(self, directory: str):
    os.makedirs(directory, exist_ok=True)
    self.directory = directory
    self._tokens = open(os.path.join(directory, "tokens.bin"), "wb")  # pylint: disable=consider-using-with
    self._targets = open(os.path.join(directory, "targets.bin"), "wb")  # pylint: disable=consider-using-with
    self._lengths, self._low, self._high, self._context = [], 0, -1, False

  def add(self, tokens: np.ndarray, targets: np.ndarray | None):
    if not len(tokens):
      return
    self._low, self._high = min(self._low, int(tokens.min())), max(self._high, int(tokens.max()))
    if self._low < 0 or self._high >= 2**32:
      raise ValueError(f"token id {self._low if self._low < 0 else self._high} cannot be "
                       "stored: token ids are in [0, 2**32)")
    self._tokens.write(np.asarray(tokens, np.uint32).tobytes())
    flags = np.ones(len(tokens), bool) if targets is None else np.asarray(targets, bool)
    self._context |= not flags.all()
    self._targets.write(flags.tobytes())
    self._lengths.append(len(tokens))

  def finish(self, description: dict) -> dict:
    self._tokens.close()
    self._targets.close()
    if not self._context:
      os.remove(os.path.join(self.directory, "targets.bin"))
    lengths = np.asarray(self._lengths, np.int64)
    np.save(os.path.join(self.directory, "documents.npy"),
            np.stack([np.cumsum(lengths) - lengths, lengths], axis=1).reshape(-1, 2))
    index = {**description, "format": 1, "num_tokens": int(lengths.sum()),
             "num_documents": len(lengths), "max_id": self._high,
             "has_targets": self._context}
    with open(os.path.join(self.directory, TOKEN_DIR_INDEX), "w", encoding="utf-8") as f:
      json.dump(index, f, indent=1)
    return index


def token_dir_corpus(directory: str, vocab_size: int | None) -> tuple[Corpus, int]:
  """The corpus of a token directory (memory-mapped) and max id + 1; ids are checked against
  ``vocab_size`` from the index."""
  with open(os.path.join(directory, TOKEN_DIR_INDEX), encoding="utf-8") as f:
    index = json.load(f)
  if index.get("format") != 1:
    raise ValueError(f"{directory}: token directory format {index.get('format')!r}, this "
                     "version reads format 1; run ulysses_jax.preprocess --out again")
  tokens = load_token_file(os.path.join(directory, "tokens.bin"), "uint32")
  documents = np.load(os.path.join(directory, "documents.npy"))
  if len(tokens) != index["num_tokens"] or len(documents) != index["num_documents"]:
    raise ValueError(f"{directory}: holds {len(tokens)} tokens and {len(documents)} documents, "
                     f"its index says {index['num_tokens']} and {index['num_documents']}; "
                     "run ulysses_jax.preprocess --out again")
  if vocab_size is not None and index["max_id"] >= vocab_size:
    raise ValueError(f"{directory}: token id {index['max_id']} is beyond the model's "
                     f"vocab_size={vocab_size}: it was tokenized with {index.get('tokenizer')!r};"
                     " preprocess with the model's own tokenizer")
  targets = None
  if index["has_targets"]:
    targets = [np.memmap(os.path.join(directory, "targets.bin"), dtype=bool, mode="r")]
  return (Corpus([tokens], np.zeros(len(documents), np.int64), documents[:, 0].copy(),
                 documents[:, 1].copy(), targets), index["max_id"] + 1)
