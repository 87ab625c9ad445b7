"""``ulysses_jax.evaluate``: per-position losses on a sequence-sharded mesh against one device
and against ``transformers``; buckets; the pass-key rows; errors before any compute."""

import dataclasses
import json
import logging
import sys

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import random_hf_model  # noqa: E402

from ulysses_jax import evaluate  # noqa: E402
from ulysses_jax.data import pipeline as data  # noqa: E402
from ulysses_jax.hf import init_from as finetune  # noqa: E402
from ulysses_jax.attention import backends  # noqa: E402
from ulysses_jax.cli import evaluate as evaluate_cli  # noqa: E402
from ulysses_jax.config_checks import ConfigError  # noqa: E402
from ulysses_jax.data.corpus import make_tokenizer  # noqa: E402
from ulysses_jax.evaluate import passkey  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402

SEQ_LEN = 16
DOC_LENGTHS = (50, 17, 5, 1)  # 4 + 1 + 1 + 0 windows; a 1-token document predicts nothing


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("eval")
  reference = random_hf_model("LlamaForCausalLM", num_key_value_heads=2)
  reference.save_pretrained(root / "hf")
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 128, n).astype(dtype)  # token files of the dtypes users write
          for n, dtype in zip(DOC_LENGTHS, (np.int32, np.int64, np.uint16, np.uint8))]
  for i, d in enumerate(docs):
    np.save(root / f"doc{i}.npy", d)
  return root, reference, docs


def _run(root, *flags):
  return evaluate_cli.run([f"--hf={root / 'hf'}", f"--data={root / 'doc*.npy'}",
                        f"--seq_len={SEQ_LEN}", *flags])


def _transformers_position_losses(reference, docs):
  """Loss sum and count by position within the window, from transformers' logits."""
  loss, count = np.zeros(SEQ_LEN), np.zeros(SEQ_LEN)
  for doc in docs:
    for start in range(0, len(doc) - 1, SEQ_LEN):
      window = doc[start:start + SEQ_LEN + 1].astype(np.int64)
      with torch.no_grad():
        logits = reference(torch.tensor(window[None, :-1])).logits[0].double()
      nll = torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]),
                                              reduction="none").numpy()
      loss[:len(nll)] += nll
      count[:len(nll)] += 1
  return loss, count


def test_sequence_sharded_equals_one_device_and_transformers(setup, tmp_path):
  root, reference, docs = setup
  sharded = _run(root, "--mesh_data=1", "--mesh_seq=4", "--batch_size=2",
                 f"--json={tmp_path / 'r.json'}")
  single = _run(root, "--mesh_data=1", "--mesh_seq=1")
  assert sharded["mesh"] == {"data": 1, "seq": 4} and single["mesh"] == {"data": 1, "seq": 1}
  assert json.loads((tmp_path / "r.json").read_text())["buckets"] == sharded["buckets"]
  assert [(b["start"], b["end"]) for b in sharded["buckets"]] == [
      (0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]
  assert sharded["tokens"] == single["tokens"] == sum(n - 1 for n in DOC_LENGTHS)
  for a, b in zip(sharded["buckets"], single["buckets"], strict=True):
    assert a["tokens"] == b["tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
  loss, count = _transformers_position_losses(reference, docs)
  assert sharded["loss"] == pytest.approx(loss.sum() / count.sum(), rel=1e-5)
  assert sharded["perplexity"] == pytest.approx(np.exp(loss.sum() / count.sum()), rel=1e-5)
  for bucket in sharded["buckets"]:
    a, b = bucket["start"], bucket["end"]
    assert bucket["tokens"] == count[a:b].sum()
    assert bucket["loss"] == pytest.approx(loss[a:b].sum() / count[a:b].sum(), rel=1e-5)


def test_log_buckets():
  assert evaluate.log_buckets(1) == [(0, 1)]
  assert evaluate.log_buckets(20) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 20)]


def test_passkey_rows_label_only_the_key():
  tok = make_tokenizer("byte")
  trials, rows = passkey.make_rows(tok, 256, trials=2)
  assert sorted({t.length for t in trials}) == [128, 256]
  assert sorted({t.depth for t in trials}) == list(passkey.DEPTHS)
  for trial, row in zip(trials, rows):
    text = bytes(row["tokens"][:trial.length].astype(np.uint8)).decode()
    assert text.endswith(passkey.QUESTION + trial.key)
    needle = passkey.NEEDLE.format(key=trial.key)
    fill = trial.length - len(needle) - len(passkey.QUESTION) - passkey.DIGITS
    assert text.index(needle) == round(trial.depth * fill)
    labelled = row["labels"] != -1
    assert bytes(row["labels"][labelled].astype(np.uint8)).decode() == trial.key
    assert np.all(row["segment_ids"][trial.length:] == 1)
  table = passkey.accuracy_table(trials, [t.depth == 0 for t in trials])
  assert table["accuracy"][0] == [1.0, 1.0] and table["accuracy"][1] == [0.0, 0.0]
  assert table["trials"] == 2 and table["chance"] == 1e-5
  with pytest.raises(ValueError, match="seq_len=64 is too short for the pass-key test"):
    passkey.make_rows(tok, 64)


