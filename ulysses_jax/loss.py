"""Next-token cross-entropy over a sequence-sharded batch, without full ``[B, S, V]`` logits.

Labels arrive already shifted (``labels[t]`` is the token after ``tokens[t]``, done by the
data pipeline before sharding, so a shard's last label comes from the next shard) and equal
``IGNORE_LABEL`` where there is no target. Losses are returned as *sums* with a token
count, all float32: the global token-weighted mean is ``sums.mean()``, and a shard, or a
whole batch, without valid tokens contributes zeros rather than NaN. ``token_losses`` gives
the per-token losses and top predictions (evaluation) from the same scan over chunks.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulysses_jax import sharding
from ulysses_jax.data.packing import IGNORE_LABEL

__all__ = ["IGNORE_LABEL", "CrossEntropySums", "TokenLosses", "chunked_cross_entropy",
           "cross_entropy_sums", "token_losses"]


class CrossEntropySums(NamedTuple):
  """Float32 scalars summed over valid (non-ignored) tokens; a mixture-of-experts model adds
  its routing statistics of the same forward pass (``models.moe``; 0 for dense models)."""
  loss: jax.Array    # sum of -log p(label)
  z_loss: jax.Array  # sum of z_loss_weight * logsumexp(logits)^2
  count: jax.Array   # number of valid tokens
  router_aux: jax.Array | float = 0.0     # the load-balancing loss (unweighted)
  expert_counts: jax.Array | float = 0.0  # [L, X] tokens routed to each expert per layer

  def __add__(self, other):
    return CrossEntropySums(*(a + b for a, b in zip(self, other)))

  def mean(self) -> jax.Array:
    """Token-weighted mean of ``loss + z_loss``; 0 when no token is valid."""
    return (self.loss + self.z_loss) / jnp.maximum(self.count, 1.0)


def cross_entropy_sums(logits_BSV: jax.Array, labels_BS: jax.Array, *,
                       z_loss_weight: float = 0.0) -> CrossEntropySums:
  """Cross-entropy sums of explicit logits ``[..., V]`` against int labels ``[...]``.

  Computed in float32 whatever the logits' dtype. Labels equal to ``IGNORE_LABEL`` count
  nowhere. ``z_loss_weight`` > 0 adds PaLM's ``z_loss_weight * logsumexp^2`` term.
  """
  loss, z_loss, count = _sums(logits_BSV.astype(jnp.float32), labels_BS, float(z_loss_weight))
  return CrossEntropySums(loss=loss, z_loss=z_loss, count=count)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _sums(logits, labels, z_loss_weight):
  """(loss, z_loss, count) of float32 logits; its gradient is one elementwise pass over the
  logits (``_sums_backward``), where differentiating the label's gather would scatter into a
  zeroed logits-sized buffer and add it to the softmax's gradient: passes over ``[c, V]``
  float32 per loss chunk that a long sequence's step repeats hundreds of times."""
  return _sums_forward(logits, labels, z_loss_weight)[0]


def _sums_forward(logits, labels, z_loss_weight):
  valid = labels != IGNORE_LABEL
  lse = jax.nn.logsumexp(logits, axis=-1)
  label_logit = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None],
                                    axis=-1)[..., 0]
  zero = jnp.zeros_like(lse)
  sums = (jnp.sum(jnp.where(valid, lse - label_logit, zero)),
          jnp.sum(jnp.where(valid, z_loss_weight * lse * lse, zero)),
          jnp.sum(valid, dtype=jnp.float32))
  return sums, (logits, lse, labels)


def _sums_backward(z_loss_weight, residuals, cotangents):
  """d/d logits = softmax · (d_loss + 2 w lse d_z_loss) - one_hot(label) · d_loss on valid
  rows, 0 on ignored ones."""
  logits, lse, labels = residuals
  d_loss, d_z_loss, _ = cotangents
  valid = labels != IGNORE_LABEL
  softmax_scale = jnp.where(valid, d_loss + 2 * z_loss_weight * lse * d_z_loss, 0.0)
  vocab = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
  label_scale = jnp.where(valid, d_loss, 0.0)[..., None]
  d_logits = (jnp.exp(logits - lse[..., None]) * softmax_scale[..., None]
              - jnp.where(vocab == labels[..., None], label_scale, 0.0))
  return d_logits, None


