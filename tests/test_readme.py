"""The README's Python examples run as written and print what their comments say."""

import pathlib
import re
import subprocess
import sys

import pytest

from child_env import user_env

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run(example):
  result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                          env=user_env(),
                          timeout=300, check=True)
  return result.stdout.strip().splitlines()


def test_attention_example():
  assert _run(EXAMPLES[0])[-1] == "(2, 1000, 12, 64)"


def test_model_example():
  shape, loss = _run(EXAMPLES[2])[-2:]
  assert shape == "(2, 32, 64)"
  assert float(loss) == pytest.approx(5.5, abs=0.2)
