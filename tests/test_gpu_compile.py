"""Compiled for GPU clusters on a machine without a GPU (``ulysses_jax.aot``).

Marked ``gpu_compile``; they need JAX's CUDA plugin and skip without it (``make
test-gpu-compile`` builds ``.venv-gpu-compile`` and runs them). Every test compiles with XLA's
GPU compiler for compile-only H100 devices: the HLO checked is the program the GPUs would run.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax import aot, make_mesh, ulysses_attention
from ulysses_jax.aot import hlo
from ulysses_jax.kernels.flash_attention import flash_attention
from ulysses_jax.mesh import sequence_axes

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not aot.cuda_plugin_installed(),
                       reason="needs JAX's CUDA plugin: run `make test-gpu-compile` (builds "
                              ".venv-gpu-compile with the .[gpu-compile] extra)"),
]

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = 'custom_call_target="mosaic_gpu'  # mosaic_gpu or mosaic_gpu_v2, by JAX version
B, HQ, HKV, D = 1, 32, 8, 128  # Llama-3.1-8B's attention
GIB = 2**30


def _compile_attention(mesh, seq_len, grad, packed=False, sliding_window=None, sinks=False):
  """The compiled GPU program of ``ulysses_attention`` with the default backend on bfloat16
  ``[B, S, Hq | Hkv, D]`` inputs sharded over the mesh's sequence axes: the output, and with
  ``grad`` also the input cotangents of an output cotangent (a training step's use); with
  ``packed`` the rows carry segment ids (packed documents); with ``sinks`` float32 ``[Hq]``
  attention sinks (differentiated too)."""
  sharding = NamedSharding(mesh, P(None, sequence_axes(mesh), None, None))
  q = jax.ShapeDtypeStruct((B, seq_len, HQ, D), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((B, seq_len, HKV, D), jnp.bfloat16, sharding=sharding)
  ids = jax.ShapeDtypeStruct((B, seq_len), jnp.int32,
                             sharding=NamedSharding(mesh, P(None, sequence_axes(mesh))))
  sinks_arg = (jax.ShapeDtypeStruct((HQ,), jnp.float32, sharding=NamedSharding(mesh, P())),)
  given_sinks = sinks_arg if sinks else ()
  attend = lambda q, k, v, *rest: ulysses_attention(
      q, k, v, mesh=mesh, segment_ids=rest[-1] if packed else None,
      sliding_window=sliding_window, sinks=rest[0] if sinks else None)
  args = (q, kv, kv) + given_sinks + ((ids,) if packed else ())
  if not grad:
    return jax.jit(attend).lower(*args).compile()

  def forward_and_backward(d_out, q, k, v, *rest):
    differentiated = (q, k, v) + rest[:len(given_sinks)]
    out, vjp = jax.vjp(lambda *x: attend(*x, *rest[len(given_sinks):]), *differentiated)
    return out, vjp(d_out)
  return jax.jit(forward_and_backward).lower(q, *args).compile()


def test_compile_only_devices():
  devices = aot.gpu_devices("h100", "1x1x8")
  assert len(devices) == 8 and devices == aot.gpu_devices("h100", "1x1x8")
  assert {(d.platform, d.device_kind) for d in devices} == {("gpu", "NVIDIA H100 80GB HBM3")}
  two_nodes = aot.gpu_devices("h200", "2x1x8")  # a node's GPUs adjacent: seq stays in a node
  assert [d.process_index for d in two_nodes] == [0] * 8 + [1] * 8
  assert jax.default_backend() == "cpu"  # the process itself still runs on the CPU


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_ulysses_attention_on_one_node(grad):
  p, s = 8, 16384
  mesh = make_mesh(seq=p, devices=aot.gpu_devices("h100", "1x1x8"))
  text = _compile_attention(mesh, s, grad).as_text()
  # "auto" picks the Mosaic GPU kernels on Hopper: forward; + dq and dk/dv kernels
  assert text.count(MOSAIC) >= (3 if grad else 1) and TRITON not in text
  # Per device, each all-to-all's result holds 1/P of the global tensor: q and the output
  # (Hq heads), k and v (Hkv heads) forward; their cotangents again backward.
  per_pass = (2 * HQ + 2 * HKV) * B * s * D * 2 // p
  assert hlo.collective_bytes(text)["all-to-all"] == per_pass * (2 if grad else 1)


def test_default_backend_compiles_gqa_causal_packed_attention_to_mosaic_kernels_on_h100():
  """bfloat16, head dim 128, GQA, causal, packed segment ids, and the gradient: every
  attention kernel in the program is one of our Mosaic GPU (Hopper) kernels."""
  mesh = make_mesh(seq=8, devices=aot.gpu_devices("h100", "1x1x8"))
  text = _compile_attention(mesh, 8192, grad=True, packed=True).as_text()
  assert text.count(MOSAIC) >= 3, text.count(MOSAIC)  # forward, dq, dk/dv
  assert TRITON not in text and "__cudnn$" not in text


def test_windowed_attention_compiles_to_mosaic_kernels_whose_flops_the_cost_model_reads():
  """A sliding window: "auto" still picks the Mosaic kernels on Hopper, and ``aot.cost`` reads
  each one's windowed FLOPs from its name (``flash_attention_dq_causal_window1000``)."""
  from ulysses_jax.aot import cost
  from ulysses_jax.attention.reference import mean_visible_keys
  s, window = 8192, 1000
  mesh = make_mesh(seq=8, devices=aot.gpu_devices("h100", "1x1x8"))
  text = _compile_attention(mesh, s, grad=True, packed=True, sliding_window=window).as_text()
  assert text.count(MOSAIC) >= 3 and TRITON not in text
  assert "flash_attention_dkv_causal_window1000/" in text
  kernels = [op for op in cost.operations(text) if op.kind == "custom-call" and op.flops]
  # forward 4, dq 6, dk/dv 8 x B x (Hq / 8 per device) x S x (keys seen) x D
  wanted = (4 + 6 + 8) * B * (HQ // 8) * s * mean_visible_keys(s, window) * D
  assert sum(op.count * op.flops for op in kernels) == pytest.approx(wanted)


@pytest.mark.slow
@pytest.mark.parametrize("ring", [1, 2], ids=["ulysses", "hybrid"])
def test_attention_sinks_compile_to_the_same_mosaic_kernels(ring):
  """Sinks are applied outside the kernels: with them (and their gradient) "auto" still runs our
  Mosaic kernels on Hopper, as many as without, and never cuDNN (which cannot take them). On
  two nodes (the hybrid) the ring's steps, forward and backward, run them too."""
  mesh = make_mesh(seq=8, ring=ring, devices=aot.gpu_devices("h100", f"{ring}x1x8"))
  without, with_sinks = (_compile_attention(mesh, 8192 * ring, grad=True, packed=True,
                                            sinks=sinks).as_text() for sinks in (False, True))
  assert with_sinks.count(MOSAIC) == without.count(MOSAIC) >= 3, without.count(MOSAIC)
  for text in (without, with_sinks):
    assert TRITON not in text and "__cudnn$" not in text
    counts = hlo.collective_bytes(text)
    assert counts["all-to-all"] > 0 and (counts["collective-permute"] > 0) == (ring > 1)


def _forward_kernels(text):
  """How many Mosaic attention forward kernels a compiled program launches per pass."""
  return sum(MOSAIC in line and "flash_attention_forward" in line for line in text.splitlines())


@pytest.mark.parametrize("ring,sinks,window", [
    (1, True, 1000), pytest.param(2, False, None, marks=pytest.mark.slow)],
    ids=["ulysses-sinks-window", "hybrid"])
def test_rematerialised_attention_backward_runs_no_forward_kernel(ring, sinks, window):
  """Under a rematerialising policy that keeps attention's residuals
  (``remat_policy(keep_attention=True)``) the backward reruns none of the forward kernels, on
  Ulysses (with sinks and a window) and on the hybrid's ring: half the forward kernels of
  recomputing them, and still the backward's dq and dk/dv."""
  from ulysses_jax.models.llama import remat_policy
  mesh = make_mesh(seq=4, ring=ring, devices=aot.gpu_devices("h100", f"1x1x{4 * ring}"))
  sharding = NamedSharding(mesh, P(None, sequence_axes(mesh), None, None))
  q = jax.ShapeDtypeStruct((B, 4096 * ring, 8, 64), jnp.bfloat16, sharding=sharding)
  sinks_arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P()))

  def compiled(keep):
    attend = jax.checkpoint(
        lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, sliding_window=window,
                                             sinks=s if sinks else None).astype(jnp.float32),
        policy=remat_policy("full", keep_attention=keep))
    grad = jax.grad(lambda *x: jnp.sum(attend(*x) ** 2), argnums=(0, 1, 2, 3))
    return jax.jit(grad).lower(q, q, q, sinks_arg).compile().as_text()

  kept, recomputed = compiled(True), compiled(False)
  assert 0 < 2 * _forward_kernels(kept) == _forward_kernels(recomputed), (
      _forward_kernels(kept), _forward_kernels(recomputed))
  assert kept.count(MOSAIC) - _forward_kernels(kept) >= 2  # dq and dk/dv


