"""ulysses_jax against transformers + PyTorch: same model, weights, batch and memory policy.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.vs_transformers \\
        --preset small --seq-lens 512,1024 --memory-policies none,full --repeats 5 \\
        --json /tmp/vs_transformers.json
    python -m benchmarks.vs_transformers --preset llama3.2-1b --seq-lens 4096,8192,16384 \\
        --find-max --plot /tmp/vs_transformers.png

A model preset is initialised once (on the CPU), written with ``ulysses_jax.hf.weights.save_llama``
and read back by both sides: ``load_llama`` for ulysses_jax (sequence-sharded over all
devices, chunked loss) and ``transformers.AutoModelForCausalLM.from_pretrained`` for PyTorch
(SDPA attention; on GPU float32 weights under bfloat16 autocast, like our float32 parameters
with bfloat16 compute). Both train on the same batch (one document per row, labels = next
token) with AdamW (betas 0.9/0.95, eps 1e-8, no weight decay, no clipping, constant
``--lr``), under the same memory policy, one row each (``--memory-policies``):

  none   nothing recomputed: our ``remat_policy="none"``, transformers without gradient
         checkpointing;
  full   each layer's forward recomputed in the backward, keeping its input: our
         ``remat_policy="full"``, transformers' ``gradient_checkpointing_enable()``.

Timing: one untimed step (compilation, warm-up), then ``--repeats`` timed steps per side;
each row gives the median step time with its min and max, the tokens/s of the median, and
``speed_ratio`` = our tokens/s / transformers' (measured in the same process, one side right
after the other). The first-step losses agree to 1e-4 relative or better in float32
(tests/test_benchmarks.py). The JSON also records the device, the versions (jax, flax,
torch, transformers) and PyTorch's thread count.

Memory: ours is the compiled step's per-device ``args + out + temp - alias`` (``est``) and on
GPU the allocator peak; PyTorch's is ``torch.cuda.max_memory_allocated`` (GPU only). With
``--find-max`` (GPU only) each side's longest fitting S is searched as in
``benchmarks.max_seqlen`` (PyTorch: a step without ``torch.cuda.OutOfMemoryError``). PyTorch
runs before JAX allocates anything on the GPU, and frees its cache after. A side that runs
out of memory at a length (``torch.cuda.OutOfMemoryError``, XLA's RESOURCE_EXHAUSTED) gets
``OOM`` as its status in that row and NaN figures; the other rows still run.
"""

import argparse
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks import common, max_seqlen
from benchmarks.train_step import synthetic_batch
from ulysses_jax import make_mesh, metrics, train_step
from ulysses_jax.hf.weights import load_llama, save_llama
from ulysses_jax.models import llama
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer

MEMORY_POLICIES = ("none", "full")  # our remat policy = transformers' checkpointing or not


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


def timed_steps(one_step, repeats: int) -> tuple[list[float], list[float]]:
  """Runs ``one_step() -> loss`` once untimed, then ``repeats`` times timed: (all losses,
  the timed steps' seconds)."""
  losses, times = [one_step()], []
  for _ in range(repeats):
    start = time.perf_counter()
    losses.append(one_step())
    times.append(time.perf_counter() - start)
  return losses, times


def run_ours(path: str, batch: dict, *, dtype: str, lr: float, repeats: int,
             policy: str) -> dict:
  """Trains our model loaded from ``path`` with remat ``policy``: losses, step times, est and
  peak GiB per device."""
  seq_len = batch["tokens"].shape[1]
  mesh = make_mesh(data=1, seq=jax.device_count())
  model = load_llama(path, mesh, dtype=dtype, remat_policy=policy)
  optimizer = make_optimizer(optimizer_config(lr, repeats + 1))
  graphdef, state = train_step.init_train_state(model, optimizer)
  del model
  compiled = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh,
                                        seq_len=seq_len).lower(state, batch).compile()
  holder = {"state": state}

  def one_step():
    holder["state"], step_metrics = compiled(holder["state"], batch)
    return float(step_metrics["loss"])

  losses, times = timed_steps(one_step, repeats)
  peak = metrics.peak_memory_gib()
  return {"losses": losses, "times": times,
          "est_GiB": max_seqlen.device_bytes(compiled) / max_seqlen.GIB,
          "peak_GiB": float("nan") if peak is None else peak}


