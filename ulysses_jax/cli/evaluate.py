"""Loss by position within the context, pass-key retrieval, RULER-style tasks and exact-match
probes: a forward pass only (``ulysses_jax.evaluate``).

  ulysses-evaluate (--hf=PATH | --workdir=DIR [--step=N]) --seq_len=S
      [--data=PATHS [--passkey]] [--ruler[=TASK,...] [--lengths=L,...] [--samples=N]
      [--seed=N] [--threshold=A] [--qa_data=PATHS] [--scoring=both|ruler|strict]]
      [--chat_template=FILE.jinja | --no_chat_template] [--examples=FILE.jsonl] [--mesh_data=N]
      [--mesh_seq=P]
      [--platform=P] [--cpu_devices=N] [--json=PATH] [--plot=PATH] [--tokenizer=T]
      [--token_dtype=int32] [--no_kernel_check]

(or ``python -m ulysses_jax.evaluate``.) The mesh flags mean what ``TrainConfig``'s do:
``--mesh_seq`` devices on the sequence axis (default 1), ``--mesh_data`` on the data axis
(default -1: the devices that ``--mesh_seq`` leaves); the model is the checkpoint's, as
``step_builder.resolve`` reads it for ``TrainConfig.init_from``, without remat, in the
checkpoint's dtype (a run's ``LlamaConfig.dtype``, config.json's ``torch_dtype``) or ``--dtype``.

Rows are the documents of ``--data`` (text, ``.jsonl`` or token files, as for training) in
file order, each cut into consecutive windows of S tokens (``data.document_windows``: row i
of a document has inputs ``tokens[i*S:(i+1)*S]`` and labels ``tokens[i*S+1:(i+1)*S+1]``,
the last window padded and masked; no packing across documents). The forward pass is
sequence-parallel over the mesh (no gradients, no optimizer state), so it reaches longer S
than training on the same devices. The loss never builds ``[B, S, V]`` logits: the
per-token losses come chunk by chunk, as in training (``LlamaConfig.loss_chunk``).

Output (printed, and with ``--json`` written): ``loss`` (mean over predicted tokens),
``tokens``, ``perplexity``, and ``buckets``: ``{"start", "end", "loss", "tokens"}`` over the
position within the row in log-spaced ranges [0, 1), [1, 2), [2, 4), ... [S/2, S), so the
curve shows whether late tokens profit from the long context; ``--plot`` draws it (PNG).
``--passkey`` adds ``passkey``: retrieval accuracy by depth x length
(``ulysses_jax.evaluate.passkey``) and, with ``--plot``, a heatmap next to it. ``--ruler``
adds ``ruler``: RULER's tasks (``ulysses_jax.ruler.tasks``; the essay haystack from ``--data``,
QA from ``--qa_data``), each task x length's score with its standard error and sample count,
the mean over tasks by length, which scoring each number is (``ulysses_jax.ruler.scoring``),
the effective length where it applies, the task x lengths that default lengths could not hold
(``skipped``) and every example with its predicted ids; ``--examples`` adds ``examples``:
``accuracy`` and one ``{"correct", "predicted_ids"}`` per line of the file, scored strictly
(as greedy decoding would write the answer; ``ulysses_jax.ruler``). ``--scoring`` chooses
RULER's: ``ruler`` generates each answer greedily within its task's budget, stopping at the
checkpoint's EOS ids (``ulysses_jax.ruler.generation``; each example gets ``prediction`` and
``generated_tokens``), and scores it as RULER does;
``strict`` scores the canonical answer under teacher forcing (one forward pass, no decoder);
``both`` (the default) reports the two, side by side. A RULER prompt is the task text as a
user turn in the checkpoint's chat template (``chat_template.jinja`` or the
``tokenizer_config.json``'s, as for training data) followed by the assistant's header, or in
``--chat_template``'s; without one, or with ``--no_chat_template``, the plain text with the
special tokens (BOS) the tokenizer adds. ``--chat_template`` also renders conversations in
``--data``.

Before the first batch the attention kernel checks itself (``ulysses_jax.kernel_check``; a
failure falls back to the next backend, with a warning); ``--no_kernel_check`` skips that.
Exit codes (``ulysses_jax.cli``): 0 evaluated, 2 bad input (found before the model is loaded).
"""

import argparse
import os
import sys

