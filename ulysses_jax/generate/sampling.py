"""The next token from float32 logits: greedy, or sampled with temperature, top-k and top-p.

Sampling runs inside the jitted step on logits replicated over the mesh, with one key per step
(``jax.random.fold_in(PRNGKey(seed), step)``): every device draws the same tokens, and a seed
reproduces a run. The filters apply in transformers' order: temperature, top-k, top-p.
"""

import dataclasses

import jax
import jax.numpy as jnp

from ulysses_jax.config_checks import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
  """``temperature`` 0 (the default) is greedy decoding; above 0 the logits are divided by it
  and a token is drawn from the softmax, restricted to the ``top_k`` most likely tokens (0:
  all) and then to the smallest set whose probability reaches ``top_p`` (1: all). ``seed``
  seeds the draws."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ConfigError(f"temperature must be >= 0 (0: greedy), got {self.temperature}.")
    if self.top_k < 0:
      raise ConfigError(f"top_k must be >= 0 (0: no top-k filter), got {self.top_k}.")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p must be in (0, 1] (1: no top-p filter), got {self.top_p}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def filter_logits(logits_BV: jax.Array, sampling: Sampling) -> jax.Array:
  """Float32 logits divided by the temperature, -inf outside the top-k and top-p sets."""
  logits = logits_BV.astype(jnp.float32) / sampling.temperature
  if sampling.top_k and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token when the tokens before it hold less than top_p: the smallest set whose
    # probability reaches top_p (the most likely token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    drop = jnp.zeros(logits.shape, bool).at[
        jnp.arange(logits.shape[0])[:, None], order].set(before >= sampling.top_p)
    logits = jnp.where(drop, -jnp.inf, logits)
  return logits


def sample(logits_BV: jax.Array, sampling: Sampling, step) -> jax.Array:
  """int32 ``[B]`` tokens from float32 logits ``[B, V]`` at decode step ``step``."""
  if sampling.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  key = jax.random.fold_in(jax.random.PRNGKey(sampling.seed), step)
  return jax.random.categorical(key, filter_logits(logits_BV, sampling),
                                axis=-1).astype(jnp.int32)
