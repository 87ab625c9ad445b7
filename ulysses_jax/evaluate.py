"""Loss by position within the context, pass-key retrieval, RULER-style tasks and exact-match
probes: a forward pass only.

  python -m ulysses_jax.evaluate (--hf=PATH | --workdir=DIR [--step=N]) --seq_len=S
      [--data=PATHS [--passkey]] [--ruler[=TASK,...] [--lengths=L,...] [--samples=N]
      [--seed=N] [--threshold=A]] [--examples=FILE.jsonl] [--mesh_data=N] [--mesh_seq=P]
      [--cpu_devices=N] [--json=PATH] [--plot=PATH] [--tokenizer=T] [--token_dtype=int32]
      [--no_kernel_check]

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
``--passkey`` adds ``passkey``: retrieval accuracy by depth x length (``ulysses_jax.passkey``)
and, with ``--plot``, a heatmap next to it. ``--ruler`` adds ``ruler``: accuracy of each task
(``ulysses_jax.ruler.tasks``) by length, the mean over tasks by length, the effective length
(the longest length up to which the mean stays at or above ``--threshold``) and every example
with its predicted ids; ``--examples`` adds ``examples``: ``accuracy`` and one ``{"correct",
"predicted_ids"}`` per line of the file. Both are scored as greedy decoding would score them
(``ulysses_jax.ruler``).

Before the first batch the attention kernel checks itself (``ulysses_jax.kernel_check``; a
failure falls back to the next backend, with a warning); ``--no_kernel_check`` skips that.

During training, ``PositionEval(graphdef)(params, dataset)`` gives the same dict for any
``data.Dataset`` (the trainer's eval split: positions are then those within each packed
document piece).
"""

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulysses_jax import distributed, finetune, kernel_check, passkey, ruler, sharding
from ulysses_jax.cli import json_path, write_json
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.corpus import make_tokenizer
from ulysses_jax.data import IGNORE_LABEL, DataConfig, Dataset, document_windows
from ulysses_jax.loss import cross_entropy_sums
from ulysses_jax.mesh import make_mesh
from ulysses_jax.ruler import tasks as tasks_lib


