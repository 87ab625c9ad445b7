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
                    "--ruler=niah_single_1,variable_tracking", "--samples=2", "--scoring=strict",
                    f"--json={path}",
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


@pytest.mark.slow
def test_real_generation_fills_rulers_column(greedy, tmp_path, monkeypatch):
  """The plumbing of real greedy generation (a random model: what it writes is noise): each
  example's prediction and token count within niah's budget, its score RULER's metric of it,
  and the first generated token the strict score's first prediction (both greedy's first)."""
  from ulysses_jax import generate as generate_lib
  root, _ = greedy
  path, outputs, real = tmp_path / "g.json", [], generate_lib.generate

  def recorded(*args, **kwargs):
    new = real(*args, **kwargs)
    outputs.extend(new)
    return new
  monkeypatch.setattr(generate_lib, "generate", recorded)
  evaluate_cli.run([f"--hf={root / 'hf'}", "--seq_len=1024", "--mesh_data=1", "--mesh_seq=2",
                    "--tokenizer=byte", "--ruler=niah_single_1", "--lengths=1024", "--samples=2",
                    "--batch_size=2", "--no_kernel_check", f"--json={path}"])
  report = json.loads(path.read_text())["ruler"]
  assert list(report["scoring"]) == ["strict", "ruler"] and report["chat_template"] is None
  examples = report["examples"]
  assert len(examples) == 2 and all(isinstance(e["prediction"], str) and
                                    1 <= e["generated_tokens"] <= 128 for e in examples)
  assert [o[0] for o in outputs] == [e["predicted_ids"][0] for e in examples]
  cell = report["tasks"]["niah_single_1"]["by_length"]["1024"]
  assert cell["samples"] == 2 and cell["ruler"] == np.mean([
      100 * sum(o.lower() in e["prediction"].strip().lower() for o in e["outputs"]) /
      len(e["outputs"]) for e in examples])


class _FakeGenerate:
  """Stands in for ``ulysses_jax.generate.generate``: answers each prompt with the text that
  ``answer(prompt_ids)`` gives (byte ids, then EOS) and records the calls."""

  def __init__(self, answer):
    self.answer, self.calls = answer, []

  def __call__(self, model, prompts, *, max_new_tokens, eos_ids=(), layout=None, **kwargs):
    self.calls.append({"prompts": [list(p) for p in prompts], "budget": max_new_tokens,
                       "eos_ids": tuple(eos_ids), "layout": layout})
    return [list(self.answer(list(p)).encode())[:max_new_tokens - 1] + [eos_ids[0]]
            for p in prompts]


def test_ruler_scoring_through_the_pipeline_right_answers_100_wrong_0(greedy, monkeypatch):
  """A model whose answers we set: all of niah's outputs (100), half of variable tracking's
  (50, string_match_all's share), in upper case and order reversed (case and order free)."""
  from ulysses_jax import generate as generate_lib
  from ulysses_jax import ruler
  from ulysses_jax.data.corpus import ByteTokenizer
  root, _ = greedy
  length, samples = 2048, 3
  outputs = {tuple(int(t) for t in ex.prompt_ids): ex.outputs for ex in ruler.generate(
      ["niah_single_1", "variable_tracking"], [length], samples, ByteTokenizer())}
  assert len(outputs) == 2 * samples

  def answer(prompt):
    expected = outputs[tuple(prompt)]
    shown = expected if len(expected) == 1 else expected[:len(expected) // 2]
    return " " + ", ".join(reversed(shown)).upper() + "."
  fake = _FakeGenerate(answer)
  monkeypatch.setattr(generate_lib, "generate", fake)
  result = evaluate_cli.run([f"--hf={root / 'hf'}", f"--seq_len={length}", "--mesh_seq=8",
                             "--tokenizer=byte", "--ruler=niah_single_1,variable_tracking",
                             f"--lengths={length}", f"--samples={samples}", "--scoring=ruler",
                             "--batch_size=2", "--no_kernel_check"])["ruler"]
  assert list(result["scoring"]) == ["ruler"]
  cells = {t: v["by_length"][str(length)] for t, v in result["tasks"].items()}
  half = len(next(o for o in outputs.values() if len(o) > 1)) // 2 / len(
      next(o for o in outputs.values() if len(o) > 1))
  assert cells["niah_single_1"] == {"samples": 3, "ruler": 100.0, "ruler_stderr": 0.0}
  assert cells["variable_tracking"] == {"samples": 3, "ruler": 100 * half, "ruler_stderr": 0.0}
  assert result["mean_by_length"][str(length)]["ruler"] == (100 + 100 * half) / 2
  # Batched by task and length (2 + 1 prompts each), RULER's budgets, the checkpoint's EOS,
  # one cache layout (one compilation) for every call at the length.
  assert [len(c["prompts"]) for c in fake.calls] == [2, 1, 2, 1]
  assert [c["budget"] for c in fake.calls] == [128, 128, 30, 30]
  assert {c["eos_ids"] for c in fake.calls} == {(2,)}
  assert len({c["layout"] for c in fake.calls}) == 1
  # Wrong answers score 0, and the strict column stands beside RULER's with --scoring=both.
  monkeypatch.setattr(fake, "answer", lambda prompt: " I do not know.")
  result = evaluate_cli.run([f"--hf={root / 'hf'}", f"--seq_len={length}", "--mesh_seq=8",
                             "--tokenizer=byte", "--ruler=niah_single_1", f"--lengths={length}",
                             "--samples=2", "--no_kernel_check"])["ruler"]
  assert list(result["scoring"]) == ["strict", "ruler"]
  assert result["tasks"]["niah_single_1"]["by_length"][str(length)]["ruler"] == 0.0
  assert all(e["prediction"] == " I do not know." for e in result["examples"])


