"""ulysses-ruler --tasks=T[,T...] --lengths=L[,L...] --samples=N [--out=FILE.jsonl]
    [--seed=N] [--tokenizer=byte|tokenizer.json] [--data=PATHS] [--qa_data=PATHS]

(or ``python -m ulysses_jax.ruler``.) Writes RULER's examples (``ulysses_jax.ruler.tasks``) as
JSONL, one line per example: ``{"prompt": ..., "completion": ...}`` (the canonical answer as
the completion, so ``DataConfig(source="files", paths=FILE)`` trains on the answers only) with
``task``, ``length``, ``sample``, ``outputs`` (the strings RULER's score looks for) and
``prompt_tokens``. To standard output without ``--out``. ``--data``: the essays of the essay
haystack (text or ``.jsonl`` files, comma-separated or repeated; RULER uses Paul Graham's);
``--qa_data``: SQuAD's ``dev-v2.0.json`` and HotpotQA's ``hotpot_dev_distractor_v1.json`` for
``qa_1`` and ``qa_2``. Use another ``--seed`` than the evaluation's (``ulysses-evaluate --ruler
--seed``, default 0) to keep the two apart. Exit codes (``ulysses_jax.cli``): 0 written, 2 bad
input.
"""

import json
import sys

from ulysses_jax import cli, ruler
from ulysses_jax.data.corpus import make_tokenizer


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-ruler", __doc__)
  p.add_argument("--tasks", required=True, help="comma-separated task names")
  p.add_argument("--lengths", required=True, help="comma-separated lengths in tokens")
  p.add_argument("--samples", type=int, required=True, help="examples per task and length")
  p.add_argument("--out", help="the JSONL file to write (default: standard output)")
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--tokenizer", default="byte")
  p.add_argument("--data", action="append", default=[],
                 help="text files or globs, comma-separated or repeated: the essay haystack")
  p.add_argument("--qa_data", action="append", default=[],
                 help="SQuAD / HotpotQA JSON files, comma-separated or repeated (qa_1, qa_2)")
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:  # every input checked before anything is written
    tokenizer, examples = _examples(args)
  except (ValueError, OSError) as e:
    return cli.report(e, args.debug)
  out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
  try:
    for ex in examples:
      out.write(json.dumps({
          "prompt": tokenizer.decode(ex.prompt_ids), "completion": ex.answer,
          "task": ex.task, "length": ex.length, "sample": ex.sample,
          "outputs": list(ex.outputs), "prompt_tokens": len(ex.prompt_ids)}) + "\n")
  finally:
    if args.out:
      out.close()
  if args.out:
    print(f"wrote {len(examples)} examples to {args.out}")
  return cli.EXIT_OK


def _examples(args):
  tokenizer = make_tokenizer(args.tokenizer)
  names, lengths = args.tasks.split(","), [int(n) for n in args.lengths.split(",")]
  split = lambda flags: [p for flag in flags for p in flag.split(",") if p]
  essays, qa_sets = ruler.read_inputs(names, split(args.data), split(args.qa_data))
  return tokenizer, ruler.generate(names, lengths, args.samples, tokenizer, seed=args.seed,
                                   essays=essays, qa_sets=qa_sets)
