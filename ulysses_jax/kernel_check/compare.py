"""One backend's check: a small problem run the way the run's mesh runs attention, compared with
the XLA reference.

A ``Problem`` is what a check runs: ``[B, S]`` tokens (B the mesh's ``data`` size, one row per
data shard) of unit-normal q, k, v and output cotangent in the run's dtype, its head dim and
head counts, mask, window, (``sinks_given``) attention sinks and (``segment_ids_given``) three
packed documents of uneven length that cross the shards' boundaries. ``check`` runs
``ulysses_attention`` with the backend on the problem's ``mesh``, forward and backward, on every
device of it. On a mesh without a ``ring`` axis that is the all-to-all around the local
attention, which runs the kernel over the whole sequence for the device's heads. With a ``ring``
axis it is the ring or the hybrid: the kernels inside the ring steps, the partial outputs merged
by float32 log-sum-exps, dK/dV sent home and the zigzag exchanges.

The reference (``prepare``) is the XLA chunked attention (the ``"xla"`` backend) on the same
inputs in float32 at the highest matmul precision, over the whole sequence on every device: no
all-to-all and no ring, so a fault in those is not in the reference. It is computed once per
problem and reused for each backend. The comparison runs on the devices too and brings back one
number, so a check reads the same on every process of a multi-process run: the error, the
largest ``|got - reference| / max(1, |reference|)`` of any element of the output, dq, dk, dv or
d(sinks) (infinite if any is not finite). It is the absolute difference for values up to 1 and
the relative one above: rounding grows with the value, and a ring's dK/dV, summed over its steps
in the inputs' dtype, reach ~10 here. Measured on CPU (``python -m
benchmarks.kernel_check_errors``: the XLA ring, bfloat16, 32 query / 8 KV heads, head dim 128, 8
ring devices of 512 tokens): dv differs by up to 0.087, over the bfloat16 tolerance, while its
error is 0.020 (dk 0.020, out 0.005, dq 0.009).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ulysses_jax.attention import backends
from ulysses_jax.attention.hybrid import ulysses_attention
from ulysses_jax.kernels import target as target_lib
from ulysses_jax.mesh import DATA, make_mesh, ring_size

TOLERANCES = {"float32": 1e-2, "bfloat16": 6e-2, "float16": 1e-2}
CHECK_LEN = 256  # tokens of a check of full attention without a ring


@dataclasses.dataclass(frozen=True)
class KernelCheck:
  """One backend's check: ``passed``; ``max_error``, the error against the reference (module
  docstring; None when the backend raised) against ``tolerance``; ``error``: what it raised
  (type and first line), else None; ``case``: which of the model's attentions it checked (""
  when the model has one); ``seconds``: its wall time (trace, compile, run)."""
  backend: str
  passed: bool
  max_error: float | None
  tolerance: float
  error: str | None = None
  case: str = ""
  seconds: float = 0.0

  def describe(self) -> str:
    case = f"{self.case}: " if self.case else ""
    if self.error:
      return f"{case}{self.backend} failed: {self.error}"
    verdict = "passed" if self.passed else "FAILED"
    return (f"{case}{self.backend} {verdict}: error {self.max_error:.2e} against the XLA "
            f"reference (largest |difference| / max(1, |reference|); tolerance "
            f"{self.tolerance:.0e}; {self.seconds:.1f} s)")


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a check runs (module docstring): ``seq_len`` tokens with ``window`` (None: full
  attention) on ``mesh`` (``make_mesh``'s axes)."""
  dtype: str
  head_dim: int
  num_q_heads: int
  num_kv_heads: int
  causal: bool
  segment_ids_given: bool
  mesh: Mesh
  seq_len: int = CHECK_LEN
  window: int | None = None
  sinks_given: bool = False

  def __post_init__(self):
    name = jnp.dtype(self.dtype).name
    if name not in TOLERANCES:
      raise ValueError(f"kernel_check: dtype must be one of {tuple(TOLERANCES)}, got {name}.")
    object.__setattr__(self, "dtype", name)

  @property
  def on_ring(self) -> bool:
    """Whether the attention runs as ring attention (the mesh has a ``ring`` axis > 1)."""
    return ring_size(self.mesh) > 1

  @property
  def tolerance(self) -> float:
    return TOLERANCES[self.dtype]

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def inputs(self):
    """(q, k, v, output cotangent, segment ids or None, sinks or None), replicated on the
    mesh. Sinks (``[Hq]`` float32) are large, of both signs: a sink misapplied shows."""
    return self._make_inputs()()

  def input_specs(self):
    """``inputs``' shapes, dtypes and shardings (to compile for devices that cannot run)."""
    return jax.eval_shape(self._make_inputs())

  def _make_inputs(self):
    def make():
      b, s = self.mesh.shape[DATA], self.seq_len
      keys = jax.random.split(jax.random.PRNGKey(0), 5)
      q_shape = (b, s, self.num_q_heads, self.head_dim)
      kv_shape = (b, s, self.num_kv_heads, self.head_dim)
      arrays = [jax.random.normal(key, shape, jnp.float32).astype(self.dtype)
                for key, shape in zip(keys, (q_shape, kv_shape, kv_shape, q_shape))]
      sinks = (jax.random.uniform(keys[4], (self.num_q_heads,), jnp.float32, -4.0, 4.0)
               if self.sinks_given else None)
      if not self.segment_ids_given:
        return (*arrays, None, sinks)
      # documents of S/5, S/2 - S/5 and S - S/2 tokens
      ids = jnp.searchsorted(jnp.array([s // 5, s // 2]), jnp.arange(s), side="right")
      return (*arrays, jnp.broadcast_to(ids.astype(jnp.int32), (b, s)), sinks)
    return jax.jit(make, out_shardings=self.replicated())


def reference_program(problem: Problem):
  """The jitted reference: (q, k, v, d_out, segment ids, sinks) -> (out, dq, dk, dv[, d_sinks])
  in float32, replicated. Trace it under ``jax.default_matmul_precision("highest")``
  (``prepare``)."""
  def reference(q, k, v, d_out, segment_ids, sinks):
    attend = lambda q, k, v, *sinks: backends.local_attention(
        "xla", q, k, v, causal=problem.causal, segment_ids=segment_ids, scale=None,
        sliding_window=problem.window, sinks=sinks[0] if sinks else None)
    f32 = lambda x: x.astype(jnp.float32)
    out, vjp = jax.vjp(attend, f32(q), f32(k), f32(v), *_given(sinks))
    return (out, *vjp(f32(d_out)))
  return jax.jit(reference, out_shardings=problem.replicated())


def error_program(backend: str, problem: Problem):
  """The jitted check of ``backend``: (q, k, v, d_out, segment ids, sinks, the reference's
  outputs) -> the error (module docstring), a replicated scalar."""
  def max_error(q, k, v, d_out, segment_ids, sinks, expected):
    attend = lambda q, k, v, *sinks: ulysses_attention(
        q, k, v, mesh=problem.mesh, causal=problem.causal, segment_ids=segment_ids,
        backend=backend, sliding_window=problem.window, sinks=sinks[0] if sinks else None)
    out, vjp = jax.vjp(attend, q, k, v, *_given(sinks))
    errors = [jnp.abs(got.astype(jnp.float32) - want) / jnp.maximum(1.0, jnp.abs(want))
              for got, want in zip((out, *vjp(d_out)), expected)]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(e)) for e in errors]))
    return jnp.where(finite, jnp.max(jnp.stack([e.max() for e in errors])), jnp.inf)
  return jax.jit(max_error, out_shardings=problem.replicated())