def run_torch(path: str, batch: dict, *, lr: float, repeats: int, on_gpu: bool,
              policy: str) -> dict:
  """Trains the ``transformers`` model loaded from ``path``, with gradient checkpointing for
  ``policy="full"``: losses, step times, peak GiB."""
  import torch
  import transformers
  device = "cuda" if on_gpu else "cpu"
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="sdpa").to(device)
  if policy == "full":  # transformers 5 renamed gradient_checkpointing_enable
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
  model.train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.0)
  tokens = torch.from_numpy(batch["tokens"]).long().to(device)
  labels = torch.from_numpy(batch["labels"]).long().to(device)
  if on_gpu:
    torch.cuda.reset_peak_memory_stats()

  def one_step():
    with torch.autocast(device, dtype=torch.bfloat16, enabled=on_gpu):
      logits = model(input_ids=tokens).logits  # noqa: F821  (a closure cell, del'd below)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                             ignore_index=-1)
    loss.backward()
    optimizer.step()  # noqa: F821
    optimizer.zero_grad(set_to_none=True)  # noqa: F821
    value = loss.item()  # synchronises
    return value

  try:
    losses, times = timed_steps(one_step, repeats)
    peak = torch.cuda.max_memory_allocated() / max_seqlen.GIB if on_gpu else float("nan")
  finally:
    del model, optimizer
    if on_gpu:
      torch.cuda.empty_cache()
  return {"losses": losses, "times": times, "peak_GiB": peak}


def torch_fits(path: str, batch_size: int, seq_len: int, vocab: int, policy: str) -> bool:
  """Whether PyTorch training steps at ``seq_len`` run without running out of memory."""
  return or_out_of_memory(run_torch, path, synthetic_batch(batch_size, seq_len, vocab, 0),
                          lr=1e-5, repeats=1, on_gpu=True, policy=policy)["status"] == "ok"


def plot(rows: list[dict], path: str, title: str) -> None:
  """Tokens/s and memory against sequence length, one line per implementation and policy."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(1, 2, figsize=(10, 4))
  for policy in dict.fromkeys(r["memory_policy"] for r in rows):
    mine = [r for r in rows if r["memory_policy"] == policy]
    lengths = [r["seq_len"] for r in mine]
    for impl in ("ours", "torch"):
      label = f"{'ulysses_jax' if impl == 'ours' else 'transformers'} ({policy})"
      axes[0].plot(lengths, [r[f"{impl}_tokens_per_s"] for r in mine], "o-", label=label)
      for column, style in (("peak_GiB", "o-"), ("est_GiB", "x--")):
        values = [r.get(f"{impl}_{column}", float("nan")) for r in mine]
        if not all(np.isnan(values)):
          axes[1].plot(lengths, values, style, label=f"{label} {column[:-4]}")
  axes[0].set_ylabel("tokens/s (median step)")
  axes[1].set_ylabel("GiB per device")
  for axis in axes:
    axis.set_xscale("log", base=2)
    axis.set_xlabel("sequence length")
    axis.legend()
  common.save_figure(figure, title, path)


def or_out_of_memory(run, *args, **kwargs) -> dict:
  """``run(*args, **kwargs)`` (``run_ours``, ``run_torch``), or ``{"status": "OOM", ...}``
  where the device ran out of memory: the row records it and the other rows still run."""
  try:
    return {"status": "ok", **run(*args, **kwargs)}
  except Exception as error:  # noqa: BLE001 - torch's and XLA's out-of-memory errors only
    if not is_out_of_memory(error):
      raise
    message = str(error).splitlines()[0][:200]
  print(f"out of memory in {run.__name__}: {message}", flush=True)
  free_torch_memory()  # after the except block: the traceback held the step's tensors
  return {"status": "OOM", "losses": [], "times": [], "peak_GiB": float("nan")}


def is_out_of_memory(error: Exception) -> bool:
  """Whether ``error`` is PyTorch's or XLA's report of a device out of memory."""
  names = {cls.__name__ for cls in type(error).__mro__}
  return "OutOfMemoryError" in names or (
      isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error))


def free_torch_memory() -> None:
  """Hands the memory PyTorch caches on the GPU back (nothing on a CPU)."""
  import torch
  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def side_columns(impl: str, result: dict, tokens: int) -> dict:
  """One side's columns of a row: status (ok or OOM), losses, step-time median / min / max,
  tokens/s, memory (NaN where it ran out of memory)."""
  if result["status"] != "ok":
    nan = float("nan")
    return {f"{impl}_status": result["status"], **{f"{impl}_{k}": nan for k in (
        "first_loss", "last_loss", "step_s", "step_s_min", "step_s_max", "tokens_per_s",
        "peak_GiB", "est_GiB")}}
  median = statistics.median(result["times"])
  columns = {"first_loss": result["losses"][0], "last_loss": result["losses"][-1],
             "step_s": median, "step_s_min": min(result["times"]),
             "step_s_max": max(result["times"]), "tokens_per_s": tokens / median,
             "peak_GiB": result["peak_GiB"]}
  if "est_GiB" in result:
    columns["est_GiB"] = result["est_GiB"]
  return {f"{impl}_status": "ok", **{f"{impl}_{k}": v for k, v in columns.items()}}


def step_text(row: dict, impl: str) -> str:
  """A side's step time in the table: median [min, max], or its status (OOM)."""
  if row[f"{impl}_status"] != "ok":
    return row[f"{impl}_status"]
  return (f"{row[f'{impl}_step_s']:.3g} [{row[f'{impl}_step_s_min']:.3g}, "
          f"{row[f'{impl}_step_s_max']:.3g}]")


