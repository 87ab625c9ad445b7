"""Training batches: packing corpora (see corpus.py) into fixed-length rows, global arrays.

A batch is a dict of int32 arrays ``[B, S]`` (B global rows, S = ``seq_len``), sharded
``P("data", "seq")``:

* ``tokens``: input ids.
* ``labels``: the next token of the same document, or ``IGNORE_LABEL`` where there is none
  (a document's last token, padding). Shifted here, before sharding, so the label of a
  shard's last token comes from the next shard.
* ``segment_ids``: 0, 1, 2, ... for the document pieces of a row, in order; padding takes
  the id after the last piece, so it never attends to real tokens.
* ``positions``: restart at 0 at the start of every piece (and of the padding).

Text rows are windows of S tokens (plus one for the last label) over the concatenation of
documents; a document crossing a row boundary continues in the next window as a new piece.
Training order is a seeded shuffle of documents, then of windows, per epoch: a pure
function of the global row index, so an iterator's whole position is one integer. Tokens of
a JSONL record's ``"prompt"`` are context only: no label names them, so the loss falls on
the ``"completion"``.

``document_windows`` gives evaluation rows instead: each document alone, cut into
consecutive windows of S tokens (see ``ulysses_jax.evaluate``).
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import NamedSharding

from ulysses_jax.config_checks import ConfigError, at_least, check_fields
from ulysses_jax.corpus import (Corpus, make_tokenizer, resolve_paths, split_corpus,
                                stdlib_files, text_corpus)
from ulysses_jax.mesh import DATA, make_mesh, sequence_axes, sequence_shards
from ulysses_jax.sharding import batch_spec
from ulysses_jax.token_files import TOKEN_DTYPES, token_corpus

IGNORE_LABEL = -1
SOURCES = ("stdlib", "files", "retrieval")
LONG_DOCUMENTS = ("split", "truncate")


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
  """Synthetic long-context retrieval; every row is one example of ``seq_len`` tokens.

  Row: ``k1 v1 ... kn vn`` at positions 0..2n-1 (distinct keys, random values), random
  filler, then ``QUERY kq`` at positions S-2, S-1 with ``kq`` one of the planted keys. The
  only label sits at S-1: the value planted after ``kq``. The pairs and the question are
  S tokens apart, so on a sequence-sharded mesh they sit on the first and last shards, and
  answering needs attention across them (an induction head: two layers). Chance accuracy
  is ``1 / num_values``. Ids: 0 = QUERY, then filler, keys, values.
  """
  num_pairs: int = dataclasses.field(default=2, metadata=at_least(1))
  num_keys: int = dataclasses.field(default=16, metadata=at_least(1))
  num_values: int = dataclasses.field(default=16, metadata=at_least(1))
  num_filler: int = dataclasses.field(default=16, metadata=at_least(1))
  eval_rows: int = dataclasses.field(default=256, metadata=at_least(1))

  def __post_init__(self):
    check_fields(self)
    if self.num_keys < self.num_pairs:
      raise ConfigError(f"RetrievalTask needs num_keys >= num_pairs (distinct keys), got "
                        f"num_keys={self.num_keys} < num_pairs={self.num_pairs}")

  @property
  def vocab_size(self) -> int:
    return 1 + self.num_filler + self.num_keys + self.num_values

  @property
  def chance(self) -> float:
    return 1 / self.num_values


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to cut it into batches (gin-configurable).

  source: "stdlib" (the Python standard library's ``*.py`` files: real text present on
    every machine), "files" (``paths``: plain text files, one document each; ``.jsonl``,
    one document per record: a ``text_field`` string, or ``"prompt"`` and ``"completion"``
    strings with the loss on the completion only; or pre-tokenized ``.bin``/``.npy`` token
    files), or "retrieval" (``RetrievalTask``).
  paths: files or globs (``**`` recurses), for source="files".
  tokenizer: "byte" or the path of a Hugging Face ``tokenizer.json`` (for a fine-tune, the
    checkpoint's own); its vocabulary must fit the model's ``vocab_size``.
  text_field: the JSONL field holding a record's text.
  token_dtype: integer dtype of raw ``.bin`` token files (``.npy`` files carry their own).
  eos_id: in token files, the id ending each document; None: each file is one document.
  seq_len: S, tokens per row; must divide by the mesh's seq axis.
  batch_size: global rows per batch; must divide by the mesh's data axis.
  long_documents: documents longer than ``seq_len``: "split" over consecutive rows (each
    piece a new segment) or "truncate" to their first ``seq_len`` tokens.
  seed: shuffles the training order (not the train/eval split).
  eval_fraction: share of the tokens held out for evaluation, in [0, 1).
  """
  source: Literal[SOURCES] = "stdlib"
  paths: str | Sequence[str] = ()
  tokenizer: str = "byte"
  text_field: str = "text"
  token_dtype: Literal[TOKEN_DTYPES] = "uint16"
  eos_id: int | None = None
  seq_len: int = dataclasses.field(default=1024, metadata=at_least(1))
  batch_size: int = dataclasses.field(default=8, metadata=at_least(1))
  long_documents: Literal[LONG_DOCUMENTS] = "split"
  seed: int = 0
  eval_fraction: float = 0.01
  retrieval: RetrievalTask = RetrievalTask()

  def __post_init__(self):
    if isinstance(self.paths, list):  # gin gives lists; keep the config hashable
      object.__setattr__(self, "paths", tuple(self.paths))
    check_fields(self)
    if not 0 <= self.eval_fraction < 1:
      raise ConfigError(f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}")
    if self.source == "stdlib" and self.paths:
      raise ConfigError("DataConfig.source='stdlib' reads the Python standard library; it "
                        "takes no paths (set DataConfig.source='files' to read them)")