def _given(sinks) -> tuple:
  """``(sinks,)``, or ``()`` for a model without sinks: what ``jax.vjp`` differentiates."""
  return () if sinks is None else (sinks,)


def prepare(problem: Problem):
  """The problem's inputs and the reference's (out, dq, dk, dv), float32, replicated."""
  inputs = problem.inputs()
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference on GPUs
    return inputs, reference_program(problem)(*inputs)


def check(backend: str, problem: Problem, prepared=None) -> KernelCheck:
  """Runs ``backend`` on ``problem`` (module docstring) against the reference (``prepared``:
  ``prepare(problem)``'s answer, computed here if None)."""
  # A local device's compute capability picks the kernels' tiles.
  target_lib.of_device(next(d for d in problem.mesh.devices.flat
                            if d.process_index == jax.process_index()))
  inputs, expected = prepared or prepare(problem)
  start = time.perf_counter()
  try:
    error = error_program(backend, problem)(*inputs, expected)
    error = float(error.addressable_data(0))  # the same on every device and process
  except Exception as e:  # pylint: disable=broad-except  # any failure to lower, compile or run
    first_line = (str(e).strip().splitlines() or [""])[0][:300]
    return KernelCheck(backend, False, None, problem.tolerance,
                       f"{type(e).__name__}: {first_line}",
                       seconds=time.perf_counter() - start)
  return KernelCheck(backend, error <= problem.tolerance, error, problem.tolerance,
                     seconds=time.perf_counter() - start)


def check_backend(backend: str, *, dtype, head_dim: int, num_q_heads: int, num_kv_heads: int,
                  causal: bool, segment_ids_given: bool, mesh: Mesh | None = None,
                  seq_len: int = CHECK_LEN, sliding_window: int | None = None,
                  sinks_given: bool = False) -> KernelCheck:
  """``check`` of ``backend`` on a ``[B, seq_len]`` problem of these shapes on ``mesh``
  (default: JAX's first device alone, where the attention is the local kernel's)."""
  mesh = mesh or make_mesh(data=1, seq=1, devices=jax.devices()[:1])
  return check(backend, Problem(dtype, head_dim, num_q_heads, num_kv_heads, causal,
                                segment_ids_given, mesh, seq_len, sliding_window, sinks_given))
