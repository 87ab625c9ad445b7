"""Compiled for GPU clusters on a machine without a GPU (``ulysses_jax.aot``).

Marked ``gpu_compile``; they need JAX's CUDA plugin and skip without it (``make
test-gpu-compile`` builds ``.venv-gpu-compile`` and runs them). Every test compiles with XLA's
GPU compiler for compile-only H100 devices: the HLO checked is the program the GPUs would run.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax import aot, hlo, make_mesh, ulysses_attention
from ulysses_jax.mesh import sequence_axes

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not aot.cuda_plugin_installed(),
                       reason="needs JAX's CUDA plugin: run `make test-gpu-compile` (builds "
                              ".venv-gpu-compile with the .[gpu-compile] extra)"),
]

TRITON = "__gpu$xla.gpu.triton"
B, HQ, HKV, D = 1, 32, 8, 128  # Llama-3.1-8B's attention


def _compile_attention(mesh, seq_len, grad):
  """The compiled GPU program of ``ulysses_attention`` with the default backend on bfloat16
  ``[B, S, Hq | Hkv, D]`` inputs sharded over the mesh's sequence axes: the output, and with
  ``grad`` also the input cotangents of an output cotangent (a training step's use)."""
  sharding = NamedSharding(mesh, P(None, sequence_axes(mesh), None, None))
  q = jax.ShapeDtypeStruct((B, seq_len, HQ, D), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((B, seq_len, HKV, D), jnp.bfloat16, sharding=sharding)
  attend = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh)
  if not grad:
    return jax.jit(attend).lower(q, kv, kv).compile()

  def forward_and_backward(q, k, v, d_out):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(d_out)
  return jax.jit(forward_and_backward).lower(q, kv, kv, q).compile()


def test_compile_only_devices():
  devices = aot.gpu_devices("h100", "1x1x8")
  assert len(devices) == 8 and devices == aot.gpu_devices("h100", "1x1x8")
  assert {(d.platform, d.device_kind) for d in devices} == {("gpu", "NVIDIA H100 80GB HBM3")}
  assert len(aot.gpu_devices("h200", "2x1x8")) == 16
  assert jax.default_backend() == "cpu"  # the process itself still runs on the CPU


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_ulysses_attention_on_one_node(grad):
  p, s = 8, 16384
  mesh = make_mesh(seq=p, devices=aot.gpu_devices("h100", "1x1x8"))
  text = _compile_attention(mesh, s, grad).as_text()
  assert text.count(TRITON) >= (3 if grad else 1)  # forward; + dq and dk/dv kernels
  # Per device, each all-to-all's result holds 1/P of the global tensor: q and the output
  # (Hq heads), k and v (Hkv heads) forward; their cotangents again backward.
  per_pass = (2 * HQ + 2 * HKV) * B * s * D * 2 // p
  assert hlo.collective_bytes(text)["all-to-all"] == per_pass * (2 if grad else 1)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_hybrid_on_two_nodes(grad):
  mesh = make_mesh(seq=8, ring=2, devices=aot.gpu_devices("h100", "2x1x8"))
  text = _compile_attention(mesh, 32768, grad).as_text()
  assert TRITON in text
  counts = hlo.collective_bytes(text)
  assert counts["all-to-all"] > 0 and counts["collective-permute"] > 0  # Ulysses + ring
