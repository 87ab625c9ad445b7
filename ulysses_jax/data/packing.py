"""Rows of ``seq_len`` tokens from a corpus (``corpus.Corpus``): packed training rows,
evaluation windows, and weighted mixtures of packed rows.

A row is a dict of int32 arrays ``[S]``: ``tokens``, ``labels`` (the next token of the same
document where that token is a target, else ``IGNORE_LABEL``), ``segment_ids`` and
``positions`` (see ``ulysses_jax.data.pipeline``). Every row is a pure function of its index
(and the seed), so an iterator's whole position is one integer.
"""

import functools
from collections.abc import Sequence

import numpy as np

from ulysses_jax.data.corpus import Corpus

IGNORE_LABEL = -1


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


class PackedRows:
  """Rows over a corpus: shuffled epochs without end, or (``shuffle=False``) one pass."""

  def __init__(self, corpus: Corpus, seq_len: int, seed: int | Sequence[int], shuffle: bool):
    self.corpus, self.seq_len, self.shuffle = corpus, seq_len, shuffle
    self.seed = [seed] if isinstance(seed, int) else list(seed)
    total = corpus.num_tokens
    self.windows = (total - 1) // seq_len if shuffle else -(-total // seq_len)
    self.num_rows = None if shuffle else self.windows
    self._epoch = functools.lru_cache(maxsize=2)(self._make_epoch)

  def _make_epoch(self, epoch: int):
    """(document order, cumulative ends, window order) of one epoch."""
    if not self.shuffle:
      return np.arange(len(self.corpus.doc_len)), np.cumsum(self.corpus.doc_len), None
    rng = np.random.default_rng([*self.seed, epoch])
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


class DocumentWindows:
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



class MixedRows:
  """Training rows drawn from several ``PackedRows`` with weights (a data mixture).

  Global row ``r`` comes from source ``k`` with probability ``weights[k]`` (normalised), drawn
  from ``(seed, r // MIX_BLOCK)``, and is that source's next row: the number of earlier rows
  drawn from it. So a row is still a pure function of its index, and resuming at row ``r``
  gives the uninterrupted run's rows, on any number of processes.
  """
  MIX_BLOCK = 4096

  def __init__(self, sources: Sequence[PackedRows], weights: Sequence[float], seed: int):
    self.sources, self.seed = list(sources), seed
    self.weights = np.asarray(weights, np.float64) / np.sum(weights)
    self.seq_len, self.num_rows = self.sources[0].seq_len, None
    self._block = functools.lru_cache(maxsize=4)(self._make_block)
    self._counts_before = [np.zeros(len(self.sources), np.int64)]  # per block, grown lazily

  def _make_block(self, block: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, block, len(self.sources)])
    return rng.choice(len(self.sources), size=self.MIX_BLOCK, p=self.weights)

  def rows_per_source(self, rows: int) -> np.ndarray:
    """How many of the first ``rows`` rows each source gave."""
    block, within = divmod(rows, self.MIX_BLOCK)
    while len(self._counts_before) <= block:
      b = len(self._counts_before) - 1
      counts = np.bincount(self._block(b), minlength=len(self.sources))
      self._counts_before.append(self._counts_before[-1] + counts)
    return self._counts_before[block] + np.bincount(self._block(block)[:within],
                                                     minlength=len(self.sources))

  def __call__(self, row: int) -> dict[str, np.ndarray]:
    k = int(self._block(row // self.MIX_BLOCK)[row % self.MIX_BLOCK])
    return self.sources[k](int(self.rows_per_source(row)[k]))
