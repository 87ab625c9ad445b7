"""ulysses-train --gin_file=configs/X.gin [--gin_file=...] [--gin_param=...] --workdir=DIR

(or ``python -m ulysses_jax.train``.) Trains the run that the gin files describe (read in
order, then the ``--gin_param`` bindings, e.g. ``--gin_param=TrainConfig.steps=50``;
``ulysses_jax.cli.gin_config``) into DIR with ``ulysses_jax.train.train``; started again with
the same DIR it resumes. ``--platform`` and ``--cpu_devices`` override ``TrainConfig.platform``
and ``cpu_devices``; the multi-process flags join processes that ``scripts/launch_local.sh``
started (SLURM and MPI launchers are detected without them).

Exit codes (``ulysses_jax.cli``): 0 finished (or nothing left to train), 1 stopped on an error
(non-finite steps; the first step out of device memory), 2 bad input (flags, gin, a config,
data or checkpoint the trainer refuses; nothing was written), 75 stopped by a signal after
saving a checkpoint: run the same command again to resume.
"""

import dataclasses
import logging

from ulysses_jax import cli, kernel_check, train
from ulysses_jax.cli import gin_config
from ulysses_jax.config_checks import ConfigError


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-train", __doc__)
  cli.add_gin_flags(p)
  p.add_argument("--workdir", required=True, help="where the run's checkpoints, metrics and "
                 "configs go")
  cli.add_platform_flags(p)
  cli.add_multiprocess_flags(p)
  return p


def main(argv: list[str] | None = None) -> int:
  """The command line; returns the exit code."""
  args = parser().parse_args(argv)
  _configure_logging()

  def body() -> int:
    try:
      config = gin_config.read(args.gin_file, args.gin_param, args.workdir)
    except (ValueError, TypeError, OSError, KeyError) as e:  # gin's errors
      raise ConfigError(str(e)) from e
    cfg = dataclasses.replace(config.train, platform=args.platform or config.train.platform,
                              cpu_devices=args.cpu_devices or config.train.cpu_devices)
    config = dataclasses.replace(config, train=cfg)
    cli.start_jax(args, platform=cfg.platform, cpu_devices=cfg.cpu_devices,
                  compilation_cache=cfg.compilation_cache)
    try:
      summary = train.train(args.workdir, config)
    except (train.NonFiniteError, train.OutOfMemoryError, kernel_check.KernelCheckError) as e:
      raise cli.Failed(str(e)) from e
    return cli.EXIT_STOPPED if summary["stopped"] else cli.EXIT_OK

  # Past reading the config, only the trainer's own ConfigError is bad input: anything else
  # failed while working (a traceback, exit 1).
  return cli.run(body, args.debug, bad_input=(ConfigError,))


def _configure_logging():
  """Our log lines with a timestamp; the libraries' own chatter (orbax, absl) at warnings."""
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
  root = logging.getLogger()
  root.handlers[:] = [handler]
  root.setLevel(logging.WARNING)
  logging.getLogger("ulysses_jax").setLevel(logging.INFO)
