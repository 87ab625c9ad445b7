"""Rotary position embeddings (RoPE) from global token positions.

Positions are an int ``[B, S]`` array that travels with the tokens (sharded like them), so a
device rotates its tokens by their *global* positions, and packed documents, whose positions
restart at 0, are rotated as if each stood alone. The rotation is token-local: no
communication.

Convention: Hugging Face Llama's "rotate half" layout (the first and second halves of the
head dimension form the rotated pairs), so Hugging Face q/k weights load unpermuted.
"""

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from ulysses_jax.config_checks import above, at_least, check_fields

ROPE_SCALING_KINDS = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Context-extension rescaling of the rotary frequencies (Hugging Face ``rope_scaling``).

  * ``"linear"``: every frequency divided by ``factor``.
  * ``"llama3"``: Llama 3.1's rule: wavelengths above ``original_max_position /
    low_freq_factor`` divided by ``factor``, below ``original_max_position /
    high_freq_factor`` kept, smooth interpolation in between.
  * ``"yarn"`` (YaRN): frequencies that turn fewer than ``beta_slow`` times over
    ``original_max_position`` tokens divided by ``factor``, more than ``beta_fast`` times
    kept, a linear ramp over the dimensions in between (its ends rounded outwards when
    ``truncate``); cos and sin are multiplied by ``attention_factor`` (None: ``0.1 ln(factor)
    + 1``, see ``attention_factor``).
  """
  kind: Literal[ROPE_SCALING_KINDS] = "llama3"
  factor: float = dataclasses.field(default=8.0, metadata=above(0))
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = dataclasses.field(default=8192, metadata=at_least(1))
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    check_fields(self)
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                       f"{self.high_freq_factor} <= {self.low_freq_factor}.")


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None = None) -> jax.Array:
  """``[head_dim // 2]`` float32 rotary frequencies ``theta^(-2i/head_dim)``, rescaled."""
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {head_dim}.")
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  if scaling.kind == "yarn":
    return _yarn(inv_freq, head_dim, theta, scaling)
  wavelen = 2 * math.pi / inv_freq
  low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor) /
            (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return jnp.where(medium, smoothed, scaled)


def _yarn(inv_freq, head_dim, theta, scaling):
  """YaRN's blend of ``inv_freq`` (extrapolation) and ``inv_freq / factor`` (interpolation)."""

  def dimension(rotations):  # the dimension whose frequency turns ``rotations`` times
    turns = scaling.original_max_position / (rotations * 2 * math.pi)
    return head_dim * math.log(turns) / (2 * math.log(theta))

  low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def attention_factor(scaling: RopeScaling | None) -> float:
  """What cos and sin are multiplied by (so attention logits by its square): YaRN's
  ``attention_factor``, by default ``0.1 ln(factor) + 1`` (1 for factor <= 1); else 1."""
  if scaling is None or scaling.kind != "yarn":
    return 1.0
  if scaling.attention_factor is not None:
    return scaling.attention_factor
  return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def apply_rope(x_BSHD: jax.Array, positions_BS: jax.Array, inv_freq: jax.Array,
               scale: float = 1.0) -> jax.Array:
  """Rotates ``x`` ``[B, S, H, D]`` by ``positions`` ``[B, S]`` and multiplies it by ``scale``
  (``attention_factor``); float32 math, x's dtype out."""
  angles_BSd = positions_BS.astype(jnp.float32)[..., None] * inv_freq
  cos, sin = (scale * f(angles_BSd)[:, :, None] for f in (jnp.cos, jnp.sin))
  x = x_BSHD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BSHD.dtype)