import jax
import numpy as np
from flax import nnx

from tqdm import tqdm

from ulysses_jax import cli, kernel_check, ruler, step_builder
from ulysses_jax.data import chat
from ulysses_jax.hf import init_from as finetune
from ulysses_jax.cli import generate as cli_generate
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.corpus import make_tokenizer
from ulysses_jax.data.pipeline import DataConfig, document_windows
from ulysses_jax.evaluate import PositionEval, format_result, passkey, plot
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.ruler import generation as ruler_generation
from ulysses_jax.ruler import prompts as ruler_prompts
from ulysses_jax.ruler import tasks as tasks_lib
from ulysses_jax.run_config import RunConfig, TrainConfig


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-evaluate", __doc__)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--hf", help="a Hugging Face checkpoint directory")
  source.add_argument("--workdir", help="a training workdir of ours (or its checkpoints/)")
  add = p.add_argument
  add("--step", type=int, help="with --workdir: the step (default: newest)")
  add("--data", action="append", default=[],
      help="files or globs, comma-separated or repeated: loss by position, and the essay "
           "haystack of the RULER tasks that use one (text files)")
  add("--seq_len", type=int, required=True)
  add("--batch_size", type=int, help="rows per batch (default: the mesh's data axis)")
  add("--tokenizer", help="'byte' or a tokenizer.json (default: the checkpoint's "
      "tokenizer.json / the run's DataConfig.tokenizer)")
  add("--token_dtype", help="dtype of .bin token files, e.g. int32 (default: the run's "
      "DataConfig.token_dtype, else uint16; .npy files carry theirs)")
  add("--mesh_data", type=int, default=-1, help="devices on the data axis (-1: the rest)")
  add("--mesh_seq", type=int, default=1, help="devices on the sequence axis")
  add("--dtype", help="LlamaConfig.dtype: the compute dtype (default: the checkpoint's, a "
      "run's LlamaConfig.dtype or config.json's torch_dtype)")
  cli.add_json_flag(p, "the result")
  add("--plot", help="PNG of loss by position (and the pass-key heatmap)")
  add("--passkey", action="store_true", help="run the pass-key test")
  add("--passkey_trials", type=int, default=2, help="keys per cell")
  add("--ruler", nargs="?", const="all", type=_task_names,
      help="RULER's tasks, comma-separated (default: all those whose input is given: the "
           f"essay haystack needs --data, qa_1/qa_2 --qa_data): {', '.join(tasks_lib.TASKS)}")
  add("--qa_data", action="append", default=[], help="SQuAD's dev-v2.0.json and HotpotQA's "
      "hotpot_dev_distractor_v1.json, comma-separated or repeated (qa_1, qa_2)")
  add("--lengths", type=_ints, help="RULER lengths in tokens, comma-separated (default: S/8, "
      "S/4, S/2, S, each task at those that hold it)")
  add("--samples", type=int, default=8, help="RULER examples per task and length (the needle "
      "depth sweeps 0-100 %% over them)")
  add("--seed", type=int, default=0, help="RULER examples' seed")
  add("--threshold", type=float, default=ruler.THRESHOLD,
      help="score in percent that defines the effective length (RULER: 85.6)")
  add("--scoring", choices=("both", "ruler", "strict"), default="both",
      help="RULER's scoring by generation, our strict teacher-forced one, or both (default)")
  template = p.add_mutually_exclusive_group()
  template.add_argument("--chat_template", help="a .jinja chat template for the RULER prompts "
                        "and conversations in --data (default: the checkpoint's, if any)")
  template.add_argument("--no_chat_template", action="store_true",
                        help="RULER prompts as plain text, even when the checkpoint has a "
                        "chat template")
  add("--examples", help="JSONL of exact-match probes: "
      '{"prompt": str, "answer": str} or {"prompt_ids": [int], "answer_ids": [int]} per line')
  add("--no_kernel_check", action="store_true", help="skip the attention kernel's "
      "self-check before the first batch (ulysses_jax.kernel_check)")
  cli.add_platform_flags(p)
  cli.add_multiprocess_flags(p)
  return p


