"""Weighted mixtures (``DataConfig.sources``, ``packing.MixedRows``): each row is its source's
next row, the shares follow the weights, the stream resumes exactly from its saved position,
and the tokens each source gave are counted; Parquet and Arrow sources with ``input_ids`` and
text, and their errors."""

import json

import numpy as np
import pytest

from ulysses_jax.data import pipeline as data
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.mesh import make_mesh


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(data=2, seq=4)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Three JSONL sources whose bytes name their source: 'a'..., 'b'..., 'c'..."""
  root = tmp_path_factory.mktemp("mixture")
  rng = np.random.default_rng(0)
  for name in "abc":
    lines = [json.dumps({"text": name * int(n)}) for n in rng.integers(20, 200, 40)]
    (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
  return root


def _config(root, weights="0.6,0.3,0.1", **kw):
  spec = ",".join(f"{root / n}.jsonl@{w}" for n, w in zip("abc", weights.split(",")))
  return data.DataConfig(source="files", sources=spec, seq_len=32, batch_size=4, seed=5, **kw)


def test_rows_come_from_their_sources_in_order_and_by_weight(sources):
  rows = data.make_rows(_config(sources))
  mixed = rows.train
  n = 3000
  counts = mixed.rows_per_source(n)
  np.testing.assert_allclose(counts / n, [0.6, 0.3, 0.1], atol=0.03)
  assert counts.sum() == n
  seen = np.zeros(3, int)
  for r in list(range(40)) + list(range(4090, 4100)):  # across a block of draws
    row = mixed(r)
    k = "abc".index(chr(row["tokens"][0]))
    if r == 4090:
      seen = mixed.rows_per_source(4090).copy()
    np.testing.assert_array_equal(row["tokens"], mixed.sources[k](int(seen[k]))["tokens"])
    assert set(row["tokens"].tolist()) == {ord("abc"[k])}  # rows never mix sources
    seen[k] += 1
  np.testing.assert_array_equal(seen, mixed.rows_per_source(4100))
  # Each source holds out its own share; the eval stream is all of them, unshuffled.
  letters = {chr(t) for r in range(rows.eval.num_rows) for t in rows.eval(r)["tokens"] if t}
  assert letters == set("abc")
  assert rows.source_names == tuple(str(sources / f"{n}.jsonl") for n in "abc")


def test_resume_and_tokens_by_source(sources, mesh):
  train, _ = data.make_datasets(_config(sources), mesh)
  for _ in range(3):
    next(train)
  state = json.loads(json.dumps(train.get_state()))
  seen = train.tokens_by_source(state)
  assert sum(seen.values()) == 3 * 4 * 32
  assert set(seen) == {f"tokens_seen/{sources / n}.jsonl" for n in "abc"}
  expected = [next(train) for _ in range(2)]
  resumed, _ = data.make_datasets(_config(sources), mesh)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  other, _ = data.make_datasets(_config(sources, weights="0.5,0.3,0.2"), mesh)
  with pytest.raises(ValueError, match="different data stream"):
    other.set_state(state)


@pytest.mark.parametrize("kw, message", [
    (dict(sources="a.jsonl@x"), r"'a.jsonl@x' is not PATHS@WEIGHT"),
    (dict(sources="a.jsonl"), r"'a.jsonl' is not PATHS@WEIGHT"),
    (dict(sources="a.jsonl@0"), r"with a weight > 0"),
    (dict(sources="a.jsonl@1", paths="b.jsonl"), "not both"),
    (dict(roles_to_train=" , "), "names no role"),
])
def test_bad_mixtures_are_config_errors(kw, message):
  with pytest.raises(ConfigError, match=message):
    data.DataConfig(source="files", **kw)


def test_parquet_and_arrow_tokens_and_text(tmp_path):
  """Pre-tokenized ``input_ids`` and text rows from Parquet (read by row group) and Arrow;
  a column of the wrong type names the file, the row and what it found."""
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  ids = [list(range(i, i + 10 + i)) for i in range(30)]
  pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}),
                 tmp_path / "ids.parquet", row_group_size=7)
  rows = data.make_rows(data.DataConfig(source="files", paths=str(tmp_path / "ids.parquet"),
                                        seq_len=16, batch_size=1, eval_fraction=0))
  docs = rows.train.corpus
  assert sorted(docs.doc_len.tolist()) == sorted(len(x) for x in ids)
  assert rows.vocab_size == 256  # the byte tokenizer's, above the ids' max of 58
  pq.write_table(pa.table({"text": ["hello", "world"]}), tmp_path / "text.parquet")
  with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink:
    with pa.ipc.new_file(sink, pa.schema([("text", pa.string())])) as writer:
      writer.write_table(pa.table({"text": ["hello", "again"]}))
  rows = data.make_rows(data.DataConfig(
      source="files", paths=[str(tmp_path / "text.parquet"), str(tmp_path / "t.arrow")],
      seq_len=4, batch_size=1, eval_fraction=0))
  assert rows.train.corpus.num_tokens == 20
  pq.write_table(pa.table({"text": ["fine", None, "x"]}), tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match=r"bad.parquet row 1: the record needs a string 'text'.*"
                     r"'text' is NoneType"):
    data.make_rows(data.DataConfig(source="files", paths=str(tmp_path / "bad.parquet"),
                                   seq_len=4, batch_size=1))
  pq.write_table(pa.table({"input_ids": [["a"]]}), tmp_path / "strs.parquet")
  with pytest.raises(ValueError, match=r"strs.parquet row 0: 'input_ids' must be a list of "
                     r"integer token ids; 'input_ids' is list"):
    data.make_rows(data.DataConfig(source="files", paths=str(tmp_path / "strs.parquet"),
                                   seq_len=4, batch_size=1))
  (tmp_path / "neg.jsonl").write_text(json.dumps({"input_ids": [3, -1]}) + "\n")
  with pytest.raises(ValueError, match=r"token id -1"):
    data.make_rows(data.DataConfig(source="files", paths=str(tmp_path / "neg.jsonl"),
                                   seq_len=1, batch_size=1))
