"""ulysses_jax against transformers + PyTorch: same model, weights, batch and optimizer.

    python -m benchmarks.vs_transformers --preset llama3.2-1b --seq-lens 4096,8192,16384 \\
        --find-max --plot benchmarks/plots/vs_transformers.png
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.vs_transformers \\
        --preset small --seq-lens 256,512,1024

A model preset is initialised once (on the CPU), written with ``ulysses_jax.hf.save_llama``
and read back by both sides: ``load_llama`` for ulysses_jax (sequence-sharded over all
devices, per-layer ``full`` remat, chunked loss) and
``transformers.AutoModelForCausalLM.from_pretrained`` for PyTorch (SDPA attention; on GPU
float32 weights under bfloat16 autocast, like our float32 parameters with bfloat16 compute,
and gradient checkpointing). Both train ``--steps`` steps of AdamW (betas 0.9/0.95, eps 1e-8,
no weight decay, no clipping, constant ``--lr``) on the same batch (one document per row,
labels = next token). The first-step loss of both is the sanity column: in float32 they
agree to 1e-4 relative or better (tests/test_benchmarks.py).

Memory: ours is the compiled step's per-device ``args + out + temp - alias`` (``est``) and on
GPU the allocator peak; PyTorch's is ``torch.cuda.max_memory_allocated`` (GPU only). With
``--find-max`` (GPU only) each side's longest fitting S is searched as in
``benchmarks.max_seqlen`` (PyTorch: a step without ``torch.cuda.OutOfMemoryError``). PyTorch
runs before JAX allocates anything on the GPU, and frees its cache after.
"""

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks import common, max_seqlen
from benchmarks.train_step import synthetic_batch
from ulysses_jax import make_mesh, metrics, train_step
from ulysses_jax.hf import load_llama, save_llama
from ulysses_jax.models import llama
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer

REMAT = "full"


def optimizer_config(lr: float, steps: int) -> OptimizerConfig:
  """AdamW at constant ``lr``, no decay, no clipping: what ``torch.optim.AdamW`` matches."""
  return OptimizerConfig(learning_rate=lr, warmup_steps=0, total_steps=steps + 1,
                         final_lr_fraction=1.0, weight_decay=0.0, clip_norm=0.0)


def export_initial_weights(preset: str, path: str, seed: int) -> llama.LlamaConfig:
  """Initialises ``preset`` on one CPU device and writes it to ``path`` (float32)."""
  cpu_mesh = make_mesh(data=1, seq=1, devices=jax.devices("cpu")[:1])
  model = llama.init_llama(llama.preset(preset), cpu_mesh, seed=seed)
  save_llama(model, path)
  return model.config


def timed_steps(one_step, steps: int) -> tuple[list[float], float]:
  """Runs ``one_step() -> loss`` ``steps`` times; losses and the median time of steps 2+."""
  losses, times = [], []
  for _ in range(steps):
    start = time.perf_counter()
    losses.append(one_step())
    times.append(time.perf_counter() - start)
  return losses, statistics.median(times[1:] or times)


def run_ours(path: str, batch: dict, *, dtype: str, lr: float, steps: int) -> dict:
  """Trains our model loaded from ``path``: losses, step time, est and peak GiB per device."""
  seq_len = batch["tokens"].shape[1]
  mesh = make_mesh(data=1, seq=jax.device_count())
  model = load_llama(path, mesh, dtype=dtype, remat_policy=REMAT)
  optimizer = make_optimizer(optimizer_config(lr, steps))
  graphdef, state = train_step.init_train_state(model, optimizer)
  del model
  compiled = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh,
                                        seq_len=seq_len).lower(state, batch).compile()
  holder = {"state": state}

  def one_step():
    holder["state"], step_metrics = compiled(holder["state"], batch)
    return float(step_metrics["loss"])

  losses, step_s = timed_steps(one_step, steps)
  peak = metrics.peak_memory_gib()
  return {"losses": losses, "step_s": step_s,
          "est_GiB": max_seqlen.device_bytes(compiled) / max_seqlen.GIB,
          "peak_GiB": float("nan") if peak is None else peak}


def run_torch(path: str, batch: dict, *, lr: float, steps: int, on_gpu: bool) -> dict:
  """Trains the ``transformers`` model loaded from ``path``: losses, step time, peak GiB."""
  import torch
  import transformers
  device = "cuda" if on_gpu else "cpu"
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="sdpa").to(device)
  if on_gpu:
    model.gradient_checkpointing_enable()
  model.train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.0)
  tokens = torch.from_numpy(batch["tokens"]).long().to(device)
  labels = torch.from_numpy(batch["labels"]).long().to(device)
  if on_gpu:
    torch.cuda.reset_peak_memory_stats()

  def one_step():
    with torch.autocast(device, dtype=torch.bfloat16, enabled=on_gpu):
      logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                             ignore_index=-1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()  # synchronises
    return value

  try:
    losses, step_s = timed_steps(one_step, steps)
    peak = torch.cuda.max_memory_allocated() / max_seqlen.GIB if on_gpu else float("nan")
  finally:
    del model, optimizer
    if on_gpu:
      torch.cuda.empty_cache()
  return {"losses": losses, "step_s": step_s, "peak_GiB": peak}


