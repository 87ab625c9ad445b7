"""Writes docs/reference/cli.md: every command's ``--help``, as its own argparse parser prints it.

    .venv/bin/python docs/gen_cli.py          # rewrite the page (commit it)
    .venv/bin/python docs/gen_cli.py --check  # exit 1 if the committed page is stale

The commands are the console scripts of pyproject.toml (``ulysses-<name>`` ->
``ulysses_jax.cli.<name>:main``); each module's ``parser()`` builds its parser.
``tests/test_docs.py`` checks that the committed page equals ``page()``.
"""

import importlib
import os
import pathlib
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "cli.md"
WIDTH = 100  # the help's line width, whatever the terminal: the page must not depend on it


def commands() -> dict[str, str]:
  """Console script -> the ``ulysses_jax.cli`` module that holds its ``parser()``."""
  with open(REPO / "pyproject.toml", "rb") as f:
    scripts = tomllib.load(f)["project"]["scripts"]
  return {name: target.split(":")[0] for name, target in scripts.items()}


def parser(command: str):
  """The argparse parser of a console script (``ulysses-plan``) or a ``python -m`` module
  name (``ulysses_jax.plan``)."""
  if command.startswith("ulysses_jax."):
    command = "ulysses-" + command.removeprefix("ulysses_jax.")
  return importlib.import_module(commands()[command]).parser()


def page() -> str:
  columns = os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = str(WIDTH)
  try:
    parts = ["# Commands", "",
             "<!-- Generated from the commands' parsers by docs/gen_cli.py: do not edit. -->", "",
             "Every command is a console script and a module: `ulysses-<name>` and",
             "`python -m ulysses_jax.<name>` are the same program. Flags are spelled with",
             "underscores (`--seq_len`); a dash reads as an underscore (`--seq-len`). Exit codes,",
             "the same for every command: 0 done, 1 a negative answer or a failure while working,",
             "2 bad input (nothing was written), 75 stopped by a signal after saving a checkpoint",
             "(`train`: run it again to resume).", ""]
    for name in commands():
      module = name.removeprefix("ulysses-")
      parts += [f"## {name}", "", f"`python -m ulysses_jax.{module}`", "", "```text",
                parser(name).format_help().rstrip(), "```", ""]
    return "\n".join(parts)
  finally:
    if columns is None:
      del os.environ["COLUMNS"]
    else:
      os.environ["COLUMNS"] = columns


def main() -> int:
  text = page()
  if "--check" in sys.argv[1:]:
    if PAGE.read_text(encoding="utf-8") != text:
      print(f"{PAGE} is stale: run python docs/gen_cli.py", file=sys.stderr)
      return 1
    return 0
  PAGE.write_text(text, encoding="utf-8")
  return 0


if __name__ == "__main__":
  sys.exit(main())
