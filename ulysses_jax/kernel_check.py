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

A model with sliding-window layers (``LlamaConfig.layer_windows()``) is checked on each attention
it runs: the windowed one (``choose_backend(..., sliding_window=W)``, whose chain holds only the
kernels that take a window) on ``WINDOW_CHECK_LEN`` tokens with window W, or, when W is more
than half of that (Mistral's 4,096), with ``WINDOW_STAND_IN``: a window that is no multiple of
any kernel block (16 to 128 tokens here) and hides whole key blocks from the later query blocks,
so the kernels' block skipping and their mask at the window's edge both run. A model mixing
full and windowed layers is checked on both. Its layers run one ``attention_backend``: the
backend of each case when they agree; ``"auto"`` (each layer picks, as ``choose_backend``) when
every case passed with ``"auto"``'s own pick; else the first backend that passes every case
(``"xla"`` at worst). Log lines and the ``metrics.jsonl`` record name the case of each check.

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
CHECK_LEN = 256  # tokens of a check of full attention
WINDOW_CHECK_LEN = 1024  # tokens of a windowed check: 8 blocks of 128
WINDOW_STAND_IN = 200  # the window checked for W > WINDOW_CHECK_LEN / 2
_log = logging.getLogger("ulysses_jax.kernel_check")


@dataclasses.dataclass(frozen=True)
class KernelCheck:
  """One backend's check: ``passed``; the largest absolute difference from the reference
  (``max_abs_diff``; None when the kernel raised) against ``tolerance``; ``error``: what it
  raised (type and first line), else None; ``case``: which of the model's attentions it
  checked (``settle`` names it for models with windowed layers, else "")."""
  backend: str
  passed: bool
  max_abs_diff: float | None
  tolerance: float
  error: str | None = None
  case: str = ""

  def describe(self) -> str:
    case = f"{self.case}: " if self.case else ""
    if self.error:
      return f"{case}{self.backend} failed: {self.error}"
    verdict = "passed" if self.passed else "FAILED"
    return (f"{case}{self.backend} {verdict}: max |difference| from the XLA reference "
            f"{self.max_abs_diff:.2e} (tolerance {self.tolerance:.0e})")


def check_backend(backend: str, *, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                  causal: bool, segment_ids_given: bool, mesh: Mesh | None = None,
                  seq_len: int = CHECK_LEN, sliding_window: int | None = None) -> KernelCheck:
  """Runs ``backend`` forward and backward on one device of ``mesh`` (default: JAX's first
  device) on a ``[1, seq_len]`` problem of these shapes (with ``segment_ids_given``: three
  packed documents of uneven length; with ``sliding_window``: that window, ``causal``) and
  compares output, dq, dk and dv with the ``"xla"`` backend on the same inputs in float32."""
  dtype = jnp.dtype(dtype)
  if dtype.name not in TOLERANCES:
    raise ValueError(f"kernel_check: dtype must be one of {tuple(TOLERANCES)}, got {dtype}.")
  tolerance = TOLERANCES[dtype.name]
  device = _first_local_device(mesh)
  target_lib.of_device(device)  # its compute capability picks the kernels' tiles
  inputs = _problem(dtype, seq_len, head_dim, num_q_heads, num_kv_heads, segment_ids_given,
                    device)
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPUs
    reference = _outputs_and_grads("xla", causal, sliding_window, device,
                                   *(x.astype(jnp.float32) for x in inputs[:4]), inputs[4])
  try:
    got = _outputs_and_grads(backend, causal, sliding_window, device, *inputs)
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


def _outputs_and_grads(backend, causal, sliding_window, device, q, k, v, d_out, segment_ids):
  """(out, dq, dk, dv) of ``backend`` run on ``device``, fetched to the host."""
  def run(q, k, v, d_out, segment_ids):
    attend = lambda q, k, v: backends.local_attention(
        backend, q, k, v, causal=causal, segment_ids=segment_ids, scale=None,
        sliding_window=sliding_window)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(d_out))
  with jax.set_mesh(Mesh(np.array([device]), ("check",))):  # the kernels' target: the device
    return jax.device_get(jax.jit(run)(q, k, v, d_out, segment_ids))


@dataclasses.dataclass(frozen=True)
class _Case:
  """One attention a model runs: its layers' ``window`` (None: full attention), ``"auto"``'s
  ``choice`` for it (or the set backend first), and the problem its check runs:
  ``check_window`` on ``seq_len`` tokens."""
  window: int | None
  choice: backends.BackendChoice
  check_window: int | None
  seq_len: int

  @property
  def chain(self) -> tuple[str, ...]:
    return (self.choice.backend, *self.choice.fallbacks)

  @property
  def name(self) -> str:
    return "full attention" if self.window is None else f"sliding window {self.window}"

  @property
  def label(self) -> str:
    """``name`` and, for a window, the problem checked."""
    if self.window is None:
      return self.name
    stand_in = "" if self.check_window == self.window else f"with window {self.check_window} "
    return f"{self.name} (checked {stand_in}on {self.seq_len:,} tokens)"


