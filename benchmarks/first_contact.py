"""A user's first contact with the shipped GPU configs on one GPU, through the real commands
(``benchmarks/gpu_session.sh first-contact``; ``--cpu``: the same path on the CPU with tiny
shapes, which tests/test_benchmarks.py runs).

Every config of ``configs/*.gin`` that includes ``configs/runs/gpu.gin`` is cut to one device
with ``--gin_param`` (``cut``: 4 layers, which the configs' remat groups divide, ``seq_len``
tokens, a few steps, a checkpoint every 2, every 10 in the first config's longer run) and
trained with ``python -m ulysses_jax.train`` (the kernel self-check, the memory line, the
checkpoints); a fine-tuning config starts from a random Hugging Face checkpoint of its family
that transformers writes (bfloat16). The first config's run is stopped by SIGTERM after its
second step (exit 75, a checkpoint) and resumed by the same command; on it then run
``ulysses-evaluate`` (loss by position, pass-key retrieval), ``ulysses-generate`` from a long
prompt (in the run's bfloat16, with the attention kernels its start-up lines name),
``ulysses-export``, transformers loading the export (on the GPU when there is one) with logits
equal to ours in float32 (``--compare``), and ``ulysses-doctor``.

Prints one table (command, exit code, seconds, the figure that matters) and writes it with
every command line and log to ``OUT/first_contact.json``; exits 1 unless every row passed.
"""

import argparse
import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from ulysses_jax.doctor.timing import format_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_RUN = "include 'configs/runs/gpu.gin'"
FIRST = "configs/llama1b_128k.gin"  # the README's first GPU run: the whole path runs on it
# Relative L2 distance of transformers' logits from ours, both computing in float32 with full
# float32 matmuls (no TF32): rounding alone stays below 1e-4; a misread weight is of order 1. In
# bfloat16 a mixture of experts routes some tokens to other experts on either side (near-tied
# router logits): gpt-oss measured 0.042 there on the CPU, routing noise rather than an error.
LOGITS_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class Size:
  """The shapes of one mode: tokens per row, model cut, prompt and doctor lengths."""
  seq_len: int
  model: tuple[str, ...]       # gin bindings cutting a from-scratch model
  hf_model: dict               # transformers config fields of the random checkpoints
  prompt_len: int
  new_tokens: int
  doctor: tuple[str, ...]
  platform: tuple[str, ...]    # gin bindings choosing the platform


_HF_GPU = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, intermediate_size=1024)
_HF_CPU = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=128)
SIZES = {
    "gpu": Size(seq_len=8192, model=("LlamaConfig.num_layers = 4",), hf_model=_HF_GPU,
                prompt_len=6000, new_tokens=32, doctor=("--seq_lens=4096",), platform=()),
    "cpu": Size(seq_len=256, model=(
        "LlamaConfig.num_layers = 4", "LlamaConfig.hidden_dim = 64", "LlamaConfig.num_heads = 4",
        "LlamaConfig.num_kv_heads = 4", "LlamaConfig.head_dim = 16", "LlamaConfig.mlp_dim = 128",
        "LlamaConfig.vocab_size = 256"), hf_model=_HF_CPU, prompt_len=160, new_tokens=4,
        doctor=("--seq_lens=256", "--platform=cpu", "--no_step"),
        platform=("TrainConfig.platform = 'cpu'",)),
}
# The family of each fine-tuning config's checkpoint, by a part of its file name.
FAMILIES = {"gpt_oss": "gpt_oss", "qwen3": "qwen3_moe", "mistral": "mistral", "llama": "llama"}
FAMILY_FIELDS = {
    "gpt_oss": lambda size: dict(num_local_experts=4, num_experts_per_tok=2,
                                 intermediate_size=size["hidden_size"],
                                 layer_types=["sliding_attention", "full_attention"] * 2,
                                 sliding_window=128),
    "qwen3_moe": lambda size: dict(num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=size["hidden_size"] // 2),
    "mistral": lambda size: dict(sliding_window=None),
    "llama": lambda size: {},
}
STOP_AFTER_STEP = 2  # the first config's run gets SIGTERM once this step is logged
LONG_STEPS = 20      # ... out of these (so that it is still training when the signal lands)
# Checkpoints every this many steps in the first config's runs: the cut 1B model's state is
# 9 GB (its 128K-token vocabulary), and saving it every 2 steps held the resumed run on an H200
# past 2 minutes, at step 22 of 40 (2026-11-27).
LONG_SAVE_EVERY = 10


@dataclasses.dataclass
class Row:
  command: str
  exit_code: int | None
  seconds: float
  figure: str
  passed: bool
  argv: list[str] = dataclasses.field(default_factory=list)
  log: str = ""


def shipped_gpu_configs() -> list[str]:
  """``configs/*.gin`` that include the GPU run settings, relative to the repository,
  ``FIRST`` first."""
  configs = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.gin"))
             if GPU_RUN in open(p, encoding="utf-8").read()]
  return sorted(configs, key=lambda c: (c != FIRST, c))


