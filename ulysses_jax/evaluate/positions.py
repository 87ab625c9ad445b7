"""Loss by position within the row: the forward pass only, sequence-parallel.

``PositionEval(graphdef)(params, dataset)`` runs one jitted forward per batch (no gradients,
no optimizer state) and returns ``summarize``'s dict: ``loss`` (mean over predicted tokens),
``tokens``, ``perplexity``, and ``buckets``: ``{"start", "end", "loss", "tokens"}`` over the
position within the row in log-spaced ranges [0, 1), [1, 2), [2, 4), ... [S/2, S), so the
curve shows whether late tokens profit from the long context. The per-token losses come chunk
by chunk (``loss.token_losses``, the training loss's scan), never as ``[B, S, V]`` logits.
For the trainer's eval split positions are those within each packed document piece; for
``data.document_windows`` those within each window.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulysses_jax.data.batches import Dataset
from ulysses_jax.data.packing import IGNORE_LABEL
from ulysses_jax.loss import token_losses


def _batch_sums(model, batch) -> dict[str, jax.Array]:
  """Loss and label count per position ``[S]`` (summed over rows, by ``positions``); per row
  ``[B]`` the labels and the labels predicted right; and ``[B, S]`` the top prediction where
  there is a label, -1 elsewhere. ``batch``: a ``data`` batch (int ``[B, S]`` tokens, labels,
  positions, segment_ids); the mesh's sequence shards must divide S."""
  hidden_BSE = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"])
  loss_BS, correct_BS, predicted_BS = token_losses(
      hidden_BSE, model.lm_head_kernel(), batch["labels"], mesh=model.mesh,
      chunk=model.config.loss_chunk)
  valid_BS = batch["labels"] != IGNORE_LABEL
  count_BS = valid_BS.astype(jnp.float32)
  s, positions = batch["tokens"].shape[1], batch["positions"].reshape(-1)
  by_position = lambda x: jax.ops.segment_sum(x.reshape(-1), positions, num_segments=s)
  return {"loss": by_position(loss_BS), "count": by_position(count_BS),
          "row_count": count_BS.sum(1), "row_correct": correct_BS.sum(1),
          "row_predicted": jnp.where(valid_BS, predicted_BS, -1)}


class PositionEval:
  """``PositionEval(graphdef)(params, dataset, max_batches=None)`` -> ``summarize`` dict.

  One jitted forward per batch; sums are kept on the host in float64. ``params``: the model
  state (``nnx.split(model)[1]``, or ``TrainState.params``), sharded as in training.
  ``step``: that jitted forward, ``(params, batch) -> per-batch sums`` (no gradients, no
  optimizer state; ``benchmarks.max_seqlen`` compiles it to size the longest S).
  """

  def __init__(self, graphdef):
    self.step = jax.jit(lambda params, batch: _batch_sums(nnx.merge(graphdef, params), batch))

  def sums(self, params, dataset: Dataset, max_batches: int | None = None) -> dict:
    """Per-position sums ``[S]`` over the batches, per-row values over all rows, and
    ``row_predicted``: per row, the top predictions at its labels (int arrays)."""
    if not dataset.num_batches:
      raise ValueError("nothing to evaluate: the dataset is an endless training stream or "
                       "has no rows (documents of one token predict nothing)")
    n = dataset.num_batches if max_batches is None else min(max_batches, dataset.num_batches)
    out = {}
    for i in range(n):
      batch = jax.device_get(self.step(params, dataset.batch(i)))
      out.setdefault("row_predicted", []).extend(
          row[row >= 0] for row in np.asarray(batch.pop("row_predicted")))
      for k, v in batch.items():
        v = np.asarray(v, np.float64)
        out[k] = v if k not in out else (np.concatenate([out[k], v]) if k.startswith("row")
                                         else out[k] + v)
    return out

  def __call__(self, params, dataset: Dataset, max_batches: int | None = None) -> dict:
    return summarize(self.sums(params, dataset, max_batches))


def log_buckets(seq_len: int) -> list[tuple[int, int]]:
  """[0, 1), [1, 2), [2, 4), ..., [2^k, seq_len)."""
  edges = [0] + [2 ** k for k in range(max(1, math.ceil(math.log2(seq_len))))] + [seq_len]
  edges = sorted(set(e for e in edges if e <= seq_len))
  return list(zip(edges[:-1], edges[1:]))


def summarize(sums: dict) -> dict:
  """``loss``, ``tokens``, ``perplexity`` and log-spaced ``buckets`` from per-position sums."""
  loss, count = sums["loss"], sums["count"]
  mean = float(loss.sum() / max(count.sum(), 1))
  buckets = [{"start": a, "end": b, "tokens": int(count[a:b].sum()),
              "loss": float(loss[a:b].sum() / count[a:b].sum()) if count[a:b].sum() else None}
             for a, b in log_buckets(len(loss))]
  return {"loss": mean, "tokens": int(count.sum()), "perplexity": math.exp(mean),
          "buckets": buckets}