def _case(window, shapes: dict, mesh: Mesh, attention_backend: str) -> _Case:
  """The ``_Case`` of layers with ``window``; ``shapes``: ``choose_backend``'s other inputs."""
  choice = backends.choose_backend(**shapes, mesh=mesh, sliding_window=window)
  if attention_backend != "auto":
    chain = tuple(dict.fromkeys((attention_backend, choice.backend, *choice.fallbacks, "xla")))
    chain = chain[:chain.index("xla") + 1]
    choice = backends.BackendChoice(chain[0], f"{chain[0]}: set by LlamaConfig.attention_backend "
                                    f"(auto would pick {choice.reason})", chain[1:])
  if window is None:
    return _Case(None, choice, None, CHECK_LEN)
  check_window = window if window <= WINDOW_CHECK_LEN // 2 else WINDOW_STAND_IN
  return _Case(window, choice, check_window, WINDOW_CHECK_LEN)


@dataclasses.dataclass(frozen=True)
class Settled:
  """What ``settle`` decided: the ``choice`` (for a model with full and windowed layers, both
  reasons), the ``checks`` run in order (empty when skipped), the ``backend`` the run uses
  (``"auto"``: each layer its own, ``by_case``) and ``by_case``: (case, backend) per attention
  the model runs."""
  choice: backends.BackendChoice
  checks: tuple[KernelCheck, ...]
  backend: str
  by_case: tuple[tuple[str, str], ...] = ()

  def model_config(self, model_config):
    """``model_config`` (a ``LlamaConfig``) running ``backend``."""
    return dataclasses.replace(model_config, attention_backend=self.backend)

  def record(self) -> dict:
    """The fields the first ``metrics.jsonl`` record carries."""
    record = {"attention_backend": self.backend, "attention_backend_reason": self.choice.reason}
    if len(self.by_case) > 1:
      record["attention_backends"] = "; ".join(f"{case}: {b}" for case, b in self.by_case)
    if self.checks:
      record["kernel_check"] = "; ".join(c.describe() for c in self.checks)
      record["kernel_check_max_abs_diff"] = self.checks[-1].max_abs_diff
    return record


def settle(model_config, mesh: Mesh, *, check: bool = True,
           segment_ids_given: bool = True) -> Settled:
  """The backend a model (``LlamaConfig``: causal) runs on ``mesh``: ``attention_backend``
  (``"auto"``: ``choose_backend``'s pick), checked when ``check`` and it is not ``"xla"``, and
  on failure the next of the chain that passes; for each attention the model runs (full,
  windowed: module docstring). Logs each check; the caller logs the choice
  (``Settled.choice.reason``) once the run is known to proceed."""
  c = model_config
  shapes = dict(dtype=c.dtype, head_dim=c.head_dim, num_q_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, causal=True, segment_ids_given=segment_ids_given)
  windows = tuple(dict.fromkeys(c.layer_windows()))
  cases = [_case(w, shapes, mesh, c.attention_backend) for w in windows]
  named = windows != (None,)  # a model with windowed layers: each check names its case
  lead = jax.process_index() == 0
  checks, results = [], {}

  def passes(backend: str, case: _Case) -> bool:
    """Whether ``backend`` passes ``case`` (checked once; "xla", the reference, always)."""
    if backend == "xla" or not check:
      return True
    if (backend, case) not in results:
      result = check_backend(backend, **shapes, mesh=mesh, seq_len=case.seq_len,
                             sliding_window=case.check_window)
      if jax.process_count() > 1:  # every process must run the same program
        everywhere = multihost_utils.process_allgather(np.array(result.passed))
        result = dataclasses.replace(result, passed=bool(np.all(everywhere)))
      results[backend, case] = dataclasses.replace(result, case=case.label if named else "")
      checks.append(results[backend, case])
    return results[backend, case].passed

  def first_passing(case: _Case) -> str:
    for backend, fallback in zip(case.chain, case.chain[1:]):
      if passes(backend, case):
        if lead and check:
          _log.info("attention kernel self-check: %s", results[backend, case].describe())
        return backend
      if lead:
        _log.warning("attention kernel self-check: %s; falling back to %s",
                     results[backend, case].describe(), fallback)
    return case.chain[-1]  # every chain ends with "xla"

  picks = [first_passing(case) for case in cases]
  if len(set(picks)) == 1:
    backend = picks[0]
  elif c.attention_backend == "auto" and picks == [case.choice.backend for case in cases]:
    backend = "auto"  # each layer resolves to its case's pick
  else:  # one backend for every layer: the first of the picks and chains that passes all
    candidates = dict.fromkeys([*picks, *(b for case in cases for b in case.chain)])
    backend = next(b for b in candidates
                   if all(b in case.chain and passes(b, case) for case in cases))
    if lead:
      _log.warning("attention kernel self-check: the layers run one backend, %s, the first that "
                   "passes %s (each alone: %s)", backend,
                   " and ".join(case.name for case in cases),
                   ", ".join(f"{b} for {case.name}" for b, case in zip(picks, cases)))
  choice = cases[0].choice if len(cases) == 1 else backends.BackendChoice(
      backend, "; ".join(f"{case.name} layers: {case.choice.reason}" for case in cases))
  by_case = tuple((case.name, pick if backend == "auto" else backend)
                  for case, pick in zip(cases, picks))
  return Settled(choice, tuple(checks), backend, by_case)