def test_the_checkpoints_chat_template_makes_transformers_prompt(tmp_path, monkeypatch):
  """The task text as a user turn with the generation prompt, BOS once (the template's), ids
  equal to transformers' tokenization of ``apply_chat_template(..., add_generation_prompt=
  True)`` followed by RULER's answer prefix; --no_chat_template turns it off."""
  import chat_cases
  from ulysses_jax import generate as generate_lib
  from ulysses_jax.data.corpus import HFTokenizer
  directory = tmp_path / "hf"
  tokenizer_json = chat_cases.save_tokenizer(directory, chat_cases.CHATML_GENERATION)
  random_hf_model("LlamaForCausalLM", num_key_value_heads=2, vocab_size=400).save_pretrained(
      directory)
  reference = transformers.AutoTokenizer.from_pretrained(str(directory))
  fake = _FakeGenerate(lambda prompt: "")
  monkeypatch.setattr(generate_lib, "generate", fake)
  flags = [f"--hf={directory}", "--seq_len=1024", "--mesh_seq=8", "--ruler=niah_single_1",
           "--lengths=1024", "--samples=1", "--scoring=ruler", "--no_kernel_check"]
  result = evaluate_cli.run(flags)["ruler"]
  assert result["chat_template"] == str(directory)
  ids = fake.calls[0]["prompts"][0]
  text = HFTokenizer(tokenizer_json).decode(ids, skip_special_tokens=False)
  header, user_and_prefix = text.split("<|im_start|>user\n", 1)
  user, prefix = user_and_prefix.split("<|im_end|>\n<|im_start|>assistant\n")
  assert header == "<s>" and prefix.startswith(" The special magic number for ")
  rendered = reference.apply_chat_template([{"role": "user", "content": user}],
                                           add_generation_prompt=True, tokenize=False)
  assert ids == reference(rendered + prefix, add_special_tokens=False)["input_ids"]
  assert ids.count(reference.bos_token_id) == 1 and len(ids) + 128 <= 1024
  evaluate_cli.run(flags + ["--no_chat_template"])
  plain = HFTokenizer(tokenizer_json).decode(fake.calls[-1]["prompts"][0],
                                             skip_special_tokens=False)
  assert plain.startswith("A special magic number is hidden") and "<|im_start|>" not in plain


def test_bad_scoring_or_template_flags_are_one_line_errors(greedy, tmp_path, capsys):
  root, _ = greedy
  for flags, message in (
      (["--scoring=exact"], "argument --scoring: invalid choice: 'exact'"),
      ([f"--chat_template={tmp_path / 'none.jinja'}"], f"--chat_template {tmp_path}/none.jinja: "
       "no such file"),
      (["--chat_template=x", "--no_chat_template"], "not allowed with argument")):
    with pytest.raises(SystemExit) as e:
      evaluate_cli.run([f"--hf={root / 'hf'}", "--seq_len=64", "--ruler", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
