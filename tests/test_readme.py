"""The README's Python examples run as written and print what their comments say."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run(example):
  result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                               "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
                          timeout=300, check=True)
  return result.stdout.strip().splitlines()


def test_attention_example():
  assert _run(EXAMPLES[0])[-1] == "(2, 1000, 12, 64)"


def test_model_example():
  shape, loss = _run(EXAMPLES[2])[-2:]
  assert shape == "(2, 32, 64)"
  assert float(loss) == pytest.approx(5.5, abs=0.2)


@pytest.mark.slow
def test_generate_example():
  """The Python example of "Generate from a long prompt": our greedy tokens are
  transformers'."""
  (example,) = [e for e in EXAMPLES if "ulysses_jax.generate" in e]
  assert _run(example)[-1] == "True"
