"""ulysses-ruler --tasks=T[,T...] --lengths=L[,L...] --samples=N --out=FILE.jsonl
    [--seed=N] [--tokenizer=byte|tokenizer.json] [--data=PATHS]

(or ``python -m ulysses_jax.ruler``.) Writes RULER-style examples (``ulysses_jax.ruler.tasks``)
as training data: one JSONL line ``{"prompt": ..., "completion": ...}`` per example, the
answer as the completion, so ``DataConfig(source="files", paths=FILE)`` trains on the answers
only. Use another ``--seed`` than the evaluation's (``ulysses-evaluate --ruler --seed``,
default 0) to keep the two apart. Exit codes (``ulysses_jax.cli``): 0 written, 2 bad input.
"""

import json

import numpy as np

from ulysses_jax import cli, ruler
from ulysses_jax.corpus import make_tokenizer, resolve_paths
from ulysses_jax.documents import text_corpus


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-ruler", __doc__)
  p.add_argument("--tasks", required=True, help="comma-separated task names")
  p.add_argument("--lengths", required=True, help="comma-separated lengths in tokens")
  p.add_argument("--samples", type=int, required=True, help="examples per task and length")
  p.add_argument("--out", required=True, help="the JSONL file to write")
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--tokenizer", default="byte")
  p.add_argument("--data", help="text files for the natural-text haystacks")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:  # every input checked before anything is written
    tokenizer, examples = _examples(args)
  except (ValueError, OSError) as e:
    return cli.report(e, args.debug)
  with open(args.out, "w", encoding="utf-8") as f:
    for ex in examples:
      f.write(json.dumps({"prompt": tokenizer.decode(ex.prompt_ids),
                          "completion": tokenizer.decode(ex.answer_ids)}) + "\n")
  print(f"wrote {len(examples)} examples to {args.out}")
  return cli.EXIT_OK


def _examples(args):
  tokenizer = make_tokenizer(args.tokenizer)
  names, lengths = args.tasks.split(","), [int(n) for n in args.lengths.split(",")]
  text_ids = None
  if args.data:
    text_ids = np.concatenate(text_corpus(resolve_paths(args.data), tokenizer).arrays)
  return tokenizer, ruler.generate(names, lengths, args.samples, tokenizer, seed=args.seed,
                                   text_ids=text_ids)
