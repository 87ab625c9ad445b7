"""Host data throughput: files to packed training rows, beside what the GPU configs consume.

Each case builds the rows of a ``DataConfig`` as the trainer does (``data.make_rows``: read,
tokenize or render, split, shuffle) and then packs every training row of one epoch
(``rows.train(r)``, what ``Dataset.local_batch`` stacks); wall time on this machine, no JAX:

* ``parquet_tokens``: pre-tokenized ``input_ids`` (uint32 lists, documents of log-normal length
  around 4K tokens) in 4 Parquet files, read by row group, into rows of ``--seq_len`` (65,536);
* ``jsonl_text``: the standard library's ``.py`` files as JSONL ``text`` records through a fast
  byte-level BPE tokenizer (32K ids, trained here on a slice of the same text; not timed);
* ``token_dir``: the same text tokenized once by ``ulysses_jax.preprocess --out`` (not timed),
  read memory-mapped, as a long run reads it;
* ``chat_generation`` / ``chat_turns``: JSONL ``messages`` conversations (2-8 turns of stdlib
  lines, a system turn in half) in a ChatML template with ``{% generation %}`` (one render per
  conversation) and without it (turn by turn: one render per trained turn more).

``need`` is the most tokens per second per host (8 GPUs, or fewer when the config has fewer)
that a shipped GPU config consumes: ``tokens_per_step / step_s`` per host from
``benchmarks/results/aot_kernels/*_<jax>.json`` (step times predicted by ``ulysses_jax.aot``'s
roofline, compiled not run) and the Llama-3.2-1B step measured on one H100 (RESULTS.md: 15,490
tokens/s, cuDNN, 64K tokens) times 8 GPUs; ``ratio`` = measured / need (goal >= 10).

  python -m benchmarks.data_pipeline [--tokens 20000000] [--text_files N] [--json PATH]
"""

import argparse
import glob
import json
import math
import os
import sysconfig
import tempfile
import time

import numpy as np

from benchmarks.common import print_table, write_json
from ulysses_jax.data import preprocess
from ulysses_jax.data import pipeline as data

COLUMNS = ["case", "tokens", "load_s", "pack_s", "load_tok_s", "pack_tok_s", "total_tok_s",
           "need_tok_s", "ratio"]
MEASURED_1B_H100_TOK_S = 15_490  # RESULTS.md, "Llama-3.2-1B training step at 65,536 tokens"
CHATML = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
          "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")


def gpu_needs(jax_version: str = "0.10.2") -> list[dict]:
  """Tokens per second per host of each shipped GPU config (see the module docstring)."""
  rows = [{"config": "llama3.2-1b 64K, 1 H100 measured x 8 per host",
           "tok_s_per_host": 8 * MEASURED_1B_H100_TOK_S}]
  pattern = os.path.join(os.path.dirname(__file__), "results", "aot_kernels",
                         f"*_{jax_version}.json")
  for path in sorted(glob.glob(pattern)):
    with open(path) as f:
      report = json.load(f)
    hosts = math.ceil(report["devices"] / 8)
    rows.append({"config": os.path.basename(path).removesuffix(f"_{jax_version}.json")
                 + f" ({report['devices']} GPUs, predicted)",
                 "tok_s_per_host": report["tokens_per_step"] / report["prediction"]["step_s"]
                 / hosts})
  return rows


def _stdlib_texts() -> list[str]:
  root = sysconfig.get_paths()["stdlib"]
  texts = []
  for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
    if "site-packages" not in path:
      with open(path, encoding="utf-8", errors="replace") as f:
        texts.append(f.read())
  return texts


