"""Test setup: 8 virtual CPU devices, set before JAX is imported anywhere; GPU tests skip
without a GPU; a quick test over its time budget fails; one trainer run on the retrieval task
shared by the tests of what it learned."""

import fcntl
import logging
import os
import shutil
import subprocess
import sys

from child_env import CPU_COMPILE_FLAGS, child_env

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
if os.environ["JAX_PLATFORMS"] == "cpu":
  # On the tests' small shapes compiling, not running, is most of the time: flags that make
  # XLA compile for the CPU faster (child_env.py; the CPU time of test_ring + test_train_step
  # fell by 38 % without LLVM's optimisation passes, interpret-mode kernels' ~3x).
  os.environ["XLA_FLAGS"] += " " + CPU_COMPILE_FLAGS

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


# The quick suite (`make test`, everything not marked slow) must stay within 10 minutes on CI's
# 2 cores: a quick test's body, and the set-up of its fixtures, may each take this long (as
# measured under CI's two workers; a module fixture's set-up counts once, at its first test).
# Tests marked gpu_compile are not in it (they skip without JAX's CUDA plugin): they compile
# for GPU clusters in their own stages, whose times `make ci-times` prints.
# ULYSSES_QUICK_TEST_LIMIT_S changes it (0: off), e.g. on a much slower or busier machine.
QUICK_TEST_LIMIT_S = float(os.environ.get("ULYSSES_QUICK_TEST_LIMIT_S", "30"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Fails a passing quick test whose set-up or body took over ``QUICK_TEST_LIMIT_S``."""
  report = (yield).get_result()
  if (report.passed and report.when in ("setup", "call") and QUICK_TEST_LIMIT_S
      and report.duration > QUICK_TEST_LIMIT_S and "slow" not in item.keywords
      and "gpu_compile" not in item.keywords):
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid}: its {report.when} took {report.duration:.1f} s, over the quick "
        f"suite's {QUICK_TEST_LIMIT_S:g} s: make it faster (smaller shapes, a shared "
        f"fixture) or mark it @pytest.mark.slow (CI runs those in make test-slow)")


def _without_compilation_cache():
  """Compiles with JAX's persistent compilation cache (`make test` uses one) turned off, then
  turns it back on. JAX decides once per process whether to use the cache: resetting it is the
  only way back."""
  from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel
  directory = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", directory)
  compilation_cache.reset_cache()


@pytest.fixture
def uncached_compiles():
  """For a test that reads what XLA says while compiling (warnings, compile events): its
  programs are compiled, never read from the persistent compilation cache, so that what it
  checks happens."""
  yield from _without_compilation_cache()


@pytest.fixture(autouse=True)
def _compile_only_gpu_programs_uncached(request):
  """A `gpu_compile` test's programs stay out of the persistent cache: JAX writes them but
  cannot load them back without a GPU client ("PjRtCompiler must be constructed with a Client
  to call DeserializeLoadedExecutable"), so caching them only costs time and a warning."""
  if request.node.get_closest_marker("gpu_compile") is None:
    yield
  else:
    yield from _without_compilation_cache()


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
def fresh_gpu_interpreter():
  """GPU interpret mode keeps global state between kernels; on jax 0.12 a kernel run on two
  devices (in shard_map) after one on a single device fails its barrier bookkeeping unless the
  state is cleared in between: cleared before and after the test. (tests/test_hopper_races.py
  clears it after its tests only: there, clearing it before made 1 to 3 of 16 race checks
  fail on jax 0.12.0.1, 2026-11-28.)"""
  from ulysses_jax.kernels import hopper_interpret  # pylint: disable=import-outside-toplevel
  hopper_interpret.reset_state()
  yield
  hopper_interpret.reset_state()


@pytest.fixture
def fault(monkeypatch):
  """``fault(module, name, replacement)`` patches a function that jitted code calls (a fault
  hook). JAX's caches are cleared before and after: module-level jits (``ulysses_attention``'s)
  would otherwise run programs traced without the fault, or later with it."""
  jax.clear_caches()
  yield lambda module, name, replacement: monkeypatch.setattr(module, name, replacement)
  monkeypatch.undo()
  jax.clear_caches()


pytest_plugins = ["pytester"]  # tests/test_conftest.py runs this file's hooks on sample tests


# The retrieval run: configs/retrieval_cpu.gin learns the task (eval accuracy about 0.5 against
# a chance of 1/16) within 40 steps at this warmup; 80 leave a margin.
RETRIEVAL_RUN = ["STEPS = 80", "OptimizerConfig.warmup_steps = 20", "TrainConfig.eval_every = 0"]


@pytest.fixture(scope="session")
def retrieval_run(tmp_path_factory):
  """``(workdir, stdout)`` of one trainer run (``python -m ulysses_jax.train``) of
  configs/retrieval_cpu.gin with ``RETRIEVAL_RUN``: evaluated after its last step, one
  checkpoint. The tests of what a model trained on retrieval learned share it; under xdist the
  first worker to ask trains it and the others wait for it."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # this session's, shared by its workers
  workdir, log = root / "retrieval_run", root / "retrieval_run.stdout"
  with open(root / "retrieval_run.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not log.exists():
      shutil.rmtree(workdir, ignore_errors=True)  # a failed attempt's: start afresh
      out = subprocess.run(
          [sys.executable, "-m", "ulysses_jax.train", "--gin_file=configs/retrieval_cpu.gin",
           f"--workdir={workdir}"] + [f"--gin_param={p}" for p in RETRIEVAL_RUN],
          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=child_env(),
          capture_output=True, text=True, timeout=600)
      if out.returncode:
        raise AssertionError(f"trainer failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
      log.write_text(out.stdout)
  return str(workdir), log.read_text()