def torch_fits(path: str, batch_size: int, seq_len: int, vocab: int) -> bool:
  """Whether one PyTorch training step at ``seq_len`` runs without running out of memory."""
  import torch
  try:
    run_torch(path, synthetic_batch(batch_size, seq_len, vocab, 0), lr=1e-5, steps=1,
              on_gpu=True)
  except torch.cuda.OutOfMemoryError:
    torch.cuda.empty_cache()
    return False
  return True


def plot(rows: list[dict], path: str, title: str) -> None:
  """Tokens/s and memory against sequence length, one line per implementation."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(1, 2, figsize=(10, 4))
  for impl in dict.fromkeys(r["impl"] for r in rows):
    mine = [r for r in rows if r["impl"] == impl]
    lengths = [r["seq_len"] for r in mine]
    axes[0].plot(lengths, [r["tokens_per_s"] for r in mine], "o-", label=impl)
    for column, style in (("peak_GiB", "o-"), ("est_GiB", "x--")):
      values = [r[column] for r in mine]
      if not all(np.isnan(values)):
        axes[1].plot(lengths, values, style, label=f"{impl} {column[:-4]}")
  axes[0].set_ylabel("tokens/s")
  axes[1].set_ylabel("GiB per device")
  for axis in axes:
    axis.set_xscale("log", base=2)
    axis.set_xlabel("sequence length")
    axis.legend()
  common.save_figure(figure, title, path)


def main(argv=None) -> list[dict]:
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="small", choices=sorted(llama.PRESETS))
  parser.add_argument("--seq-lens", default="8192" if on_gpu else "512",
                      help="comma-separated sequence lengths")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--lr", type=float, default=1e-4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--find-max", action="store_true",
                      help="also search each side's longest sequence (GPU only)")
  parser.add_argument("--granularity", type=int, default=1024)
  parser.add_argument("--max-len", type=int, default=2**20)
  parser.add_argument("--json", default="")
  parser.add_argument("--plot", default="", help="PNG path")
  args = parser.parse_args(argv)
  common.check_plotting(parser, args.plot)
  seq_lens = [int(s) for s in args.seq_lens.split(",")]

  with tempfile.TemporaryDirectory() as path:
    config = export_initial_weights(args.preset, path, args.seed)
    batches = [synthetic_batch(args.batch, s, config.vocab_size, 0) for s in seq_lens]
    max_tokens = {"ours": "n/a", "torch": "n/a"}
    if args.find_max and on_gpu:  # before either side holds GPU memory in this process
      max_tokens["torch"] = max_seqlen.search(
          lambda s: torch_fits(path, args.batch, s, config.vocab_size), args.granularity,
          args.max_len)[0]
      setup = max_seqlen.Setup(args.preset, args.dtype, 1, jax.device_count(), args.batch)
      max_tokens["ours"] = max_seqlen.search(
          lambda s: max_seqlen.run_in_child(setup, max_seqlen.MemoryConfig(REMAT), s, 1)["fits"],
          max(args.granularity, jax.device_count()), args.max_len)[0]
    # All PyTorch runs first: JAX's allocator keeps what it once held.
    theirs = [run_torch(path, b, lr=args.lr, steps=args.steps, on_gpu=on_gpu) for b in batches]
    ours = [run_ours(path, b, dtype=args.dtype, lr=args.lr, steps=args.steps) for b in batches]

  rows, differences = [], []
  for seq_len, mine, other in zip(seq_lens, ours, theirs):
    differences.append(abs(mine["losses"][0] - other["losses"][0]) / abs(other["losses"][0]))
    rows += [{"impl": name, "seq_len": seq_len, "first_loss": result["losses"][0],
              "last_loss": result["losses"][-1], "step_s": result["step_s"],
              "tokens_per_s": args.batch * seq_len / result["step_s"],
              "est_GiB": result.get("est_GiB", float("nan")), "peak_GiB": result["peak_GiB"],
              "max_tokens": max_tokens[key]}
             for name, key, result in (("ulysses_jax", "ours", mine),
                                       ("transformers", "torch", other))]
  print(f"{args.preset}, batch {args.batch}, {args.dtype}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s) for ulysses_jax; first-step loss relative "
        f"difference per length: {', '.join(f'{d:.1e}' for d in differences)}")
  common.print_table(rows, list(rows[0]))
  if args.json:
    common.write_json(args.json, rows, first_loss_relative_difference=differences,
                      losses=[{"ulysses_jax": m["losses"], "transformers": t["losses"]}
                              for m, t in zip(ours, theirs)])
  if args.plot:
    plot(rows, args.plot, f"{args.preset}, batch {args.batch}, {args.dtype}")
  return rows


if __name__ == "__main__":
  main()
