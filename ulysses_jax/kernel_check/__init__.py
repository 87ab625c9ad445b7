"""The attention's self-check at first contact, and the fall back down the chain.

Before a run's first step (the trainer, ``python -m ulysses_jax.evaluate``), ``settle`` asks
``attention.backends.choose_backend`` which backend runs each kind of attention the model's
layers take (``cases.attention_kinds``: full, each sliding window) on the run's mesh, for the
run's sequence length, then checks it the way the mesh runs it (``compare``): forward and
backward with the run's dtype, head dim, head counts, causal mask, window and packed segments,
on every device of the mesh, against the XLA chunked attention in float32 without the mesh.
On a mesh with a ``ring`` axis that is the ring (or the Ulysses x ring hybrid) on a few kernel
blocks per ring device: the kernels inside the ring steps, the merge of their partial outputs
by log-sum-exp, dK/dV sent home and the zigzag exchanges. A windowed ring is decided with the
run's S/R: the kernels where W <= S/R, so the check runs them there (``cases``).

A backend that raises, returns non-finite values or whose error passes the dtype's tolerance is
reported in one log line (the case, the backend, its error or largest difference, the
fallback) and the next backend of the chain is checked instead (e.g. the Mosaic ring, the Triton
ring, then XLA's); the run goes on with the first that passes. Without a ring, ``"xla"`` is the
reference itself and passes unchecked. On a ring the XLA ring is checked too (the ring around
the local attention is ours), and if it fails as well no backend can run that ring:
``KernelCheckError``. ``TrainConfig.kernel_check=False`` skips every check (the choice is still
logged). Each check's wall time is in its line, the total in ``Settled.seconds``.

A model with several kinds of layers runs one ``attention_backend``: the backend of each case
when they agree; ``"auto"`` (each layer picks, as ``choose_backend``) when every case passed
with ``"auto"``'s own pick; else the first backend that passes every case (``"xla"`` at worst).
Log lines and the ``metrics.jsonl`` record name the case of each check.

Tolerances (``TOLERANCES``) bound the error (``compare``: the largest ``|difference| / max(1,
|reference|)`` of any element of the output, dq, dk or dv, whose values are of order 1 to 10
here: unit normal q, k, v and output cotangent, scale ``D ** -0.5``): 1e-2 for float32 inputs
(room for TF32 matmuls on GPUs), 6e-2 for bfloat16 and 1e-2 for float16 (a few units in the
last place). Our Triton kernels in interpret mode on CPU (head dim 64, GQA 4/2, causal, S = 256,
one device) have errors of 9.9e-3 (bfloat16), 1.0e-3 (float16) and 2.0e-6 (float32); the XLA
ring in bfloat16 on 8 ring devices of 512 tokens (32/8 heads, head dim 128) 2.0e-2
(``python -m benchmarks.kernel_check_errors``). A wrong
mask, scale, block or merge gives errors of order 1.
"""

import dataclasses
import logging
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ulysses_jax.attention import backends
from ulysses_jax.kernel_check import compare
from ulysses_jax.kernel_check.cases import (RING_CHECK_LEN, WINDOW_CHECK_LEN,  # noqa: F401
                                            WINDOW_STAND_IN, AttentionKind, Case,
                                            attention_kinds, make_case)
from ulysses_jax.kernel_check.compare import (CHECK_LEN, TOLERANCES, KernelCheck,  # noqa: F401
                                              Problem, check_backend)
from ulysses_jax.mesh import ring_size

_log = logging.getLogger("ulysses_jax.kernel_check")


class KernelCheckError(Exception):
  """Every backend of a case failed its check, the XLA ring included: the run cannot go on."""


@dataclasses.dataclass(frozen=True)
class Settled:
  """What ``settle`` decided: the ``choice`` (for a model with several kinds of layers, every
  reason), the ``checks`` run in order (empty when skipped), the ``backend`` the run uses
  (``"auto"``: each layer its own, ``by_case``), ``by_case``: (case, backend) per attention
  the model runs, and ``seconds``: the checks' wall time, the references' included."""
  choice: backends.BackendChoice
  checks: tuple[KernelCheck, ...]
  backend: str
  by_case: tuple[tuple[str, str], ...] = ()
  seconds: float = 0.0

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
      record["kernel_check_max_error"] = self.checks[-1].max_error
      record["kernel_check_seconds"] = round(self.seconds, 2)
    return record


