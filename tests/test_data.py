"""Tests for ulysses_jax.data.pipeline: packing, determinism, sharded batches, bad inputs,
retrieval."""

import functools
import json
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ulysses_jax import evaluate, ulysses_attention
from ulysses_jax.data import batches
from ulysses_jax.data import corpus
from ulysses_jax.data import pipeline as data
from ulysses_jax.data import packing
from ulysses_jax.mesh import make_mesh

IGNORE = packing.IGNORE_LABEL


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(data=2, seq=4)


def _letter_docs(tmp_path, lengths):
  """Text files whose document i is one letter repeated: every byte names its document."""
  for i, n in enumerate(lengths):
    (tmp_path / f"doc{i:02d}.txt").write_text(string.ascii_letters[i] * n)
  return str(tmp_path / "*.txt")


def _check_row_invariants(row, seq_len):
  """Checks a packed row against the batch contract; returns its document pieces."""
  tokens, labels, seg, pos = (row[k] for k in ("tokens", "labels", "segment_ids", "positions"))
  assert seg[0] == 0 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 1)
  starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
  pieces = list(zip(starts, np.r_[starts[1:], seq_len]))
  if np.all(tokens[pieces[-1][0]:] == 0) and np.all(labels[pieces[-1][0]:] == IGNORE):
    pieces.pop()  # trailing padding: its own segment, nothing to predict
  for a, b in pieces:
    np.testing.assert_array_equal(pos[a:b], np.arange(b - a))
    np.testing.assert_array_equal(labels[a:b - 1], tokens[a + 1:b])  # next token, same piece
    if b < seq_len:  # a piece ending inside the row is a document end: nothing to predict
      assert labels[b - 1] == IGNORE
  tail = pieces[-1][1] if pieces else 0
  np.testing.assert_array_equal(pos[tail:], np.arange(seq_len - tail))
  return [tokens[a:b] for a, b in pieces]


def test_byte_tokenizer_round_trip():
  tok = corpus.make_tokenizer("byte")
  text = "héllo ✓"
  (ids,) = tok.encode_batch([text.encode()])
  assert tok.vocab_size == 256 and ids.max() < 256
  assert tok.decode(ids) == text


def test_hf_tokenizer(tmp_path):
  tokenizers = pytest.importorskip("tokenizers", reason="`tokenizers` is not installed")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "a.txt").write_text(" ".join(["hello world"] * 40))
  hf = corpus.make_tokenizer(str(tmp_path / "tokenizer.json"))
  assert hf.vocab_size == 3
  np.testing.assert_array_equal(hf.encode_batch([b"hello there world"])[0], [1, 0, 2])
  train, _ = data.make_datasets(data.DataConfig(
      source="files", paths=str(tmp_path / "a.txt"), tokenizer=str(tmp_path / "tokenizer.json"),
      seq_len=8, batch_size=2, eval_fraction=0.1), make_mesh(data=2, seq=4), vocab_size=3)
  assert train.vocab_size == 3
  assert set(np.unique(train.local_batch(0)["tokens"])) == {1, 2}


def test_eval_rows_are_exact(tmp_path, mesh):
  # JSONL (blank lines skipped, extra fields ignored); 8 tokens, the last 2 held out. The
  # eval pass is one row of 2 tokens and padding, then a row of padding to fill the batch.
  (tmp_path / "a.jsonl").write_text(json.dumps({"text": "abcde"}) + "\n\n" +
                                    json.dumps({"text": "xyz", "id": 3}) + "\n")
  config = data.DataConfig(source="files", paths=str(tmp_path / "a.jsonl"), seq_len=4,
                           batch_size=2, eval_fraction=0.25)
  _, evals = data.make_datasets(config, mesh)
  assert evals.num_batches == 1
  rows = evals.local_batch(0)
  text = bytes(rows["tokens"][0, :2].astype(np.uint8)).decode()
  assert text in ("yz", "de")  # the tail of whichever document the fixed shuffle put last
  np.testing.assert_array_equal(rows["tokens"][0], [ord(text[0]), ord(text[1]), 0, 0])
  np.testing.assert_array_equal(rows["labels"][0], [ord(text[1]), IGNORE, IGNORE, IGNORE])
  np.testing.assert_array_equal(rows["segment_ids"][0], [0, 0, 1, 1])
  np.testing.assert_array_equal(rows["positions"][0], [0, 1, 0, 1])
  np.testing.assert_array_equal(rows["tokens"][1], 0)
  np.testing.assert_array_equal(rows["labels"][1], IGNORE)
  np.testing.assert_array_equal(rows["positions"][1], np.arange(4))
  with pytest.raises(StopIteration):
    next(evals), next(evals)


