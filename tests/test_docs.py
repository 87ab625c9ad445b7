"""README.md and every page under docs/ are true: each fenced Python block runs as a user's shell
runs it and passes ruff; a named block (``<!-- example: NAME -->`` on the line before its fence)
prints what the checks below expect, wherever the block moves; a block that cannot run on the CPU
says why (``<!-- skip: REASON -->``); every ``ulysses-*`` and ``python -m ulysses_jax.*`` command
of a shell block is read by that command's own parser; the commands' page is what the parsers
print (docs/gen_cli.py)."""

import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import sysconfig

import pytest

from child_env import user_env

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELLS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
MARKER = re.compile(r"<!-- (example|skip): (.+?) -->")


@dataclasses.dataclass(frozen=True)
class Block:
  page: str  # relative to the repo
  line: int  # of the opening fence, 1-based
  lang: str
  code: str
  example: str = ""
  skip: str = ""

  def __str__(self):
    return f"{self.page}:{self.line}"


def blocks(text: str, page: str = "sample.md") -> list[Block]:
  """The fenced blocks of a Markdown text, with the markers on the lines just above each."""
  found = []
  for match in FENCE.finditer(text):
    above = text[:match.start()].splitlines()
    markers = {}
    while above and MARKER.fullmatch(above[-1].strip()):
      kind, value = MARKER.fullmatch(above.pop().strip()).groups()
      markers[kind] = value
    found.append(Block(page, text.count("\n", 0, match.start()) + 1, match[1], match[2],
                       **markers))
  return found


ALL = [b for page in PAGES for b in blocks(page.read_text(encoding="utf-8"),
                                            str(page.relative_to(REPO)))]
PYTHON = [b for b in ALL if b.lang == "python"]


def _in_user_shell(code: str, cwd: pathlib.Path, timeout: int = 600) -> list[str]:
  """Runs ``code`` in a fresh process from ``cwd`` (with the repo's configs/ beside it), as a
  user's shell on 8 virtual CPU devices would; returns its stdout's lines."""
  if not (cwd / "configs").exists():
    (cwd / "configs").symlink_to(REPO / "configs")
  result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={**user_env(), "PYTHONPATH": str(REPO)}, timeout=timeout)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "Involuntary full rematerialization" not in result.stderr
  return result.stdout.strip().splitlines()


# What each named block prints. Each check takes the block's stdout lines and its directory.

def _attention(out, _):
  assert out[-1] == "(2, 1000, 12, 64)"


def _flax_model(out, _):
  attn_spec, embed_spec, losses = out[-3:]
  assert attn_spec == "P(('data', 'seq'), None, None)"
  assert embed_spec == "P(('data', 'seq'), None)"
  first, last = map(float, losses.split())
  assert first == pytest.approx(math.log(256), abs=0.1) and last < first


def _llama_step(out, _):
  shape, loss = out[-2:]
  assert shape == "(2, 32, 64)"
  assert float(loss) == pytest.approx(5.5, abs=0.2)


def _moe(out, _):
  counts, metric_names, aux = out[-3:]
  held, active = map(int, counts.split())
  assert active < held
  assert metric_names == ("['expert_share_max/layer_01', 'expert_share_min/layer_01', "
                          "'router_aux_loss']")
  assert float(aux) == pytest.approx(2.0, abs=0.3)  # k = 2 when balanced


def _tiny_hf(_, cwd):
  assert (cwd / "runs" / "tiny_hf" / "config.json").exists()
  records = [json.loads(line) for line in (cwd / "runs" / "ft_data.jsonl").open()]
  stdlib_json = pathlib.Path(sysconfig.get_paths()["stdlib"], "json")  # the child's: our python
  assert sorted(r["prompt"] for r in records) == sorted(
      f"# {p.name}\n" for p in stdlib_json.glob("*.py"))
  assert all(r["completion"] for r in records)