def family_of(config: str) -> str | None:
  """The Hugging Face family a fine-tuning config starts from (None: trained from scratch)."""
  text = open(os.path.join(ROOT, config), encoding="utf-8").read()
  if "TrainConfig.init_from = %gin.REQUIRED" not in text:
    return None
  name = os.path.basename(config)
  return next(family for key, family in FAMILIES.items() if key in name)


def write_hf_checkpoint(family: str, size: Size, directory: str, max_positions: int) -> None:
  """A random bfloat16 checkpoint of ``family`` at ``size``, written by transformers."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  fields = {**size.hf_model, **FAMILY_FIELDS[family](size.hf_model),
            "max_position_embeddings": max_positions}
  torch.manual_seed(0)
  config = transformers.AutoConfig.for_model(family, **fields)
  model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
  model.save_pretrained(directory)


def cut(config: str, size: Size, out: str, steps: int, save_every: int = 2) -> list[str]:
  """The ``--gin_param`` flags cutting ``config`` to one device and a few steps, a checkpoint
  every ``save_every``."""
  params = [f"TrainConfig.steps = {steps}", "TrainConfig.mesh_data = 1",
            "TrainConfig.mesh_seq = 1", "TrainConfig.mesh_ring = 1", "TrainConfig.accum_steps = 1",
            "TrainConfig.log_every = 1", "TrainConfig.eval_every = 0",
            "TrainConfig.eval_batches = 1", "TrainConfig.export_at_end = ''",
            "TrainConfig.progress_bar = False",
            f"TrainConfig.compilation_cache = '{os.path.join(out, 'jax_cache')}'",
            f"DataConfig.seq_len = {size.seq_len}", "DataConfig.batch_size = 1",
            f"CheckpointConfig.save_every = {save_every}", *size.platform]
  family = family_of(config)
  if family is None:
    return params + list(size.model)
  return params + [f"TrainConfig.init_from = '{os.path.join(out, 'hf', family)}'",
                   f"DataConfig.paths = ('{os.path.join(out, 'tokens.npy')}',)"]


def run(command: str, argv: list[str], env: dict, expect: int = 0,
        stop_at: str | None = None) -> Row:
  """Runs ``argv`` (``stop_at``: SIGTERM once a line matches it) and times it."""
  start = time.perf_counter()
  process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  lines = []
  for line in process.stdout:
    lines.append(line)
    if stop_at and re.search(stop_at, line):
      process.send_signal(signal.SIGTERM)
      stop_at = None
  code = process.wait()
  log = "".join(lines)
  return Row(command, code, time.perf_counter() - start, "", code == expect, argv, log)


def train_figure(row: Row, workdir: str) -> None:
  """Steps, tokens/s, memory and checkpoints of a training run, from its log and workdir."""
  steps = re.findall(r"step (\d+)/\d+\s+loss (\S+)\s+([\d,]+) tok/s", row.log)
  memory = re.search(r"per device: (.*?); compiled figure of the step (\S+ GiB)", row.log)
  checkpoints = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                       if d.isdigit()) if os.path.isdir(os.path.join(workdir,
                                                                     "checkpoints")) else []
  figure = []
  if steps:
    figure.append(f"step {steps[-1][0]} loss {steps[-1][1]}, {steps[-1][2]} tok/s")
  if memory:
    figure.append(f"memory {memory.group(1).split(' (')[0]} vs compiled {memory.group(2)}")
  figure.append(f"checkpoints {checkpoints}")
  row.figure = "; ".join(figure)
  row.passed = row.passed and bool(steps) and bool(checkpoints)


def compare_with_transformers(export: str, seq_len: int) -> dict:
  """Logits of ``export`` from transformers (on the GPU if there is one) and from ulysses_jax,
  both in float32 (``LOGITS_TOLERANCE``), on one row of random tokens: their relative L2
  distance."""
  import jax  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from ulysses_jax.hf import weights as hf  # pylint: disable=import-outside-toplevel
  from ulysses_jax.mesh import make_mesh  # pylint: disable=import-outside-toplevel
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.backends.cuda.matmul.allow_tf32 = False
  model = transformers.AutoModelForCausalLM.from_pretrained(
      export, dtype=torch.float32).to(device).eval()
  tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, seq_len))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, device=device)).logits.float().cpu().numpy()
  del model
  torch.cuda.empty_cache() if device == "cuda" else None
  mesh = make_mesh(1, 1, devices=jax.devices()[:1])
  ours_model = hf.load_llama(export, mesh, dtype="float32", param_dtype="float32",
                             attention_backend="xla")
  with jax.default_matmul_precision("highest"):
    ours = np.asarray(ours_model(jax.numpy.asarray(tokens, jax.numpy.int32)), np.float32)
  distance = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
  return {"torch_device": device, "jax_device": jax.devices()[0].device_kind,
          "tokens": seq_len, "relative_l2": distance, "tolerance": LOGITS_TOLERANCE,
          "max_abs": float(np.abs(ours - theirs).max()),
          "top1_agreement": float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))}


def first_contact(out: str, mode: str, configs: list[str]) -> list[Row]:
  """Every command of the path, in order; a row per command."""
  size = SIZES[mode]
  os.makedirs(out, exist_ok=True)
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  python = [sys.executable, "-m"]
  rows = []

  def record(row: Row) -> None:
    """Keeps ``row`` and prints it at once, with the command and its log's end if it failed
    (a run stopped later keeps what it printed)."""
    rows.append(row)
    print(f"[{'ok' if row.passed else 'FAILED'}] {row.command}: exit {row.exit_code}, "
          f"{row.seconds:.1f} s; {row.figure}", flush=True)
    if not row.passed:
      print(f"{' '.join(row.argv)}\n{row.log[-3000:]}", flush=True)

  families = {f for f in map(family_of, configs) if f}
  if families:
    vocab = size.hf_model["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, 8 * (size.seq_len + 1), np.int32)
    np.save(os.path.join(out, "tokens.npy"), tokens)
    for family in sorted(families):
      start = time.perf_counter()
      write_hf_checkpoint(family, size, os.path.join(out, "hf", family), 2 * size.seq_len)
      record(Row(f"transformers writes a random {family}", 0,
                      time.perf_counter() - start, "bfloat16", True))
  first = configs[0]
  for config in configs:
    name = os.path.splitext(os.path.basename(config))[0]
    workdir = os.path.join(out, "runs", name)
    train = [*python, "ulysses_jax.train", f"--gin_file={config}", f"--workdir={workdir}"]
    if config == first:
      flags = [f"--gin_param={p}" for p in cut(config, size, out, LONG_STEPS, LONG_SAVE_EVERY)]
      row = run(f"ulysses-train {name} (SIGTERM after step {STOP_AFTER_STEP})",
                train + flags, env, expect=75, stop_at=rf"step {STOP_AFTER_STEP}/{LONG_STEPS}")
      train_figure(row, workdir)
      record(row)
      row = run(f"ulysses-train {name} (resumed)", train + flags, env)
      train_figure(row, workdir)
      resumed = re.search(r"resumed from step (\d+)", row.log)
      row.figure = (f"resumed from step {resumed.group(1)}; " if resumed else
                    "NOT resumed; ") + row.figure
      row.passed = row.passed and bool(resumed)
      record(row)
      continue
    flags = [f"--gin_param={p}" for p in cut(config, size, out, 4)]
    row = run(f"ulysses-train {name}", train + flags, env)
    train_figure(row, workdir)
    record(row)

  workdir = os.path.join(out, "runs", os.path.splitext(os.path.basename(first))[0])
  platform = ["--platform=cpu"] if mode == "cpu" else []
  data = ",".join(os.path.join(ROOT, "ulysses_jax", f) for f in ("train/__init__.py",
                                                                 "generate/__init__.py"))
  result = os.path.join(out, "evaluate.json")
  row = run("ulysses-evaluate (by position, passkey)",
            [*python, "ulysses_jax.evaluate", f"--workdir={workdir}",
             f"--seq_len={size.seq_len}", f"--data={data}", "--passkey", "--passkey_trials=1",
             f"--json={result}", *platform], env)
  if row.exit_code == 0:
    report = json.load(open(result, encoding="utf-8"))
    row.figure = (f"loss {report['loss']:.3f} over {report['tokens']} tokens; passkey "
                  f"{report['passkey']['overall']:.2f}")
  record(row)

  prompt = open(os.path.join(ROOT, "ulysses_jax", "train", "__init__.py"),
                encoding="utf-8").read()[:size.prompt_len]
  result = os.path.join(out, "generate.json")
  row = run(f"ulysses-generate ({len(prompt)}-token prompt)",
            [*python, "ulysses_jax.generate", f"--workdir={workdir}", f"--prompt={prompt}",
             f"--max_new_tokens={size.new_tokens}", f"--json={result}", *platform], env)
  dtype = re.search(r"computing in (\S+) \(", row.log)
  speed = re.search(r"(\d+) tokens generated in (\S+) s", row.log)
  attention = re.search(r"^attention: (.*)$", row.log, re.M)
  row.figure = "; ".join(x for x in (
      dtype and f"{dtype.group(1)}", speed and f"{speed.group(1)} tokens in {speed.group(2)} s",
      attention and attention.group(1)[:80]) if x)
  row.passed = row.passed and bool(dtype) and dtype.group(1) == "bfloat16"
  record(row)

  export = os.path.join(out, "export")
  row = run("ulysses-export", [*python, "ulysses_jax.export", f"--workdir={workdir}",
                               f"--out={export}"], env)
  if row.exit_code == 0:
    row.figure = f"{len(os.listdir(export))} files in {export}"
  record(row)

  result = os.path.join(out, "transformers.json")
  if os.path.isfile(os.path.join(export, "config.json")):
    row = run("transformers loads the export", [
        sys.executable, "-m", "benchmarks.first_contact", f"--compare={export}",
        f"--out={out}", f"--mode={mode}"], {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  else:
    row = Row("transformers loads the export", None, 0.0, "no export to load", False)
  if row.exit_code == 0:
    report = json.load(open(result, encoding="utf-8"))
    row.figure = (f"logits relative L2 {report['relative_l2']:.2e} (<= {LOGITS_TOLERANCE}), "
                  f"top-1 agree {report['top1_agreement']:.3f}, torch on "
                  f"{report['torch_device']}")
    row.passed = report["relative_l2"] <= LOGITS_TOLERANCE
  record(row)

  result = os.path.join(out, "doctor.json")
  row = run("ulysses-doctor", [*python, "ulysses_jax.doctor", f"--json={result}",
                               *size.doctor], env)
  if os.path.isfile(result):
    checks = json.load(open(result, encoding="utf-8"))["checks"]
    passed = sum(c["passed"] is True for c in checks)
    failed = [c["name"] for c in checks if c["passed"] is False]
    untried = sum(c["passed"] is None for c in checks)
    row.figure = f"{passed} of {len(checks)} checks passed ({untried} need a GPU)" + (
        f"; failed: {', '.join(failed)}" if failed else "")
  record(row)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="a new folder for the runs, logs and JSON")
  p.add_argument("--mode", choices=sorted(SIZES), default="gpu",
                 help="gpu (default): the configs' shapes cut to one GPU; cpu: tiny shapes")
  p.add_argument("--configs", help="comma-separated configs (default: every shipped GPU "
                 "config; the first gets the SIGTERM and the path after training)")
  p.add_argument("--compare", help=argparse.SUPPRESS)  # the transformers check's process
  args = p.parse_args(argv)
  if args.compare:
    report = compare_with_transformers(args.compare, min(SIZES[args.mode].seq_len, 512))
    with open(os.path.join(args.out, "transformers.json"), "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0
  configs = args.configs.split(",") if args.configs else shipped_gpu_configs()
  start = time.perf_counter()
  rows = first_contact(args.out, args.mode, configs)
  table = [{"command": r.command, "exit": r.exit_code, "seconds": round(r.seconds, 1),
            "ok": "ok" if r.passed else "FAILED", "figure": r.figure} for r in rows]
  print(format_table(table, ["command", "exit", "seconds", "ok", "figure"]))
  total = time.perf_counter() - start
  print(f"{sum(r.passed for r in rows)} of {len(rows)} commands passed in {total:.0f} s")
  with open(os.path.join(args.out, "first_contact.json"), "w", encoding="utf-8") as f:
    json.dump({"mode": args.mode, "seconds": total, "rows": [dataclasses.asdict(r)
                                                             for r in rows]}, f, indent=1)
  return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