def test_packing_contract_and_padding(tmp_path, mesh):
  paths = _letter_docs(tmp_path, [5, 3, 9, 1, 7, 4])
  config = data.DataConfig(source="files", paths=paths, seq_len=8, batch_size=2,
                           eval_fraction=0.3)
  train, evals = data.make_datasets(config, mesh, vocab_size=256)
  for ds in (train, evals):
    for first in range(0, 8, 2):
      batch = ds.local_batch(first)
      for i in range(2):
        row = {k: v[i] for k, v in batch.items()}
        for piece in _check_row_invariants(row, 8):
          real = piece[piece > 0]
          assert len(set(real.tolist())) <= 1  # a piece never mixes documents
  # The eval pass ends in padding: its own segment, no labels, positions from 0.
  last = evals.local_batch((evals.num_batches - 1) * 2)
  pad = last["tokens"] == 0
  assert pad.any()
  assert np.all(last["labels"][pad] == IGNORE)
  for i in range(2):
    real_seg = last["segment_ids"][i][~pad[i]]
    if real_seg.size and pad[i].any():
      assert last["segment_ids"][i][pad[i]].min() == real_seg.max() + 1


def test_split_is_disjoint_and_complete(tmp_path, mesh):
  lengths = [50 + 7 * i for i in range(20)]
  config = data.DataConfig(source="files", paths=_letter_docs(tmp_path, lengths), seq_len=16,
                           batch_size=2, eval_fraction=0.25)
  train, evals = data.make_datasets(config, mesh)
  count = lambda c: {chr(int(t)): int(n) for t, n in zip(*np.unique(
      np.concatenate([c.arrays[0][s:s + n] for s, n in zip(c.doc_start, c.doc_len)]),
      return_counts=True))}
  tr, ev = count(train._rows.corpus), count(evals._rows.corpus)
  assert len(set(tr) & set(ev)) <= 1  # only the document straddling the cut is shared
  total = sum(lengths)
  assert sum(tr.values()) + sum(ev.values()) == total
  assert abs(sum(ev.values()) - total / 4) <= 1
  for i, n in enumerate(lengths):
    c = string.ascii_letters[i]
    assert tr.get(c, 0) + ev.get(c, 0) == n


def test_one_epoch_covers_each_window_once(tmp_path, mesh):
  lengths = [40, 13, 70, 22, 5, 31]
  config = data.DataConfig(source="files", paths=_letter_docs(tmp_path, lengths), seq_len=8,
                           batch_size=2, eval_fraction=0)
  train, evals = data.make_datasets(config, mesh)
  assert evals is None
  windows = (sum(lengths) - 1) // 8
  epoch = np.concatenate([train._rows(r)["tokens"] for r in range(windows)])
  np.testing.assert_array_equal(train.local_batch(4)["tokens"],
                                [train._rows(4)["tokens"], train._rows(5)["tokens"]])
  counts = {chr(t): n for t, n in zip(*np.unique(epoch, return_counts=True))}
  for i, n in enumerate(lengths):  # each document once, but for <= seq_len dropped tokens
    assert n - 8 <= counts.get(string.ascii_letters[i], 0) <= n
  # The next epoch is a different order of the same windows.
  second = np.concatenate([train._rows(r)["tokens"] for r in range(windows, 2 * windows)])
  assert not np.array_equal(second, epoch)


def test_resume_yields_the_same_batches(mesh):
  config = data.DataConfig(seq_len=64, batch_size=4, seed=3)
  train, _ = data.make_datasets(config, mesh)
  for _ in range(2):
    next(train)
  state = json.loads(json.dumps(train.get_state()))
  expected = [next(train) for _ in range(3)]
  resumed, _ = data.make_datasets(config, mesh)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  other, _ = data.make_datasets(data.DataConfig(seq_len=64, batch_size=4, seed=4), mesh)
  with pytest.raises(ValueError, match="different data stream"):
    other.set_state(state)


