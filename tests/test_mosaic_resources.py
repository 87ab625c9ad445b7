"""The Mosaic kernels' registers, from ptxas's report without a GPU
(``benchmarks.mosaic_resources``: JAX's CUDA plugin compiles each kernel when XLA compiles the
program for compile-only H100s). Marked ``gpu_compile``: CI runs them on the newest JAX and on
the GPU machines' 0.11.2."""

import pytest

from benchmarks import mosaic_resources
from ulysses_jax import aot
from ulysses_jax.kernels import mosaic_tiles

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not aot.cuda_plugin_installed(),
                       reason="needs JAX's CUDA plugin: run `make test-gpu-compile`"),
]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_tables_mosaic_kernels_keep_everything_in_registers_on_packed_causal_rows(head_dim):
  """Causal with segment ids (the trainer's packed rows) holds the most a thread: every block's
  mask. A value ptxas spills goes to local memory and back in the inner loop."""
  tiles = mosaic_resources.table_tiles(head_dim, causal=True)
  reports = mosaic_resources.compile_reports(head_dim, tiles, causal=True, segments=True)
  assert set(reports) == {mosaic_resources.gpu_kernel_name(kernel, tile, True)
                          for kernel, tile in zip(mosaic_tiles.KERNELS, tiles)}
  for name, text in reports.items():
    found = mosaic_resources.parse_report(text)
    assert found["spill_stores"] == found["spill_loads"] == 0, (name, found)
    assert 0 < found["registers"] <= 255, (name, found)