def settle(model_config, mesh: Mesh, *, seq_len: int, check: bool = True,
           segment_ids_given: bool = True) -> Settled:
  """The backend a model (``LlamaConfig``: causal) runs on ``mesh`` with ``seq_len`` tokens:
  ``attention_backend`` (``"auto"``: ``choose_backend``'s pick), checked when ``check``, and on
  failure the next of the chain that passes; for each attention the model runs (module
  docstring). Logs each check; the caller logs the choice (``Settled.choice.reason``) once the
  run is known to proceed. Raises ``ValueError`` for a set backend the mesh cannot run, and
  ``KernelCheckError`` when no backend passes a case."""
  c = model_config
  shapes = dict(dtype=c.dtype, head_dim=c.head_dim, num_q_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, causal=True, segment_ids_given=segment_ids_given,
                sinks_given=c.attention_sinks)
  cases = [make_case(kind, shapes, mesh, c.attention_backend, seq_len)
           for kind in attention_kinds(c)]
  named = len(cases) > 1 or cases[0].kind.window is not None or ring_size(mesh) > 1
  lead = jax.process_index() == 0
  checks, results, prepared = [], {}, {}
  start = time.perf_counter()

  def passes(backend: str, case: Case) -> bool:
    """Whether ``backend`` passes ``case`` (checked once; XLA without a ring, the reference,
    always)."""
    if not check or (backend == "xla" and not case.problem.on_ring):
      return True
    if (backend, case) not in results:
      if case.problem not in prepared:
        prepared[case.problem] = compare.prepare(case.problem)
      result = compare.check(backend, case.problem, prepared[case.problem])
      if jax.process_count() > 1:  # every process must run the same program
        everywhere = multihost_utils.process_allgather(np.array(result.passed))
        result = dataclasses.replace(result, passed=bool(np.all(everywhere)))
      results[backend, case] = dataclasses.replace(result, case=case.label if named else "")
      checks.append(results[backend, case])
    return results[backend, case].passed

  def first_passing(case: Case) -> str:
    for backend, fallback in zip(case.chain, (*case.chain[1:], None)):
      if passes(backend, case):
        if lead and (backend, case) in results:
          _log.info("attention kernel self-check: %s", results[backend, case].describe())
        return backend
      if lead and fallback:
        _log.warning("attention kernel self-check: %s; falling back to %s",
                     results[backend, case].describe(), fallback)
    raise KernelCheckError(_no_backend_passes(case, [results[b, case] for b in case.chain]))

  picks = [first_passing(case) for case in cases]
  if len(set(picks)) == 1:
    backend = picks[0]
  elif c.attention_backend == "auto" and picks == [case.choice.backend for case in cases]:
    backend = "auto"  # each layer resolves to its case's pick
  else:  # one backend for every layer: the first of the picks and chains that passes all
    candidates = dict.fromkeys([*picks, *(b for case in cases for b in case.chain)])
    backend = next((b for b in candidates
                    if all(b in case.chain and passes(b, case) for case in cases)), None)
    if backend is None:
      raise KernelCheckError(f"no attention backend passes the self-check of every kind of "
                             f"layer ({', '.join(case.name for case in cases)}): "
                             + "; ".join(r.describe() for r in checks))
    if lead:
      _log.warning("attention kernel self-check: the layers run one backend, %s, the first that "
                   "passes %s (each alone: %s)", backend,
                   " and ".join(case.name for case in cases),
                   ", ".join(f"{b} for {case.name}" for b, case in zip(picks, cases)))
  choice = cases[0].choice if len(cases) == 1 else backends.BackendChoice(
      backend, "; ".join(f"{case.name} layers: {case.choice.reason}" for case in cases))
  by_case = tuple((case.name, pick if backend == "auto" else backend)
                  for case, pick in zip(cases, picks))
  seconds = time.perf_counter() - start
  if lead and checks:
    _log.info("attention kernel self-check: %d check%s in %.1f s, references included",
              len(checks), "" if len(checks) == 1 else "s", seconds)
  return Settled(choice, tuple(checks), backend, by_case, seconds)


def _no_backend_passes(case: Case, failed: list[KernelCheck]) -> str:
  """The error of a ring ``case`` whose every backend ``failed`` (without a ring XLA passes)."""
  return (f"ring attention on this mesh ({dict(case.problem.mesh.shape)}) fails the self-check "
          f"with every backend it can run, {', '.join(case.chain)}: "
          + "; ".join(r.describe() for r in failed)
          + ". With XLA failing too the fault is in what they share (the ring's exchanges, "
          "its merge, the devices' links), not in a kernel: run `python -m ulysses_jax.doctor "
          f"--mesh_seq {case.problem.mesh.shape['seq']} --mesh_ring "
          f"{ring_size(case.problem.mesh)}` to see it alone, or train on a mesh without a "
          "ring axis (TrainConfig.mesh_ring=1)")