def _chat_data(_, cwd):
  """The preprocess command the page shows next prints the rows the page shows."""
  page = next(p for p in PAGES if "<!-- example: chat-data -->" in p.read_text())
  shell = [b for b in blocks(page.read_text()) if b.lang in SHELLS
           and "ulysses_jax.preprocess" in b.code]
  (command,) = [c for c in commands(shell[0].code) if c[0] == "ulysses-preprocess"]
  out = subprocess.run([sys.executable, "-m", "ulysses_jax.preprocess", *command[1]], cwd=cwd,
                       capture_output=True, text=True, timeout=120, check=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(REPO)}).stdout
  shown = re.search(r"^#   (=== row 0.*?)\n# Train", shell[0].code, re.S | re.M)[1]
  lines = [line.removeprefix("#   ") for line in shown.splitlines() if line[-3:] != "..."]
  for line in lines:
    assert line in out.splitlines(), line


def _train_from_python(out, cwd):
  from ulysses_jax.checkpoint import read_run_config  # pylint: disable=import-outside-toplevel
  step, loss = eval(out[-1])  # (40, loss): print(summary["last_loss"])
  assert step == 40 and loss < 4.5, out  # from ln(256) = 5.5
  assert read_run_config(cwd / "runs" / "from_python" / "checkpoints")[0] == 40


def _generate(out, _):
  assert out[-1] == "True"  # our greedy tokens are transformers'


SLOW = pytest.mark.slow
EXAMPLES = {  # name: (check, the packages it needs, marks)
    "attention": (_attention, (), ()),
    "flax-model": (_flax_model, (), ()),
    "llama-step": (_llama_step, (), (SLOW,)),
    "moe": (_moe, (), (SLOW,)),
    "tiny-hf": (_tiny_hf, ("transformers",), ()),
    "chat-data": (_chat_data, ("jinja2",), ()),
    "train-from-python": (_train_from_python, (), (SLOW,)),
    "generate-vs-transformers": (_generate, ("transformers",), (SLOW,)),
}


def test_every_python_block_is_run_or_says_why_not():
  for block in PYTHON:
    assert block.example in EXAMPLES or block.skip or not block.example, (
        f"{block}: example {block.example!r} has no check in EXAMPLES")
  named = {b.example for b in PYTHON}
  assert named >= EXAMPLES.keys(), f"examples no page holds: {EXAMPLES.keys() - named}"


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, _, m) in EXAMPLES.items()])
def test_named_example(name, tmp_path):
  check, needs, _ = EXAMPLES[name]
  for package in needs:
    pytest.importorskip(package)
  codes = {b.code: b for b in PYTHON if b.example == name and not b.skip}  # README = a guide's
  for i, (code, block) in enumerate(codes.items()):
    cwd = tmp_path / str(i)
    cwd.mkdir()
    try:
      check(_in_user_shell(code, cwd), cwd)
    except AssertionError as e:
      raise AssertionError(f"{block} (example {name}): {e}") from e


UNNAMED = [b for b in PYTHON if not b.example and not b.skip]


@pytest.mark.parametrize("block", UNNAMED or [None], ids=str)
def test_unnamed_python_block_runs(block, tmp_path):
  if block is None:
    pytest.skip("every Python block is a named example")
  _in_user_shell(block.code, tmp_path)


def test_python_blocks_pass_ruff(tmp_path):
  pytest.importorskip("ruff")
  files = []
  for block in PYTHON:
    path = tmp_path / (re.sub(r"\W", "_", str(block)) + ".py")
    path.write_text(block.code)
    files.append(str(path))
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           str(REPO / "pyproject.toml"), *files],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stdout + result.stderr


# The shell blocks' commands.

def commands(code: str) -> list[tuple[str, list[str]]]:
  """``(console script, args)`` of each ``ulysses-*`` / ``python -m ulysses_jax.*`` command
  of a shell block (in a console block, the lines after ``$ `` and their continuations), and
  of the trainer under ``scripts/launch_local.sh N`` and ``sbatch scripts/launch_slurm.sh``.
  ``[--flag=...]`` (optional in a synopsis) reads as ``--flag=...``; ``...`` is left out."""
  console = code.lstrip().startswith("$ ")
  found, line = [], ""
  for raw in code.splitlines():
    if not line and console:
      if not raw.startswith("$ "):
        continue
      raw = raw[2:]
    line += raw
    if line.endswith("\\"):
      line = line[:-1] + " "
      continue
    words, line = shlex.split(line, comments=True), ""
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the program
      words.pop(0)
    if not words:
      continue
    if words[0] == "sbatch":  # sbatch [its options] SCRIPT [the script's arguments]
      words = words[next(i for i, w in enumerate(words) if i and not w.startswith("-")):]
    program, args = os.path.basename(words[0]), words[1:]
    if program in ("launch_local.sh", "launch_slurm.sh"):  # the trainer's flags, after N locally
      program, args = "ulysses-train", args[program == "launch_local.sh":]
    if re.fullmatch(r"python[\d.]*", program) and args[:1] == ["-m"] and len(args) > 1 \
        and args[1].startswith("ulysses_jax."):
      program, args = "ulysses-" + args[1].removeprefix("ulysses_jax."), args[2:]
    if program.startswith("ulysses-"):
      args = [a.strip("[]") for a in args if a.strip("[]") not in ("...", "")]
      found.append((program, args))
  return found