# ----------------------------------------------------------------------------- rows

def pack_row(tokens: np.ndarray, docs: np.ndarray, seq_len: int,
              targets: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """One row from up to ``seq_len + 1`` consecutive stream tokens, their document ranks and
  whether each may be a label (None: all)."""
  n, m = min(len(tokens), seq_len), min(len(tokens) - 1, seq_len)
  row = {k: np.zeros(seq_len, np.int32) for k in ("tokens", "segment_ids", "positions")}
  row["tokens"][:n] = tokens[:n]
  row["labels"] = np.full(seq_len, IGNORE_LABEL, np.int32)
  if m > 0:
    labelled = docs[1:m + 1] == docs[:m]
    if targets is not None:
      labelled &= targets[1:m + 1]
    row["labels"][:m] = np.where(labelled, tokens[1:m + 1], IGNORE_LABEL)
  seg = row["segment_ids"]
  if n:
    seg[1:n] = np.cumsum(docs[1:n] != docs[:n - 1])
    seg[n:] = seg[n - 1] + 1
  starts = np.flatnonzero(np.concatenate([[True], seg[1:] != seg[:-1]]))
  row["positions"][:] = np.arange(seq_len) - starts[seg]
  return row


class _PackedRows:
  """Rows over a corpus: shuffled epochs without end, or (``shuffle=False``) one pass."""

  def __init__(self, corpus: Corpus, seq_len: int, seed: int, shuffle: bool):
    self.corpus, self.seq_len, self.seed, self.shuffle = corpus, seq_len, seed, shuffle
    total = corpus.num_tokens
    self.windows = (total - 1) // seq_len if shuffle else -(-total // seq_len)
    self.num_rows = None if shuffle else self.windows
    self._epoch = functools.lru_cache(maxsize=2)(self._make_epoch)

  def _make_epoch(self, epoch: int):
    """(document order, cumulative ends, window order) of one epoch."""
    if not self.shuffle:
      return np.arange(len(self.corpus.doc_len)), np.cumsum(self.corpus.doc_len), None
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(len(self.corpus.doc_len))
    return order, np.cumsum(self.corpus.doc_len[order]), rng.permutation(self.windows)

  def _read(self, order, ends, offset: int, n: int):
    """Stream tokens [offset, offset + n), clipped at the end, each one's document rank and
    target flag."""
    c, pieces = self.corpus, [(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))]
    i = int(np.searchsorted(ends, offset, side="right"))
    while n > 0 and i < len(ends):
      d = order[i]
      take = min(n, int(ends[i] - offset))
      tokens, targets = c.read(d, int(offset - (ends[i] - c.doc_len[d])), take)
      pieces.append((tokens, np.full(take, i), targets))
      offset, n, i = offset + take, n - take, i + 1
    return tuple(np.concatenate(p) for p in zip(*pieces))

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    epoch, window = divmod(row, self.windows)
    order, ends, windows = self._epoch(epoch)
    if windows is not None:
      window = windows[window]
    tokens, docs, targets = self._read(order, ends, window * self.seq_len, self.seq_len + 1)
    return pack_row(tokens, docs, self.seq_len, targets)


