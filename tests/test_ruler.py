"""RULER-style tasks and exact-match probes: generation (deterministic, exact lengths, the
answer hidden where it says), scoring equal to transformers' greedy decoding on a
sequence-sharded mesh, the report's keys, and errors before any compute."""

import json
import re

import numpy as np
import pytest

from ulysses_jax import evaluate, ruler
from ulysses_jax.corpus import make_tokenizer
from ulysses_jax.ruler import tasks

TEXT = ("Long ago the river carried boats of grain to the city, and the millers ground it into "
        "flour for the bakers, who sold bread at dawn. ") * 40


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE tokenizer.json trained on a little text (merges make lengths uneven)."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TEXT, tasks.FILLER, " ".join(tasks.words())], trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  return make_tokenizer(str(path))


@pytest.mark.parametrize("tokenizer_name", ["byte", "bpe"])
def test_every_task_has_its_exact_length_and_is_reproducible(tokenizer_name, bpe):
  tokenizer = make_tokenizer("byte") if tokenizer_name == "byte" else bpe
  (text_ids,) = tokenizer.encode_batch([TEXT.encode()])
  for name in tasks.TASKS:
    for length in (1500, 2500):
      make = lambda seed, n=name, length=length: tasks.generate(
          n, length, 1, tokenizer, seed=seed, samples=3, text_ids=text_ids)
      example, again, other = make(0), make(0), make(1)
      assert len(example.prompt_ids) + len(example.answer_ids) == length, name
      assert np.array_equal(example.prompt_ids, again.prompt_ids), name
      assert np.array_equal(example.answer_ids, again.answer_ids), name
      assert not np.array_equal(example.prompt_ids, other.prompt_ids), name
      decoded = tokenizer.decode(example.prompt_ids)
      if tasks.TASKS[name].kind != "common_words":  # its answer is sorted, not in the text
        for part in re.split(r", | ", example.answer):
          assert part in decoded, (name, part)


def test_the_needle_depth_sweeps_from_start_to_end():
  tokenizer = make_tokenizer("byte")
  positions = []
  for sample in range(3):
    example = tasks.generate("niah_single_1", 3000, sample, tokenizer, samples=3)
    assert example.depth == sample / 2
    positions.append(tokenizer.decode(example.prompt_ids).find(example.answer) / 3000)
  assert positions[0] < 0.1 < 0.4 < positions[1] < 0.6 < 0.9 < positions[2]


def test_word_tasks_count_as_they_claim():
  tokenizer = make_tokenizer("byte")
  common = tasks.generate("common_words", 8000, 0, tokenizer)
  listed = re.findall(r"^- (\w+)$", tokenizer.decode(common.prompt_ids), re.M)
  counts = {w: listed.count(w) for w in set(listed)}
  assert sorted(w for w, c in counts.items() if c > 3) == common.answer.split(", ")
  assert min(c for c in counts.values() if c > 3) == 30 and max(counts.values()) == 30
  short = tasks.generate("common_words", 1500, 0, tokenizer)
  listed = re.findall(r"^- (\w+)$", tokenizer.decode(short.prompt_ids), re.M)
  assert sorted(w for w in set(listed) if listed.count(w) >= 5) == short.answer.split(", ")
  frequent = tasks.generate("frequent_words", 8000, 0, tokenizer)
  body = tokenizer.decode(frequent.prompt_ids).split("\n")[-2].split()
  ranked = sorted(set(body), key=body.count, reverse=True)
  top = [body.count(w) for w in ranked[:4]]
  assert ranked[:3] == frequent.answer.split(", ") and top[0] > top[1] > top[2] > top[3]


def test_lengths_too_short_and_text_tasks_without_text_are_clear_errors():
  tokenizer = make_tokenizer("byte")
  with pytest.raises(ValueError, match="haystack room.*use longer --lengths"):
    tasks.generate("niah_multikey_3", 200, 0, tokenizer)
  with pytest.raises(ValueError, match="give documents with --data"):
    tasks.generate("niah_single_2", 2000, 0, tokenizer)
  with pytest.raises(ValueError, match="unknown RULER task 'nope'"):
    tasks.generate("nope", 2000, 0, tokenizer)


