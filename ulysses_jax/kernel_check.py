"""The attention kernel's self-check at first contact, and the fall back down the chain.

Before a run's first step (the trainer, ``python -m ulysses_jax.evaluate``), ``settle`` asks
``attention.backends.choose_backend`` which kernel runs for the model on the mesh, then runs it
forward and backward on a small problem with the run's dtype, head dim, head counts, causal mask
and packed segment layout, on one of the mesh's devices (``check_backend``), and compares the
output and the q/k/v gradients with the XLA chunked attention (the ``"xla"`` backend) on the
same inputs in float32. A kernel that raises, returns non-finite values or differs by more than
the dtype's tolerance is reported in one log line (kernel, error or largest difference, the
fallback) and the next backend of the chain is checked instead; the run goes on with the first
that passes. ``TrainConfig.kernel_check=False`` skips the check (the choice is still logged).

Tolerances (``TOLERANCES``): the largest absolute difference of any element of the output, dq,
dk or dv, whose values are of order 1 here (unit normal q, k, v and output cotangent, scale
``D ** -0.5``): 1e-2 for float32 inputs (room for TF32 matmuls on GPUs), 6e-2 for bfloat16 and
1e-2 for float16 (a few units in the last place of values up to ~4). Our Triton kernels in
interpret mode on CPU (head dim 64, GQA 4/2, causal, S = 256) differ by 1.6e-2 (bfloat16),
1.9e-3 (float16) and 5e-6 (float32). A wrong mask, scale or block gives differences of order 1.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ulysses_jax.attention import backends
from ulysses_jax.kernels import target as target_lib

TOLERANCES = {"float32": 1e-2, "bfloat16": 6e-2, "float16": 1e-2}
_log = logging.getLogger("ulysses_jax.kernel_check")


@dataclasses.dataclass(frozen=True)
class KernelCheck:
  """One backend's check: ``passed``; the largest absolute difference from the reference
  (``max_abs_diff``; None when the kernel raised) against ``tolerance``; ``error``: what it
  raised (type and first line), else None."""
  backend: str
  passed: bool
  max_abs_diff: float | None
  tolerance: float
  error: str | None = None

  def describe(self) -> str:
    if self.error:
      return f"{self.backend} failed: {self.error}"
    verdict = "passed" if self.passed else "FAILED"
    return (f"{self.backend} {verdict}: max |difference| from the XLA reference "
            f"{self.max_abs_diff:.2e} (tolerance {self.tolerance:.0e})")


def check_backend(backend: str, *, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                  causal: bool, segment_ids_given: bool, mesh: Mesh | None = None,
                  seq_len: int = 256) -> KernelCheck:
  """Runs ``backend`` forward and backward on one device of ``mesh`` (default: JAX's first
  device) on a ``[1, seq_len]`` problem of these shapes (with ``segment_ids_given``: three
  packed documents of uneven length) and compares output, dq, dk and dv with the ``"xla"``
  backend on the same inputs in float32."""
  dtype = jnp.dtype(dtype)
  if dtype.name not in TOLERANCES:
    raise ValueError(f"kernel_check: dtype must be one of {tuple(TOLERANCES)}, got {dtype}.")
  tolerance = TOLERANCES[dtype.name]
  device = _first_local_device(mesh)
  target_lib.of_device(device)  # its compute capability picks the kernels' tiles
  inputs = _problem(dtype, seq_len, head_dim, num_q_heads, num_kv_heads, segment_ids_given,
                    device)
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPUs
    reference = _outputs_and_grads("xla", causal, device,
                                   *(x.astype(jnp.float32) for x in inputs[:4]), inputs[4])
  try:
    got = _outputs_and_grads(backend, causal, device, *inputs)
  except Exception as e:  # pylint: disable=broad-except  # any failure to lower, compile or run
    first_line = (str(e).strip().splitlines() or [""])[0][:300]
    return KernelCheck(backend, False, None, tolerance, f"{type(e).__name__}: {first_line}")
  diffs = [np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))
           for a, b in zip(got, reference)]
  diff = max(float(d.max()) if np.all(np.isfinite(d)) else float("inf") for d in diffs)
  return KernelCheck(backend, diff <= tolerance, diff, tolerance)


def _first_local_device(mesh):
  if mesh is None:
    return jax.devices()[0]
  return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def _problem(dtype, seq_len, head_dim, num_q_heads, num_kv_heads, segment_ids_given, device):
  """(q, k, v, output cotangent, segment ids or None) on ``device``."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q_shape, kv_shape = (1, seq_len, num_q_heads, head_dim), (1, seq_len, num_kv_heads, head_dim)
  arrays = [jax.random.normal(key, shape, jnp.float32).astype(dtype)
            for key, shape in zip(keys, (q_shape, kv_shape, kv_shape, q_shape))]
  segment_ids = None
  if segment_ids_given:  # documents of S/5, S/2 - S/5 and S - S/2 tokens
    ids = np.searchsorted([seq_len // 5, seq_len // 2], np.arange(seq_len), side="right")
    segment_ids = jnp.asarray(ids[None], jnp.int32)
  return tuple(jax.device_put(x, device) if x is not None else None
               for x in (*arrays, segment_ids))


def _outputs_and_grads(backend, causal, device, q, k, v, d_out, segment_ids):
  """(out, dq, dk, dv) of ``backend`` run on ``device``, fetched to the host."""
  def run(q, k, v, d_out, segment_ids):
    attend = lambda q, k, v: backends.local_attention(
        backend, q, k, v, causal=causal, segment_ids=segment_ids, scale=None)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(d_out))
  with jax.set_mesh(Mesh(np.array([device]), ("check",))):  # the kernels' target: the device
    return jax.device_get(jax.jit(run)(q, k, v, d_out, segment_ids))


@dataclasses.dataclass(frozen=True)
class Settled:
  """What ``settle`` decided: the ``choice``, the ``checks`` run in order (empty when
  skipped) and the ``backend`` the run uses."""
  choice: backends.BackendChoice
  checks: tuple[KernelCheck, ...]
  backend: str

  def model_config(self, model_config):
    """``model_config`` (a ``LlamaConfig``) running ``backend``."""
    return dataclasses.replace(model_config, attention_backend=self.backend)

  def record(self) -> dict:
    """The fields the first ``metrics.jsonl`` record carries."""
    record = {"attention_backend": self.backend, "attention_backend_reason": self.choice.reason}
    if self.checks:
      record["kernel_check"] = "; ".join(c.describe() for c in self.checks)
      record["kernel_check_max_abs_diff"] = self.checks[-1].max_abs_diff
    return record


def settle(model_config, mesh: Mesh, *, check: bool = True,
           segment_ids_given: bool = True) -> Settled:
  """The backend a model (``LlamaConfig``: causal) runs on ``mesh``: ``attention_backend``
  (``"auto"``: ``choose_backend``'s pick), checked when ``check`` and it is not ``"xla"``, and
  on failure the next of the chain that passes. Logs each check; the caller logs the choice
  (``Settled.choice.reason``) once the run is known to proceed."""
  c = model_config
  case = dict(dtype=c.dtype, head_dim=c.head_dim, num_q_heads=c.num_heads,
              num_kv_heads=c.num_kv_heads, causal=True, segment_ids_given=segment_ids_given)
  choice = backends.choose_backend(**case, mesh=mesh)
  if c.attention_backend != "auto":
    chain = tuple(dict.fromkeys((c.attention_backend, choice.backend, *choice.fallbacks, "xla")))
    chain = chain[:chain.index("xla") + 1]
    choice = backends.BackendChoice(chain[0], f"{chain[0]}: set by LlamaConfig.attention_backend "
                                    f"(auto would pick {choice.reason})", chain[1:])
  chain = (choice.backend, *choice.fallbacks)
  lead = jax.process_index() == 0
  checks, backend = [], chain[0]
  # Every chain ends with "xla", the reference itself: never checked, always the last resort.
  for backend, fallback in zip(chain, chain[1:] if check else ()):
    result = check_backend(backend, **case, mesh=mesh)
    if jax.process_count() > 1:  # every process must run the same program
      everywhere = multihost_utils.process_allgather(np.array(result.passed))
      result = dataclasses.replace(result, passed=bool(np.all(everywhere)))
    checks.append(result)
    if result.passed:
      if lead:
        _log.info("attention kernel self-check: %s", result.describe())
      break
    if lead:
      _log.warning("attention kernel self-check: %s; falling back to %s", result.describe(),
                  fallback)
    backend = fallback
  return Settled(choice, tuple(checks), backend)
