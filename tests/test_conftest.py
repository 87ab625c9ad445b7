"""The quick suite's per-test time budget (conftest.py) fails a quick test over it and leaves
slow and gpu_compile tests alone."""

import pathlib

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")


def test_a_quick_test_over_the_budget_fails_and_says_what_to_do(pytester, monkeypatch):
  monkeypatch.setenv("ULYSSES_QUICK_TEST_LIMIT_S", "0.3")
  pytester.makeconftest(CONFTEST.read_text())
  pytester.makeini("[pytest]\nmarkers =\n  slow: slow\n  gpu: gpu\n  gpu_compile: gpu_compile\n")
  pytester.makepyfile(test_sample="""
import time, pytest

@pytest.fixture(scope="module")
def heavy():
  time.sleep(0.5)

def test_quick(): pass
def test_over(): time.sleep(0.5)
def test_heavy_fixture(heavy): pass
def test_after_the_fixture_is_set_up(heavy): pass
@pytest.mark.slow
def test_slow_over(): time.sleep(0.5)
@pytest.mark.gpu_compile
def test_compiled_for_gpus_over(): time.sleep(0.5)
""")
  result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
  # a quick body over the budget fails; a shared fixture over it fails its first test (at
  # set-up, an error), not the tests after it; slow and gpu_compile tests (not in `make
  # test`'s suite) may take what they need
  result.assert_outcomes(passed=4, failed=1, errors=1)
  result.stdout.fnmatch_lines_random([
      "FAILED test_sample.py::test_over - *", "ERROR test_sample.py::test_heavy_fixture - *",
      "*test_over: its call took 0.5 s, over the quick suite's 0.3 s: make it faster*",
      "*test_heavy_fixture: its setup took 0.5 s, over*"])
