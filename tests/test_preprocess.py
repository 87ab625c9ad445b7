"""``python -m ulysses_jax.preprocess``: the inspected rows hold transformers' chat ids and
masks (from a two-file Parquet directory and from JSONL), the printed text marks the trained
tokens, and ``--out`` writes token files that train to the same rows."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import chat_cases
from ulysses_jax.data import preprocess
from ulysses_jax.data import pipeline as data
from ulysses_jax.cli import preprocess as preprocess_cli

pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
  """A tokenizer saved as transformers saves it, conversations as a two-file Parquet directory
  and as JSONL, and transformers' (ids, assistant mask) of each."""
  root = tmp_path_factory.mktemp("chat_data")
  tokenizer = chat_cases.save_tokenizer(root / "model", chat_cases.CHATML_GENERATION)
  convs = chat_cases.conversations(40, seed=1)
  (root / "parquet").mkdir()
  for i, part in enumerate((convs[:20], convs[20:])):
    pq.write_table(pa.Table.from_pylist([{"messages": m} for m in part]),
                   root / "parquet" / f"part-{i}.parquet")
  (root / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
  return root, tokenizer, chat_cases.reference(root / "model", convs)


def _preprocess(tmp_path, *flags, params=(), capsys=None):
  """Runs the command line with a gin file of ``params``: in this process with ``capsys``,
  else as ``python -m ulysses_jax.preprocess``; returns (exit code, stdout, stderr)."""
  gin = tmp_path / "data.gin"
  gin.write_text("DataConfig.source = 'files'\nDataConfig.seq_len = 192\n"
                 "DataConfig.batch_size = 2\n" + "".join(p + "\n" for p in params))
  args = [f"--gin_file={gin}", *flags]
  if capsys is not None:
    code = preprocess_cli.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err
  out = subprocess.run([sys.executable, "-m", "ulysses_jax.preprocess", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  return out.returncode, out.stdout, out.stderr


@pytest.mark.parametrize("paths", ["parquet", "chat.jsonl"])
def test_inspect_rows_hold_transformers_ids_and_labels(tmp_path, chat_data, paths, capsys):
  """The hold-out check: Parquet as a separate ``python -m`` process, JSONL in this one."""
  root, tokenizer, refs = chat_data
  code, stdout, stderr = _preprocess(
      tmp_path, "--inspect=4", f"--json={tmp_path / 'rows.json'}",
      params=[f"DataConfig.paths = '{root / paths}'", f"DataConfig.tokenizer = '{tokenizer}'"],
      capsys=capsys if paths.endswith(".jsonl") else None)
  assert code == 0, stderr
  rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert len(rows) == 4 and set(rows[0]) == set(preprocess.ROW_FIELDS)
  assert chat_cases.check_rows(rows, refs) >= 4
  # The printed rows: a header per row, each segment decoded, the trained tokens marked.
  assert stdout.count("=== row ") == 4
  assert "<|im_start|>assistant\n[[" in stdout and "<|im_end|>]]" in stdout
  assert "<|im_start|>user\n[[" not in stdout


def test_out_writes_token_files_that_train_to_the_same_rows(tmp_path, chat_data, capsys):
  root, tokenizer, _ = chat_data
  params = [f"DataConfig.paths = '{root / 'parquet'}'", f"DataConfig.tokenizer = '{tokenizer}'"]
  code, stdout, stderr = _preprocess(tmp_path, f"--out={tmp_path / 'tokens'}", params=params,
                                     capsys=capsys)
  assert code == 0, stderr
  assert "train on it with DataConfig.paths=" in stdout
  assert sorted(os.listdir(tmp_path / "tokens")) == ["documents.npy", "targets.bin", "tokens.bin",
                                                   "ulysses_tokens.json"]
  config = data.DataConfig(source="files", paths=str(root / "parquet"), tokenizer=tokenizer,
                           seq_len=192, batch_size=2)
  from_files = data.make_rows(config)
  from_tokens = data.make_rows(data.DataConfig(source="files", paths=str(tmp_path / "tokens"),
                                               seq_len=192, batch_size=2))
  assert from_tokens.vocab_size <= from_files.vocab_size
  for r in range(6):
    for k, v in from_files.train(r).items():
      np.testing.assert_array_equal(from_tokens.train(r)[k], v)
  np.testing.assert_array_equal(from_tokens.eval(0)["labels"], from_files.eval(0)["labels"])


def test_bad_input_is_one_error_line(tmp_path, chat_data, capsys):
  _, tokenizer, _ = chat_data
  code, _, stderr = _preprocess(tmp_path, f"--json={tmp_path / 'x.json'}", capsys=capsys)
  assert code == 2 and "error: --json writes the inspected rows" in stderr
  user_only = {"messages": [{"role": "user", "content": "hi"}]}
  (tmp_path / "bad.jsonl").write_text(json.dumps(user_only) + "\n")
  code, _, stderr = _preprocess(tmp_path, "--inspect=1", capsys=capsys, params=[
      f"DataConfig.paths = '{tmp_path / 'bad.jsonl'}'", f"DataConfig.tokenizer = '{tokenizer}'"])
  assert code == 2
  assert f"error: {tmp_path / 'bad.jsonl'}:1: this conversation has no token to train" in stderr
