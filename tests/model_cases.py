"""Shared helpers for model tests: packed batches, models on a mesh, loss and gradients."""

import jax
import numpy as np
from flax import nnx

from ulysses_jax import make_mesh, sharding
from ulysses_jax.data.packing import IGNORE_LABEL
from ulysses_jax.models.llama import Llama

F32_RTOL = 1e-5  # relative L2 error per array, float32
# The meshes of the SP-equivalence checks: pure data parallel, hybrid, pure sequence parallel.
MESHES = ((8, 1), (2, 4), (1, 8))


def mesh_of(data, seq, ring=1):
  return make_mesh(data=data, seq=seq, ring=ring, devices=jax.devices()[:data * seq * ring])


def packed_batch(seed, batch, seq_len, vocab, *, max_docs=3, ignore_fraction=0.1):
  """A batch in the ``ulysses_jax.data.pipeline`` format: packed documents of random lengths.

  Positions restart at every document, labels are the next token of the same document
  (``IGNORE_LABEL`` at document ends), and a random ``ignore_fraction`` of labels is
  ignored too. Documents cross shard boundaries wherever they happen to fall.
  """
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch, seq_len), dtype=np.int32)
  segment_ids = np.sort(rng.integers(0, max_docs, (batch, seq_len)), axis=1).astype(np.int32)
  starts = np.concatenate([np.ones((batch, 1), bool),
                           segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  index = np.broadcast_to(np.arange(seq_len), (batch, seq_len))
  positions = (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1))
  same_doc_next = np.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1],
                                  np.zeros((batch, 1), bool)], axis=1)
  labels = np.where(same_doc_next, np.roll(tokens, -1, axis=1), IGNORE_LABEL)
  labels = np.where(rng.random((batch, seq_len)) < ignore_fraction, IGNORE_LABEL, labels)
  return {"tokens": tokens, "labels": labels.astype(np.int32),
          "positions": positions.astype(np.int32), "segment_ids": segment_ids}


def initial_state(config, seed=0):
  """Host copy of a freshly initialised model's parameters (built eagerly on one device:
  after the first call this reuses compiled kernels, unlike a jitted init per config)."""
  return tree_on_host(nnx.state(Llama(config, mesh=mesh_of(1, 1), rngs=nnx.Rngs(seed))))


def model_on(config, mesh, state):
  """A ``Llama`` for ``mesh`` holding a copy of ``state``, sharded by the default rules."""
  return sharding.put_sharded(lambda: Llama(config, mesh=mesh, rngs=nnx.Rngs(0)), state, mesh)


def loss_and_grads(model, batch, z_loss_weight=0.0):
  """Token-mean loss and its gradient with respect to every parameter (jitted)."""
  graphdef, state = nnx.split(model)

  def loss(state):
    return nnx.merge(graphdef, state).loss(
        batch["tokens"], batch["labels"], batch.get("positions"), batch.get("segment_ids"),
        z_loss_weight=z_loss_weight).mean()

  return jax.jit(jax.value_and_grad(loss))(state)


def relative_error(actual, expected):
  """||actual - expected|| / ||expected|| (float64), without any floor."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_trees_close(actual, expected, rtol=F32_RTOL):
  """Every array of ``actual`` within ``rtol`` relative L2 error of ``expected``."""
  paths_actual, tree_actual = jax.tree_util.tree_flatten_with_path(actual)
  leaves_expected, tree_expected = jax.tree.flatten(expected)
  assert tree_actual == tree_expected, f"tree structures differ: {tree_actual} vs {tree_expected}"
  errors = [(jax.tree_util.keystr(path), relative_error(a, e))
            for (path, a), e in zip(paths_actual, leaves_expected)]
  bad = [(name, err) for name, err in errors if not err < rtol]
  assert not bad, f"relative errors above {rtol}: {bad}"
  assert errors


def tree_on_host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)

