"""The command lines: every command's argument handling, and the only place gin is read.

Each command is a module here with ``main(argv) -> exit code``, run as a console script or
with ``python -m``: ``ulysses-train`` (``python -m ulysses_jax.train``), ``ulysses-evaluate``,
``ulysses-export``, ``ulysses-aot``, ``ulysses-plan``, ``ulysses-doctor``, ``ulysses-ruler``,
``ulysses-generate``.
The library below takes config objects (a ``RunConfig``); ``cli.gin_config`` builds them
from gin files.

Exit codes, the same for every command:

  0   success
  1   a negative answer or a failure while working: does not fit (aot, plan), a check failed
      (doctor), training stopped on an error (train)
  2   bad input or usage, found before any work: a flag, a gin file or binding, a config or
      data the command refuses, a checkpoint that is not there
  75  stopped by a signal after saving a checkpoint (train): run the same command again

Errors are one line on stderr, ``error: ...`` (``--debug``: the traceback instead).

Flags are spelled with underscores, like the config fields they set (``--seq_len``); a dash
in a flag's name reads as an underscore, so ``--seq-len`` works too. The flags several
commands take are declared once, here: ``--gin_file``/``--gin_param``, ``--json``,
``--debug``, ``--platform``/``--cpu_devices`` and the multi-process flags.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable

from ulysses_jax import distributed
from ulysses_jax.config_checks import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75  # 75: EX_TEMPFAIL, "try again"


class Failed(Exception):
  """A negative answer or a failure while working (exit 1); the message says which."""


class Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` that reads ``--a-b`` as ``--a_b``, shows the module docstring
  as the description, and takes ``--debug``."""

  def __init__(self, prog: str, description: str | None, **kwargs):
    super().__init__(prog=prog, description=description, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    self.add_argument("--debug", action="store_true",
                      help="on an error, the traceback instead of one line")

  def parse_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else list(args)
    return super().parse_args([_underscored(a) for a in args], namespace)


def _underscored(arg: str) -> str:
  if not arg.startswith("--"):
    return arg
  name, equals, value = arg.partition("=")
  return "--" + name[2:].replace("-", "_") + equals + value


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--gin_file", action="append", default=[],
                      help="a gin file of the run (repeatable; read in order)")
  parser.add_argument("--gin_param", action="append", default=[],
                      help="a gin binding applied after the files, e.g. "
                           "TrainConfig.steps=50 (repeatable)")


def add_json_flag(parser: argparse.ArgumentParser, what: str = "the report") -> None:
  parser.add_argument("--json", type=json_path, help=f"also write {what} as JSON here")


def add_platform_flags(parser: argparse.ArgumentParser) -> None:
  """``--platform`` and ``--cpu_devices`` (``TrainConfig.platform`` and ``cpu_devices``)."""
  parser.add_argument("--platform", choices=distributed.PLATFORMS,
                      help="JAX's platform (default: JAX's choice, a GPU if there is one); gpu: "
                      "the GPU backend installed (CUDA or ROCm)")
  parser.add_argument("--cpu_devices", type=int, help="virtual CPU devices per process "
                      "(default: JAX's, one)")


def add_multiprocess_flags(parser: argparse.ArgumentParser) -> None:
  """The flags of ``distributed.initialize``: all three or none (none: a SLURM or MPI
  launcher is detected from the environment)."""
  parser.add_argument("--coordinator_address", help="host:port of process 0 (multi-process)")
  parser.add_argument("--num_processes", type=int)
  parser.add_argument("--process_id", type=int)


def start_jax(args: argparse.Namespace, *, platform: str = "", cpu_devices: int = 0,
              compilation_cache: str = "") -> None:
  """Platform settings, then the processes joined, before JAX starts its backends; the
  flags win over the config's values. Raises ``ConfigError`` for settings JAX cannot take."""
  platform = getattr(args, "platform", None) or platform
  cpu_devices = getattr(args, "cpu_devices", None) or cpu_devices
  try:
    distributed.configure_platform(platform, cpu_devices, compilation_cache)
    if hasattr(args, "coordinator_address"):
      distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    distributed.check_platform(platform, cpu_devices)
  except (ValueError, RuntimeError) as e:
    raise ConfigError(str(e)) from e


def error_line(error: BaseException | str) -> str:
  """``error: <message>``, without the lines gin appends ("In call to configurable ...":
  our messages name the config already)."""
  lines = [line for line in str(error).splitlines() if not line.startswith("  In call to ")]
  return "error: " + "\n".join(lines)


def fail(message: str, code: int = EXIT_USAGE, *, debug: bool = False):
  """Prints ``error: message`` (after what was printed before it) and exits with ``code``;
  called while an exception is handled, with ``debug`` that exception propagates instead."""
  handled = sys.exc_info()[1]
  if debug and handled is not None:
    raise handled
  sys.stdout.flush()
  print(error_line(message), file=sys.stderr, flush=True)
  raise SystemExit(code)


BAD_INPUT = (ValueError, TypeError, OSError, KeyError)  # ConfigError is a ValueError


def run(body: Callable[[], int], debug: bool,
        bad_input: tuple[type[BaseException], ...] = BAD_INPUT) -> int:
  """``body()``'s exit code; an exception it raises becomes one error line and its code:
  ``Failed`` 1, ``bad_input`` 2. With ``debug`` the exception propagates, traceback and
  all."""
  try:
    return body()
  except (Failed, *bad_input) as e:
    return report(e, debug)


def report(error: BaseException, debug: bool) -> int:
  """Prints ``error``'s line and returns its exit code (``Failed``: 1, else 2); with
  ``debug`` re-raises it instead."""
  if debug:
    raise error
  sys.stdout.flush()
  print(error_line(error), file=sys.stderr, flush=True)
  return EXIT_FAILED if isinstance(error, Failed) else EXIT_USAGE


def json_path(text: str) -> str:
  """argparse type of ``--json``: the file's folder is made while the arguments are read, so a
  report that took minutes to measure is never lost to a missing or read-only folder."""
  folder = os.path.dirname(os.path.abspath(text))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {e}") from e
  if os.path.isdir(text) or not os.access(folder, os.W_OK):
    raise argparse.ArgumentTypeError(f"cannot write {text}: give a file path in a writable "
                                     f"folder")
  return text


def write_json(path: str, report: dict, **dump_options) -> None:
  """Writes ``report`` to ``path`` whole or not at all (a temporary file, then a rename)."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, **dump_options)
  os.replace(path + ".tmp", path)