def test_passkey_through_the_command_line(tmp_path):
  random_hf_model("LlamaForCausalLM", vocab_size=256).save_pretrained(tmp_path / "hf")
  (tmp_path / "a.txt").write_text("some text to evaluate " * 20)
  result = evaluate_cli.run([f"--hf={tmp_path / 'hf'}", f"--data={tmp_path / 'a.txt'}",
                          "--seq_len=128", "--mesh_seq=4", "--mesh_data=2", "--passkey",
                          "--passkey_trials=1"])
  table = result["passkey"]
  assert table["lengths"] == [128] and len(table["accuracy"]) == len(passkey.DEPTHS)
  assert 0 <= table["overall"] <= 1


def test_errors_before_any_compute(setup, tmp_path, monkeypatch):
  root, _, _ = setup
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ConfigError, match="--plot needs matplotlib: pip install matplotlib"):
    _run(root, f"--plot={tmp_path / 'p.png'}")
  (tmp_path / "a.txt").write_text("text")
  with pytest.raises(ConfigError, match="tokenizer 'byte' uses ids up to 255, beyond the "
                     "model's vocab_size=128"):
    evaluate_cli.run([f"--hf={root / 'hf'}", f"--data={tmp_path / 'a.txt'}", "--seq_len=16"])
  with pytest.raises(ConfigError, match="pass-key tokenizer has 256 ids but the model's "
                     "vocab_size is 128"):
    _run(root, "--passkey", "--seq_len=256")


def test_plot_draws_the_curve_and_the_heatmap(tmp_path):
  pytest.importorskip("matplotlib")
  result = {"loss": 2.0, "buckets": [{"start": 0, "end": 1, "loss": 3.0, "tokens": 4},
                                     {"start": 1, "end": 2, "loss": None, "tokens": 0},
                                     {"start": 2, "end": 4, "loss": 2.0, "tokens": 8}],
            "passkey": {"lengths": [128, 256], "depths": [0.0, 1.0],
                        "accuracy": [[1.0, 0.5], [0.0, 0.0]], "overall": 0.375}}
  evaluate.plot(result, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_model_trained_on_retrieval_beats_chance_at_retrieval(retrieval_run):
  """Pass-key-style scoring (a row counts when every label is the top prediction) of a Llama
  trained by the trainer on the retrieval task (keys on the first of 8 sequence shards, the
  question on the last; conftest's ``retrieval_run``), read back from its workdir."""
  workdir, _ = retrieval_run
  mesh = make_mesh(data=1, seq=8)
  config = finetune.model_config(workdir)
  model = finetune.load_model(workdir, config, mesh)
  task = data.RetrievalTask()
  _, evals = data.make_datasets(data.DataConfig(source="retrieval", seq_len=64, batch_size=64,
                                                retrieval=task), mesh)
  graphdef, params = nnx.split(model)
  sums = evaluate.PositionEval(graphdef).sums(params, evals)
  assert np.all(sums["row_count"] == 1)
  accuracy = float(np.mean(sums["row_correct"] == sums["row_count"]))
  assert accuracy > 4 * task.chance, accuracy


def test_data_with_nothing_to_predict(setup, tmp_path):
  root, _, _ = setup
  np.save(tmp_path / "one.npy", np.array([5], np.uint16))
  with pytest.raises(ConfigError, match="holds no document of 2 or more tokens"):
    evaluate_cli.run([f"--hf={root / 'hf'}", f"--data={tmp_path / 'one.npy'}", "--seq_len=16"])


def test_a_failing_attention_kernel_falls_back_before_the_first_batch(setup, monkeypatch,
                                                                       caplog):
  """The model set to the "pallas" backend, made to raise: the self-check falls back to xla;
  with --no_kernel_check the evaluation runs the broken kernel and fails."""
  root, _, _ = setup
  real_config, real_attention = finetune.model_config, backends.local_attention

  def broken(backend, *args, **kwargs):
    if backend == "pallas":
      raise RuntimeError("broken kernel")
    return real_attention(backend, *args, **kwargs)
  monkeypatch.setattr(finetune, "model_config", lambda *args, **kwargs: dataclasses.replace(
      real_config(*args, **kwargs), attention_backend="pallas"))
  monkeypatch.setattr(backends, "local_attention", broken)
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    result = _run(root, "--mesh_data=1", "--mesh_seq=4", "--batch_size=2")
  assert "pallas failed: RuntimeError: broken kernel; falling back to xla" in caplog.text
  assert np.isfinite(result["loss"])
  with pytest.raises(RuntimeError, match="broken kernel"):
    _run(root, "--mesh_data=1", "--mesh_seq=4", "--batch_size=2", "--no_kernel_check")
