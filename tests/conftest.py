"""Test setup: 8 virtual CPU devices, set before JAX is imported anywhere."""

import logging
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """GPU tests skip (never pass) unless a GPU backend is present."""
  try:
    has_gpu = bool(jax.devices("gpu"))
  except RuntimeError:
    has_gpu = False
  skip = pytest.mark.skip(
      reason="needs a CUDA GPU: on a GPU machine run with JAX_PLATFORMS=cuda,cpu")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_stale_log_handler():
  """A command line's main() run in a test adds a root handler writing to that test's
  captured stderr, closed once the test ends: it goes with the test (pytest's own handlers,
  subclasses, stay)."""
  root = logging.getLogger()
  before, level = root.handlers[:], root.level
  yield
  for handler in root.handlers[:]:
    if type(handler) is logging.StreamHandler and handler not in before:
      root.removeHandler(handler)
  root.setLevel(level)


@pytest.fixture
def fault(monkeypatch):
  """``fault(module, name, replacement)`` patches a function that jitted code calls (a fault
  hook). JAX's caches are cleared before and after: module-level jits (``ulysses_attention``'s)
  would otherwise run programs traced without the fault, or later with it."""
  jax.clear_caches()
  yield lambda module, name, replacement: monkeypatch.setattr(module, name, replacement)
  monkeypatch.undo()
  jax.clear_caches()