class _DocumentWindows:
  """One pass over a corpus's documents in order, each alone, cut into consecutive windows.

  A document of n tokens gives ``ceil((n - 1) / S)`` rows; its window ``w`` holds tokens
  ``[w*S, (w+1)*S)`` at positions ``0..S-1`` and their next tokens as labels; the last
  window is padded (segment 1, no labels). A row never holds two documents.
  """

  def __init__(self, corpus: Corpus, seq_len: int):
    windows = -(-np.maximum(corpus.doc_len - 1, 0) // seq_len)
    self.corpus, self.seq_len = corpus, seq_len
    self.row_doc = np.repeat(np.arange(len(windows)), windows)
    self.row_window = np.arange(len(self.row_doc)) - np.repeat(np.cumsum(windows) - windows,
                                                               windows)
    self.num_rows = len(self.row_doc)

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    d, begin = int(self.row_doc[row]), int(self.row_window[row]) * self.seq_len
    n = min(self.seq_len + 1, int(self.corpus.doc_len[d]) - begin)
    tokens, targets = self.corpus.read(d, begin, n)
    return pack_row(tokens, np.zeros(n, np.int64), self.seq_len, targets)


class _RetrievalRows:
  """``RetrievalTask`` rows; row ``r`` depends only on (seed, split, r)."""

  def __init__(self, task: RetrievalTask, seq_len: int, seed: int, split: str):
    if seq_len < 2 * task.num_pairs + 2:
      raise ValueError(f"seq_len={seq_len} cannot hold {task.num_pairs} key-value pairs and "
                       f"the question: need at least {2 * task.num_pairs + 2}")
    self.task, self.seq_len, self.seed = task, seq_len, seed
    self.split = ("train", "eval").index(split)
    self.num_rows = None if split == "train" else task.eval_rows

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    t, s = self.task, self.seq_len
    rng = np.random.default_rng([self.seed, self.split, row])
    key0, value0 = 1 + t.num_filler, 1 + t.num_filler + t.num_keys
    keys = key0 + rng.choice(t.num_keys, t.num_pairs, replace=False)
    values = value0 + rng.integers(t.num_values, size=t.num_pairs)
    tokens = 1 + rng.integers(t.num_filler, size=s)
    tokens[0:2 * t.num_pairs:2], tokens[1:2 * t.num_pairs:2] = keys, values
    asked = rng.integers(t.num_pairs)
    tokens[s - 2], tokens[s - 1] = 0, keys[asked]
    labels = np.full(s, IGNORE_LABEL)
    labels[s - 1] = values[asked]
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32),
            "segment_ids": np.zeros(s, np.int32), "positions": np.arange(s, dtype=np.int32)}


# ----------------------------------------------------------------------------- batches

def _data_coords(mesh) -> list[int]:
  """Indices along the data axis of the mesh slices holding this process's devices."""
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(DATA), 0)
  return [i for i, d in enumerate(devices)
          if any(x.process_index == jax.process_index() for x in d.flat)]


def _check_divisible(mesh, batch_size: int, seq_len: int):
  shards, axes = sequence_shards(mesh), " x ".join(repr(a) for a in sequence_axes(mesh))
  if seq_len % shards:
    raise ValueError(f"seq_len={seq_len} does not divide over the mesh's {axes} axis of "
                     f"{shards} devices; use a multiple of {shards}")
  if batch_size % mesh.shape[DATA]:
    raise ValueError(f"batch size {batch_size} does not divide over the mesh's {DATA!r} axis "
                     f"of {mesh.shape[DATA]} devices; use a multiple of {mesh.shape[DATA]}")