def test_ulysses_attention_compiles_for_b200():
  """sm_100a: XLA and our Triton kernels build for it (jax 0.10.2 and 0.12.0.1)."""
  mesh = make_mesh(seq=8, devices=aot.gpu_devices("b200", "1x1x8"))
  assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA B200"}
  assert TRITON in _compile_attention(mesh, 16384, grad=False).as_text()


def test_hybrid_on_two_nodes():
  """The ring runs our Mosaic GPU kernels too (the backward's: the sinks test's hybrid case)."""
  mesh = make_mesh(seq=8, ring=2, devices=aot.gpu_devices("h100", "2x1x8"))
  text = _compile_attention(mesh, 32768, grad=False).as_text()
  assert MOSAIC in text and TRITON not in text
  counts = hlo.collective_bytes(text)
  assert counts["all-to-all"] > 0 and counts["collective-permute"] > 0  # Ulysses + ring


def test_a_process_that_started_jax_without_the_plugin_is_told_how_to_fix_it():
  script = ("import jax; jax.devices()\n"
            "from ulysses_jax import aot\n"
            "try:\n  aot.gpu_devices('h100', '1x1x8')\n"
            "except aot.AotError as e:\n  print(e)\n")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout
  assert "already started its backends" in out and "JAX_PLATFORMS=cpu" in out


