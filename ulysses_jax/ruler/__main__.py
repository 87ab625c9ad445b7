"""python -m ulysses_jax.ruler --tasks=T[,T...] --lengths=L[,L...] --samples=N --out=FILE.jsonl
    [--seed=N] [--tokenizer=byte|tokenizer.json] [--data=PATHS]

Writes RULER-style examples (``ulysses_jax.ruler.tasks``) as training data: one JSONL line
``{"prompt": ..., "completion": ...}`` per example, the answer as the completion, so
``DataConfig(source="files", paths=FILE)`` trains on the answers only. Use another ``--seed``
than the evaluation's (``evaluate --ruler --seed``, default 0) to keep the two apart.
"""

import argparse
import json
import sys

import numpy as np

from ulysses_jax import ruler
from ulysses_jax.corpus import make_tokenizer, resolve_paths, text_corpus


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ulysses_jax.ruler", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tasks", required=True, help="comma-separated task names")
  parser.add_argument("--lengths", required=True, help="comma-separated lengths in tokens")
  parser.add_argument("--samples", type=int, required=True, help="examples per task and length")
  parser.add_argument("--out", required=True, help="the JSONL file to write")
  parser.add_argument("--seed", type=int, default=1)
  parser.add_argument("--tokenizer", default="byte")
  parser.add_argument("--data", help="text files for the natural-text haystacks")
  args = parser.parse_args(argv)
  try:
    tokenizer = make_tokenizer(args.tokenizer)
    names, lengths = args.tasks.split(","), [int(n) for n in args.lengths.split(",")]
    text_ids = None
    if args.data:
      text_ids = np.concatenate(text_corpus(resolve_paths(args.data), tokenizer).arrays)
    examples = ruler.generate(names, lengths, args.samples, tokenizer, seed=args.seed,
                              text_ids=text_ids)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  with open(args.out, "w", encoding="utf-8") as f:
    for ex in examples:
      f.write(json.dumps({"prompt": tokenizer.decode(ex.prompt_ids),
                          "completion": tokenizer.decode(ex.answer_ids)}) + "\n")
  print(f"wrote {len(examples)} examples to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
