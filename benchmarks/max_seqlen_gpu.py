"""Longest sequence a config's train step fits on a GPU cluster, by the GPU compiler (no GPU).

    make gpu-compile-venv
    .venv-gpu-compile/bin/python -m benchmarks.max_seqlen --gpu=h100,h200 \\
        --case=1x1x1:configs/llama8b_1gpu_1m.gin \\
        --case=1x1x8:configs/llama8b_8gpu_8m.gin:LlamaConfig.attn_head_chunks=4 \\
        --case=4x1x8:configs/llama8b_32gpu_32m.gin \\
        --json=benchmarks/results/max_seqlen_gpu.json --plot=benchmarks/plots/max_seqlen_gpu.png

(``python -m benchmarks.max_seqlen --gpu=...`` hands over to this module.) A case is
``TOPOLOGY:GIN_FILE[:GIN_PARAM[:GIN_PARAM...]]``: the config's layout on that cluster, with
only ``DataConfig.seq_len`` varied. A length fits when the step ``python -m ulysses_jax.aot``
compiles for it (``ulysses_jax.step_builder.build_train_step``, the trainer's own step) fits the
GPU's budget, its memory less the runtime reserve left to the CUDA context, the libraries and
NCCL (``ulysses_jax.gpus``; ``--reserve-gib`` to change it), and needs at most ``--host-gb``
of host memory per GPU (a DGX H100 has 2 TB for 8 GPUs). The search
(``benchmarks.common.search``) doubles from the config's length and bisects to
``--granularity`` tokens per GPU. Compiled, not run: no autotuning; the step time is the
roofline prediction of ``ulysses_jax.aot.roofline``. Arctic Long Sequence Training's
published Llama-3.1-8B lengths and iteration times on H100s (arXiv 2506.13996) stand beside
each row of the same GPU count, with our predicted step at ALST's length (rounded up to the
granularity).

A fine-tuning config takes its model from ``TrainConfig.init_from``; compiling needs only the
checkpoint's shapes, so ``--init-from-preset=NAME`` stands a directory holding only preset
NAME's Hugging Face ``config.json`` in for it, on every case (as ``tests/test_gpu_compile.py``
does), e.g. Mistral-7B-v0.1's windowed layers beside the same model with full attention:

    .venv-gpu-compile/bin/python -m benchmarks.max_seqlen --gpu=h100 \\
        --init-from-preset=mistral-7b-v0.1 \\
        --case=1x1x8:configs/finetune_mistral7b_8gpu_8m.gin \\
        --case=1x1x8:configs/finetune_mistral7b_8gpu_8m.gin:LlamaConfig.sliding_window=None \\
        --granularity=65536 --json=benchmarks/results/max_seqlen_gpu_window.json
"""

import argparse
import dataclasses
import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin cannot start without a GPU

from benchmarks import common  # noqa: E402
from ulysses_jax.aot import gpu_spec, parse_topology  # noqa: E402
from ulysses_jax.aot.report import compile_config  # noqa: E402
from ulysses_jax.cli import gin_config  # noqa: E402
from ulysses_jax.models.config import preset  # noqa: E402

GIB = 2**30
# Arctic Long Sequence Training, Llama-3.1-8B on H100s (arXiv 2506.13996): the longest sequence
# by GPU count and its measured iteration time in seconds (16:50, 1:47:35, 7:25:09).
ALST_H100 = {1: 500_000, 8: 3_700_000, 32: 15_000_000}
ALST_H100_STEP_S = {1: 16 * 60 + 50, 8: 3600 + 47 * 60 + 35, 32: 7 * 3600 + 25 * 60 + 9}


def parse_case(spec: str) -> tuple[str, str, list[str]]:
  """``TOPOLOGY:GIN_FILE[:GIN_PARAM...]`` -> (topology, gin file, gin params)."""
  parts = spec.split(":")
  if len(parts) < 2:
    raise ValueError(f"--case {spec!r}: expected TOPOLOGY:GIN_FILE[:GIN_PARAM...], e.g. "
                     "1x1x8:configs/llama8b_8gpu_8m.gin")
  parse_topology(parts[0])
  return parts[0], parts[1], parts[2:]


def preset_checkpoint(name: str, directory: str) -> str:
  """Writes preset ``name``'s Hugging Face ``config.json`` into ``directory`` (a checkpoint with
  no weights: enough for a fine-tuning config's ``init_from`` when compiling); returns it."""
  from ulysses_jax.hf import weights as hf
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf.config_to_hf(preset(name)), f)
  return directory