def test_flash_attention_under_jit_compiles_its_kernel_for_the_inputs_gpus():
  mesh = make_mesh(seq=8, devices=aot.gpu_devices("h100", "1x1x8"))
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  lower = lambda: jax.jit(lambda q: flash_attention(q, q, q)).lower(q).compile().as_text()
  with jax.set_mesh(mesh):
    assert TRITON in lower()  # not the interpret mode of the CPU this process runs on
  if jax.__version_info__ < (0, 11):
    assert TRITON in lower()  # JAX 0.10 needs no mesh context
  else:  # JAX 0.11's Triton lowering reads the GPU from the mesh context: say so, early
    with pytest.raises(ValueError, match=r"jax\.set_mesh\(mesh\)"):
      lower()


# One test compiles this layout (50-66 s on CI's 2 cores; two tests sharing a fixture compiled
# it once per pytest worker): slow, and CI runs it on the newest JAX only (the Makefile's
# test-gpu-compile).
def _ring_layout_row():
  """Llama-3.1-8B on 4x1x8 at 256K tokens per GPU, far below an H100's capacity, compiled as is
  and under memory pressure (``aot.report.UNDER_PRESSURE``), beside the planner's figures."""
  from benchmarks import plan_vs_compiler
  return plan_vs_compiler.compare("configs/llama8b_32gpu_32m.gin", "4x1x8",
                                  ("DataConfig.seq_len=8388608",), "h100")