def versions() -> dict:
  """PyTorch's side of the environment (``common.environment`` records JAX's)."""
  import torch
  import transformers
  return {"torch": torch.__version__, "transformers": transformers.__version__,
          "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def main(argv=None) -> list[dict]:
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="small", choices=sorted(llama.PRESETS))
  parser.add_argument("--seq-lens", default="8192" if on_gpu else "512",
                      help="comma-separated sequence lengths")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
  parser.add_argument("--memory-policies", default=",".join(MEMORY_POLICIES),
                      help=f"comma-separated, of {MEMORY_POLICIES} (see the module docstring)")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed steps per side, after one untimed step")
  parser.add_argument("--lr", type=float, default=1e-4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--find-max", action="store_true",
                      help="also search each side's longest sequence (GPU only)")
  parser.add_argument("--granularity", type=int, default=1024)
  parser.add_argument("--max-len", type=int, default=2**20)
  parser.add_argument("--json", default="", help="write the rows here as JSON "
                      "(nothing is written without it)")
  parser.add_argument("--plot", default="", help="PNG path")
  args = parser.parse_args(argv)
  common.check_plotting(parser, args.plot)
  policies = args.memory_policies.split(",")
  if unknown := [p for p in policies if p not in MEMORY_POLICIES]:
    parser.error(f"unknown --memory-policies {unknown}; choose from {MEMORY_POLICIES}")
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  cases = [(int(s), policy) for s in args.seq_lens.split(",") for policy in policies]

  with tempfile.TemporaryDirectory() as path:
    config = export_initial_weights(args.preset, path, args.seed)
    batches = {s: synthetic_batch(args.batch, s, config.vocab_size, 0) for s, _ in cases}
    max_tokens = {}
    if args.find_max and on_gpu:  # before either side holds GPU memory in this process
      for policy in policies:
        max_tokens["torch", policy] = common.search(
            lambda s, policy=policy: torch_fits(path, args.batch, s, config.vocab_size, policy),
            args.granularity, args.max_len)[0]
        setup = max_seqlen.Setup(args.preset, args.dtype, 1, jax.device_count(), args.batch)
        max_tokens["ours", policy] = common.search(
            lambda s, setup=setup, policy=policy: max_seqlen.run_in_child(
                setup, max_seqlen.MemoryConfig(policy), s, 1)["fits"],
            max(args.granularity, jax.device_count()), args.max_len)[0]
    # All PyTorch runs first: JAX's allocator keeps what it once held.
    common_args = dict(lr=args.lr, repeats=args.repeats)
    theirs = [or_out_of_memory(run_torch, path, batches[s], on_gpu=on_gpu, policy=p,
                               **common_args) for s, p in cases]
    ours = [or_out_of_memory(run_ours, path, batches[s], dtype=args.dtype, policy=p,
                             **common_args) for s, p in cases]

  rows = []
  for (seq_len, policy), mine, other in zip(cases, ours, theirs):
    tokens = args.batch * seq_len
    row = {"seq_len": seq_len, "memory_policy": policy, **side_columns("ours", mine, tokens),
           **side_columns("torch", other, tokens)}
    row["speed_ratio"] = row["ours_tokens_per_s"] / row["torch_tokens_per_s"]
    row["first_loss_rel_diff"] = abs(row["ours_first_loss"] - row["torch_first_loss"]) / abs(
        row["torch_first_loss"])
    row["ours_max_tokens"] = max_tokens.get(("ours", policy), "n/a")
    row["torch_max_tokens"] = max_tokens.get(("torch", policy), "n/a")
    rows.append(row)
  print(f"{args.preset}, batch {args.batch}, {args.dtype}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s) for ulysses_jax, {versions()}; step times: "
        f"median [min, max] of {args.repeats} timed steps after one untimed")
  common.print_table([{**r, "ours_step_s": step_text(r, "ours"),
                       "torch_step_s": step_text(r, "torch")} for r in rows],
                     ["seq_len", "memory_policy", "ours_step_s", "ours_tokens_per_s",
                      "torch_step_s", "torch_tokens_per_s", "speed_ratio", "first_loss_rel_diff",
                      "ours_est_GiB", "ours_peak_GiB", "torch_peak_GiB"])
  if args.json:
    common.write_json(args.json, rows, versions=versions(), repeats=args.repeats,
                      losses=[{"ulysses_jax": m["losses"], "transformers": t["losses"]}
                              for m, t in zip(ours, theirs)],
                      step_times=[{"ulysses_jax": m["times"], "transformers": t["times"]}
                                  for m, t in zip(ours, theirs)])
  if args.plot:
    plot(rows, args.plot, f"{args.preset}, batch {args.batch}, {args.dtype}")
  return rows


if __name__ == "__main__":
  main()