def make_global_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
  """Global int32 ``[B, S]`` arrays sharded ``sharding.batch_spec`` (``P(DATA, SEQ)``) from
  this process's rows.

  ``local_batch`` holds, in order, the rows of the data-axis slices that this process's
  devices hold (all rows on one process); B = local rows * data size / local slices.
  """
  coords = _data_coords(mesh)
  local_rows, seq_len = next(iter(local_batch.values())).shape
  if local_rows % len(coords):
    raise ValueError(f"{local_rows} local rows do not split over this process's "
                     f"{len(coords)} slices of the {DATA!r} axis")
  global_rows = local_rows // len(coords) * mesh.shape[DATA]
  _check_divisible(mesh, global_rows, seq_len)
  global_sharding = NamedSharding(mesh, batch_spec(mesh, seq_len))
  return {k: jax.make_array_from_process_local_data(global_sharding, np.asarray(v, np.int32),
                                                    (global_rows, seq_len))
          for k, v in local_batch.items()}


class Dataset:
  """Batches of ``batch_size`` rows as global arrays; an iterator with a JSON-able position.

  ``next(ds)`` returns the next batch (see the module docstring); ``batch(i)`` is batch i
  from the start (random access, for evaluation: ``range(ds.num_batches)``). Each process
  builds only its own rows. The position counts rows, so resuming with another batch size
  continues where the last run stopped.
  """

  def __init__(self, rows, *, mesh, batch_size: int, vocab_size: int, fingerprint: str):
    _check_divisible(mesh, batch_size, rows.seq_len)
    self._rows, self.mesh, self.batch_size = rows, mesh, batch_size
    self.seq_len, self.vocab_size, self.fingerprint = rows.seq_len, vocab_size, fingerprint
    per_slice = batch_size // mesh.shape[DATA]
    self._local = np.concatenate([np.arange(c * per_slice, (c + 1) * per_slice)
                                  for c in _data_coords(mesh)])
    self._next_row = 0

  @property
  def num_batches(self) -> int | None:
    """Batches in one pass (the last padded), or None for an endless training stream."""
    n = self._rows.num_rows
    return None if n is None else -(-n // self.batch_size)

  def local_batch(self, first_row: int) -> dict[str, np.ndarray]:
    """This process's rows of global rows [first_row, first_row + batch_size); rows past
    the end of a finite pass are padding."""
    n, pad = self._rows.num_rows, pack_row(np.zeros(0), np.zeros(0), self.seq_len)
    rows = [pad if n is not None and r >= n else self._rows(r)
            for r in (first_row + self._local).tolist()]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def batch(self, index: int) -> dict[str, jax.Array]:
    return make_global_batch(self.local_batch(index * self.batch_size), self.mesh)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    n = self._rows.num_rows
    if n is not None and self._next_row >= n:
      raise StopIteration
    batch = make_global_batch(self.local_batch(self._next_row), self.mesh)
    self._next_row += self.batch_size
    return batch

  def get_state(self) -> dict:
    return {"next_row": self._next_row, "data": self.fingerprint}

  def set_state(self, state: dict):
    if state.get("data") != self.fingerprint:
      raise ValueError(f"the saved data position belongs to a different data stream:\n"
                       f"  saved: {state.get('data')}\n  now:   {self.fingerprint}\n"
                       "resume with the same data config (batch_size may change)")
    self._next_row = int(state["next_row"])


def _load_corpus(config: DataConfig, vocab_size: int | None) -> tuple[Corpus, int, str]:
  """(corpus in file order, smallest vocabulary it fits, a description) of a text or token
  file config; documents truncated to ``seq_len`` when ``long_documents="truncate"``."""
  files = stdlib_files() if config.source == "stdlib" else resolve_paths(config.paths)
  tokenized = [f.endswith((".bin", ".npy")) for f in files]
  if any(tokenized) and not all(tokenized):
    raise ValueError("mix of token files (.bin/.npy) and text files: they need different "
                     "tokenizers; give one kind")
  if all(tokenized):
    corpus, data_vocab = token_corpus(files, config.token_dtype, config.eos_id, vocab_size)
  else:
    tokenizer = make_tokenizer(config.tokenizer)
    data_vocab = tokenizer.vocab_size
    _check_vocab(data_vocab, vocab_size, f"tokenizer {config.tokenizer!r}")
    corpus = text_corpus(files, tokenizer, config.text_field)
  if corpus.num_tokens == 0:
    raise ValueError(f"the {config.source} corpus is empty: {len(files)} file(s) but no tokens")
  if config.long_documents == "truncate":
    corpus = corpus.truncated(config.seq_len)
  name = (f"{config.source} files={len(files)} tokens={corpus.num_tokens} "
          f"tokenizer={config.tokenizer} text_field={config.text_field} "
          f"long_documents={config.long_documents} seq_len={config.seq_len}")
  return corpus, data_vocab, name


def make_datasets(config: DataConfig = DataConfig(), mesh=None, *,
                  vocab_size: int | None = None) -> tuple[Dataset, Dataset | None]:
  """(train, eval) datasets; eval is None when ``eval_fraction`` is 0.

  ``mesh`` defaults to ``make_mesh()``; ``vocab_size`` (the model's) is checked against the
  data's ids. Every data problem raises here, before training starts. ``Dataset.vocab_size``
  is the smallest model vocabulary the data fits.
  """
  mesh = make_mesh() if mesh is None else mesh
  _check_divisible(mesh, config.batch_size, config.seq_len)
  make = functools.partial(Dataset, mesh=mesh, batch_size=config.batch_size)
  if config.source == "retrieval":
    task = config.retrieval
    _check_vocab(task.vocab_size, vocab_size, "the retrieval task")
    name = f"retrieval {task} seq_len={config.seq_len} seed={config.seed}"
    return tuple(make(_RetrievalRows(task, config.seq_len, config.seed, split),
                      vocab_size=task.vocab_size, fingerprint=f"{split}: {name}")
                 for split in ("train", "eval"))
  corpus, data_vocab, name = _load_corpus(config, vocab_size)
  train, eval_ = split_corpus(corpus, config.eval_fraction)
  if eval_ is not None and eval_.num_tokens == 0:
    raise ValueError(f"eval_fraction={config.eval_fraction} of {corpus.num_tokens} tokens "
                     "holds out nothing; raise it, or set 0 for no evaluation split")
  if train.num_tokens <= config.seq_len:
    raise ValueError(f"the training split has {train.num_tokens} tokens, too few for one row "
                     f"of seq_len={config.seq_len} (+1 for its last label)")
  train_ds = make(_PackedRows(train, config.seq_len, config.seed, shuffle=True),
                  vocab_size=data_vocab, fingerprint=f"train: {name} seed={config.seed}")
  if eval_ is None:
    return train_ds, None
  return train_ds, make(_PackedRows(eval_, config.seq_len, 0, shuffle=False),
                        vocab_size=data_vocab, fingerprint=f"eval: {name}")


def document_windows(config: DataConfig, mesh, *, vocab_size: int | None = None) -> Dataset:
  """Evaluation rows (``_DocumentWindows``) of every document of ``config``'s files, in file
  order, ``config.batch_size`` rows per batch (the last batch padded); no split, no shuffle.
  """
  if config.source == "retrieval":
    raise ConfigError("document_windows reads text or token files, not the retrieval task")
  _check_divisible(mesh, config.batch_size, config.seq_len)
  corpus, data_vocab, name = _load_corpus(config, vocab_size)
  return Dataset(_DocumentWindows(corpus, config.seq_len), mesh=mesh,
                 batch_size=config.batch_size, vocab_size=data_vocab,
                 fingerprint=f"windows: {name}")


def _check_vocab(data_vocab: int, model_vocab: int | None, what: str):
  if model_vocab is not None and data_vocab > model_vocab:
    raise ConfigError(f"{what} uses ids up to {data_vocab - 1}, beyond the model's "
                      f"vocab_size={model_vocab}: use the model's own tokenizer (the "
                      f"tokenizer.json of its checkpoint) or a model with vocab_size >= "
                      f"{data_vocab}")