def test_global_batch_is_sharded(mesh):
  train, _ = data.make_datasets(data.DataConfig(seq_len=64, batch_size=4), mesh)
  local = train.local_batch(0)
  batch = next(train)
  for k, v in batch.items():
    assert v.dtype == jnp.int32 and v.shape == (4, 64)
    assert v.sharding.spec == P("data", "seq")
    np.testing.assert_array_equal(v, local[k])
    assert {s.data.shape for s in v.addressable_shards} == {(2, 16)}
  # The label of a shard's last token is the first token of the next shard.
  same = batch["segment_ids"][:, 16] == batch["segment_ids"][:, 15]
  np.testing.assert_array_equal(np.where(same, batch["labels"][:, 15], -2),
                                np.where(same, batch["tokens"][:, 16], -2))


def test_stdlib_default():
  train, evals = data.make_datasets(data.DataConfig(seq_len=128, batch_size=8),
                                    make_mesh(data=8, seq=1), vocab_size=256)
  assert train.vocab_size == 256 and evals.num_batches > 10
  text = corpus.ByteTokenizer().decode(train.local_batch(0)["tokens"].ravel())
  assert any(w in text for w in ("def ", "import ", "return ", "self"))
  row = {k: v[0] for k, v in evals.local_batch(0).items()}
  _check_row_invariants(row, 128)


def test_retrieval_rows():
  task = data.RetrievalTask(num_pairs=3, eval_rows=6)
  seq_mesh = make_mesh(data=1, seq=8)
  train, evals = data.make_datasets(data.DataConfig(source="retrieval", seq_len=64, batch_size=4,
                                                    retrieval=task), seq_mesh)
  assert train.vocab_size == task.vocab_size and evals.num_batches == 2
  last = evals.local_batch(4)  # rows 4, 5 of the 6 eval rows, then 2 rows of padding
  assert [np.sum(r != IGNORE) for r in last["labels"]] == [1, 1, 0, 0]
  key0 = 1 + task.num_filler
  batch = train.local_batch(0)
  for tokens, labels in zip(batch["tokens"], batch["labels"]):
    keys, values = tokens[0:6:2], tokens[1:6:2]
    assert len(set(keys.tolist())) == 3 and np.all((keys >= key0) & (keys < key0 + 16))
    assert tokens[62] == 0 and tokens[63] in keys
    assert np.flatnonzero(labels != IGNORE).tolist() == [63]
    assert labels[63] == values[keys.tolist().index(tokens[63])]
    assert np.all((tokens[6:62] >= 1) & (tokens[6:62] < key0))  # filler only
  # Key and question sit on the first and the last of the 8 sequence shards.
  assert 0 // (64 // 8) == 0 and 63 // (64 // 8) == 7
  np.testing.assert_array_equal(train.local_batch(0)["tokens"], batch["tokens"])
  assert not np.array_equal(evals.local_batch(0)["tokens"], batch["tokens"])


def test_retrieval_accuracy():
  labels = jnp.array([[IGNORE, 5, IGNORE], [IGNORE, IGNORE, 7]])
  predictions = jnp.array([[5, 5, 1], [0, 0, 3]])
  assert float(evaluate.retrieval_accuracy(predictions, labels)) == 0.5
  logits = jax.nn.one_hot(jnp.array([[0, 5, 0], [0, 0, 7]]), 8)
  assert float(evaluate.retrieval_accuracy(logits, labels)) == 1.0


# ----------------------------------------------------------------------------- bad inputs

def _files(paths, **kw):
  return data.DataConfig(source="files", paths=paths, **{"seq_len": 8, "batch_size": 2, **kw})


