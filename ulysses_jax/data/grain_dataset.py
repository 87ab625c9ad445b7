"""A Grain dataset of documents as the trainer's training stream (the ``grain`` extra).

    documents = grain.MapDataset.source(my_docs).shuffle(seed=0).repeat().to_iter_dataset()
    train_ds = GrainDataset(documents, mesh=mesh, batch_size=8, seq_len=4096)
    train.train(workdir, config, datasets=(train_ds, None))

Each element of ``documents`` is a document: a 1-D array (or list) of token ids, or a dict with
``"tokens"`` and optionally ``"targets"`` (bool per token: may it be a label; False for a
prompt or a user turn). Documents are packed in the dataset's own order (shuffle, filter and
mix them in Grain) as ``packing.PackedRows`` packs a corpus: their concatenation cut into rows
of ``seq_len`` tokens, each with the next token for its last label, a document crossing a row
boundary continuing in the next row as a new segment; the batch layout is
``ulysses_jax.data.pipeline``'s.

The position (``get_state``, saved in every checkpoint) is Grain's iterator state before the
document the next row starts in, and how many of its tokens earlier rows used: a resumed run
reads the same batches as the uninterrupted one. One process only for now: the checkpoint keeps
one data position, and each process would need its own.
"""

import copy
from collections import deque

import jax
import numpy as np

from ulysses_jax.data.batches import check_divisible, make_global_batch
from ulysses_jax.data.packing import pack_row


def _document(element) -> tuple[np.ndarray, np.ndarray | None]:
  tokens, targets = (element.get("tokens"), element.get("targets")) if isinstance(
      element, dict) else (element, None)
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
    raise ValueError(f"a Grain document must be a 1-D array of token ids (or a dict with "
                     f"'tokens'), got {type(element).__name__} of shape {tokens.shape}, dtype "
                     f"{tokens.dtype}")
  if targets is not None:
    targets = np.asarray(targets, bool)
    if targets.shape != tokens.shape:
      raise ValueError(f"a Grain document's 'targets' has shape {targets.shape}, its 'tokens' "
                       f"{tokens.shape}: give one flag per token")
  return tokens.astype(np.int64), targets


class _Stream:
  """Rows from a Grain iterator; ``docs`` holds the documents that the next row reads, each with
  the iterator's state before it."""

  def __init__(self, documents, seq_len: int, state: dict | None = None):
    self._it, self.seq_len = iter(documents), seq_len
    self.docs, self.offset = deque(), 0
    if state is not None:
      self._it.set_state(copy.deepcopy(state["grain"]))
      self.offset = int(state["offset"])

  def _fetch(self):
    before = copy.deepcopy(self._it.get_state())
    try:
      tokens, targets = _document(next(self._it))
    except StopIteration:
      raise ValueError("the Grain dataset of documents ran out; make it endless with "
                       ".repeat() before .to_iter_dataset()") from None
    self.docs.append((before, tokens, targets))

  def state(self) -> dict:
    if not self.docs:
      self._fetch()
    return {"grain": self.docs[0][0], "offset": self.offset}

  def row(self) -> dict[str, np.ndarray]:
    pieces, need, i, offset = [], self.seq_len + 1, 0, self.offset
    while need > 0:
      if i == len(self.docs):
        self._fetch()
      _, tokens, targets = self.docs[i]
      take = tokens[offset:offset + need]
      flags = (np.ones(len(take), bool) if targets is None
               else targets[offset:offset + need])
      pieces.append((take, np.full(len(take), i), flags))
      need, i, offset = need - len(take), i + 1, 0
    advance = self.seq_len
    while advance > 0:
      left = len(self.docs[0][1]) - self.offset
      if left <= advance:
        self.docs.popleft()
        advance, self.offset = advance - left, 0
      else:
        self.offset, advance = self.offset + advance, 0
    tokens, ranks, targets = (np.concatenate(p) for p in zip(*pieces))
    return pack_row(tokens, ranks, self.seq_len, targets)


class GrainDataset:
  """Training batches (global arrays) packed from a Grain dataset of documents; see the module
  docstring. ``name`` goes into the position's fingerprint: resuming with another dataset under
  the same name is not detected."""

  def __init__(self, documents, *, mesh, batch_size: int, seq_len: int,
               vocab_size: int | None = None, name: str = "grain"):
    if jax.process_count() > 1:
      raise ValueError(f"GrainDataset runs on one process (this is one of "
                       f"{jax.process_count()}); use DataConfig's files with several")
    check_divisible(mesh, batch_size, seq_len)
    self._documents, self.mesh = documents, mesh
    self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size
    self.fingerprint = f"train: {name} seq_len={seq_len}"
    self._stream = _Stream(documents, seq_len)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    rows = [self._stream.row() for _ in range(self.batch_size)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    if self.vocab_size is not None and batch["tokens"].max() >= self.vocab_size:
      raise ValueError(f"the Grain documents hold token id {int(batch['tokens'].max())}, "
                       f"beyond the model's vocab_size={self.vocab_size}")
    return make_global_batch(batch, self.mesh)

  def get_state(self) -> dict:
    return {**self._stream.state(), "data": self.fingerprint}

  def set_state(self, state: dict):
    if state.get("data") != self.fingerprint:
      raise ValueError(f"the saved data position belongs to a different data stream:\n"
                       f"  saved: {state.get('data')}\n  now:   {self.fingerprint}\n"
                       "resume with the same Grain dataset, name and seq_len")
    self._stream = _Stream(self._documents, self.seq_len, state)
