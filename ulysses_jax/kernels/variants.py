"""The attention variants every backend honours, checked and applied below the kernels:
sliding windows (``check_sliding_window``) and attention sinks; and the names of the residuals
every attention's backward reads (``name_kernel_residuals``).

Attention sinks (gpt-oss): one learnable logit per query head in every query row's softmax.

A sink is an extra "key" of score ``s_h`` (not scaled: transformers' ``GptOssAttention`` appends
the raw ``sinks`` parameter to the scaled scores) and value zero. It takes probability mass but
adds nothing to the output, so, with ``lse`` the log-sum-exp of a row's scaled scores over its
real keys and ``out`` the softmax-weighted values without the sink::

    out_with_sink = out · exp(lse - logaddexp(lse, s)) = out · σ(lse - s)
    lse_with_sink = logaddexp(lse, s)

A row that sees no key (lse = -inf) keeps out = 0, and its lse becomes s: all of its mass goes
to the sink, as in transformers. Every attention here returns ``lse`` and takes its cotangent,
so the sink is applied outside the kernels (``apply_sinks``) and autodiff carries the gradient
into them; ring attention, which merges partial results by their lse, applies it once after the
merge and, holding the final output and lse, gets ``d(sinks)`` from ``sinks_grad``.

This module is a leaf: it imports nothing from the package, so the kernels and the attention
layers above them both use it.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Names of the residuals an attention's backward needs besides its inputs: its output and
# log-sum-exp as its custom_vjp's forward rule returns them (``name_kernel_residuals``). A remat
# policy that saves them (``models.llama.remat_policy``) keeps the backward from running the
# attention's forward again.
KERNEL_OUT = "attn_kernel_out"
KERNEL_LSE = "attn_kernel_lse"
KERNEL_RESIDUALS = (KERNEL_OUT, KERNEL_LSE)


def name_kernel_residuals(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` tagged ``KERNEL_OUT`` and ``KERNEL_LSE`` for remat policies. Every
  attention's custom_vjp forward rule returns the tagged pair as its output and keeps it as
  its residuals, so that saving the names saves what the backward reads.

  The optimization barriers keep XLA's GPU compiler (jax 0.11.2) from running the kernel
  twice: its dynamic-slice fusion copied the kernel's custom call into a fusion that writes the
  saved pair straight into the layer scan's stack, beside the original call for the output,
  so each layer ran attention's forward twice (step 4.57 s on an H200, 2026-11-27)."""
  out, lse = jax.lax.optimization_barrier(out), jax.lax.optimization_barrier(lse)
  return checkpoint_name(out, KERNEL_OUT), checkpoint_name(lse, KERNEL_LSE)


def check_sliding_window(sliding_window, causal) -> None:
  """Raises ValueError unless ``sliding_window`` is None or a positive int with ``causal``."""
  if sliding_window is None:
    return
  if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
    raise ValueError(f"sliding_window must be a positive int (keys a query sees, itself "
                     f"included) or None, got {sliding_window!r}.")
  if not causal:
    raise ValueError(f"sliding_window ({sliding_window}) needs causal=True: the window is "
                     "transformers' causal one; pass causal=True or sliding_window=None.")



def check_sinks(sinks_H, num_q_heads: int, where: str) -> None:
  """Raises ValueError unless ``sinks_H`` is None or a floating ``[num_q_heads]`` array; the
  message names ``where`` (the function called) and the fix."""
  if sinks_H is None:
    return
  shape, dtype = tuple(jnp.shape(sinks_H)), jnp.result_type(sinks_H)
  if shape != (num_q_heads,) or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{where}: sinks must be a float32 array of shape [query heads] = "
                     f"({num_q_heads},), one logit per query head, got {dtype}{list(shape)}; "
                     "pass the model's per-head sink logits, or None for no sinks.")



def _rows(x_BHS):
  """``[B, H, S]`` -> ``[B, S, H, 1]``: one factor per row of a ``[B, S, H, D]`` output."""
  return jnp.swapaxes(x_BHS, 1, 2)[..., None]


def apply_sinks(out_BSHD: jax.Array, lse_BHS: jax.Array,
                sinks_H: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The attention with sinks from the one without: ``(out · σ(lse - s), logaddexp(lse, s))``.

  ``out_BSHD`` ``[B, S, H, D]`` (any float dtype, kept), ``lse_BHS`` ``[B, H, S]`` float32 (-inf
  for a row that sees no key), ``sinks_H`` ``[H]``, computed in float32. Differentiable in all
  three (module docstring); rows without keys stay finite, their gradients zero.
  """
  sinks = sinks_H.astype(jnp.float32)[None, :, None]
  weight = jax.nn.sigmoid(lse_BHS - sinks)
  out = (out_BSHD.astype(jnp.float32) * _rows(weight)).astype(out_BSHD.dtype)
  return out, jnp.logaddexp(lse_BHS, sinks)


def sinks_grad(out_BSHD: jax.Array, lse_BHS: jax.Array, d_out_BSHD: jax.Array,
               sinks_H: jax.Array) -> jax.Array:
  """``d(sinks)`` ``[H]`` (in ``sinks_H``'s dtype) given the output and lse WITH the sinks.

  The sink is a key of value zero: its score's gradient is ``p_sink · (0 - delta)`` with
  ``p_sink = exp(s - lse)`` and ``delta = rowsum(d_out · out)``, summed over every row of the
  head. (The same ``out``, ``lse`` and ``delta`` make the flash backward of the real keys exact:
  the sink only lowers their probabilities, which ``exp(scores - lse)`` already reflects.)
  """
  delta = jnp.einsum("bshd,bshd->bhs", d_out_BSHD.astype(jnp.float32),
                     out_BSHD.astype(jnp.float32))
  p_sink = jnp.exp(sinks_H.astype(jnp.float32)[None, :, None] - lse_BHS)
  return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks_H.dtype)
