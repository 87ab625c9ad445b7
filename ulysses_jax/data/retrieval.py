"""The synthetic long-context retrieval task (``DataConfig.source="retrieval"``): its config
and its rows."""

import dataclasses

import numpy as np

from ulysses_jax.config_checks import ConfigError, at_least, check_fields
from ulysses_jax.data.packing import IGNORE_LABEL


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



class RetrievalRows:
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

