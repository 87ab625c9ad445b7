"""Local (per-device) attention backends behind one interface.

After the Ulysses all-to-all every device holds the whole sequence for a subset of heads and
runs ordinary self-attention on it. Which implementation does that is the ``backend``:

* ``"xla"``: ``chunked.chunked_attention``, memory-efficient online softmax in plain XLA;
  runs everywhere, supports every feature.
* ``"pallas"``: our Pallas flash-attention kernel (``ulysses_jax.kernels``); GPU, or Pallas
  interpret mode elsewhere (slow: for tests).
* ``"pallas_mosaic"``: the same with its Hopper kernels (Pallas Mosaic GPU) for the forward and
  the backward; H100/H200, float16 or bfloat16, head dims 64 and 128 (GPU interpret mode
  elsewhere: for tests).
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``; GPU only, float16 or
  bfloat16 only, no ``segment_ids``.
* ``"auto"``: ``"pallas"`` on GPU, ``"xla"`` elsewhere.

"On GPU" means the devices the attention is built for: those of ``mesh`` when given (a mesh
of compile-only GPU devices from ``ulysses_jax.aot`` included), else those of the enclosing
mesh context (``ulysses_jax.kernels.target.current``).
"""

import jax
from jax.sharding import Mesh

from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.kernels import target as target_lib

BACKENDS = ("auto", "xla", "pallas", "cudnn", "pallas_mosaic")


def resolve_backend(backend: str, *, dtype, head_dim: int, segment_ids_given: bool,
                    mesh: Mesh | None = None) -> str:
  """Checks ``backend`` against the inputs and the devices of ``mesh`` (default: the
  enclosing mesh context, else JAX's default device) and returns a concrete backend name."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
  target = target_lib.current(mesh)
  if backend == "auto":
    return "pallas" if target.on_gpu else "xla"
  if backend == "cudnn":
    if not target.on_gpu:
      raise ValueError(f"backend='cudnn' needs a CUDA GPU, but the mesh's devices are "
                       f"{target.platform!r} ({target.device_kind}); use backend='xla' or "
                       "'auto', or build the mesh on GPU devices.")
    if segment_ids_given:
      raise ValueError("backend='cudnn' does not support segment_ids (packed sequences); "
                       "use backend='pallas' or 'xla'.")
    if jax.numpy.dtype(dtype).name not in ("float16", "bfloat16"):
      raise ValueError(f"backend='cudnn' needs float16 or bfloat16 inputs, got {dtype}; "
                       "cast q/k/v or use backend='pallas' or 'xla'.")
  if backend == "pallas_mosaic":
    from ulysses_jax.kernels import flash_hopper, flash_hopper_backward
    if (jax.numpy.dtype(dtype) not in flash_hopper.DTYPES
        or head_dim not in flash_hopper_backward.HEAD_DIMS):
      raise ValueError(f"backend='pallas_mosaic' needs float16 or bfloat16 inputs and head dim "
                       f"in {flash_hopper_backward.HEAD_DIMS}, got {dtype} and {head_dim}; "
                       "use backend='pallas'.")
    if target.on_gpu and (target.compute_capability or 9.0) < 9.0:
      raise ValueError(f"backend='pallas_mosaic' needs Hopper GPUs (compute capability >= "
                       f"9.0), but the mesh's devices are {target.device_kind} (compute "
                       f"capability {target.compute_capability}); use backend='pallas'.")
  return backend


def local_attention(backend: str, q_BSHD, k_BSKD, v_BSKD, *, causal, segment_ids, scale):
  """Self-attention over the full local sequence.

  q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` with Hq % Hkv == 0, segment_ids ``[B, S]`` or
  None; returns ``[B, S, Hq, D]``. ``backend`` must already be resolved.
  """
  if backend == "xla":
    return chunked_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal, q_segment_ids=segment_ids,
                             kv_segment_ids=segment_ids, scale=scale)
  if backend in ("pallas", "pallas_mosaic"):
    from ulysses_jax.kernels.flash_attention import flash_attention
    kernel = "mosaic" if backend == "pallas_mosaic" else "triton"
    return flash_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal, segment_ids=segment_ids,
                           scale=scale, forward_kernel=kernel, backward_kernel=kernel)
  if backend == "cudnn":
    return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, scale=scale, is_causal=causal,
                                        implementation="cudnn")
  raise ValueError(f"unresolved backend {backend!r}; call resolve_backend first.")
