"""The README's Python example runs as written and prints what it claims."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
  example = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
  result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                               "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
                          timeout=300, check=True)
  assert result.stdout.strip().splitlines()[-1] == "(2, 1000, 12, 64)"
