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
def test_mixture_of_experts_example():
  example = README.read_text().split("### Mixtures of experts\n", 1)[1]
  counts, metric_names, aux = _run(re.search(r"```python\n(.*?)```", example, re.S)[1])[-3:]
  held, active = map(int, counts.split())
  assert active < held
  assert metric_names == ("['expert_share_max/layer_01', 'expert_share_min/layer_01', "
                          "'router_aux_loss']")
  assert float(aux) == pytest.approx(2.0, abs=0.3)  # k = 2 when balanced
