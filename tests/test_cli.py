"""The command lines (``ulysses_jax.cli``): declared as console scripts, each also a ``python
-m`` form calling the same ``main``; one exit-code table; one spelling per flag."""

import ast
import contextlib
import importlib
import io
import pathlib
import runpy
import sys
import tomllib

import pytest

from ulysses_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = ("train", "evaluate", "export", "aot", "plan", "doctor", "ruler", "preprocess")


def _scripts() -> dict[str, str]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["scripts"]


def test_every_command_is_a_console_script_that_resolves():
  scripts = _scripts()
  assert scripts == {f"ulysses-{c}": f"ulysses_jax.cli.{c}:main" for c in COMMANDS}
  for target in scripts.values():
    module, function = target.split(":")
    assert callable(getattr(importlib.import_module(module), function)), target


@pytest.mark.parametrize("command", COMMANDS)
def test_the_python_m_form_calls_the_same_main(command, monkeypatch):
  """``ulysses_jax/<command>/__main__.py`` runs ``ulysses_jax.cli.<command>.main`` and exits
  with what it returns; ``--help`` shows the console script's name and its docstring."""
  tree = ast.parse((ROOT / "ulysses_jax" / command / "__main__.py").read_text())
  imports = [(n.module, [a.name for a in n.names]) for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom)]
  assert (f"ulysses_jax.cli.{command}", ["main"]) in imports
  out = io.StringIO()
  monkeypatch.setattr(sys, "argv", [f"ulysses-{command}", "--help"])
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
    runpy.run_module(f"ulysses_jax.{command}", run_name="__main__")
  assert exit_info.value.code == 0
  assert out.getvalue().startswith(f"usage: ulysses-{command} "), out.getvalue()[:200]
  assert "--debug" in out.getvalue()


def test_one_exit_code_table():
  assert (cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_STOPPED) == (0, 1, 2, 75)
  for code, meaning in (("0", "success"), ("1", "a negative answer or a failure while working"),
                        ("2", "bad input or usage"), ("75", "stopped by a signal")):
    assert f"\n  {code:<4}{meaning}" in cli.__doc__


def test_a_dash_in_a_flag_reads_as_an_underscore(capsys):
  parser = cli.Parser("ulysses-test", None)
  parser.add_argument("--seq_len", type=int)
  parser.add_argument("--gin_param", action="append", default=[])
  args = parser.parse_args(["--seq-len=8", "--gin-param=DataConfig.tokenizer='a-b.json'"])
  assert (args.seq_len, args.gin_param) == (8, ["DataConfig.tokenizer='a-b.json'"])
  assert parser.parse_args(["--seq-len", "9"]).seq_len == 9
  assert "--seq_len SEQ_LEN" in parser.format_help() and "--seq-len" not in parser.format_help()


def test_errors_are_one_line_and_their_exit_code(capsys):
  def failing(error):
    def body():
      raise error
    return body
  assert cli.run(failing(cli.Failed("does not fit")), debug=False) == cli.EXIT_FAILED
  assert cli.run(failing(ValueError("bad\n  In call to configurable 'X'")),
                 debug=False) == cli.EXIT_USAGE
  assert capsys.readouterr().err == "error: does not fit\nerror: bad\n"
  with pytest.raises(ValueError):
    cli.run(failing(ValueError("bad")), debug=True)


def test_debug_shows_the_error_itself():
  from ulysses_jax.cli import plan  # pylint: disable=import-outside-toplevel
  args = ["--model=llama9", "--seq_len=1024", "--devices=8"]
  with pytest.raises(SystemExit) as exit_info:
    plan.run(args)
  assert exit_info.value.code == cli.EXIT_USAGE
  with pytest.raises(ValueError, match="unknown model 'llama9'"):
    plan.run([*args, "--debug"])