def _parse(argv):
  p = parser()
  args = p.parse_args(argv)
  if args.step is not None and not args.workdir:
    p.error("--step goes with --workdir")
  if not (args.data or args.ruler or args.examples):
    p.error("nothing to evaluate: give --data (loss by position), --ruler or --examples")
  if args.passkey and not args.data:
    p.error("--passkey goes with --data (it reports beside the loss by position)")
  if args.lengths and max(args.lengths) > args.seq_len:
    p.error(f"--lengths {max(args.lengths)} exceeds --seq_len={args.seq_len}")
  if args.chat_template and not os.path.isfile(args.chat_template):
    p.error(f"--chat_template {args.chat_template}: no such file (a .jinja chat template)")
  if not 1 < args.threshold <= 100:
    p.error(f"--threshold is a percentage in (1, 100] (RULER: 85.6), got {args.threshold}")
  return args


def _ints(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got "
                                     f"{text!r}")
  return values


def _task_names(text: str) -> str:
  unknown = [n for n in text.split(",") if n not in tasks_lib.TASKS] if text != "all" else []
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown RULER task(s) {unknown}; choose from "
                                     f"{', '.join(tasks_lib.TASKS)} or all")
  return text


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)

  def body() -> int:
    try:
      evaluate(args)
    except kernel_check.KernelCheckError as e:
      raise cli.Failed(str(e)) from e
    return cli.EXIT_OK
  # Bad input is found before the model is loaded; what fails after it is a traceback.
  return cli.run(body, args.debug, bad_input=(ConfigError, ValueError, OSError))


def run(argv: list[str] | None = None) -> dict:
  """Evaluates as the flags say; returns the result (what ``--json`` writes)."""
  return evaluate(_parse(argv))