@pytest.mark.parametrize("make_config, message", [
    (lambda d: _files(str(d / "missing.txt")), "data file not found"),
    (lambda d: _files(str(d / "*.nothing")), "matched no files"),
    (lambda d: _files(str(d)), "is a directory"),
    (lambda d: _files(()), "needs DataConfig.paths"),
    (lambda d: _files(str(d / "empty.txt")), "corpus is empty"),
    (lambda d: _files(str(d / "small.txt"), eval_fraction=0), "too few for one row"),
    (lambda d: _files(str(d / "small.txt"), seq_len=6), "does not divide over the mesh's 'seq'"),
    (lambda d: _files(str(d / "small.txt"), batch_size=3), "not divide over the mesh's 'data'"),
    (lambda d: _files(str(d / "big.txt"), eval_fraction=1.0), "eval_fraction must be in"),
    (lambda d: _files(str(d / "big.txt"), eval_fraction=1e-6), "holds out nothing"),
    (lambda d: _files(str(d / "bad.jsonl")), r"bad.jsonl:2: the record needs a string 'text'"),
    (lambda d: _files(str(d / "broken.jsonl")), r"broken.jsonl:1: not a JSON object"),
    (lambda d: _files(str(d / "big.txt"), tokenizer=str(d / "nope.json")), "tokenizer file not"),
    (lambda d: _files([str(d / "big.txt"), str(d / "t16.bin")]), "mix of token files"),
    (lambda d: _files(str(d / "t16.bin"), token_dtype="float32"), "token_dtype must be one of"),
    (lambda d: _files(str(d / "odd.bin")), "not a whole number of uint16 tokens"),
    (lambda d: _files(str(d / "f32.npy")), "f32.npy: holds float32 values, need an integer"),
    (lambda d: data.DataConfig(source="web"),
     "DataConfig.source must be one of 'stdlib', 'files', 'retrieval', got 'web'"),
    (lambda d: data.DataConfig(paths="x.txt"), "it takes no paths"),
    (lambda d: data.DataConfig(source="retrieval", seq_len=8, batch_size=2,
                               retrieval=data.RetrievalTask(num_pairs=4)), "cannot hold 4"),
    (lambda d: data.DataConfig(source="retrieval", seq_len=8, batch_size=2,
                               retrieval=data.RetrievalTask(num_keys=1)), "num_keys >= num_pairs"),
])
def test_bad_data_is_a_clear_error(tmp_path, mesh, make_config, message):
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "small.txt").write_text("abcdefgh")
  (tmp_path / "big.txt").write_text("x" * 200)
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
  (tmp_path / "broken.jsonl").write_text('{"text": \n')
  np.arange(100, dtype=np.uint16).tofile(tmp_path / "t16.bin")
  (tmp_path / "odd.bin").write_bytes(b"abc")
  np.save(tmp_path / "f32.npy", np.zeros(10, np.float32))
  with pytest.raises((ValueError, OSError), match=message):
    data.make_datasets(make_config(tmp_path), mesh)


def test_tokens_beyond_the_vocabulary(tmp_path, mesh):
  np.arange(300, dtype=np.uint16).tofile(tmp_path / "t.bin")
  config = _files(str(tmp_path / "t.bin"), eval_fraction=0.1)
  with pytest.raises(ValueError, match=r"t.bin: token 256 is 256; the model's vocab_size is 256"):
    data.make_datasets(config, mesh, vocab_size=256)
  train, _ = data.make_datasets(config, mesh, vocab_size=300)
  assert train.vocab_size == 300
  with pytest.raises(ValueError, match=r"tokenizer 'byte' uses ids up to 255, beyond the model's"):
    data.make_datasets(data.DataConfig(seq_len=8, batch_size=2), mesh, vocab_size=100)
  with pytest.raises(ValueError, match="the retrieval task uses ids up to 48"):
    data.make_datasets(data.DataConfig(source="retrieval", seq_len=8, batch_size=2), mesh,
                       vocab_size=40)


def test_token_files_with_documents(tmp_path, mesh):
  eos = 9
  np.array([1, 2, 3, eos, 4, 5, eos, 6, 7, 8, 1, 2], np.uint32).tofile(tmp_path / "a.bin")
  np.save(tmp_path / "b.npy", np.array([3, 3, 3, 3, eos, 2, 2], np.uint16))
  config = _files([str(tmp_path / "a.bin"), str(tmp_path / "b.npy")], token_dtype="uint32",
                  eos_id=eos, eval_fraction=0.2, seq_len=4)
  train, evals = data.make_datasets(config, mesh, vocab_size=10)
  corpus = train._rows.corpus
  docs = sorted(corpus.arrays[a][s:s + n].tolist()
                for a, s, n in zip(corpus.doc_array, corpus.doc_start, corpus.doc_len))
  assert all(d[-1] == eos or eos not in d for d in docs)
  assert sum(map(len, docs)) + evals._rows.corpus.num_tokens == 19
  for first in range(0, 10, 2):
    batch = train.local_batch(first)
    for i in range(2):
      _check_row_invariants({k: v[i] for k, v in batch.items()}, 4)


def test_make_global_batch_validates(mesh):
  ok = {"tokens": np.zeros((2, 8), np.int32)}
  assert batches.make_global_batch(ok, mesh)["tokens"].shape == (2, 8)
  with pytest.raises(ValueError, match="seq_len=6 does not divide over the mesh's 'seq' axis of 4"):
    batches.make_global_batch({"tokens": np.zeros((2, 6), np.int32)}, mesh)
  with pytest.raises(ValueError, match="3 local rows do not split over"):
    batches.make_global_batch({"tokens": np.zeros((3, 8), np.int32)}, mesh)


