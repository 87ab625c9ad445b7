"""Token files as users write them: every integer dtype, ids checked against the vocabulary,
damaged files named in one ``error:`` line by ``train`` and ``evaluate``."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ulysses_jax import cli, train
from ulysses_jax.data import token_files
from ulysses_jax.cli import evaluate as evaluate_cli
from ulysses_jax.cli import gin_config
from ulysses_jax.cli import train as train_cli
from ulysses_jax.data.token_files import TOKEN_DTYPES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--gin_file=configs/tiny_cpu.gin", "--gin_param=LlamaConfig.preset='tiny'",
        "--gin_param=DataConfig.source='files'", "--gin_param=DataConfig.seq_len=16",
        "--gin_param=DataConfig.eval_fraction=0.0", "--gin_param=STEPS=2",
        "--gin_param=OptimizerConfig.warmup_steps=0"]


def _tokens(n=200, vocab=100, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("dtype, suffix", [(d, s) for d in TOKEN_DTYPES for s in (".npy", ".bin")]
                         + [(">i4", ".npy"), (">u8", ".npy")])  # big-endian .npy files too
def test_every_integer_dtype_is_read_memory_mapped(tmp_path, dtype, suffix):
  tokens, path = _tokens(), str(tmp_path / f"t{suffix}")
  if suffix == ".npy":
    np.save(path, tokens.astype(dtype))
  else:
    tokens.astype(dtype).tofile(path)
  corpus, vocab = token_files.token_corpus([path], dtype.lstrip("><"), None, 128)
  assert isinstance(corpus.arrays[0], np.memmap)
  assert vocab == tokens.max() + 1
  read, _ = corpus.read(0, 0, len(tokens))
  np.testing.assert_array_equal(read, tokens)
  assert read.dtype == np.int64


@pytest.mark.parametrize("tokens, dtype, message", [
    ([3, 1, -5, 2, -1], "int32", r"bad.npy: token 2 is -5; the model's vocab_size is 50"),
    ([3, 1, 2, 7, 50, 60], "uint64", r"bad.npy: token 4 is 50; the model's vocab_size is 50, "
     r"so ids are in \[0, 50\)"),
    ([1] * 37 + [2**40], "int64", r"bad.npy: token 37 is 1099511627776;"),
])
def test_ids_outside_the_vocabulary_name_file_position_and_value(tmp_path, monkeypatch, tokens,
                                                                   dtype, message):
  monkeypatch.setattr(token_files, "SCAN_CHUNK", 8)  # the bad id sits in a later chunk
  np.save(tmp_path / "bad.npy", np.array(tokens, dtype))
  with pytest.raises(ValueError, match=message):
    token_files.token_corpus([str(tmp_path / "bad.npy")], "uint16", None, 50)


def _write_damaged(path, kind):
  good = _tokens().astype(np.int32)
  np.save(path, good)
  whole = path.read_bytes()
  writers = {
      "truncated": lambda: path.write_bytes(whole[:300]),
      "header cut": lambda: path.write_bytes(whole[:20]),
      "empty file": lambda: path.write_bytes(b""),
      "text": lambda: path.write_text("1 2 3 4\n"),
      "npz": lambda: np.savez(str(path)[:-4], tokens=good) or os.replace(f"{path}"[:-4] + ".npz",
                                                                         path),
      "2-D": lambda: np.save(path, good.reshape(20, 10)),
      "0-D": lambda: np.save(path, np.int32(7)),
      "float": lambda: np.save(path, good.astype(np.float32)),
      "negative": lambda: np.save(path, np.concatenate([good, [-3]]).astype(np.int16)),
      "too large": lambda: np.save(path, np.concatenate([good, [70000]]).astype(np.uint32)),
  }
  writers[kind]()


DAMAGED = {
    "truncated": r"truncated: its header promises 200 int32 tokens \(928 bytes\) but the file "
                 r"has 300 bytes",
    "header cut": r"not a NumPy .npy file or its header is damaged",
    "empty file": r"not a NumPy .npy file or its header is damaged",
    "text": r"not a NumPy .npy file or its header is damaged",
    "npz": r"not a NumPy .npy file or its header is damaged",
    "2-D": r"holds a 2-D array of shape \(20, 10\), need a 1-D array",
    "0-D": r"holds a 0-D array of shape \(\), need a 1-D array",
    "float": r"holds float32 values, need an integer dtype",
    "negative": r"token 200 is -3; the model's vocab_size is 256",
    "too large": r"token 200 is 70000; the model's vocab_size is 256",
}


@pytest.mark.parametrize("kind", DAMAGED)
def test_train_names_a_damaged_token_file_in_one_error_line(tmp_path, capsys, kind):
  _write_damaged(tmp_path / "doc.npy", kind)
  workdir = tmp_path / "run"
  code = train_cli.main([f"--workdir={workdir}", *TINY,
                         f"--gin_param=DataConfig.paths='{tmp_path / 'doc.npy'}'"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == cli.EXIT_USAGE
  assert len(err) == 1 and err[0].startswith(f"error: token file {tmp_path / 'doc.npy'}: "), err
  assert re.search(DAMAGED[kind], err[0]), err
  assert not workdir.exists()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  pytest.importorskip("transformers")
  from test_hf import random_hf_model  # pylint: disable=import-outside-toplevel
  path = tmp_path_factory.mktemp("hf")
  random_hf_model("LlamaForCausalLM", vocab_size=256, num_key_value_heads=2).save_pretrained(path)
  return path


@pytest.mark.parametrize("kind", DAMAGED)
def test_evaluate_names_a_damaged_token_file(hf_dir, tmp_path, kind):
  _write_damaged(tmp_path / "doc.npy", kind)
  with pytest.raises(ValueError, match=rf"^token file {re.escape(str(tmp_path / 'doc.npy'))}: "
                     rf".*{DAMAGED[kind]}"):
    evaluate_cli.run([f"--hf={hf_dir}", f"--data={tmp_path / 'doc.npy'}", "--seq_len=16"])


def test_evaluate_reads_token_files_of_unusual_dtypes(hf_dir, tmp_path):
  docs = {"a.npy": _tokens(40, 128, 1).astype(np.int8), "b.npy": _tokens(30, 256, 2).astype(">u8"),
          "c.bin": _tokens(20, 256, 3).astype(np.int32), "d.npy": np.zeros(0, np.int16)}
  for name, tokens in docs.items():
    (np.save if name.endswith(".npy") else lambda p, t: t.tofile(p))(tmp_path / name, tokens)
  flags = [f"--hf={hf_dir}", "--seq_len=16"]
  together = evaluate_cli.run([*flags, f"--data={tmp_path / '*.npy'},{tmp_path / 'c.bin'}",
                            "--token_dtype=int32"])
  assert together["tokens"] == 39 + 29 + 19
  alone = evaluate_cli.run([*flags, f"--data={tmp_path / 'c.bin'}", "--token_dtype=int32"])
  as_uint16 = evaluate_cli.run([*flags, f"--data={tmp_path / 'c.bin'}"])  # each id split in two
  assert alone["tokens"] == 19 and as_uint16["tokens"] == 39


@pytest.mark.slow
def test_training_from_an_int64_token_file(tmp_path):
  np.save(tmp_path / "doc.npy", _tokens(2000, 256).astype(np.int64))
  config = gin_config.read(["configs/tiny_cpu.gin"], [
      p.removeprefix("--gin_param=") for p in TINY[1:]] + [
      f"DataConfig.paths='{tmp_path / 'doc.npy'}'", "TrainConfig.progress_bar=False",
      "DataConfig.batch_size=2", "TrainConfig.mesh_data=1", "TrainConfig.mesh_seq=8"])
  summary = train.train(str(tmp_path / "run"), config)
  assert summary["step"] == 2 and np.isfinite(summary["last_loss"][1])


def test_the_command_lines_print_one_line_for_a_truncated_file(tmp_path):
  """``python -m ulysses_jax.train`` and ``... evaluate``, as a user runs them."""
  pytest.importorskip("transformers")
  from test_hf import random_hf_model  # pylint: disable=import-outside-toplevel
  random_hf_model("LlamaForCausalLM", num_key_value_heads=2).save_pretrained(tmp_path / "hf")
  _write_damaged(tmp_path / "doc.npy", "truncated")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for command in (
      ["ulysses_jax.train", f"--workdir={tmp_path / 'run'}", *TINY,
       f"--gin_param=DataConfig.paths='{tmp_path / 'doc.npy'}'"],
      ["ulysses_jax.evaluate", f"--hf={tmp_path / 'hf'}", f"--data={tmp_path / 'doc.npy'}",
       "--seq_len=16"]):
    out = subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    lines = [x for x in out.stderr.splitlines() if not x.startswith("WARNING:absl")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: token file {tmp_path / 'doc.npy'}: truncated"), lines
