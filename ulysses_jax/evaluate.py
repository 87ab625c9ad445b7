"""Loss by position within the context, and pass-key retrieval: a forward pass only.

  python -m ulysses_jax.evaluate (--hf=PATH | --workdir=DIR [--step=N]) --data=PATHS
      --seq_len=S [--mesh_data=N] [--mesh_seq=P] [--cpu_devices=N] [--json=PATH]
      [--plot=PATH] [--passkey] [--tokenizer=T] [--token_dtype=int32]

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
and, with ``--plot``, a heatmap next to it.

During training, ``PositionEval(graphdef)(params, dataset)`` gives the same dict for any
``data.Dataset`` (the trainer's eval split: positions are then those within each packed
document piece).
"""

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulysses_jax import distributed, finetune, passkey, sharding
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.corpus import make_tokenizer
from ulysses_jax.data import IGNORE_LABEL, DataConfig, Dataset, document_windows
from ulysses_jax.loss import cross_entropy_sums
from ulysses_jax.mesh import make_mesh


def token_losses(model, batch) -> tuple[jax.Array, jax.Array]:
  """(loss, correct): float32 ``[B, S]`` sharded (data, seq): each token's ``-log p(label)``
  and whether the label is the top prediction, 0 where the label is ``IGNORE_LABEL``.

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
    correct = (logits.argmax(-1) == labels_BPc) & (labels_BPc != IGNORE_LABEL)
    return None, (loss.reshape(labels_BPc.shape), correct.astype(jnp.float32))

  _, (loss_N, correct_N) = jax.lax.scan(step, None, (hidden_NBPcE, labels_NBPc))
  return (sharding.from_local_chunks(loss_N, s, mesh=mesh),
          sharding.from_local_chunks(correct_N, s, mesh=mesh))


def _batch_sums(model, batch) -> dict[str, jax.Array]:
  """Loss and label count per position ``[S]`` (summed over rows, by ``positions``), and per
  row ``[B]`` the labels and the labels predicted right."""
  loss_BS, correct_BS = token_losses(model, batch)
  valid_BS = (batch["labels"] != IGNORE_LABEL).astype(jnp.float32)
  s, positions = batch["tokens"].shape[1], batch["positions"].reshape(-1)
  by_position = lambda x: jax.ops.segment_sum(x.reshape(-1), positions, num_segments=s)
  return {"loss": by_position(loss_BS), "count": by_position(valid_BS),
          "row_count": valid_BS.sum(1), "row_correct": correct_BS.sum(1)}


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
    """Per-position sums ``[S]`` over the batches, and per-row values over all rows."""
    if not dataset.num_batches:
      raise ValueError("nothing to evaluate: the dataset is an endless training stream or "
                       "has no rows (documents of one token predict nothing)")
    n = dataset.num_batches if max_batches is None else min(max_batches, dataset.num_batches)
    batches = [jax.device_get(self.step(params, dataset.batch(i))) for i in range(n)]
    return {k: (np.concatenate if k.startswith("row") else sum)(
        [np.asarray(b[k], np.float64) for b in batches]) for k in batches[0]}

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


class _Rows:
  """A fixed list of rows for ``data.Dataset``."""

  def __init__(self, rows, seq_len):
    self.rows, self.seq_len, self.num_rows = rows, seq_len, len(rows)

  def __call__(self, row):
    return self.rows[row]


def passkey_dataset(tokenizer, mesh, *, seq_len: int, batch_size: int, vocab_size: int,
                    trials: int = 2) -> tuple[list[passkey.Trial], Dataset]:
  """The pass-key rows (``passkey.make_rows``) as a ``Dataset``; errors before any compute."""
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"the pass-key tokenizer has {tokenizer.vocab_size} ids but the model's "
                      f"vocab_size is {vocab_size}: give the model's own tokenizer.json "
                      "(--tokenizer)")
  trials_, rows = passkey.make_rows(tokenizer, seq_len, trials=trials)
  return trials_, Dataset(_Rows(rows, seq_len), mesh=mesh, batch_size=batch_size,
                          vocab_size=vocab_size, fingerprint="passkey")


def run_passkey(evaluator: PositionEval, params, trials: list[passkey.Trial],
                dataset: Dataset) -> dict:
  """Pass-key accuracy by depth x length (``passkey.accuracy_table``)."""
  sums, n = evaluator.sums(params, dataset), len(trials)
  retrieved = (sums["row_correct"][:n] == sums["row_count"][:n]) & (sums["row_count"][:n] > 0)
  return passkey.accuracy_table(trials, retrieved)


def plot(result: dict, path: str):
  """Loss by position (log x axis); with pass-key results, their heatmap beside it."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  panels = 2 if "passkey" in result else 1
  fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
  buckets = [b for b in result["buckets"] if b["loss"] is not None]
  ax = axes[0, 0]
  ax.plot([max(b["start"], 0.5) for b in buckets], [b["loss"] for b in buckets], "o-")
  ax.set(xscale="log", xlabel="position in the row (bucket start)", ylabel="loss (nats)",
         title=f"loss by position, mean {result['loss']:.3f}")
  if panels == 2:
    p, ax = result["passkey"], axes[0, 1]
    image = ax.imshow(p["accuracy"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(xticks=range(len(p["lengths"])), xticklabels=p["lengths"],
           yticks=range(len(p["depths"])), yticklabels=[f"{d:.0%}" for d in p["depths"]],
           xlabel="context length (tokens)", ylabel="needle depth",
           title=f"pass-key accuracy, overall {p['overall']:.2f}")
    fig.colorbar(image, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def format_result(result: dict) -> str:
  """The printed report: totals, one line per bucket, the pass-key table."""
  lines = [f"{result['model']}: loss {result['loss']:.4f} (perplexity "
           f"{result['perplexity']:.2f}) over {result['tokens']:,} tokens, S={result['seq_len']}",
           "  positions        loss     tokens"]
  for b in result["buckets"]:
    loss = "-" if b["loss"] is None else f"{b['loss']:.4f}"
    lines.append(f"  {b['start']:>6}-{b['end']:<8} {loss:>7} {b['tokens']:>10,}")
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
  parser.add_argument("--data", required=True, action="append",
                      help="files or globs, comma-separated or repeated")
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
  parser.add_argument("--json", help="write the result here")
  parser.add_argument("--plot", help="PNG of loss by position (and the pass-key heatmap)")
  parser.add_argument("--passkey", action="store_true", help="run the pass-key test")
  parser.add_argument("--passkey_trials", type=int, default=2, help="keys per cell")
  args = parser.parse_args(argv)
  if args.step is not None and not args.workdir:
    parser.error("--step goes with --workdir")
  return args


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
  windows = document_windows(data_config, mesh, vocab_size=config.vocab_size)
  if not windows.num_batches:
    raise ConfigError(f"--data {data_config.paths} holds no document of 2 or more tokens: "
                      "nothing to predict")
  if args.passkey:
    trials, keys = passkey_dataset(
        make_tokenizer(data_config.tokenizer), mesh, seq_len=args.seq_len,
        batch_size=data_config.batch_size, vocab_size=config.vocab_size,
        trials=args.passkey_trials)
  graphdef, params = nnx.split(finetune.load_model(source, config, mesh))
  evaluator = PositionEval(graphdef)
  result = {"model": os.path.abspath(source), "seq_len": args.seq_len,
            "mesh": dict(mesh.shape), **evaluator(params, windows)}
  if args.passkey:
    result["passkey"] = run_passkey(evaluator, params, trials, keys)
  print(format_result(result))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)
  if args.plot:
    plot(result, args.plot)
  return result


if __name__ == "__main__":
  try:
    main()
  except (ConfigError, ValueError, OSError) as e:
    sys.exit(f"error: {e}")
