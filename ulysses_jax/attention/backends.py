"""Local (per-device) attention backends behind one interface.

After the Ulysses all-to-all every device holds the whole sequence for a subset of heads and
runs ordinary self-attention on it. Which implementation does that is the ``backend``:

* ``"xla"``: ``chunked.chunked_attention``, memory-efficient online softmax in plain XLA;
  runs everywhere, supports every feature.
* ``"pallas"``: our Pallas flash-attention kernel (``ulysses_jax.kernels``); GPU, or Pallas
  interpret mode elsewhere (slow: for tests).
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``; GPU only, float16 or
  bfloat16 only, no ``segment_ids``.
* ``"auto"``: ``"pallas"`` on GPU, ``"xla"`` elsewhere.
"""

import jax

from ulysses_jax.attention.chunked import chunked_attention

BACKENDS = ("auto", "xla", "pallas", "cudnn")


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve_backend(backend: str, *, dtype, segment_ids_given: bool) -> str:
  """Checks ``backend`` against the inputs and returns a concrete backend name."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
  if backend == "auto":
    return "pallas" if _on_gpu() else "xla"
  if backend == "cudnn":
    if not _on_gpu():
      raise ValueError(f"backend='cudnn' needs a CUDA GPU, but JAX runs on "
                       f"{jax.default_backend()!r}; use backend='xla' or 'auto'.")
    if segment_ids_given:
      raise ValueError("backend='cudnn' does not support segment_ids (packed sequences); "
                       "use backend='pallas' or 'xla'.")
    if jax.numpy.dtype(dtype).name not in ("float16", "bfloat16"):
      raise ValueError(f"backend='cudnn' needs float16 or bfloat16 inputs, got {dtype}; "
                       "cast q/k/v or use backend='pallas' or 'xla'.")
  return backend


def local_attention(backend: str, q_BSHD, k_BSKD, v_BSKD, *, causal, segment_ids, scale):
  """Self-attention over the full local sequence.

  q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` with Hq % Hkv == 0, segment_ids ``[B, S]`` or
  None; returns ``[B, S, Hq, D]``. ``backend`` must already be resolved.
  """
  if backend == "xla":
    return chunked_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal, q_segment_ids=segment_ids,
                             kv_segment_ids=segment_ids, scale=scale)
  if backend == "pallas":
    from ulysses_jax.kernels.flash_attention import flash_attention
    return flash_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal, segment_ids=segment_ids,
                           scale=scale)
  if backend == "cudnn":
    return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, scale=scale, is_causal=causal,
                                        implementation="cudnn")
  raise ValueError(f"unresolved backend {backend!r}; call resolve_backend first.")