def _tokenizer(directory: str, texts: list[str], template: str | None) -> str:
  """A byte-level BPE tokenizer of 32K ids trained on a slice of ``texts``, saved with
  ``template`` as its chat template; returns the tokenizer.json path."""
  import tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=32_000, special_tokens=["<|im_start|>", "<|im_end|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts[::20], trainer)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  if template is not None:
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
      f.write(template)
  return os.path.join(directory, "tokenizer.json")


def _time(config: data.DataConfig) -> dict:
  """Load (``make_rows``) and pack one epoch of training rows; times and token counts."""
  start = time.perf_counter()
  rows = data.make_rows(config)
  load_s = time.perf_counter() - start
  start = time.perf_counter()
  for r in range(rows.train.windows):
    rows.train(r)
  pack_s = time.perf_counter() - start
  tokens = rows.train.corpus.num_tokens + (rows.eval.corpus.num_tokens if rows.eval else 0)
  packed = rows.train.windows * config.seq_len
  return {"tokens": tokens, "load_s": load_s, "pack_s": pack_s, "load_tok_s": tokens / load_s,
          "pack_tok_s": packed / pack_s, "total_tok_s": packed / (load_s + pack_s)}


def _parquet(directory: str, tokens: int, seed: int = 0) -> str:
  import pyarrow as pa
  import pyarrow.parquet as pq
  rng = np.random.default_rng(seed)
  lengths = np.maximum(rng.lognormal(np.log(4096), 1.0, tokens // 2048), 16).astype(np.int64)
  lengths = lengths[np.cumsum(lengths) <= tokens]
  os.makedirs(directory, exist_ok=True)
  for i, part in enumerate(np.array_split(lengths, 4)):
    offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
    values = pa.array(rng.integers(0, 128_000, int(offsets[-1]), dtype=np.uint32))
    column = pa.ListArray.from_arrays(pa.array(offsets), values)
    pq.write_table(pa.table({"input_ids": column}), os.path.join(directory, f"{i}.parquet"),
                   row_group_size=1024)
  return directory


def _conversations(path: str, texts: list[str], count: int, seed: int = 0) -> str:
  rng = np.random.default_rng(seed)
  lines = [line for text in texts[:400] for line in text.splitlines() if line.strip()][:100_000]
  pick = lambda: "\n".join(lines[i] for i in rng.integers(0, len(lines), rng.integers(1, 12)))
  with open(path, "w") as f:
    for _ in range(count):
      messages = [{"role": "system", "content": pick()}] if rng.random() < 0.5 else []
      for _ in range(int(rng.integers(1, 5))):
        messages += [{"role": "user", "content": pick()}, {"role": "assistant", "content": pick()}]
      f.write(json.dumps({"messages": messages}) + "\n")
  return path


def main(argv: list[str] | None = None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=int, default=20_000_000, help="Parquet case's tokens")
  p.add_argument("--seq_len", type=int, default=65_536)
  p.add_argument("--conversations", type=int, default=5000)
  p.add_argument("--text_files", type=int, default=0, help="stdlib files to read (0: all)")
  p.add_argument("--json", default="", help="also write the results here")
  args = p.parse_args(argv)
  needs = gpu_needs()
  need = max(n["tok_s_per_host"] for n in needs)
  texts = _stdlib_texts()[:args.text_files or None]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    base = dict(source="files", seq_len=args.seq_len, batch_size=1)
    cases = {"parquet_tokens": data.DataConfig(
        paths=_parquet(os.path.join(tmp, "parquet"), args.tokens), **base)}
    with open(os.path.join(tmp, "text.jsonl"), "w") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    plain = _tokenizer(os.path.join(tmp, "tok"), texts, None)
    cases["jsonl_text"] = data.DataConfig(paths=os.path.join(tmp, "text.jsonl"),
                                          tokenizer=plain, **base)
    preprocess.write_tokens(cases["jsonl_text"], os.path.join(tmp, "tokens"))
    cases["token_dir"] = data.DataConfig(paths=os.path.join(tmp, "tokens"), **base)
    chat = _conversations(os.path.join(tmp, "chat.jsonl"), texts, args.conversations)
    tagged = _tokenizer(os.path.join(tmp, "chat_tok"), texts, CHATML)
    cases["chat_generation"] = data.DataConfig(paths=chat, tokenizer=tagged,
                                               **{**base, "seq_len": 8192})
    untagged = os.path.join(tmp, "plain.jinja")
    with open(untagged, "w") as f:
      f.write(CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    cases["chat_turns"] = data.DataConfig(paths=chat, tokenizer=tagged, chat_template=untagged,
                                          **{**base, "seq_len": 8192})
    for name, config in cases.items():
      row = {"case": name, **_time(config), "need_tok_s": need}
      row["ratio"] = row["total_tok_s"] / need
      rows.append(row)
      print_table([row], COLUMNS)
  print(f"\nneed: tokens/s per host of the shipped GPU configs (most demanding: {need:,.0f})")
  print_table(needs, ["config", "tok_s_per_host"])
  print()
  print_table(rows, COLUMNS)
  load = os.getloadavg()
  print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} when done")
  if args.json:
    write_json(args.json, rows, needs=needs, load_average=load, cpu_count=os.cpu_count())
  return rows


if __name__ == "__main__":
  main()
