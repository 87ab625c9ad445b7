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


def test_chat_example_trains_the_assistant_answers(tmp_path):
  """"Your data": the conversations and template it writes, inspected as it shows."""
  pytest.importorskip("jinja2")  # the data extra's; the newest-JAX environment goes without
  example = next(e for e in EXAMPLES if "chatml.jinja" in e)
  subprocess.run([sys.executable, "-c", example], cwd=tmp_path, check=True, timeout=60)
  out = subprocess.run(
      [sys.executable, "-m", "ulysses_jax.preprocess",
       f"--gin_file={README.parent / 'configs' / 'finetune_tiny_cpu.gin'}",
       "--gin_param=DataConfig.paths='runs/chat.jsonl'",
       "--gin_param=DataConfig.chat_template='runs/chatml.jinja'", "--inspect=1"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
      env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}).stdout
  shown = re.search(r"    #   (=== row 0.*?)\n    # Train", README.read_text(), re.S).group(1)
  lines = [line.removeprefix("    #   ") for line in shown.splitlines() if "..." != line[-3:]]
  for line in lines:
    assert line in out.splitlines(), line


@pytest.mark.slow
def test_generate_example():
  """The Python example of "Generate from a long prompt": our greedy tokens are
  transformers'."""
  (example,) = [e for e in EXAMPLES if "ulysses_jax.generate" in e]
  assert _run(example)[-1] == "True"


@pytest.mark.slow
def test_mixture_of_experts_example():
  example = README.read_text().split("### Mixtures of experts\n", 1)[1]
  counts, metric_names, aux = _run(re.search(r"```python\n(.*?)```", example, re.S)[1])[-3:]
  held, active = map(int, counts.split())
  assert active < held
  assert metric_names == ("['expert_share_max/layer_01', 'expert_share_min/layer_01', "
                          "'router_aux_loss']")
  assert float(aux) == pytest.approx(2.0, abs=0.3)  # k = 2 when balanced
