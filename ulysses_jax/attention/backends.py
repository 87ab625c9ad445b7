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
  bfloat16 only, no ``segment_ids``, no ``sinks`` (``NO_SINKS_IN_CUDNN``).
* ``"auto"``: on GPUs the first of ``"pallas_mosaic"``, ``"pallas"``, ``"cudnn"``, ``"xla"``
  that covers the inputs, the devices and the mesh (``choose_backend`` says which and why);
  ``"xla"`` elsewhere (the kernels would run interpreted).

Every backend takes a ``sliding_window`` (the Pallas ones through their kernels, Triton and
Mosaic alike; cuDNN as ``local_window_size=(W - 1, 0)``), except that ring attention with a
window needs ``"xla"`` (the kernels take no positions). Every backend but cuDNN takes
``sinks`` (gpt-oss' per-head softmax sinks, ``attention.sinks``), applied through the lse.

"On GPU" means the devices the attention is built for: those of ``mesh`` when given (a mesh
of compile-only GPU devices from ``ulysses_jax.aot`` included), else those of the enclosing
mesh context (``ulysses_jax.kernels.target.current``).
"""

import dataclasses

import jax
from jax.sharding import Mesh

from ulysses_jax.attention.chunked import chunked_attention
from ulysses_jax.kernels.variants import check_sliding_window
from ulysses_jax.kernels import target as target_lib

BACKENDS = ("auto", "xla", "pallas", "cudnn", "pallas_mosaic")
# The order "auto" tries on GPUs: our Mosaic GPU (Hopper) kernels, our Triton kernels (JAX has
# deprecated Pallas' Triton backend), cuDNN, then the XLA chunked attention that always runs.
PREFERENCE = ("pallas_mosaic", "pallas", "cudnn", "xla")
KERNEL_NAMES = {"pallas_mosaic": "our Mosaic GPU (Hopper) kernels", "pallas": "our Triton "
                "kernels", "cudnn": "cuDNN's attention", "xla": "the XLA chunked attention"}
# Why ring attention (the "ring" axis of the hybrid) cannot use a backend.
NOT_IN_RING = {"cudnn": "it merges partial results by log-sum-exp, which cuDNN's attention does "
                        "not return"}
_HALF_DTYPES = ("bfloat16", "float16")
# The kernel (``flash_attention``'s forward_kernel/backward_kernel) each Pallas backend runs.
_KERNEL_OF = {"pallas": "triton", "pallas_mosaic": "mosaic"}
# Why cuDNN cannot run a model with attention sinks (checked in jax 0.10.2 and 0.12.0.1).
NO_SINKS_IN_CUDNN = ("JAX's dot_product_attention takes no sinks, and its backward drops the "
                     "cotangent of the log-sum-exp it returns (return_residual), so they cannot "
                     "be applied outside it either")
# Why ring attention cannot use a backend with a sliding window over more than one ring step.
NOT_IN_RING_WITH_WINDOW = ("its kernels take no positions, which a window reaching further "
                           "than the previous ring device needs")


@dataclasses.dataclass(frozen=True)
class BackendChoice:
  """Which local attention runs (``backend``), why (``reason``, one sentence), and what is
  left to fall back to, in order (``fallbacks``: the next backends that cover the case)."""
  backend: str
  reason: str
  fallbacks: tuple[str, ...] = ()


def choose_backend(*, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, causal: bool,
                   segment_ids_given: bool, mesh: Mesh | None = None,
                   ring_attention: bool | None = None,
                   sliding_window: int | None = None,
                   ring_window_in_two_steps: bool = False,
                   sinks_given: bool = False) -> BackendChoice:
  """The backend ``"auto"`` runs for these inputs on ``mesh``'s devices (default: the enclosing
  mesh context, else JAX's first device), and why.

  ``ring_attention``: whether the local attention runs inside ring attention (which takes only
  ``"pallas"`` and ``"xla"``); default: whether ``mesh`` has a ``ring`` axis longer than 1.
  Every backend covers GQA/MQA and both masks; head counts and ``causal`` are checked and
  named in the reason. ``sliding_window`` (None or W, see
  ``kernels.variants.check_sliding_window``): every backend applies it, but inside ring
  attention the kernels run it only when ``ring_window_in_two_steps``
  (``ring.window_in_two_steps``: W within a ring device's tokens, natural layout, which the
  caller knows from the sequence length); else only ``"xla"`` does.
  ``sinks_given``: the attention has sinks, which every backend but ``"cudnn"`` takes.
  """
  check_sliding_window(sliding_window, causal)
  if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"query heads ({num_q_heads}) must be a positive multiple of KV heads "
                     f"({num_kv_heads}); use a number of KV heads that divides {num_q_heads}.")
  target = target_lib.current(mesh)
  if ring_attention is None:
    ring_attention = dict(getattr(mesh, "shape", {})).get("ring", 1) > 1
  case = (f"{jax.numpy.dtype(dtype).name}, head dim {head_dim}, {num_q_heads} query / "
          f"{num_kv_heads} KV heads, {'causal' if causal else 'full'} mask, "
          f"{'with' if segment_ids_given else 'no'} segment ids"
          + (f", sliding window {sliding_window}" if sliding_window is not None else "")
          + (", with sinks" if sinks_given else "")
          + (", inside ring attention" if ring_attention else ""))
  if not target.on_gpu:
    return BackendChoice("xla", f"{KERNEL_NAMES['xla']} for {case}: the devices are "
                         f"{target.platform!r} ({target.device_kind}), where the Pallas kernels "
                         "would run interpreted (slow)")
  chain, skipped = [], []
  for backend in PREFERENCE:
    why = _why_not(backend, target, dtype, head_dim, segment_ids_given, sinks_given)
    if backend == "pallas_mosaic" and not why and target.compute_capability is None:
      why = f"the compute capability of {target.device_kind} is unknown (they need Hopper)"
    if ring_attention and backend in NOT_IN_RING:
      why = f"ring attention cannot use it: {NOT_IN_RING[backend]}"
    if (ring_attention and sliding_window is not None and backend in _KERNEL_OF
        and not ring_window_in_two_steps):
      why = f"ring attention cannot use it with sliding_window: {NOT_IN_RING_WITH_WINDOW}"
    if why:
      skipped.append(f"not {KERNEL_NAMES[backend]}: {why}")
    else:
      chain.append(backend)
  reason = (f"{KERNEL_NAMES[chain[0]]} for {case} on {target.device_kind} (compute capability "
            f"{target.compute_capability or 'unknown'})")
  return BackendChoice(chain[0], "; ".join([reason, *skipped]), tuple(chain[1:]))


def _why_not(backend, target, dtype, head_dim, segment_ids_given,
             sinks_given=False) -> str | None:
  """Why ``backend`` cannot run these inputs on GPUs like ``target``, as the end of a
  sentence starting "backend=... "; None when it can."""
  from ulysses_jax.kernels import flash_attention, flash_hopper_backward
  dtype = jax.numpy.dtype(dtype).name
  capability = target.compute_capability
  if backend == "pallas_mosaic":
    # Both Mosaic kernels (forward and backward) must cover the head dim.
    if dtype not in _HALF_DTYPES or head_dim not in flash_hopper_backward.HEAD_DIMS:
      return (f"needs float16 or bfloat16 inputs and head dim in "
              f"{flash_hopper_backward.HEAD_DIMS}, got {dtype} and {head_dim}")
    if target.on_gpu and capability is not None and not 9.0 <= capability < 10.0:
      return (f"needs Hopper GPUs (compute capability 9.x: the kernels use wgmma), but the "
              f"mesh's devices are {target.device_kind} (compute capability {capability})")
  if backend == "pallas" and head_dim not in flash_attention.SUPPORTED_HEAD_DIMS:
    return f"needs head dim in {flash_attention.SUPPORTED_HEAD_DIMS}, got {head_dim}"
  if backend == "cudnn":
    if not target.on_gpu:
      return (f"needs a CUDA GPU, but the mesh's devices are {target.platform!r} "
              f"({target.device_kind})")
    if segment_ids_given:
      return "does not support segment_ids (packed sequences)"
    if sinks_given:
      return f"does not support attention sinks: {NO_SINKS_IN_CUDNN}"
    if dtype not in _HALF_DTYPES:
      return f"needs float16 or bfloat16 inputs, got {dtype}"
  return None


def resolve_backend(backend: str, *, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                    causal: bool, segment_ids_given: bool, mesh: Mesh | None = None,
                    sliding_window: int | None = None, sinks_given: bool = False) -> str:
  """Checks ``backend`` against the inputs and the devices of ``mesh`` (default: the
  enclosing mesh context, else JAX's first device) and returns a concrete backend name
  (``"auto"``: ``choose_backend``'s)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
  check_sliding_window(sliding_window, causal)
  if backend == "auto":
    return choose_backend(dtype=dtype, head_dim=head_dim, num_q_heads=num_q_heads,
                          num_kv_heads=num_kv_heads, causal=causal,
                          segment_ids_given=segment_ids_given, mesh=mesh,
                          ring_attention=False, sliding_window=sliding_window,
                          sinks_given=sinks_given).backend
  instead = {"cudnn": "use backend='pallas' or 'xla'", "pallas_mosaic": "use backend='pallas'"}
  if backend in instead:
    # Off GPUs the Mosaic kernels run in GPU interpret mode (for tests): only dtype and head
    # dim are checked there; a GPU of unknown compute capability is given the benefit.
    why = _why_not(backend, target_lib.current(mesh), dtype, head_dim, segment_ids_given,
                   sinks_given)
    if why:
      raise ValueError(f"backend={backend!r} {why}; {instead[backend]}.")
  return backend


def local_attention(backend: str, q_BSHD, k_BSKD, v_BSKD, *, causal, segment_ids, scale,
                    sliding_window=None, sinks=None):
  """Self-attention over the full local sequence.

  q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]`` with Hq % Hkv == 0, segment_ids ``[B, S]`` or
  None; returns ``[B, S, Hq, D]``. ``sliding_window``: None, or W >= 1 with ``causal`` (query
  p sees keys p' with ``0 <= p - p' < W``). ``sinks``: None or ``[Hq]`` float logits
  (``attention.sinks``). ``backend`` must already be resolved, for this window and sinks too.
  """
  if backend == "xla":
    return chunked_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal, q_segment_ids=segment_ids,
                             kv_segment_ids=segment_ids, scale=scale,
                             sliding_window=sliding_window, sinks=sinks)
  if backend in _KERNEL_OF:
    from ulysses_jax.kernels.flash_attention import flash_attention
    kernel = _KERNEL_OF[backend]
    # Only a given window is passed, so kernels without the keyword still run the rest.
    window = {} if sliding_window is None else dict(sliding_window=sliding_window)
    return flash_attention(q_BSHD, k_BSKD, v_BSKD, causal=causal, segment_ids=segment_ids,
                           scale=scale, forward_kernel=kernel, backward_kernel=kernel,
                           sinks=sinks, **window)
  if backend == "cudnn":
    if sinks is not None:
      raise ValueError(f"backend='cudnn' {NO_SINKS_IN_CUDNN}; use backend='pallas_mosaic', "
                       "'pallas' or 'xla' for a model with sinks.")
    # jax's window (left, right) shows key k to query q iff q - left <= k <= q + right, so
    # transformers' W is (W - 1, 0) (jax.nn.functions._get_window_mask; cuDNN's is the same).
    local_window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, scale=scale, is_causal=causal,
                                        local_window_size=local_window, implementation="cudnn")
  raise ValueError(f"unresolved backend {backend!r}; call resolve_backend first.")
