"""Pallas' GPU interpret mode for the Hopper kernels: its parameters, what of the hardware path
the installed JAX's interpreter executes, and its race detector.

GPU interpret mode simulates on the CPU the warpgroups, shared memory, mbarriers and TMA copies
of a Mosaic GPU kernel. Of our kernels it executes the TMA windows, the ring's barrier protocol,
the proxy fences, masks, softmax and stores, plus each register-level form of the hardware path
that the installed JAX's interpreter runs correctly (``wgmma_forms.interpreter_runs``, probed
once per process: on jax 0.12 the wgmma of ``a_times_bt`` and ``at_times_b`` and the
``layout_cast``s; on jax 0.10 none). A form it cannot run is replaced in interpret mode by a
plain dot (or, for a layout cast, nothing) over the same shared-memory tiles and is only lowered
(``tests/test_flash_attention.py::test_mosaic_kernels_lower_for_hopper``); today that is the
register-A wgmma of ``plus_a_times_b`` everywhere.

The race detector (``detect_races=True``) is a happens-before checker of every shared-memory
access against the barriers, and from jax 0.12 on it tells the generic proxy (loads and stores
of threads) from the async proxy (TMA) apart, as the hardware's memory model does. It does not
check wgmma's operand reads.
"""

import concurrent.futures
import importlib.util
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_INTERPRET = "jax._src.pallas.mosaic_gpu.interpret"


def params(**options):
  """GPU interpret mode's parameters with ``options`` (e.g. ``detect_races=True``)."""
  # JAX 0.11 exports the class; 0.10 does not yet.
  params_class = getattr(plgpu, "InterpretGPUParams", None)
  if params_class is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params_class
  return params_class(**options)


def has_proxy_aware_race_detector():
  """Whether the installed JAX's GPU interpreter has a race detector of its own that models the
  generic and async proxies (jax 0.12 on; 0.10's reports no race in a ring without the fence)."""
  return importlib.util.find_spec(f"{_INTERPRET}.race_detection_state") is not None


def reset_state():
  """Clears the interpreter's global state; needed after a kernel raised in interpret mode."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # not exported (jax 0.10-0.12)
  gpu_callbacks.reset_gpu_interpret_mode_state()


def runs_correctly(compute, expected, tile_of):
  """Whether GPU interpret mode runs ``compute(a_smem, b_smem) -> [64, 64] float32`` on two
  64 x 64 bfloat16 tiles (allocated by ``tile_of(shape, dtype)``) and gets
  ``expected(a, b)``. A form the interpreter cannot run fails in lowering or in a callback."""
  a_MK, b_NK = (((np.arange(64 * 64).reshape(64, 64) * p) % 13 - 6).astype(jnp.bfloat16)
                for p in (3, 5))

  def kernel(a_gmem, b_gmem, out_gmem):
    def body(a_smem, b_smem, out_smem, landed):
      plgpu.copy_gmem_to_smem(a_gmem, a_smem, landed.at[0])
      plgpu.copy_gmem_to_smem(b_gmem, b_smem, landed.at[1])
      plgpu.barrier_wait(landed.at[0])
      plgpu.barrier_wait(landed.at[1])
      out_smem[...] = compute(a_smem, b_smem)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem)
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(body, tile_of((64, 64), jnp.bfloat16), tile_of((64, 64), jnp.bfloat16),
                  plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_barriers=2))

  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                      interpret=params())
  # A thread of its own runs the probe outside the trace of the kernel that asks (JAX's trace
  # state is per thread); a form that fails in a callback is not logged as an error.
  callback_log = logging.getLogger("jax._src.callback")
  was_disabled, callback_log.disabled = callback_log.disabled, True
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      out = pool.submit(lambda: np.asarray(jax.jit(call)(a_MK, b_NK))).result()
  except Exception:  # noqa: BLE001 - lowering and callback errors differ by JAX version
    reset_state()
    return False
  finally:
    callback_log.disabled = was_disabled
  want = expected(np.asarray(a_MK, np.float32), np.asarray(b_NK, np.float32))
  return bool(np.array_equal(out, want))