def token_losses(model, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss, correct, predicted) ``[B, S]`` sharded (data, seq): each token's ``-log p(label)``
  and whether the label is the top prediction (float32, 0 where the label is
  ``IGNORE_LABEL``), and the top prediction (int32, the argmax over the vocabulary).

  ``batch``: a ``data`` batch (int ``[B, S]`` tokens, labels, positions, segment_ids); the
  mesh's sequence shards must divide S. At most ``[B, P*loss_chunk, V]`` logits exist.
  """
  hidden_BSE = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"])
  mesh, chunk, s = model.mesh, model.config.loss_chunk, batch["tokens"].shape[1]
  hidden_NBPcE = sharding.to_local_chunks(hidden_BSE, mesh=mesh, chunk=chunk)
  labels_NBPc = sharding.to_local_chunks(batch["labels"], mesh=mesh, chunk=chunk,
                                         pad_value=IGNORE_LABEL)
  head_EV = model.lm_head_kernel()

  def step(_, xs):
    hidden_BPcE, labels_BPc = xs
    logits = jnp.einsum("bpce,ev->bpcv", hidden_BPcE, head_EV,
                        preferred_element_type=jnp.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    loss = jax.vmap(cross_entropy_sums)(flat, labels_BPc.reshape(-1)).loss
    predicted = logits.argmax(-1).astype(jnp.int32)
    correct = (predicted == labels_BPc) & (labels_BPc != IGNORE_LABEL)
    return None, (loss.reshape(labels_BPc.shape), correct.astype(jnp.float32), predicted)

  _, outputs_N = jax.lax.scan(step, None, (hidden_NBPcE, labels_NBPc))
  return tuple(sharding.from_local_chunks(x_N, s, mesh=mesh) for x_N in outputs_N)


def _batch_sums(model, batch) -> dict[str, jax.Array]:
  """Loss and label count per position ``[S]`` (summed over rows, by ``positions``); per row
  ``[B]`` the labels and the labels predicted right; and ``[B, S]`` the top prediction where
  there is a label, -1 elsewhere."""
  loss_BS, correct_BS, predicted_BS = token_losses(model, batch)
  valid_BS = batch["labels"] != IGNORE_LABEL
  count_BS = valid_BS.astype(jnp.float32)
  s, positions = batch["tokens"].shape[1], batch["positions"].reshape(-1)
  by_position = lambda x: jax.ops.segment_sum(x.reshape(-1), positions, num_segments=s)
  return {"loss": by_position(loss_BS), "count": by_position(count_BS),
          "row_count": count_BS.sum(1), "row_correct": correct_BS.sum(1),
          "row_predicted": jnp.where(valid_BS, predicted_BS, -1)}


class PositionEval:
  """``PositionEval(graphdef)(params, dataset, max_batches=None)`` -> ``summarize`` dict.

  One jitted forward per batch; sums are kept on the host in float64. ``params``: the model
  state (``nnx.split(model)[1]``, or ``TrainState.params``), sharded as in training.
  ``step``: that jitted forward, ``(params, batch) -> per-batch sums`` (no gradients, no
  optimizer state; ``benchmarks.max_seqlen`` compiles it to size the longest S).
  """

  def __init__(self, graphdef):
    self.step = jax.jit(lambda params, batch: _batch_sums(nnx.merge(graphdef, params), batch))

  def sums(self, params, dataset: Dataset, max_batches: int | None = None) -> dict:
    """Per-position sums ``[S]`` over the batches, per-row values over all rows, and
    ``row_predicted``: per row, the top predictions at its labels (int arrays)."""
    if not dataset.num_batches:
      raise ValueError("nothing to evaluate: the dataset is an endless training stream or "
                       "has no rows (documents of one token predict nothing)")
    n = dataset.num_batches if max_batches is None else min(max_batches, dataset.num_batches)
    out = {}
    for i in range(n):
      batch = jax.device_get(self.step(params, dataset.batch(i)))
      out.setdefault("row_predicted", []).extend(
          row[row >= 0] for row in np.asarray(batch.pop("row_predicted")))
      for k, v in batch.items():
        v = np.asarray(v, np.float64)
        out[k] = v if k not in out else (np.concatenate([out[k], v]) if k.startswith("row")
                                         else out[k] + v)
    return out

  def __call__(self, params, dataset: Dataset, max_batches: int | None = None) -> dict:
    return summarize(self.sums(params, dataset, max_batches))


def log_buckets(seq_len: int) -> list[tuple[int, int]]:
  """[0, 1), [1, 2), [2, 4), ..., [2^k, seq_len)."""
  edges = [0] + [2 ** k for k in range(max(1, math.ceil(math.log2(seq_len))))] + [seq_len]
  edges = sorted(set(e for e in edges if e <= seq_len))
  return list(zip(edges[:-1], edges[1:]))


def summarize(sums: dict) -> dict:
  """``loss``, ``tokens``, ``perplexity`` and log-spaced ``buckets`` from per-position sums."""
  loss, count = sums["loss"], sums["count"]
  mean = float(loss.sum() / max(count.sum(), 1))
  buckets = [{"start": a, "end": b, "tokens": int(count[a:b].sum()),
              "loss": float(loss[a:b].sum() / count[a:b].sum()) if count[a:b].sum() else None}
             for a, b in log_buckets(len(loss))]
  return {"loss": mean, "tokens": int(count.sum()), "perplexity": math.exp(mean),
          "buckets": buckets}


def passkey_dataset(tokenizer, mesh, *, seq_len: int, batch_size: int, vocab_size: int,
                    trials: int = 2) -> tuple[list[passkey.Trial], Dataset]:
  """The pass-key rows (``passkey.make_rows``) as a ``Dataset``; errors before any compute."""
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"the pass-key tokenizer has {tokenizer.vocab_size} ids but the model's "
                      f"vocab_size is {vocab_size}: give the model's own tokenizer.json "
                      "(--tokenizer)")
  trials_, rows = passkey.make_rows(tokenizer, seq_len, trials=trials)
  return trials_, Dataset(ruler.Rows(rows, seq_len), mesh=mesh, batch_size=batch_size,
                          vocab_size=vocab_size, fingerprint="passkey")


def run_passkey(evaluator: PositionEval, params, trials: list[passkey.Trial],
                dataset: Dataset) -> dict:
  """Pass-key accuracy by depth x length (``passkey.accuracy_table``)."""
  sums, n = evaluator.sums(params, dataset), len(trials)
  retrieved = (sums["row_correct"][:n] == sums["row_count"][:n]) & (sums["row_count"][:n] > 0)
  return passkey.accuracy_table(trials, retrieved)


def plot(result: dict, path: str):
  """One panel each: loss by position (log x axis), the pass-key heatmap, RULER accuracy by
  task x length (with the mean), whichever the result holds."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  panels = [k for k in ("buckets", "passkey", "ruler") if k in result]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
  for ax, panel in zip(axes[0], panels):
    if panel == "buckets":
      buckets = [b for b in result["buckets"] if b["loss"] is not None]
      ax.plot([max(b["start"], 0.5) for b in buckets], [b["loss"] for b in buckets], "o-")
      ax.set(xscale="log", xlabel="position in the row (bucket start)", ylabel="loss (nats)",
             title=f"loss by position, mean {result['loss']:.3f}")
      continue
    if panel == "passkey":
      p = result["passkey"]
      grid, rows, columns = p["accuracy"], [f"{d:.0%}" for d in p["depths"]], p["lengths"]
      title, ylabel = f"pass-key accuracy, overall {p['overall']:.2f}", "needle depth"
    else:
      r = result["ruler"]
      rows, columns = [*r["tasks"], "mean"], r["lengths"]
      grid = [[t["by_length"][str(n)]["accuracy"] for n in columns] for t in r["tasks"].values()]
      grid.append([r["mean_by_length"][str(n)] for n in columns])
      title, ylabel = f"RULER accuracy, effective length {r['effective_length'] or 'none'}", "task"
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(xticks=range(len(columns)), xticklabels=columns, yticks=range(len(rows)),
           yticklabels=rows, xlabel="context length (tokens)", ylabel=ylabel, title=title)
    fig.colorbar(image, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def format_result(result: dict) -> str:
  """The printed report: totals, one line per bucket, the pass-key table, RULER accuracy by
  task x length, the examples' accuracy."""
  lines = [f"{result['model']}: S={result['seq_len']}, mesh {result['mesh']}"]
  if "loss" in result:
    lines += [f"  loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}) over "
              f"{result['tokens']:,} tokens", "  positions        loss     tokens"]
  for b in result.get("buckets", []):
    loss = "-" if b["loss"] is None else f"{b['loss']:.4f}"
    lines.append(f"  {b['start']:>6}-{b['end']:<8} {loss:>7} {b['tokens']:>10,}")
  if "ruler" in result:
    r = result["ruler"]
    width = max(map(len, r["tasks"]))
    lines.append(f"  RULER accuracy (effective length at {r['threshold']:.1%}: "
                 f"{r['effective_length']})  " + " ".join(f"{n:>8}" for n in r["lengths"]))
    rows = [(name, [t["by_length"][str(n)]["accuracy"] for n in r["lengths"]])
            for name, t in r["tasks"].items()]
    rows.append(("mean", [r["mean_by_length"][str(n)] for n in r["lengths"]]))
    lines += [f"    {name:<{width}}  " + " ".join(f"{a:>8.2f}" for a in accuracies)
              for name, accuracies in rows]
  if "examples" in result:
    e = result["examples"]
    lines.append(f"  examples: accuracy {e['accuracy']:.3f} over {len(e['results'])} "
                 "(exact match under greedy decoding)")
  if "passkey" in result:
    p = result["passkey"]
    lines.append(f"  pass key (accuracy by depth x length, chance {p['chance']:g}; overall "
                 f"{p['overall']:.2f}):  " + " ".join(f"{n:>7}" for n in p["lengths"]))
    lines += [f"    depth {d:>4.0%}  " + " ".join(f"{a:>7.2f}" for a in row)
              for d, row in zip(p["depths"], p["accuracy"])]
  return "\n".join(lines)


def _parse(argv):
  parser = argparse.ArgumentParser(prog="python -m ulysses_jax.evaluate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--hf", help="a Hugging Face checkpoint directory")
  source.add_argument("--workdir", help="a training workdir of ours (or its checkpoints/)")
  parser.add_argument("--step", type=int, help="with --workdir: the step (default: newest)")
  parser.add_argument("--data", action="append", default=[],
                      help="files or globs, comma-separated or repeated: loss by position, "
                           "and the natural-text haystack of the RULER tasks that use one")
  parser.add_argument("--seq_len", type=int, required=True)
  parser.add_argument("--batch_size", type=int, help="rows per batch (default: mesh_data)")
  parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the "
                      "checkpoint's tokenizer.json / the run's DataConfig.tokenizer)")
  parser.add_argument("--token_dtype", help="dtype of .bin token files, e.g. int32 (default: "
                      "the run's DataConfig.token_dtype, else uint16; .npy files carry theirs)")
  parser.add_argument("--mesh_data", type=int, default=1)
  parser.add_argument("--mesh_seq", type=int, default=-1, help="-1: all remaining devices")
  parser.add_argument("--cpu_devices", type=int, default=0, help="virtual CPU devices")
  parser.add_argument("--dtype", default="float32", help="compute dtype")
  parser.add_argument("--json", type=json_path, help="write the result here")
  parser.add_argument("--plot", help="PNG of loss by position (and the pass-key heatmap)")
  parser.add_argument("--passkey", action="store_true", help="run the pass-key test")
  parser.add_argument("--passkey_trials", type=int, default=2, help="keys per cell")
  parser.add_argument("--ruler", nargs="?", const="all", type=_task_names,
                      help="RULER-style tasks, comma-separated (default: all; those with a "
                           f"natural-text haystack need --data): {', '.join(tasks_lib.TASKS)}")
  parser.add_argument("--lengths", type=_ints, help="RULER lengths in tokens, comma-separated "
                      "(default: S/8, S/4, S/2, S)")
  parser.add_argument("--samples", type=int, default=8, help="RULER examples per task and "
                      "length (the needle depth sweeps 0-100 %% over them)")
  parser.add_argument("--seed", type=int, default=0, help="RULER examples' seed")
  parser.add_argument("--threshold", type=float, default=ruler.THRESHOLD,
                      help="accuracy that defines the effective length (RULER: 0.856)")
  parser.add_argument("--examples", help="JSONL of exact-match probes: "
                      '{"prompt": str, "answer": str} or {"prompt_ids": [int], '
                      '"answer_ids": [int]} per line')
  parser.add_argument("--no_kernel_check", action="store_true", help="skip the attention "
                      "kernel's self-check before the first batch (ulysses_jax.kernel_check)")
  args = parser.parse_args(argv)
  if args.step is not None and not args.workdir:
    parser.error("--step goes with --workdir")
  if not (args.data or args.ruler or args.examples):
    parser.error("nothing to evaluate: give --data (loss by position), --ruler or --examples")
  if args.passkey and not args.data:
    parser.error("--passkey goes with --data (it reports beside the loss by position)")
  if args.lengths and max(args.lengths) > args.seq_len:
    parser.error(f"--lengths {max(args.lengths)} exceeds --seq_len={args.seq_len}")
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