@functools.cache
def _gen_cli():
  spec = importlib.util.spec_from_file_location("gen_cli", REPO / "docs" / "gen_cli.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def command_errors(pages: list[Block], cwd: pathlib.Path) -> list[str]:
  """Each command its own parser refuses, with the parser's message."""
  errors = []
  os.makedirs(cwd, exist_ok=True)
  here = os.getcwd()
  os.chdir(cwd)  # --json makes its file's folder as it is read
  try:
    for block in pages:
      for program, args in commands(block.code):
        if program not in _gen_cli().commands():
          errors.append(f"{block}: no command {program}")
          continue
        stderr = io.StringIO()
        try:
          with contextlib.redirect_stderr(stderr):
            _gen_cli().parser(program).parse_args(args)
        except SystemExit:
          message = stderr.getvalue().strip().splitlines()[-1]
          errors.append(f"{block}: {program} {shlex.join(args)}: {message}")
  finally:
    os.chdir(here)
  return errors


SHELL = [b for b in ALL if b.lang in SHELLS]


def test_every_documented_command_is_read_by_its_parser(tmp_path):
  assert sum(len(commands(b.code)) for b in SHELL) > 20  # the pages do show commands
  assert command_errors(SHELL, tmp_path) == []


def test_a_renamed_flag_in_a_documented_command_fails(tmp_path):
  """The check above can fail: the README's first generate command with --max_new_tokens
  renamed, and a command that does not exist."""
  (block,) = [b for b in SHELL if "ulysses_jax.generate --hf=runs/tiny_hf" in b.code
              and "--prompt=" in b.code]
  renamed = dataclasses.replace(block, code=block.code.replace("--max_new_tokens=", "--max_new=",
                                                                1))
  (error,) = command_errors([renamed], tmp_path)
  assert "unrecognized arguments: --max_new=32" in error and str(block) in error
  missing = blocks("```bash\nulysses-trian --workdir=runs/x\n```\n")
  assert command_errors(missing, tmp_path) == ["sample.md:1: no command ulysses-trian"]


def test_the_commands_page_is_what_their_parsers_print():
  assert _gen_cli().PAGE.read_text(encoding="utf-8") == _gen_cli().page(), (
      "docs/reference/cli.md is stale: run .venv/bin/python docs/gen_cli.py and commit it")


def test_readme_is_short_and_shows_the_two_commands():
  readme = (REPO / "README.md").read_text(encoding="utf-8")
  assert len(readme.splitlines()) <= 200
  shell = "\n".join(b.code for b in blocks(readme) if b.lang in SHELLS)
  assert re.search(r"^make train\b", shell, re.M) and re.search(r"^make test\b", shell, re.M)
  for target in re.findall(r"\]\(([^)#:]+)\)", readme):  # its links into the repo (GitHub's view)
    assert (REPO / target).exists(), target


def test_no_indented_code_blocks():
  """Code is fenced (a language, markers, copy buttons): no block indented four spaces after a
  blank line outside a fence or a list."""
  for page in PAGES:
    text = FENCE.sub(lambda m: "\n" * m[0].count("\n"), page.read_text(encoding="utf-8"))
    lines = text.splitlines()
    for i in range(1, len(lines)):
      if lines[i].startswith("    ") and not lines[i - 1].strip():
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        assert before.startswith((" ", "-", "1", "2", "3", "|")), (
            f"{page.relative_to(REPO)}:{i + 1}: an indented code block; fence it")
