"""The pass-key retrieval test: can the model fetch a number from anywhere in its context?

A row is filler text (a few plain sentences, repeated) of a given total length in tokens, with
the needle "The pass key is 12345. Remember it. 12345 is the pass key." hidden at a depth
between 0 (the start) and 1 (just before the question), then the question "What is the pass
key? The pass key is" and the key's tokens as the only labels. A row counts as retrieved
when every key token is the model's top prediction given what precedes it, which is exactly
when greedy decoding after the question produces the key. Chance is ``10 ** -DIGITS``.
"""

import dataclasses

import numpy as np

from ulysses_jax import ruler
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.batches import Dataset
from ulysses_jax.data.packing import pack_row

DIGITS = 5
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclasses.dataclass(frozen=True)
class Trial:
  length: int  # tokens in the row (filler, needle, question and key)
  depth: float  # where the needle sits in the filler: 0 = start, 1 = end
  key: str


def make_rows(tokenizer, seq_len: int, lengths=None, depths=DEPTHS, trials: int = 2,
              seed: int = 0) -> tuple[list[Trial], list[dict[str, np.ndarray]]]:
  """(trials, rows): ``trials`` random keys for every (length, depth), each row a
  ``packing.pack_row`` dict of ``seq_len`` tokens (padded beyond ``length``) whose labels are
  the key's tokens only.

  ``tokenizer``: a ``corpus`` tokenizer (``encode_batch``). ``lengths``: row lengths in
  tokens; None: S/8, S/4, S/2 and S, those long enough for the needle, question and key.
  Raises ``ValueError`` when a length cannot hold them or exceeds ``seq_len``.
  """
  rng = np.random.default_rng(seed)
  filler, question = tokenizer.encode_batch([FILLER.encode(), QUESTION.encode()])
  sample = tokenizer.encode_batch([NEEDLE.format(key="0" * DIGITS).encode(),
                                   ("0" * DIGITS).encode()])
  needed = len(question) + sum(map(len, sample))
  if lengths is None:
    lengths = sorted({seq_len >> k for k in range(4) if seq_len >> k >= needed})
    if not lengths:
      raise ValueError(f"seq_len={seq_len} is too short for the pass-key test: the needle, "
                       f"question and key take ~{needed} tokens")
  out_trials, rows = [], []
  for length in lengths:
    if length > seq_len:
      raise ValueError(f"passkey length {length} exceeds seq_len={seq_len}")
    for depth in depths:
      for _ in range(trials):
        key = "".join(str(d) for d in rng.integers(0, 10, DIGITS))
        needle, answer = tokenizer.encode_batch([NEEDLE.format(key=key).encode(),
                                                  key.encode()])
        fill = length - len(needle) - len(question) - len(answer)
        if fill < 0:
          raise ValueError(f"passkey length {length} is too short for the needle, question "
                           f"and key ({length - fill} tokens); use longer lengths")
        hay = np.resize(filler, fill)
        cut = int(round(depth * fill))
        tokens = np.concatenate([hay[:cut], needle, hay[cut:], question, answer]).astype(np.int64)
        targets = np.arange(length) >= length - len(answer)
        rows.append(pack_row(tokens, np.zeros(length, np.int64), seq_len, targets))
        out_trials.append(Trial(length, depth, key))
  return out_trials, rows


def accuracy_table(trials: list[Trial], retrieved) -> dict:
  """JSON-able accuracy by depth x length from per-row booleans ``retrieved``."""
  lengths = sorted({t.length for t in trials})
  depths = sorted({t.depth for t in trials})
  hits = {}
  for t, ok in zip(trials, retrieved):
    hits.setdefault((t.depth, t.length), []).append(bool(ok))
  return {"lengths": lengths, "depths": depths,
          "accuracy": [[float(np.mean(hits[d, n])) for n in lengths] for d in depths],
          "trials": len(trials) // (len(lengths) * len(depths)),
          "overall": float(np.mean([bool(x) for x in retrieved])),
          "chance": 10.0 ** -DIGITS}


def dataset(tokenizer, mesh, *, seq_len: int, batch_size: int, vocab_size: int,
            trials: int = 2) -> tuple[list[Trial], Dataset]:
  """The pass-key rows (``make_rows``) as a ``Dataset``; errors before any compute."""
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"the pass-key tokenizer has {tokenizer.vocab_size} ids but the model's "
                      f"vocab_size is {vocab_size}: give the model's own tokenizer.json "
                      "(--tokenizer)")
  trials_, rows = make_rows(tokenizer, seq_len, trials=trials)
  return trials_, Dataset(ruler.Rows(rows, seq_len), mesh=mesh, batch_size=batch_size,
                          vocab_size=vocab_size, fingerprint="passkey")


def score(evaluator, params, trials: list[Trial], rows: Dataset) -> dict:
  """Pass-key accuracy by depth x length (``accuracy_table``); ``evaluator``: a
  ``PositionEval``, ``rows``: from ``dataset``."""
  sums, n = evaluator.sums(params, rows), len(trials)
  retrieved = (sums["row_correct"][:n] == sums["row_count"][:n]) & (sums["row_count"][:n] > 0)
  return accuracy_table(trials, retrieved)
