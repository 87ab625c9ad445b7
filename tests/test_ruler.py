"""RULER-style tasks: generation (deterministic, exact lengths for any tokenizer, the answer
hidden where it says), the report's arithmetic, the training-data command. Scoring against
transformers: ``test_ruler_scoring.py``."""

import json
import re

import numpy as np
import pytest

from ulysses_jax import ruler, train
from ulysses_jax.cli import gin_config
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.cli import ruler as ruler_cli
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
def test_every_task_has_its_exact_length_and_is_reproducible(tokenizer_name, request):
  tokenizer = (make_tokenizer("byte") if tokenizer_name == "byte"
               else request.getfixturevalue(tokenizer_name))
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


def test_the_training_data_command_writes_prompt_completion_lines_of_the_asked_length(
    tmp_path, capsys):
  out = tmp_path / "train.jsonl"
  assert ruler_cli.main(["--tasks=niah_single_1,variable_tracking", "--lengths=700,900",
                         "--samples=3", f"--out={out}"]) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(lines) == 2 * 2 * 3
  assert sorted({len((r["prompt"] + r["completion"]).encode()) for r in lines}) == [700, 900]
  first = tasks.generate("niah_single_1", 700, 0, make_tokenizer("byte"), seed=1, samples=3)
  assert lines[0]["completion"] == first.answer  # the default seed 1, not evaluate's 0
  assert ruler_cli.main(["--tasks=nope", "--lengths=700", "--samples=1", f"--out={out}"]) == 2
  assert "unknown RULER task 'nope'" in capsys.readouterr().err


def _tiny_run(*params):
  return gin_config.read(["configs/tiny_cpu.gin"], [
      "LlamaConfig.preset = 'tiny'", "DataConfig.seq_len = 512", "DataConfig.batch_size = 2",
      "STEPS = 2", "OptimizerConfig.warmup_steps = 0", "TrainConfig.eval_every = 2",
      "TrainConfig.eval_batches = 1",
      "TrainConfig.progress_bar = False", *params])


@pytest.mark.slow
def test_training_logs_ruler_scores_at_eval_steps(tmp_path):
  config = _tiny_run("TrainConfig.ruler_tasks = 'niah_single_1'", "TrainConfig.ruler_samples = 2")
  train.train(str(tmp_path), config)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert "ruler_mean" not in records[0]  # step 1: no eval
  last = records[-1]
  assert last["step"] == 2
  assert {"ruler_mean", "ruler_niah_single_1", "ruler_mean_256", "ruler_mean_512"} <= set(last)
  assert last["ruler_mean"] == 0.0  # two steps from random: nothing retrieved


def test_training_refuses_unknown_or_too_long_ruler_tasks_before_the_workdir_changes(tmp_path):
  with pytest.raises(ConfigError, match="ruler_tasks names unknown tasks \\['nope'\\]"):
    _tiny_run("TrainConfig.ruler_tasks = 'niah_single_1,nope'")
  config = _tiny_run("TrainConfig.ruler_tasks = 'common_words'")
  with pytest.raises(ConfigError, match="common_words.*use longer"):
    train.train(str(tmp_path / "run"), config)
  assert not (tmp_path / "run").exists()