_sums.defvjp(_sums_forward, _sums_backward)


def chunked_cross_entropy(hidden_BSE: jax.Array, head_EV: jax.Array, labels_BS: jax.Array, *,
                          mesh: Mesh, chunk: int, z_loss_weight: float = 0.0,
                          head_sharding: NamedSharding | None = None) -> CrossEntropySums:
  """``cross_entropy_sums(hidden @ head, labels)`` in sequence chunks.

  Args:
    hidden_BSE: final hidden states ``[B, S, E]`` sharded ``(data, seq)``; the seq axis
      must divide S (``Llama.loss`` pads).
    head_EV: output projection ``[E, V]``, replicated (gathered once, outside the loop).
    labels_BS: int ``[B, S]`` sharded like ``hidden``.
    mesh: the ``("data", "seq")`` mesh.
    chunk: tokens per device per step. A ``lax.scan`` walks all devices' local sequence
      slices together, ``chunk`` tokens at a time, so at most ``[B, P*chunk, V]`` float32
      logits exist (P = seq axis). Differentiated, each chunk's gradients are formed in the
      forward scan, while its logits exist, and the backward only scales them; with a z-loss
      the backward recomputes each chunk's logits instead (``_chunked_sums``).
    z_loss_weight: see ``cross_entropy_sums``.
    head_sharding: the FSDP shards of the head's parameter (``[E, V]``), if it is sharded:
      its gradient, summed over every device's tokens, is reduce-scattered to them once
      after the scan over chunks (``_to_head_shards``); None leaves it replicated.
  """
  loss, z_loss, count = _chunked_sums(hidden_BSE, head_EV, labels_BS, mesh, chunk,
                                      float(z_loss_weight), head_sharding)
  return CrossEntropySums(loss=loss, z_loss=z_loss, count=count)


class TokenLosses(NamedTuple):
  """Per token, ``[B, S]`` sharded ``(data, seq)``; 0 (False) where the label is
  ``IGNORE_LABEL``."""
  loss: jax.Array       # float32: -log p(label)
  correct: jax.Array    # float32: 1 where the label is the top prediction
  predicted: jax.Array  # int32: the top prediction (the argmax over the vocabulary)


def token_losses(hidden_BSE: jax.Array, head_EV: jax.Array, labels_BS: jax.Array, *,
                 mesh: Mesh, chunk: int) -> TokenLosses:
  """Each token's loss and top prediction, chunk by chunk as ``chunked_cross_entropy``
  walks them (same arguments): at most ``[B, P*chunk, V]`` logits exist."""
  def per_token(hidden_BPcE, head_EV, labels_BPc):
    logits_BPcV = _logits(hidden_BPcE, head_EV)
    flat = logits_BPcV.reshape(-1, logits_BPcV.shape[-1])
    loss = jax.vmap(cross_entropy_sums)(flat, labels_BPc.reshape(-1)).loss
    predicted = logits_BPcV.argmax(-1).astype(jnp.int32)
    correct = (predicted == labels_BPc) & (labels_BPc != IGNORE_LABEL)
    return (), TokenLosses(loss.reshape(labels_BPc.shape), correct.astype(jnp.float32),
                           predicted)
  return _over_chunks(per_token, hidden_BSE, head_EV, labels_BS, mesh=mesh, chunk=chunk)[1]


