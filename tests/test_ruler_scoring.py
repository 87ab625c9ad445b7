"""RULER scoring and exact-match probes against transformers' greedy decoding, on
sequence-sharded meshes: the same predicted ids; the report's keys; errors before any compute."""

import json

import numpy as np
import pytest

from ulysses_jax.cli import evaluate as evaluate_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import random_hf_model  # noqa: E402

SEQ_LEN = 64


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
  """A random transformers Llama saved as a checkpoint, and prompts with their greedy
  continuations from ``generate``."""
  root = tmp_path_factory.mktemp("ruler")
  model = random_hf_model("LlamaForCausalLM", num_key_value_heads=2, vocab_size=300)
  model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
  model.generation_config.pad_token_id = 0
  model.save_pretrained(root / "hf")
  rng = np.random.default_rng(0)
  cases = []
  for prompt_len, answer_len in ((40, 4), (21, 1), (57, 6), (9, 3)):
    prompt = rng.integers(0, 300, prompt_len)
    input_ids = torch.tensor(prompt[None])
    with torch.no_grad():  # every prompt token attended, whatever pad_token_id is
      out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                           max_new_tokens=answer_len, do_sample=False)
    cases.append({"prompt_ids": prompt.tolist(), "answer_ids": out[0, prompt_len:].tolist()})
  return root, cases


def _examples_file(path, cases):
  path.write_text("".join(json.dumps(c) + "\n" for c in cases))
  return str(path)


def test_scoring_equals_greedy_decoding_on_a_sequence_sharded_mesh(greedy, tmp_path):
  root, cases = greedy
  args = [f"--hf={root / 'hf'}", f"--seq_len={SEQ_LEN}", "--mesh_data=2", "--mesh_seq=4",
          "--batch_size=2"]
  result = evaluate_cli.run(args + [f"--examples={_examples_file(tmp_path / 'a.jsonl', cases)}"])
  assert result["examples"]["accuracy"] == 1.0
  assert [r["predicted_ids"] for r in result["examples"]["results"]] == \
      [c["answer_ids"] for c in cases]
  altered = [dict(c) for c in cases]
  altered[0]["answer_ids"] = [altered[0]["answer_ids"][0]] + [
      (t + 1) % 300 for t in altered[0]["answer_ids"][1:]]  # the first token stays right
  altered[1]["answer_ids"] = [(altered[1]["answer_ids"][0] + 7) % 300]
  result = evaluate_cli.run(args + [f"--examples={_examples_file(tmp_path / 'b.jsonl', altered)}"])
  assert [r["correct"] for r in result["examples"]["results"]] == [False, False, True, True]
  assert result["examples"]["accuracy"] == 0.5
  first = result["examples"]["results"][0]["predicted_ids"]
  assert first[:2] == cases[0]["answer_ids"][:2]  # fed the right first token, it predicts
  assert result["examples"]["results"][1]["predicted_ids"] == cases[1]["answer_ids"]


def test_ruler_report_keys_default_lengths_skip_what_they_cannot_hold(greedy, tmp_path,
                                                                       capsys):
  root, _ = greedy
  path = tmp_path / "r.json"
  evaluate_cli.run([f"--hf={root / 'hf'}", "--seq_len=1024", "--mesh_seq=8", "--tokenizer=byte",
                    "--ruler=niah_single_1,variable_tracking", "--samples=2", f"--json={path}",
                    f"--plot={tmp_path / 'r.png'}"])
  report = json.loads(path.read_text())["ruler"]
  assert "note: skipped RULER task variable_tracking does not fit 1,024 tokens" in \
      capsys.readouterr().err
  assert [(s["task"], s["length"]) for s in report["skipped"]] == [
      ("niah_single_1", 128), ("niah_single_1", 256), ("niah_single_1", 512),
      ("variable_tracking", 128), ("variable_tracking", 256), ("variable_tracking", 512),
      ("variable_tracking", 1024)]
  assert list(report["scoring"]) == ["strict"] and report["lengths"] == [1024]
  assert report["tasks"] == {"niah_single_1": {"by_length": {"1024": {
      "samples": 2, "strict": 0.0, "strict_stderr": 0.0}}}}  # a random model retrieves nothing
  assert report["effective_length"] is None and report["threshold"] == 85.6
  assert len(report["examples"]) == 2 and all(
      len(e["predicted_ids"]) == len(e["answer"].encode()) for e in report["examples"])
  assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hi"}', "line 2: expected"),
    ("not json", "line 2: not JSON"),
    ('{"prompt_ids": [1, 2.5], "answer_ids": [3]}', "line 2: prompt_ids and answer_ids must"),
    ('{"prompt_ids": [1], "answer_ids": [300]}', r"example 2 \(examples\): token ids must be in "
     r"\[0, 300\)"),
    ('{"prompt_ids": ' + json.dumps(list(range(70))) + ', "answer_ids": [3]}',
     "example 2 .* take 71 tokens, more than --seq_len=64"),
])
def test_bad_examples_are_refused_before_the_model_loads(greedy, tmp_path, monkeypatch, line,
                                                         message):
  root, cases = greedy
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(cases[0]) + "\n" + line + "\n")
  monkeypatch.setattr(evaluate_cli.finetune, "load_model", lambda *a: pytest.fail("loaded"))
  with pytest.raises(ValueError, match=message):
    evaluate_cli.run([f"--hf={root / 'hf'}", f"--seq_len={SEQ_LEN}", f"--examples={path}"])


def test_cli_errors_before_any_work(greedy, capsys):
  root, _ = greedy
  for flags, message in ((["--ruler=nope"], "unknown RULER task"),
                         ([], "nothing to evaluate"),
                         (["--ruler", "--lengths=1024"], "exceeds --seq_len=64")):
    with pytest.raises(SystemExit):
      evaluate_cli.run([f"--hf={root / 'hf'}", f"--seq_len={SEQ_LEN}", *flags])
    assert message in capsys.readouterr().err
