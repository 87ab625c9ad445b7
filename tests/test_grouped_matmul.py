"""The experts' grouped matmul (``kernels.grouped_matmul``): which backend runs where, and on a
Hopper GPU the Mosaic kernels' forward and gradients against ``jax.lax.ragged_dot``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_cases import relative_error
from ulysses_jax.kernels import grouped_matmul as gm
from ulysses_jax.kernels.target import Target

HOPPER = Target("gpu", "NVIDIA H100 80GB HBM3", 9.0)


@pytest.mark.parametrize("backend, dtype, shape, target, expected", [
    ("auto", jnp.bfloat16, (128, 256), HOPPER, "mosaic"),
    ("auto", jnp.float32, (128, 256), HOPPER, "ragged_dot"),
    ("auto", jnp.bfloat16, (2880, 96), HOPPER, "ragged_dot"),  # 96 is no multiple of 64
    ("auto", jnp.bfloat16, (128, 256), Target("gpu", "NVIDIA A100-SXM4-80GB", 8.0),
     "ragged_dot"),
    ("auto", jnp.bfloat16, (128, 256), Target("cpu", "cpu"), "ragged_dot"),
    ("ragged_dot", jnp.bfloat16, (128, 256), HOPPER, "ragged_dot"),
])
def test_auto_picks_the_mosaic_kernels_only_where_they_run(backend, dtype, shape, target,
                                                           expected):
  assert gm.choose_backend(backend, dtype, *shape, target) == expected


def test_asking_for_mosaic_where_it_cannot_run_says_why():
  with pytest.raises(ValueError, match=r"cannot run here: not a Hopper GPU \(cpu"):
    gm.choose_backend("mosaic", jnp.bfloat16, 128, 256, Target("cpu", "cpu"))
  with pytest.raises(ValueError, match=r"dtype float32 \(the kernels take bfloat16"):
    gm.choose_backend("mosaic", jnp.float32, 128, 256, HOPPER)
  with pytest.raises(ValueError, match="must be one of"):
    gm.choose_backend("cutlass", jnp.bfloat16, 128, 256, HOPPER)


def _case(rows=1000, groups=6, k=128, n=192, seed=0):
  """Rows sorted by group, one group empty, bfloat16."""
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(rows, np.full(groups, 1 / groups))
  sizes[2], sizes[0] = 0, sizes[0] + sizes[2]
  x = jnp.asarray(rng.normal(0, 1, (rows, k)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(0, 0.1, (groups, k, n)), jnp.bfloat16)
  dy = jnp.asarray(rng.normal(0, 1, (rows, n)), jnp.bfloat16)
  return x, w, jnp.asarray(sizes, jnp.int32), dy


def test_ragged_dot_backend_is_the_grouped_product():
  x, w, sizes, _ = _case(rows=40, groups=4, k=8, n=16)
  x, w = x.astype(jnp.float32), w.astype(jnp.float32)
  groups = np.repeat(np.arange(4), np.asarray(sizes))
  expected = np.einsum("rk,rkn->rn", x, np.asarray(w)[groups])
  np.testing.assert_allclose(gm.grouped_matmul(x, w, sizes, backend="ragged_dot"), expected,
                             rtol=1e-6)


@pytest.mark.gpu
def test_mosaic_kernels_match_ragged_dot_forward_and_gradients():
  """On a Hopper GPU: y, dx and dw of the Mosaic kernels against ragged_dot's (bfloat16
  inputs, float32 references)."""
  x, w, sizes, dy = _case()

  def run(backend):
    y, vjp = jax.vjp(lambda x, w: gm.grouped_matmul(x, w, sizes, backend=backend), x, w)
    return (y, *vjp(dy))

  ours = jax.jit(lambda: run("mosaic"))()
  f32 = lambda t: t.astype(jnp.float32)
  reference = jax.jit(lambda: jax.vjp(
      lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32),
      f32(x), f32(w)))()
  expected = (reference[0], *reference[1](f32(dy)))
  for name, a, b in zip(("y", "dx", "dw"), ours, expected):
    assert relative_error(a, b) < 1e-2, name