@pytest.mark.slow
def test_under_memory_pressure_xla_drops_buffers_to_the_footprint_the_planner_predicts():
  """XLA keeps buffers it could do without (jax 0.10.2: 20.61 GiB per GPU compiled as is) and
  drops them when told memory is short (16.65); jax 0.11.2 and 0.12.0.1 keep fewer to begin
  with (18.26, 17.28; 16.16 under pressure). The planner predicts the footprint under pressure
  within 10 % (17.53 GiB: +5.3 % on jax 0.10.2, +8.5 % on 0.11.2 and 0.12.0.1; 2026-12-08,
  ``plan_vs_compiler_grid_jax*.json``)."""
  row = _ring_layout_row()
  gap_gib = 2 if jax.__version_info__ < (0, 11) else 0.5
  assert row["under_pressure_gib"] < row["compiled_device_gib"] - gap_gib
  assert row["plan_host_gib"] == pytest.approx(row["compiled_host_gib"], rel=0.01)
  assert row["plan_device_gib"] == pytest.approx(row["under_pressure_gib"], rel=0.1)


def test_the_trainer_runs_the_step_compiled_under_memory_pressure_where_only_that_fits():
  """The tiny model at 4M tokens on 8 H100s: 24.25 GiB per device compiled as is, 22.64 under
  memory pressure (jax 0.12.0.1; 24.75 and 22.90 on jax 0.11.2). A pool between the two runs
  the second program; a larger one the jitted step; a smaller one is an error before any
  step, naming both sizes."""
  from ulysses_jax import step_builder
  from ulysses_jax.cli import gin_config
  from ulysses_jax.train import fit
  config = gin_config.read(["configs/tiny_cpu.gin"], [
      "TrainConfig.mesh_data = 1", "TrainConfig.mesh_seq = 8", "DataConfig.batch_size = 1",
      "DataConfig.seq_len = 4194304", "TrainConfig.platform = ''", "TrainConfig.cpu_devices = 0"])
  built = step_builder.build_train_step(
      config, step_builder.run_mesh(config.train, aot.gpu_devices("h100", "1x1x8")))
  args = (built.step, built.state, built.batch)
  roomy = fit.compile_to_fit(*args, pool_gib=80.0, gpu="h100", topology="1x1x8")
  assert roomy.step is built.step and not roomy.under_pressure
  pressed = fit.compile_to_fit(*args, pool_gib=roomy.device_gib - 0.5, gpu="h100",
                               topology="1x1x8")
  assert pressed.under_pressure and pressed.step is not built.step
  assert pressed.device_gib < roomy.device_gib - 1.0
  assert fit.fitted_line(pressed, 23.0) == (
      f"the train step compiled as usual needs {roomy.device_gib:.2f} GiB per device, more than "
      f"XLA's memory pool (23.00 GiB); compiled again under memory pressure "
      f"(xla_gpu_memory_limit_slop_factor=10) it needs {pressed.device_gib:.2f} GiB, which "
      "fits: training runs that program (it recomputes more: a slower step)")
  with pytest.raises(fit.ConfigError) as caught:
    fit.compile_to_fit(*args, pool_gib=pressed.device_gib - 0.5, gpu="h100", topology="1x1x8")
  assert (f"the train step needs {roomy.device_gib:.2f} GiB per device as compiled "
          f"({pressed.device_gib:.2f} compiled under memory pressure) but XLA's memory pool "
          f"holds {pressed.device_gib - 0.5:.2f} GiB per device; nothing ran. Without a GPU, "
          "ulysses-aot --gin_file=YOUR.gin --gpu=h100 --topology=1x1x8") in str(caught.value)