def evaluate(args) -> dict:
  """The evaluation of the parsed flags: inputs checked, the model loaded, the result
  printed (and written, drawn) and returned."""
  if args.plot:
    try:
      import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
  cli.start_jax(args)
  source, data_defaults, eos = args.hf, {}, ()
  if args.workdir:
    saved = finetune.SavedParams(args.workdir, args.step)
    source = os.path.dirname(saved.state_dir)
    eos = cli_generate.eos_ids(run_data=saved.run.get("data", {}))
    data_defaults = {k: saved.run.get("data", {})[k] for k in (
        "tokenizer", "text_field", "token_dtype", "eos_id", "chat_template")
        if k in saved.run.get("data", {})}
  else:
    eos = cli_generate.eos_ids(hf=args.hf)
    if os.path.isfile(os.path.join(args.hf, "tokenizer.json")):
      data_defaults["tokenizer"] = os.path.join(args.hf, "tokenizer.json")
  if args.tokenizer:
    data_defaults["tokenizer"] = args.tokenizer
  if args.token_dtype:
    data_defaults["token_dtype"] = args.token_dtype
  if args.chat_template:
    data_defaults["chat_template"] = args.chat_template
  dtype, dtype_reason = finetune.compute_dtype(source, args.dtype)
  given = {"dtype": dtype, "remat_policy": "none"}
  run_config = step_builder.resolve(RunConfig(
      train=TrainConfig(mesh_data=args.mesh_data, mesh_seq=args.mesh_seq, init_from=source),
      model=LlamaConfig(**given)), given=given)
  config = run_config.model
  devices = jax.devices()
  mesh = step_builder.run_mesh(run_config.train, devices if args.mesh_data == -1 else
                               devices[:args.mesh_data * args.mesh_seq])
  data_config = DataConfig(
      **{**data_defaults, "source": "files", "seq_len": args.seq_len, "eval_fraction": 0.0,
         "paths": tuple(p for d in args.data for p in d.split(",") if p),
         "batch_size": args.batch_size or mesh.shape["data"]})
  needs_tokenizer = args.passkey or args.ruler or args.examples
  tokenizer = make_tokenizer(data_config.tokenizer) if needs_tokenizer else None
  windows = None
  if data_config.paths:
    windows = document_windows(data_config, mesh, vocab_size=config.vocab_size)
    if not windows.num_batches:
      raise ConfigError(f"--data {data_config.paths} holds no document of 2 or more tokens: "
                        "nothing to predict")
  if args.passkey:
    trials, keys = passkey.dataset(tokenizer, mesh, seq_len=args.seq_len,
                                   batch_size=data_config.batch_size,
                                   vocab_size=config.vocab_size, trials=args.passkey_trials)
  probes = {}  # "ruler" / "examples" -> (examples, their dataset), all built before the model
  make_dataset = lambda examples: ruler.dataset(
      examples, mesh, seq_len=args.seq_len, batch_size=data_config.batch_size,
      vocab_size=config.vocab_size)
  skipped = None if args.lengths else []  # default lengths leave out what they cannot hold
  if args.ruler:
    qa_paths = [q for flag in args.qa_data for q in flag.split(",") if q]
    names = _ruler_tasks(args.ruler, has_essays=bool(data_config.paths),
                         has_qa=bool(qa_paths))
    essays, qa_sets = ruler.read_inputs(names, data_config.paths, qa_paths)
    lengths = args.lengths or sorted({args.seq_len >> k for k in range(4)})
    wrap, template_used = _prompt_wrap(args, data_config, tokenizer)
    examples = ruler.generate(names, lengths, args.samples, tokenizer, seed=args.seed,
                              essays=essays, qa_sets=qa_sets, wrap=wrap,
                              add_special_tokens=template_used is None, skipped=skipped)
    for s in skipped or []:
      print(f"note: skipped {s['reason']}", file=sys.stderr)
    if not examples:
      raise ValueError(f"no RULER task fits the lengths {lengths}; raise --seq_len")
    probes["ruler"] = examples, (None if args.scoring == "ruler" else make_dataset(examples))
  if args.examples:
    examples = ruler.read_examples(args.examples, tokenizer)
    probes["examples"] = examples, make_dataset(examples)
  # Every input checked: now the kernel (a bad file stays one error line, nothing before it).
  attention = kernel_check.settle(config, mesh, seq_len=args.seq_len,
                                  check=not args.no_kernel_check)
  model = finetune.load_model(source, attention.model_config(config), mesh)
  graphdef, params = nnx.split(model)
  print(f"computing in {dtype} ({dtype_reason})", file=sys.stderr)
  print(f"attention: {attention.choice.reason}", file=sys.stderr)
  evaluator = PositionEval(graphdef)
  result = {"model": os.path.abspath(source), "seq_len": args.seq_len, "mesh": dict(mesh.shape)}
  if windows is not None:
    result.update(evaluator(params, windows))
  if args.passkey:
    result["passkey"] = passkey.score(evaluator, params, trials, keys)
  for name, (examples, dataset) in probes.items():
    scored = ([{} for _ in examples] if dataset is None else
              ruler.score(evaluator, params, examples, dataset))
    if name == "examples":
      result[name] = {"accuracy": float(np.mean([r["correct"] for r in scored])),
                      "results": scored}
      continue
    if args.scoring != "strict":
      bar = tqdm(total=len(examples), unit="example", desc="RULER generation",
                 file=sys.stderr)
      generated = ruler_generation.predict(model, examples, tokenizer, eos_ids=eos,
                                           batch_size=data_config.batch_size,
                                           progress=bar.update)
      bar.close()
      scored = [{**r, **g} for r, g in zip(scored, generated)]
    result[name] = {**ruler.summarize(examples, scored, list(tasks_lib.TASKS), args.threshold),
                    "chat_template": template_used, "skipped": skipped or []}
  print(format_result(result))
  if args.json:
    cli.write_json(args.json, result)
  if args.plot:
    plot(result, args.plot)
  return result


def _prompt_wrap(args, data_config: DataConfig, tokenizer):
  """(wrap, template) of the RULER prompts: the chat turn of ``--chat_template`` or the
  checkpoint's template and where it came from, or the identity and None."""
  if args.no_chat_template:
    return ruler_prompts.identity, None
  text, special = chat.find_template(data_config.tokenizer, data_config.chat_template,
                                     required=False)
  if text is None:
    return ruler_prompts.identity, None
  used = data_config.chat_template or os.path.dirname(os.path.abspath(data_config.tokenizer))
  return ruler_prompts.chat_turn(chat.ChatTemplate(text, special, tokenizer)), used


def _ruler_tasks(asked: str, has_essays: bool, has_qa: bool) -> list[str]:
  """The task names of ``--ruler``: "all" leaves out those whose input is not given."""
  if asked != "all":
    return asked.split(",")
  need = tasks_lib.needs(tasks_lib.TASKS)
  missing = set(need["essays"] if not has_essays else []) | set(
      [] if has_qa else need["qa_squad"] + need["qa_hotpotqa"])
  return [n for n in tasks_lib.TASKS if n not in missing]
