"""Evaluation, in one place: a forward pass only, sequence-parallel like training.

* ``held_out``: the trainer's eval step (``make_eval_step``) and held-out loss
  (``held_out``), with retrieval accuracy for ``data.RetrievalTask`` (``retrieval_accuracy``);
* ``positions``: loss by position within the row, in log-spaced buckets (``PositionEval``,
  ``summarize``, ``log_buckets``), from ``loss.token_losses``;
* ``passkey``: can the model fetch a number from anywhere in its context?
* ``report``: the result as text (``format_result``) and as a figure (``plot``).

RULER-style tasks and exact-match probes are scored with ``PositionEval`` too
(``ulysses_jax.ruler``). The command line, ``ulysses-evaluate`` (``python -m
ulysses_jax.evaluate``), is ``ulysses_jax.cli.evaluate``.
"""

from ulysses_jax.evaluate import passkey  # noqa: F401
from ulysses_jax.evaluate.held_out import held_out, make_eval_step, retrieval_accuracy
from ulysses_jax.evaluate.positions import PositionEval, log_buckets, summarize
from ulysses_jax.evaluate.report import format_result, plot

__all__ = ["PositionEval", "format_result", "held_out", "log_buckets", "make_eval_step",
           "passkey", "plot", "retrieval_accuracy", "summarize"]