def longest(gpu: str, topology: str, gin_file: str, gin_params: list[str], *,
            granularity: int, host_gb: float, max_len: int,
            reserve_gib: float | None = None, init_from: str = "") -> dict:
  """The row of one case: the longest fitting length and the compiled figures there; on
  H100s also the predicted step at ALST's length for the GPU count. ``init_from``: the
  checkpoint directory of a fine-tuning config (its model's shapes)."""
  slices, hosts, per_host = parse_topology(topology)
  num_gpus = slices * hosts * per_host
  reports = {}
  bind = [f"TrainConfig.init_from = '{init_from}'"] if init_from else []
  config = gin_config.read([gin_file], bind + gin_params)

  def compile_at(seq_len: int) -> dict:
    data = dataclasses.replace(config.data, seq_len=seq_len)
    return compile_config(dataclasses.replace(config, data=data), gpu, topology,
                          reserve_gib=reserve_gib)

  def fits(seq_len: int) -> bool:
    r = compile_at(seq_len)
    reports[seq_len] = r
    ok = r["fits"] and r["host_bytes"] <= host_gb * 1e9
    print(f"  {gpu} {topology} S={seq_len:,}: device {r['device_bytes'] / GIB:.2f} GiB, host "
          f"{r['host_bytes'] / GIB:.2f} GiB per GPU -> {'fits' if ok else 'does not fit'}",
          flush=True)
    return ok

  best, first_failure = common.search(fits, granularity * num_gpus, max_len, config.data.seq_len)
  r = reports.get(best)
  alst = ALST_H100.get(num_gpus) if gpu == "h100" else None
  row = {
      "gpu": gpu, "gpus": num_gpus, "topology": topology,
      "config": " ".join([gin_file] + gin_params),
      "layer_windows": list(dict.fromkeys(config.model.layer_windows())),  # None: full
      "max_tokens": best,
      "tokens_per_gpu": best // num_gpus, "first_failure": first_failure,
      "device_gib": r and r["device_bytes"] / GIB, "host_gib_per_gpu": r and r["host_bytes"] / GIB,
      "capacity_gib": r and r["device_capacity_bytes"] / GIB,
      "budget_gib": r and r["budget_bytes"] / GIB,
      "predicted_step_s": r and r["prediction"]["step_s"],
      "alst_h100_tokens": alst, "vs_alst": alst and best / alst,
  }
  if alst:
    step = granularity * num_gpus
    at = -(-alst // step) * step
    row.update(alst_h100_step_s=ALST_H100_STEP_S[num_gpus], predicted_tokens_at_alst=at,
               predicted_step_s_at_alst=compile_at(at)["prediction"]["step_s"])
  return row


def plot(rows: list[dict], path: str) -> None:
  """Longest sequence by GPU count: each GPU kind's compiled result beside ALST's H100 one."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  counts = sorted({r["gpus"] for r in rows})
  series = {f"ulysses_jax {g.upper()} (compiled)": {r["gpus"]: r["max_tokens"] for r in rows
                                                     if r["gpu"] == g}
            for g in dict.fromkeys(r["gpu"] for r in rows)}
  series["ALST H100 (published)"] = ALST_H100
  figure, axis = plt.subplots(figsize=(7, 4))
  width = 0.8 / len(series)
  for i, (name, values) in enumerate(series.items()):
    axis.bar([c + (i - (len(series) - 1) / 2) * width for c in range(len(counts))],
             [values.get(c, 0) / 1e6 for c in counts], width, label=name)
  axis.set_xticks(range(len(counts)), [f"{c} GPU{'s' if c > 1 else ''}" for c in counts])
  axis.set_yscale("log")
  axis.set_ylabel("longest sequence (M tokens, log scale)")
  axis.legend()
  common.save_figure(figure, "Llama-3.1-8B, longest trainable sequence", path)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.max_seqlen --gpu=...",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gpu", required=True, help="comma-separated: h100, h200, a100")
  parser.add_argument("--case", action="append", required=True,
                      help="TOPOLOGY:GIN_FILE[:GIN_PARAM...] (repeatable)")
  parser.add_argument("--granularity", type=int, default=131072, help="tokens per GPU")
  parser.add_argument("--host-gb", type=float, default=256.0, help="host memory per GPU, GB")
  parser.add_argument("--reserve-gib", type=float, help="GPU memory left to the runtime, GiB "
                      "per GPU (default: the GPU table's, a tenth of the memory)")
  parser.add_argument("--max-len", type=int, default=2**31)
  parser.add_argument("--init-from-preset", default="",
                      help="for fine-tuning configs: their checkpoint (TrainConfig.init_from) "
                           "is a directory holding only this preset's config.json, every case")
  parser.add_argument("--json", default="")
  parser.add_argument("--plot", default="", help="PNG path")
  args = parser.parse_args(argv)
  common.check_plotting(parser, args.plot)
  try:
    cases = [parse_case(c) for c in args.case]
    gpus = args.gpu.split(",")
    for gpu in gpus:
      gpu_spec(gpu).with_reserve(args.reserve_gib)  # errors before any compile
    if args.init_from_preset:
      preset(args.init_from_preset)
  except ValueError as e:
    parser.error(str(e))
  with tempfile.TemporaryDirectory() as checkpoint:
    init_from = args.init_from_preset and preset_checkpoint(args.init_from_preset, checkpoint)
    rows = [longest(gpu, *case, granularity=args.granularity, host_gb=args.host_gb,
                    max_len=args.max_len, reserve_gib=args.reserve_gib, init_from=init_from)
            for gpu in gpus for case in cases]
  criterion = (f"compiled for the GPUs (not run): device bytes <= the budget (the GPU's "
               f"memory less the runtime reserve), host bytes <= {args.host_gb:g} GB per GPU")
  print(f"fits = {criterion}; granularity {args.granularity:,} tokens per GPU; step times "
        "are roofline predictions, ALST's are measured")
  common.print_table(rows, ["gpu", "gpus", "layer_windows", "max_tokens", "tokens_per_gpu",
                            "device_gib", "budget_gib", "host_gib_per_gpu", "predicted_step_s",
                            "alst_h100_tokens", "vs_alst", "alst_h100_step_s",
                            "predicted_step_s_at_alst"])
  if args.json:
    common.write_json(args.json, rows, criterion=criterion,
                      init_from_preset=args.init_from_preset or None)
  if args.plot:
    plot(rows, args.plot)
  return rows


if __name__ == "__main__":
  main()