def main(argv: list[str] | None = None) -> dict:
  args = _parse(argv)
  if args.plot:
    try:
      import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
  if args.cpu_devices:
    distributed.configure_platform("cpu", args.cpu_devices)
    distributed.check_platform("cpu", args.cpu_devices)
  else:
    distributed.reserve_gpu_memory()
  source, data_defaults = args.hf, {}
  if args.workdir:
    saved = finetune.SavedParams(args.workdir, args.step)
    source = os.path.dirname(saved.state_dir)
    data_defaults = {k: saved.run.get("data", {})[k] for k in (
        "tokenizer", "text_field", "token_dtype", "eos_id") if k in saved.run.get("data", {})}
  elif os.path.isfile(os.path.join(args.hf, "tokenizer.json")):
    data_defaults["tokenizer"] = os.path.join(args.hf, "tokenizer.json")
  if args.tokenizer:
    data_defaults["tokenizer"] = args.tokenizer
  if args.token_dtype:
    data_defaults["token_dtype"] = args.token_dtype
  config = finetune.model_config(source, {"dtype": args.dtype, "remat_policy": "none"})
  seq = args.mesh_seq if args.mesh_seq > 0 else len(jax.devices()) // args.mesh_data
  mesh = make_mesh(args.mesh_data, seq, devices=jax.devices()[:args.mesh_data * seq])
  data_config = DataConfig(
      **{**data_defaults, "source": "files", "seq_len": args.seq_len, "eval_fraction": 0.0,
         "paths": tuple(p for d in args.data for p in d.split(",") if p),
         "batch_size": args.batch_size or args.mesh_data})
  needs_tokenizer = args.passkey or args.ruler or args.examples
  tokenizer = make_tokenizer(data_config.tokenizer) if needs_tokenizer else None
  windows = None
  if data_config.paths:
    windows = document_windows(data_config, mesh, vocab_size=config.vocab_size)
    if not windows.num_batches:
      raise ConfigError(f"--data {data_config.paths} holds no document of 2 or more tokens: "
                        "nothing to predict")
  if args.passkey:
    trials, keys = passkey_dataset(tokenizer, mesh, seq_len=args.seq_len,
                                   batch_size=data_config.batch_size,
                                   vocab_size=config.vocab_size, trials=args.passkey_trials)
  probes = {}  # "ruler" / "examples" -> (examples, their dataset), all built before the model
  make_dataset = lambda examples: ruler.dataset(
      examples, mesh, seq_len=args.seq_len, batch_size=data_config.batch_size,
      vocab_size=config.vocab_size)
  if args.ruler:
    names = _ruler_tasks(args.ruler, has_text=windows is not None)
    lengths = args.lengths or sorted({args.seq_len >> k for k in range(4)})
    text_ids = _text_ids(windows, max(lengths)) if tasks_lib.needs_text(names) else None
    examples = ruler.generate(names, lengths, args.samples, tokenizer, seed=args.seed,
                              text_ids=text_ids)
    probes["ruler"] = examples, make_dataset(examples)
  if args.examples:
    examples = ruler.read_examples(args.examples, tokenizer)
    probes["examples"] = examples, make_dataset(examples)
  # Every input checked: now the kernel (a bad file stays one error line, nothing before it).
  attention = kernel_check.settle(config, mesh, check=not args.no_kernel_check)
  graphdef, params = nnx.split(finetune.load_model(source, attention.model_config(config), mesh))
  print(f"attention: {attention.choice.reason}", file=sys.stderr)
  evaluator = PositionEval(graphdef)
  result = {"model": os.path.abspath(source), "seq_len": args.seq_len, "mesh": dict(mesh.shape)}
  if windows is not None:
    result.update(evaluator(params, windows))
  if args.passkey:
    result["passkey"] = run_passkey(evaluator, params, trials, keys)
  for name, (examples, dataset) in probes.items():
    scored = ruler.score(evaluator, params, examples, dataset)
    result[name] = (ruler.summarize(examples, scored, args.threshold) if name == "ruler" else
                    {"accuracy": float(np.mean([r["correct"] for r in scored])),
                     "results": scored})
  print(format_result(result))
  if args.json:
    write_json(args.json, result)
  if args.plot:
    plot(result, args.plot)
  return result


def _ruler_tasks(asked: str, has_text: bool) -> list[str]:
  """The task names of ``--ruler``: "all" leaves out the natural-text ones without --data."""
  if asked != "all":
    return asked.split(",")
  return [n for n in tasks_lib.TASKS if has_text or n not in tasks_lib.needs_text([n])]


def _text_ids(windows, n: int) -> np.ndarray:
  """The first ``n`` tokens of the --data documents (the haystack of the natural-text tasks)."""
  if windows is None:
    return None
  parts, total = [], 0
  for i in range(windows.num_batches):
    batch = windows.local_batch(i * windows.batch_size)
    for tokens, labels in zip(batch["tokens"], batch["labels"]):
      parts.append(tokens[labels != IGNORE_LABEL])
      total += len(parts[-1])
    if total >= n:
      break
  return np.concatenate(parts)[:n]


if __name__ == "__main__":
  try:
    main()
  except (ConfigError, ValueError, OSError) as e:
    sys.exit(f"error: {e}")