# ----------------------------------------------------------------------------- learnability

def _tiny_model_accuracy(mesh, train, evals, *, shard_local, steps):
  """Trains a 2-layer transformer (Ulysses attention) on retrieval; returns eval accuracy.

  With ``shard_local`` the attention is confined to each sequence shard (segment ids =
  shard index), the control showing that the answer needs attention across shards; without,
  every position is in one segment (the causal mask alone). The segment ids are an input of
  one compiled step and accuracy, which both runs share.
  """
  s, dim, vocab = train.seq_len, 64, train.vocab_size
  shard = np.arange(s)[None] // (s // mesh.shape["seq"])
  segments = shard if shard_local else np.zeros_like(shard)
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  dense = lambda *shape: normal(*shape) * shape[0] ** -0.5
  params = {"embed": normal(vocab, dim), "pos": 0.1 * normal(s, dim), "out": dense(dim, vocab),
            "layers": [{"qkv": dense(dim, 3, dim), "o": dense(dim, dim),
                        "up": dense(dim, 4 * dim), "down": dense(4 * dim, dim)}
                       for _ in range(2)]}
  step, accuracy = _tiny_model_program(mesh)
  params, opt_state = jax.device_put((params, _TINY_OPTIMIZER.init(params)),
                                     NamedSharding(mesh, P()))
  for _ in range(steps):
    params, opt_state = step(params, opt_state, next(train), segments)
    # One step in flight, as in the trainer: with many 8-device steps queued, jaxlib 0.10.2's
    # CPU runtime can leave one device's launch waiting for its in-flight slot while the
    # other seven wait in the step's all-reduce, until XLA aborts the process.
    jax.block_until_ready(params)
  return float(np.mean([accuracy(params, evals.batch(i), segments)
                        for i in range(evals.num_batches)]))


_TINY_OPTIMIZER = optax.adam(3e-3)


@functools.cache
def _tiny_model_program(mesh):
  """The jitted ``step(params, opt_state, batch, segments)`` and ``accuracy(params, batch,
  segments)`` of ``_tiny_model_accuracy``'s model (4 heads) on ``mesh``, parameters
  replicated (so the first step's output feeds the second without a recompile)."""
  heads = 4
  norm = lambda x: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)

  def logits_fn(p, tokens, segments):
    x = p["embed"][tokens] + p["pos"][None]
    dim = x.shape[-1]
    for layer in p["layers"]:
      q, k, v = jnp.einsum("bsd,dte->tbse", norm(x), layer["qkv"]).reshape(
          3, *tokens.shape, heads, dim // heads)
      attn = ulysses_attention(q, k, v, mesh=mesh, causal=True,
                               segment_ids=jnp.broadcast_to(segments, tokens.shape))
      x = x + attn.reshape(x.shape) @ layer["o"]
      x = x + jax.nn.gelu(norm(x) @ layer["up"]) @ layer["down"]
    return norm(x) @ p["out"]

  def loss_fn(p, batch, segments):
    mask = batch["labels"] != IGNORE
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits_fn(p, batch["tokens"], segments), jnp.maximum(batch["labels"], 0))
    return (nll * mask).sum() / mask.sum()

  @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, P()))
  def step(p, opt_state, batch, segments):
    grads = jax.grad(loss_fn)(p, batch, segments)
    updates, opt_state = _TINY_OPTIMIZER.update(grads, opt_state)
    return optax.apply_updates(p, updates), opt_state

  accuracy = jax.jit(lambda p, batch, segments: evaluate.retrieval_accuracy(
      logits_fn(p, batch["tokens"], segments), batch["labels"]))
  return step, accuracy


# 150 steps: accuracy 0.50 against 0.05 for the control (chance 1/16); the model learns the
# task between steps 50 (0.05) and 100 (0.43).
@pytest.mark.slow
def test_retrieval_is_learnable_across_shards():
  mesh = make_mesh(data=1, seq=8)
  config = data.DataConfig(source="retrieval", seq_len=64, batch_size=16)
  chance = config.retrieval.chance
  accuracy = _tiny_model_accuracy(mesh, *data.make_datasets(config, mesh), shard_local=False,
                                  steps=150)
  control = _tiny_model_accuracy(mesh, *data.make_datasets(config, mesh), shard_local=True,
                                 steps=150)
  assert accuracy > 4 * chance, (accuracy, chance)
  assert control < 2 * chance, (control, chance)