def _over_chunks(chunk_fn, hidden_BSE, head_EV, labels_BS, *inputs_BS, mesh: Mesh, chunk: int):
  """The one scan over sequence chunks: ``chunk_fn(hidden [B, P, c, E], head [E, V], labels
  [B, P, c], *inputs [B, P, c]) -> (sums, per-token arrays [B, P, c, ...])``, where
  ``inputs_BS`` are more per-token arrays ``[B, S]``. Returns (the sums added over the chunks,
  the per-token arrays as ``[B, S, ...]``)."""
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}.")
  if tuple(labels_BS.shape) != tuple(hidden_BSE.shape[:2]):
    raise ValueError(f"labels must be [batch, seq] = {tuple(hidden_BSE.shape[:2])}, got "
                     f"{tuple(labels_BS.shape)}.")
  hidden_NBPcE = sharding.to_local_chunks(hidden_BSE, mesh=mesh, chunk=chunk)
  labels_NBPc = sharding.to_local_chunks(labels_BS, mesh=mesh, chunk=chunk,
                                         pad_value=IGNORE_LABEL)
  inputs_NBPc = tuple(sharding.to_local_chunks(x, mesh=mesh, chunk=chunk) for x in inputs_BS)

  def step(total, xs):
    sums, per_token = chunk_fn(xs[0], head_EV, *xs[1:])
    return jax.tree.map(jnp.add, total, sums), per_token

  one = lambda x_N: jax.ShapeDtypeStruct(x_N.shape[1:], x_N.dtype)
  sums_shape = jax.eval_shape(chunk_fn, one(hidden_NBPcE), head_EV, one(labels_NBPc),
                              *map(one, inputs_NBPc))[0]
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sums_shape)
  total, per_token_N = jax.lax.scan(step, zeros, (hidden_NBPcE, labels_NBPc, *inputs_NBPc))
  s = labels_BS.shape[1]
  return total, jax.tree.map(lambda x: sharding.from_local_chunks(x, s, mesh=mesh), per_token_N)


def _logits(hidden_BPcE: jax.Array, head_EV: jax.Array) -> jax.Array:
  """Float32 logits ``[B, P, c, V]`` of hidden states and the head, both in the compute dtype,
  accumulated in float32."""
  return jnp.einsum("bpce,ev->bpcv", hidden_BPcE, head_EV, preferred_element_type=jnp.float32)


def _chunk_gradients(hidden_BPcE, head_EV, labels_BPc, logits_BPcV, lse, z_loss_weight,
                     cotangents):
  """Float32 gradients of one chunk's sums to its hidden states and the head. They multiply
  in the compute dtype: the float32 logit cotangent is rounded to it (a bfloat16 model's head
  then runs bfloat16 GEMMs with float32 accumulation, not float32 ones)."""
  d_logits_BPcV, _ = _sums_backward(z_loss_weight, (logits_BPcV, lse, labels_BPc), cotangents)
  d_BPcV = d_logits_BPcV.astype(jnp.promote_types(hidden_BPcE.dtype, head_EV.dtype))
  d_hidden = jnp.einsum("bpcv,ev->bpce", d_BPcV, head_EV, preferred_element_type=jnp.float32)
  d_head = jnp.einsum("bpce,bpcv->ev", hidden_BPcE, d_BPcV, preferred_element_type=jnp.float32)
  return d_hidden, d_head


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_sums(hidden_BSE, head_EV, labels_BS, mesh, chunk, z_loss_weight, head_sharding):
  """(loss, z_loss, count) of the chunked loss. Differentiated, the gradients leave as
  ``d hidden [B, S, E]`` in hidden's dtype and ``d head [E, V]``, summed over the chunks in
  float32 and rounded once to the head's dtype (summed in bfloat16, a long sequence's hundreds
  of chunks would lose most of its bits).

  Without a z-loss the gradient depends on the loss's cotangent alone, so the forward scan forms
  it for a unit cotangent, chunk by chunk while the logits exist (Liger's fused linear
  cross-entropy), and the backward scales it: three head GEMMs per chunk. With one the forward
  keeps each token's log-sum-exp and the backward scans the chunks again, recomputing their
  logits: four GEMMs per chunk (forming the gradients of both cotangents in the forward would
  take five)."""
  def sums(hidden_BPcE, head_EV, labels_BPc):
    return _sums_forward(_logits(hidden_BPcE, head_EV), labels_BPc, z_loss_weight)[0], ()
  return _over_chunks(sums, hidden_BSE, head_EV, labels_BS, mesh=mesh, chunk=chunk)[0]