def test_effective_length_is_the_last_length_before_the_mean_falls_below_the_threshold():
  examples = [tasks.Example(t, n, 0, np.zeros(1), np.zeros(1), "") for t in "ab"
              for n in (100, 200, 400)]
  correct = {("a", 100): 1, ("b", 100): 1, ("a", 200): 1, ("b", 200): 0.0,
             ("a", 400): 1, ("b", 400): 1}
  results = [{"correct": bool(correct[e.task, e.length]), "predicted_ids": []}
             for e in examples]
  report = ruler.summarize(examples, results, threshold=0.5)
  assert report["mean_by_length"] == {"100": 1.0, "200": 0.5, "400": 1.0}
  assert report["effective_length"] == 400
  assert ruler.summarize(examples, results, threshold=0.6)["effective_length"] == 100
  assert ruler.summarize(examples, results, threshold=1.01)["effective_length"] is None
  assert report["tasks"]["b"]["by_length"]["200"] == {"accuracy": 0.0, "samples": 1}


# ---------------------------------------------------------------- against transformers

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
  result = evaluate.main(args + [f"--examples={_examples_file(tmp_path / 'a.jsonl', cases)}"])
  assert result["examples"]["accuracy"] == 1.0
  assert [r["predicted_ids"] for r in result["examples"]["results"]] == \
      [c["answer_ids"] for c in cases]
  altered = [dict(c) for c in cases]
  altered[0]["answer_ids"] = [altered[0]["answer_ids"][0]] + [
      (t + 1) % 300 for t in altered[0]["answer_ids"][1:]]  # the first token stays right
  altered[1]["answer_ids"] = [(altered[1]["answer_ids"][0] + 7) % 300]
  result = evaluate.main(args + [f"--examples={_examples_file(tmp_path / 'b.jsonl', altered)}"])
  assert [r["correct"] for r in result["examples"]["results"]] == [False, False, True, True]
  assert result["examples"]["accuracy"] == 0.5
  first = result["examples"]["results"][0]["predicted_ids"]
  assert first[:2] == cases[0]["answer_ids"][:2]  # fed the right first token, it predicts
  assert result["examples"]["results"][1]["predicted_ids"] == cases[1]["answer_ids"]


def test_ruler_report_keys_and_a_random_model_scores_nothing(greedy, tmp_path):
  root, _ = greedy
  path = tmp_path / "r.json"
  evaluate.main([f"--hf={root / 'hf'}", "--seq_len=1024", "--mesh_seq=8", "--tokenizer=byte",
                 "--ruler=niah_single_1,variable_tracking", "--lengths=512,1024", "--samples=2",
                 f"--json={path}", f"--plot={tmp_path / 'r.png'}"])
  report = json.loads(path.read_text())["ruler"]
  assert set(report["tasks"]) == {"niah_single_1", "variable_tracking"}
  for task in report["tasks"].values():
    assert set(task["by_length"]) == {"512", "1024"}
    assert all(v == {"accuracy": 0.0, "samples": 2} for v in task["by_length"].values())
  assert report["mean_by_length"] == {"512": 0.0, "1024": 0.0}
  assert report["effective_length"] is None
  assert len(report["examples"]) == 8 and all(
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
  monkeypatch.setattr(evaluate.finetune, "load_model", lambda *a: pytest.fail("loaded"))
  with pytest.raises(ValueError, match=message):
    evaluate.main([f"--hf={root / 'hf'}", f"--seq_len={SEQ_LEN}", f"--examples={path}"])


def test_cli_errors_before_any_work(greedy, capsys):
  root, _ = greedy
  for flags, message in ((["--ruler=nope"], "unknown RULER task"),
                         ([], "nothing to evaluate"),
                         (["--ruler", "--lengths=1024"], "exceeds --seq_len=64")):
    with pytest.raises(SystemExit):
      evaluate.main([f"--hf={root / 'hf'}", f"--seq_len={SEQ_LEN}", *flags])
    assert message in capsys.readouterr().err
