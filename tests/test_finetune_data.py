"""Fine-tuning data: prompt/completion JSONL, the JSONL text field, long documents, config
checks, and evaluation windows (``data.document_windows``)."""

import json

import numpy as np
import pytest

from ulysses_jax.data import pipeline as data
from ulysses_jax.data import packing
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.mesh import make_mesh

IGNORE = packing.IGNORE_LABEL


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(data=2, seq=4)


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _rows(ds, n):
  batch = ds.local_batch(0)
  return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def test_prompt_tokens_carry_no_loss(tmp_path, mesh):
  # Byte tokens: the prompt "ab" is context only; the completion "XYZ" is predicted, its
  # first token from the prompt's last.
  paths = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "ab", "completion": "XYZ"},
                                         {"text": "pq"}, {"prompt": "cd", "completion": "Z"}])
  config = data.DataConfig(source="files", paths=paths, seq_len=8, batch_size=2,
                           eval_fraction=0)
  windows = data.document_windows(config, mesh)
  first, second = _rows(windows, 2)
  np.testing.assert_array_equal(first["tokens"][:5], [ord(c) for c in "abXYZ"])
  np.testing.assert_array_equal(first["labels"],
                                [IGNORE, ord("X"), ord("Y"), ord("Z")] + [IGNORE] * 4)
  np.testing.assert_array_equal(second["labels"][:2], [ord("q"), IGNORE])
  # Packed training rows keep the same labels: every label is a completion token or from a
  # plain-text record, never a prompt token.
  train, _ = data.make_datasets(config, mesh, vocab_size=256)
  labels = np.concatenate([train.local_batch(r)["labels"] for r in (0, 2)])
  assert set(labels[labels != IGNORE].tolist()) <= {ord(c) for c in "XYZq"}
  assert ord("X") in labels


def test_text_field_is_configurable(tmp_path, mesh):
  paths = _jsonl(tmp_path / "b.jsonl", [{"body": "hello world"}, {"body": "again"}])
  config = data.DataConfig(source="files", paths=paths, text_field="body", seq_len=4,
                           batch_size=2, eval_fraction=0)
  rows = _rows(data.document_windows(config, mesh), 2)
  assert bytes(rows[0]["tokens"].astype(np.uint8)) == b"hell"
  with pytest.raises(ValueError, match=r"b.jsonl:1: the record needs a string 'text'.*"
                     r"DataConfig.text_field.*its fields are \['body'\]"):
    data.make_datasets(data.DataConfig(source="files", paths=paths, seq_len=4, batch_size=2),
                       mesh)


def test_long_documents_split_or_truncate(tmp_path, mesh):
  (tmp_path / "a.txt").write_text("a" * 30)
  (tmp_path / "b.txt").write_text("b" * 3)
  config = data.DataConfig(source="files", paths=str(tmp_path / "*.txt"), seq_len=8,
                           batch_size=2, eval_fraction=0)
  split = data.document_windows(config, mesh)
  # a: 29 labels in windows of 8 -> 4 rows; b: 2 labels -> 1 row, padded.
  assert split._rows.num_rows == 5 and split.num_batches == 3
  last_a = split.local_batch(2)
  np.testing.assert_array_equal(last_a["tokens"][1], [ord("a")] * 6 + [0, 0])
  np.testing.assert_array_equal(last_a["labels"][1], [ord("a")] * 5 + [IGNORE] * 3)
  np.testing.assert_array_equal(last_a["segment_ids"][1], [0] * 6 + [1, 1])
  truncated = data.document_windows(
      data.DataConfig(**{**config.__dict__, "long_documents": "truncate"}), mesh)
  assert truncated._rows.num_rows == 2
  np.testing.assert_array_equal(truncated.local_batch(0)["labels"][0],
                                [ord("a")] * 7 + [IGNORE])
  train, _ = data.make_datasets(
      data.DataConfig(**{**config.__dict__, "long_documents": "truncate"}), mesh)
  assert train._rows.corpus.num_tokens == 8 + 3


@pytest.mark.parametrize("fields, message", [
    (dict(seq_len=256.0), "DataConfig.seq_len must be an int, got 256.0"),
    (dict(batch_size=0), "DataConfig.batch_size must be >= 1, got 0"),
    (dict(seq_len="abc"), "DataConfig.seq_len must be an int, got 'abc'"),
    (dict(long_documents="drop"), "DataConfig.long_documents must be one of 'split', "
                                  "'truncate', got 'drop'"),
    (dict(token_dtype="float32"), "DataConfig.token_dtype must be one of 'uint8', 'uint16'"),
    (dict(eval_fraction=1.0), r"DataConfig.eval_fraction must be in \[0, 1\), got 1.0"),
])
def test_bad_config_values_are_config_errors(fields, message):
  with pytest.raises(ConfigError, match=message):
    data.DataConfig(**fields)


def test_bad_retrieval_values_are_config_errors():
  with pytest.raises(ConfigError, match="RetrievalTask.num_values must be >= 1, got 0"):
    data.RetrievalTask(num_values=0)
  with pytest.raises(ConfigError, match="num_keys >= num_pairs"):
    data.RetrievalTask(num_pairs=3, num_keys=2)


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path, mesh):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(40)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "a.txt").write_text(" ".join(f"w{i % 40}" for i in range(100)))
  config = data.DataConfig(source="files", paths=str(tmp_path / "a.txt"), seq_len=8,
                           batch_size=2, tokenizer=str(tmp_path / "tokenizer.json"))
  with pytest.raises(ConfigError, match=r"tokenizer.json' uses ids up to 40, beyond the "
                     r"model's vocab_size=32: use the model's own tokenizer .* vocab_size >= 41"):
    data.make_datasets(config, mesh, vocab_size=32)
  with pytest.raises(ConfigError, match="beyond the model's vocab_size=32"):
    data.document_windows(config, mesh, vocab_size=32)
