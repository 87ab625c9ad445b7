"""The trainer's evaluation on held-out batches: loss, and for the retrieval task
(``data.RetrievalTask``) the share of answers predicted right."""

import jax
from flax import nnx

from ulysses_jax.data.packing import IGNORE_LABEL


def retrieval_accuracy(logits_or_predictions: jax.Array, labels: jax.Array) -> jax.Array:
  """Share of labelled positions (the answers, for ``RetrievalTask``) predicted right.

  Takes logits ``[B, S, V]`` (argmax taken) or predicted ids ``[B, S]``; any sharding.
  """
  predictions = (logits_or_predictions.argmax(-1) if logits_or_predictions.ndim == 3
                 else logits_or_predictions)
  mask = labels != IGNORE_LABEL
  return (mask & (predictions == labels)).sum() / mask.sum()


def make_eval_step(graphdef: nnx.GraphDef, retrieval: bool):
  """Jitted (params, batch) -> loss sum, label count and, for the retrieval task, the
  number of labels predicted right (which needs full logits: small vocabulary only)."""
  @jax.jit
  def eval_step(params, batch):
    model = nnx.merge(graphdef, params)
    inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
    sums = model.loss(inputs[0], batch["labels"], *inputs[1:])
    out = {"loss": sums.loss, "count": sums.count}
    if retrieval:
      out["correct"] = retrieval_accuracy(model(*inputs), batch["labels"]) * sums.count
    return out
  return eval_step


def held_out(eval_step, params, eval_ds, num_batches: int) -> dict:
  """``eval_loss`` (and ``eval_accuracy``) over the first ``num_batches`` eval batches."""
  totals = {}
  for i in range(min(num_batches, eval_ds.num_batches)):
    for k, v in jax.device_get(eval_step(params, eval_ds.batch(i))).items():
      totals[k] = totals.get(k, 0.0) + float(v)
  count = max(totals["count"], 1.0)
  result = {"eval_loss": totals["loss"] / count}
  if "correct" in totals:
    result["eval_accuracy"] = totals["correct"] / count
  return result
