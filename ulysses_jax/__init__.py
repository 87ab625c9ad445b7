"""ulysses_jax: Ulysses sequence parallelism for JAX.

Public names (stable; see docs/DESIGN.md):
  make_mesh          a ("data", "seq") device mesh
  ulysses_attention  exact attention over a sequence sharded on the "seq" axis
  UlyssesAttention   the Flax NNX attention layer (projections, RoPE, GQA) around it
"""

from ulysses_jax.attention.module import UlyssesAttention
from ulysses_jax.attention.hybrid import ulysses_attention
from ulysses_jax.mesh import make_mesh

__all__ = ["UlyssesAttention", "make_mesh", "ulysses_attention"]
