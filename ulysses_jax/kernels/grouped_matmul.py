"""The grouped matmul of the mixture-of-experts layer: ``x[r] @ w[g(r)]`` for rows sorted by
group, forward and backward, with FLOPs and memory that scale with the rows, not the groups.

Two backends (``GROUPED_MATMUL_BACKENDS``):

* ``"ragged_dot"``: ``jax.lax.ragged_dot`` and its own derivative. Exact everywhere, but
  grouped only where the compiler has a grouped matmul (TPU): XLA:CPU lowers it to a masked
  dense product over the G groups, and XLA:GPU rewrites it into a dense ``[R, G·N]`` one
  (jax 0.10 to 0.12), so FLOPs and temporaries grow G times (``docs/DESIGN.md``).
* ``"mosaic"``: JAX's Hopper (sm90) Mosaic GPU kernels, which ship without a derivative
  (``jax.experimental.pallas.ops.gpu``: ``ragged_dot_mgpu``, ``transposed_ragged_dot_mgpu``),
  joined by a ``custom_vjp`` here: the forward ``y = x @ w[g]``; the backward
  ``dx = dy @ w[g]^T`` (the same kernel, the weights read transposed) and
  ``dw[g] = x_g^T @ dy_g`` (the transposed kernel: it contracts the rows of each group). Bf16 or
  f16 only, and every weight dimension a multiple of 64.

``"auto"`` picks ``"mosaic"`` on a Hopper GPU when the dtype and shapes allow, else
``"ragged_dot"``; ``choose_backend`` says why.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax.gpus import GPUS
from ulysses_jax.kernels import target as target_lib

GROUPED_MATMUL_BACKENDS = ("auto", "ragged_dot", "mosaic")
_HALF = (jnp.bfloat16, jnp.float16)
_BLOCK_K = 64
_PIPELINE_STEPS = 4
# The kernels' name scope: ``aot.cost`` reads their FLOPs (2·R·K·N each) from it.
KERNEL_SCOPE = "grouped_matmul_mosaic"


def _block(dim: int) -> int:
  """The largest of 128 and 64 that divides ``dim``."""
  return 128 if dim % 128 == 0 else 64


def mosaic_unsupported(dtype, k: int, n: int, target: target_lib.Target) -> str:
  """Why the Mosaic kernels cannot multiply ``[R, k]`` rows by ``[G, k, n]`` weights of
  ``dtype`` on ``target`` ("" when they can)."""
  if not target.on_gpu or not 9.0 <= (target.compute_capability or 0.0) < 10.0:
    return f"not a Hopper GPU ({target.platform} {target.device_kind})"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _HALF]:
    return f"dtype {jnp.dtype(dtype).name} (the kernels take bfloat16 or float16)"
  if k % _BLOCK_K or n % _BLOCK_K:
    return f"weights [G, {k}, {n}]: both dimensions must be multiples of {_BLOCK_K}"
  return ""


def choose_backend(backend: str, dtype, k: int, n: int, target: target_lib.Target) -> str:
  """``backend`` resolved: "auto" is "mosaic" where ``mosaic_unsupported`` says nothing."""
  if backend not in GROUPED_MATMUL_BACKENDS:
    raise ValueError(f"grouped matmul backend must be one of {GROUPED_MATMUL_BACKENDS}, got "
                     f"{backend!r}.")
  why = mosaic_unsupported(dtype, k, n, target)
  if backend == "mosaic" and why:
    raise ValueError(f"the Mosaic grouped matmul cannot run here: {why}; use 'auto' or "
                     "'ragged_dot'.")
  if backend == "auto":
    return "ragged_dot" if why else "mosaic"
  return backend


def grouped_matmul(x_RK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, *,
                   backend: str = "auto") -> jax.Array:
  """``[R, N]``: row r times ``w[g]``, the rows sorted by group, group g's rows
  ``sizes[g]`` many (their sum is R). ``backend``: one of ``GROUPED_MATMUL_BACKENDS``; the
  target is the enclosing mesh's or the arrays' (``kernels.target``)."""
  target = target_lib.current(arrays=(x_RK,))
  k, n = w_GKN.shape[1:]
  if choose_backend(backend, x_RK.dtype, k, n, target) == "ragged_dot":
    return jax.lax.ragged_dot(x_RK, w_GKN, sizes_G)
  return _mosaic(x_RK, w_GKN.astype(x_RK.dtype), sizes_G.astype(jnp.int32))


def _ragged(x_RK, w, sizes_G, *, transpose_rhs=False):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # only where it runs
  n = w.shape[1] if transpose_rhs else w.shape[2]
  with jax.named_scope(KERNEL_SCOPE):
    return ragged_dot_mgpu.ragged_dot(
        x_RK, w, group_sizes=sizes_G, block_m=128, block_n=_block(n), block_k=_BLOCK_K,
        max_concurrent_steps=_PIPELINE_STEPS, grid_block_n=1, transpose_rhs=transpose_rhs)


def _transposed(x_RK, dy_RN, sizes_G):
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  k, n = x_RK.shape[1], dy_RN.shape[1]
  with _first_device_reports_sms(target_lib.current(arrays=(x_RK,))), jax.named_scope(
      KERNEL_SCOPE):
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x_RK, dy_RN, group_sizes=sizes_G, block_m=_block(k), block_n=_block(n),
        block_k=_BLOCK_K, max_concurrent_steps=_PIPELINE_STEPS, grid_block_n=1)


class _StandIn:
  def __init__(self, core_count):
    self.core_count = core_count


@contextlib.contextmanager
def _first_device_reports_sms(target: target_lib.Target):
  """JAX's transposed kernel (0.10 to 0.12) sizes its persistent grid by
  ``jax.devices()[0].core_count``. In a process that compiles for GPUs it has not got
  (``ulysses_jax.aot``) the first device is a CPU, which has no such count: while the kernel
  is traced, that call reports the target GPU's SM count (``ulysses_jax.gpus``)."""
  if hasattr(jax.devices()[0], "core_count"):
    yield
    return
  counts = {gpu.name: gpu.sm_count for gpu in GPUS.values()}
  if target.device_kind not in counts:
    raise ValueError(f"the SM count of {target.device_kind!r} is unknown (not in "
                     f"ulysses_jax.gpus); compile for one of {sorted(counts)}.")
  devices, jax.devices = jax.devices, lambda *_, **__: [_StandIn(counts[target.device_kind])]
  try:
    yield
  finally:
    jax.devices = devices


@jax.custom_vjp
def _mosaic(x_RK, w_GKN, sizes_G):
  return _ragged(x_RK, w_GKN, sizes_G)


def _mosaic_forward(x_RK, w_GKN, sizes_G):
  return _ragged(x_RK, w_GKN, sizes_G), (x_RK, w_GKN, sizes_G)


def _mosaic_backward(residuals, dy_RN):
  x_RK, w_GKN, sizes_G = residuals
  dy_RN = dy_RN.astype(x_RK.dtype)
  dx_RK = _ragged(dy_RN, w_GKN, sizes_G, transpose_rhs=True)
  dw_GKN = _transposed(x_RK, dy_RN, sizes_G)
  return dx_RK, dw_GKN.astype(w_GKN.dtype), np.zeros(sizes_G.shape, jax.dtypes.float0)


_mosaic.defvjp(_mosaic_forward, _mosaic_backward)
