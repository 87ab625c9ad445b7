"""Platform decisions read from the mesh's devices, and ``ulysses_jax.aot``'s input checks.

These run everywhere (no CUDA plugin needed); the GPU compiles themselves are in
``test_gpu_compile.py``. A GPU target is simulated with an abstract mesh whose abstract device
is a GPU, which is what the body of a ``shard_map`` over compile-only GPU devices sees.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from ulysses_jax import aot, make_mesh
from ulysses_jax.attention.backends import resolve_backend
from ulysses_jax.kernels import flash_attention as fa
from ulysses_jax.kernels import target as target_lib

H100 = "NVIDIA H100 80GB HBM3"


def _gpu_context(kind=H100):
  """What the body of a shard_map over GPU devices of ``kind`` sees."""
  device = AbstractDevice(device_kind=kind, num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      AbstractMesh((1, 8), ("data", "seq"), abstract_device=device))


def _resolve(backend, **kwargs):
  return resolve_backend(backend, dtype=jnp.bfloat16, head_dim=128, segment_ids_given=False,
                         **kwargs)


def test_auto_backend_follows_the_mesh_not_the_process():
  cpu_mesh = make_mesh(seq=8, devices=jax.devices()[:8])
  assert _resolve("auto", mesh=cpu_mesh) == "xla"
  assert _resolve("auto") == "xla"  # no mesh, no context: JAX's first device (a CPU here)
  with _gpu_context():
    assert _resolve("auto") == "pallas"
    assert _resolve("cudnn") == "cudnn"
    assert _resolve("auto", mesh=cpu_mesh) == "xla"  # an explicit mesh wins


def test_cudnn_and_mosaic_checks_name_the_mesh_devices(monkeypatch):
  with pytest.raises(ValueError, match=r"mesh's devices are 'cpu'"):
    _resolve("cudnn", mesh=make_mesh(seq=2, devices=jax.devices()[:2]))
  monkeypatch.setitem(target_lib._CAPABILITIES, "NVIDIA A100-SXM4-80GB", 8.0)
  with _gpu_context("NVIDIA A100-SXM4-80GB"), pytest.raises(ValueError, match="Hopper"):
    _resolve("pallas_mosaic")
  monkeypatch.delitem(target_lib._CAPABILITIES, H100, raising=False)
  with _gpu_context():  # capability unknown: allowed, as on a GPU never seen
    assert _resolve("pallas_mosaic") == "pallas_mosaic"


def test_kernel_interpret_mode_and_tiles_follow_the_target(monkeypatch):
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  spec = fa._plan_for(q, True, None, None, None, None, "triton", "triton")
  assert spec.interpret and spec.forward.num_warps == 8 and spec.forward.block_kv == 64
  monkeypatch.setitem(target_lib._CAPABILITIES, H100, 9.0)
  with _gpu_context():
    spec = fa._plan_for(q, True, None, None, None, None, "triton", "triton")
  assert not spec.interpret
  assert spec == fa.choose_tiles(256, 128, causal=True, scale=128 ** -0.5, generation="sm90")


def test_target_generation():
  assert target_lib.Target("gpu", H100, 9.0).generation == "sm90"
  assert target_lib.Target("gpu", "NVIDIA A100-SXM4-80GB", 8.0).generation == "other"
  assert target_lib.Target("gpu", "unknown", None).generation == "other"
  assert target_lib.Target("cpu", "cpu", None).generation == "other"
  assert target_lib.of_device(jax.devices()[0]).platform == "cpu"


@pytest.mark.parametrize("gpu,kind,capability", [
    ("h100", H100, "major: 9"), ("h200", "NVIDIA H200 141GB HBM3e", "major: 9"),
    ("a100", "NVIDIA A100-SXM4-80GB", "major: 8")])
def test_target_descriptions(gpu, kind, capability):
  text = aot.targets.target_config(aot.GPUS[gpu])
  assert f'name: "{kind}"' in text and capability in text
  assert "collective_memory_granularity" not in text  # jaxlib 0.10.2 rejects it


def test_bad_gpu_and_topology_are_refused_before_any_work():
  with pytest.raises(aot.AotError, match=r"unknown GPU 'v100': expected one of \['a100', "):
    aot.gpu_devices("v100", "1x1x8")
  for bad in ("8", "1x8", "1x1x0", "axbxc", "1x1x8x2"):
    with pytest.raises(aot.AotError, match="malformed topology"):
      aot.gpu_devices("h100", bad)
  assert aot.parse_topology("4x1x8") == (4, 1, 8)


def test_missing_plugin_names_the_fix(monkeypatch):
  monkeypatch.setattr(aot.devices, "_PLUGINS", ("jax_plugins.no_such_plugin",))
  aot.devices._devices.cache_clear()
  with pytest.raises(aot.AotError, match=r"\.\[gpu-compile\].*make gpu-compile-venv"):
    aot.gpu_devices("h100", "1x1x8")