def _to_head_shards(d_head_EV, d_hidden_BSE, mesh: Mesh, head_sharding: NamedSharding | None):
  """The head's float32 gradient, summed over the chunks on each device, summed over the
  devices into ``head_sharding``; returned with ``d_hidden_BSE``, which waits for it.

  Replicated first, so that XLA keeps each device's partial sum in the scan, all-reduces it
  once after it and turns the all-reduce and the slice of each device's shard into one
  reduce-scatter. Constrained to the shards alone, the constraint reaches into the scan, and
  XLA reduce-scattered every chunk's gradient: Llama-3.2-1B at 128K tokens on 8 GPUs, 16
  chunks per micro-batch, each [2048, 128256] in float32.

  The hidden states' gradient waits for the reduce-scatter (an optimization barrier), so the
  layers' backward, which starts from it, starts after it. Else XLA overlapped the
  reduce-scatter with the layers' backward and kept the replicated float32 sum through it:
  Llama-3.1-70B at 4,702,208 tokens on 8 H100s, 3.91 GiB of sum, 62.08 GiB per GPU compiled
  (jax 0.12.0.1; 76.83 with jax 0.10.2), 59.40 with the barrier (68.76)."""
  if head_sharding is None:
    return d_head_EV, d_hidden_BSE
  d_head_EV = jax.lax.with_sharding_constraint(d_head_EV, NamedSharding(mesh, P()))
  d_head_EV = jax.lax.with_sharding_constraint(d_head_EV, head_sharding)
  return jax.lax.optimization_barrier((d_head_EV, d_hidden_BSE))


def _chunked_sums_forward(hidden_BSE, head_EV, labels_BS, mesh, chunk, z_loss_weight,
                          head_sharding):
  if z_loss_weight:
    def sums_and_lse(hidden_BPcE, head_EV, labels_BPc):
      sums, (_, lse_BPc, _) = _sums_forward(_logits(hidden_BPcE, head_EV), labels_BPc,
                                            z_loss_weight)
      return sums, lse_BPc
    sums, lse_BS = _over_chunks(sums_and_lse, hidden_BSE, head_EV, labels_BS, mesh=mesh,
                                chunk=chunk)
    return sums, (hidden_BSE, head_EV, labels_BS, lse_BS)
  unit = (jnp.float32(1), jnp.float32(0), None)

  def sums_and_gradients(hidden_BPcE, head_EV, labels_BPc):
    logits_BPcV = _logits(hidden_BPcE, head_EV)
    sums, (_, lse_BPc, _) = _sums_forward(logits_BPcV, labels_BPc, 0.0)
    d_hidden, d_head = _chunk_gradients(hidden_BPcE, head_EV, labels_BPc, logits_BPcV,
                                        lse_BPc, 0.0, unit)
    return (sums, d_head), d_hidden.astype(hidden_BPcE.dtype)

  (sums, d_head_EV), d_hidden_BSE = _over_chunks(sums_and_gradients, hidden_BSE, head_EV,
                                                 labels_BS, mesh=mesh, chunk=chunk)
  d_head_EV, d_hidden_BSE = _to_head_shards(d_head_EV, d_hidden_BSE, mesh, head_sharding)
  return sums, (d_hidden_BSE, d_head_EV.astype(head_EV.dtype))


def _chunked_sums_backward(mesh, chunk, z_loss_weight, head_sharding, residuals, cotangents):
  if z_loss_weight:
    hidden_BSE, head_EV, labels_BS, lse_BS = residuals

    def gradients(hidden_BPcE, head_EV, labels_BPc, lse_BPc):
      d_hidden, d_head = _chunk_gradients(hidden_BPcE, head_EV, labels_BPc,
                                          _logits(hidden_BPcE, head_EV), lse_BPc,
                                          z_loss_weight, cotangents)
      return d_head, d_hidden.astype(hidden_BPcE.dtype)
    d_head_EV, d_hidden_BSE = _over_chunks(gradients, hidden_BSE, head_EV, labels_BS, lse_BS,
                                           mesh=mesh, chunk=chunk)
    d_head_EV, d_hidden_BSE = _to_head_shards(d_head_EV, d_hidden_BSE, mesh, head_sharding)
    return d_hidden_BSE, d_head_EV.astype(head_EV.dtype), None
  d_loss = cotangents[0]
  scale = lambda unit: (d_loss * unit.astype(jnp.float32)).astype(unit.dtype)
  d_hidden_BSE, d_head_EV = residuals
  return scale(d_hidden_BSE), scale(d_head_EV), None


_chunked_sums.defvjp(_chunked_sums_forward, _chunked_sums_backward)
