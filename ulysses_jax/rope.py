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

ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Context-extension rescaling of the rotary frequencies (Hugging Face ``rope_scaling``).

  * ``"linear"``: every frequency divided by ``factor``.
  * ``"llama3"``: Llama 3.1's rule: wavelengths above ``original_max_position /
    low_freq_factor`` divided by ``factor``, below ``original_max_position /
    high_freq_factor`` kept, smooth interpolation in between.
  """
  kind: Literal[ROPE_SCALING_KINDS] = "llama3"
  factor: float = dataclasses.field(default=8.0, metadata=above(0))
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = dataclasses.field(default=8192, metadata=at_least(1))

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
  wavelen = 2 * math.pi / inv_freq
  low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor) /
            (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BSHD: jax.Array, positions_BS: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates ``x`` ``[B, S, H, D]`` by ``positions`` ``[B, S]``; float32 math, x's dtype out."""
  angles_BSd = positions_BS.astype(jnp.float32)[..., None] * inv_freq
  cos, sin = jnp.cos(angles_BSd)[:, :, None], jnp.sin(angles_BSd)[:, :, None]
  x = x_BSHD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BSHD.dtype)
