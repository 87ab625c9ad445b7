"""ulysses-preprocess --gin_file=CFG [--gin_param=...] [--inspect=N [--json=OUT]] [--out=DIR]

(or ``python -m ulysses_jax.preprocess``.) Reads the ``DataConfig`` of the gin files (the
training run's own) and

* ``--inspect=N``: prints the first N packed training rows exactly as the trainer feeds them
  (rows 0..N-1 of the training stream), each document piece decoded, the tokens the loss falls
  on marked (green on a terminal, else between [[ and ]]); ``--json=OUT`` also writes
  ``{"rows": [{"tokens", "labels", "segment_ids", "positions"}, ...]}``;
* ``--out=DIR``: tokenizes the files once into a token directory; give DIR as
  ``DataConfig.paths`` and training reads it memory-mapped (the same rows, no tokenizing).

Needs no accelerator and starts no JAX devices. Exit codes (``ulysses_jax.cli``): 0 done, 2 bad
input (the config or the data; the error names the file and row).
"""

import sys

from ulysses_jax import cli
from ulysses_jax.data import preprocess
from ulysses_jax.cli import gin_config
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.corpus import make_tokenizer
from ulysses_jax.data.pipeline import DataConfig

GREEN = ("\033[32m", "\033[0m")


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-preprocess", __doc__)
  cli.add_gin_flags(p)
  p.add_argument("--inspect", type=int, metavar="N", help="print the first N training rows")
  cli.add_json_flag(p, "the inspected rows")
  p.add_argument("--out", metavar="DIR", help="write the tokenized files here")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)

  def body() -> int:
    if args.json and not args.inspect:
      raise ConfigError("--json writes the inspected rows: give --inspect=N too")
    if not (args.inspect or args.out):
      raise ConfigError("give --inspect=N (see the first rows), --out=DIR (tokenize once) "
                        "or both")
    gin_config.parse(args.gin_file, args.gin_param)
    config = gin_config.build(DataConfig)
    progress = sys.stderr.isatty()
    if args.inspect:
      rows = preprocess.training_rows(config, args.inspect, progress=progress)
      tokenizer = make_tokenizer(config.tokenizer)
      marks = GREEN if sys.stdout.isatty() else ("[[", "]]")
      for i, row in enumerate(rows):
        print(preprocess.format_row(row, i, tokenizer, marks=marks))
      if args.json:
        cli.write_json(args.json, preprocess.row_json(rows))
        print(f"wrote {len(rows)} rows to {args.json}")
    if args.out:
      index = preprocess.write_tokens(config, args.out, progress=progress)
      print(f"wrote {index['num_tokens']:,} tokens of {index['num_documents']:,} documents to "
            f"{args.out}; train on it with DataConfig.paths={args.out!r}")
    return cli.EXIT_OK

  return cli.run(body, args.debug)
