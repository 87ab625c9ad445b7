"""RULER's tasks: each generated prompt parsed back (the asked keys stand only with their
values, needles at sentence boundaries, the counts RULER's tasks promise), RULER's templates,
one tokenization that fits prompt + budget in L, QA from SQuAD/HotpotQA files, RULER's
scoring, the training-data command. Scoring against transformers: ``test_ruler_scoring.py``."""

import json
import re

import numpy as np
import pytest

from ulysses_jax import ruler, train
from ulysses_jax.cli import gin_config
from ulysses_jax.cli import ruler as ruler_cli
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.corpus import make_tokenizer
from ulysses_jax.ruler import haystacks, prompts, scoring, tasks, words

ESSAY = " ".join([
    "Long ago the river carried boats of grain to the city.", "Mr. Hale, the miller, ground it "
    "into flour for the bakers, who sold bread at dawn!", "Was it hard work?",
    "\"Yes,\" said the baker (who knew).", "Prices rose in 1848, e.g. for rye and wheat.",
    "Nobody wrote down why."] * 60)
NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")
BYTE = make_tokenizer("byte")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE tokenizer.json trained on a little text (merges make lengths uneven)."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=500, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([ESSAY, prompts.NOISE, *(t for t, _, _ in prompts.TEMPLATES.values()),
                           " ".join(words.common_word_pool()[:2000])], trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  return make_tokenizer(str(path))


def _needles(prompt: str) -> dict[str, list[str]]:
  found = {}
  for _, key, value in NEEDLE.findall(prompt):
    found.setdefault(key, []).append(value)
  return found


def _asked(prompt: str) -> list[str]:
  query = re.search(r"special magic \w+ for (.+) mentioned in the provided text\?", prompt)[1]
  return re.split(r", and |, ", query)


@pytest.mark.parametrize("name", [n for n, t in tasks.TASKS.items() if t.family == "niah"])
def test_every_asked_key_stands_only_with_its_values_and_needles_sit_between_sentences(name):
  examples = tasks.generate(name, 3000, 3, BYTE, essays=ESSAY)
  task = tasks.TASKS[name]
  for ex in examples:
    prompt = BYTE.decode(ex.prompt_ids)
    needles, asked = _needles(prompt), _asked(prompt)
    assert len(needles) == (max(task.needles, task.queries) if task.haystack != "needle"
                            else len(needles))
    assert len(asked) == task.queries and all(a in needles for a in asked)
    assert [v for a in asked for v in needles[a]] == list(ex.outputs)  # nothing else
    assert all(len(needles[a]) == task.value_count for a in asked)
    for a in asked:  # no other key contains it
      assert [k for k in needles if a in k or k in a] == [a]
    for match in NEEDLE.finditer(prompt):
      before, after = prompt[:match.start()], prompt[match.end():]
      assert before.endswith("\n") or re.search(r"""[.!?]["')]* $""", before), before[-30:]
      assert after[0] in "\n ", after[:30]
    assert ex.answer == " " + ", ".join(ex.outputs) and ex.budget == 128


def test_rulers_templates_singular_for_one_value_plural_for_several():
  one = BYTE.decode(tasks.generate("niah_single_1", 1000, 1, BYTE)[0].prompt_ids)
  assert one.startswith("A special magic number is hidden within the following text. Make sure "
                        "to memorize it. I will quiz you about the number afterwards.\nThe grass")
  key = _asked(one)[0]
  assert one.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided "
                      f"text? The special magic number for {key} mentioned in the provided text "
                      "is")
  many = BYTE.decode(tasks.generate("niah_multiquery", 1500, 1, BYTE, essays=ESSAY)[0].prompt_ids)
  a, b, c, d = _asked(many)
  assert many.startswith("Some special magic numbers are hidden")
  assert many.endswith(f"What are all the special magic numbers for {a}, {b}, {c}, and {d} "
                       "mentioned in the provided text? The special magic numbers for "
                       f"{a}, {b}, {c}, and {d} mentioned in the provided text are")
  uuid = BYTE.decode(tasks.generate("niah_multikey_3", 1500, 1, BYTE)[0].prompt_ids)
  assert re.search(r"One of the special magic uuids for [0-9a-f-]{36} is: [0-9a-f]{8}-"
                   r"[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\.\n", uuid)


def test_distractor_keys_never_take_an_asked_key_even_from_a_tiny_pool(monkeypatch):
  monkeypatch.setattr(words, "adjectives", lambda: ("red", "tired", "big"))
  monkeypatch.setattr(words, "nouns", lambda: ("cat", "dog", "cats"))
  for sample, ex in enumerate(tasks.generate("niah_multikey_2", 4000, 4, BYTE)):
    prompt = BYTE.decode(ex.prompt_ids)
    (asked,), needles = _asked(prompt), _needles(prompt)
    assert needles[asked] == list(ex.outputs) and len(needles) > 2, sample
    assert [k for k in needles if asked in k or k in asked] == [asked]


def test_the_needle_depth_sweeps_from_start_to_end():
  positions = []
  for ex in tasks.generate("niah_single_2", 3000, 3, BYTE, essays=ESSAY):
    prompt = BYTE.decode(ex.prompt_ids)
    positions.append(prompt.find("One of the special") / len(prompt))
  assert positions[0] < 0.1 < 0.4 < positions[1] < 0.6 < 0.85 < positions[2]


def test_sentences_cut_after_ends_not_after_abbreviations_or_initials():
  text = ('Mr. Hale met J. Smith. "Why?" he asked (twice.) Then e.g. bread, etc. '
          "Prices rose in 1848. done")
  assert haystacks.sentences(text) == [
      'Mr. Hale met J. Smith.', '"Why?" he asked (twice.)', 'Then e.g. bread, etc. Prices rose '
      'in 1848. done']
  cut = haystacks.essay_sentences(haystacks.essay_words(ESSAY), 17)
  assert cut[-1].endswith(".") and len(" ".join(cut).split()) < 17


def test_variable_tracking_follows_rulers_chain_after_a_one_shot_example():
  ex = tasks.generate("variable_tracking", 2000, 1, BYTE)[0]
  prompt = BYTE.decode(ex.prompt_ids)
  shot, question = prompt.split("\n\nMemorize and track")
  assert shot.startswith("Memorize and track the chain(s) of variable assignment")
  shot_names = re.findall(r"VAR ([A-Z]+) =", shot)
  assert len(shot_names) == 5 and all(len(n) == 3 for n in shot_names)
  assert shot.endswith("they are:  " + " ".join(shot_names))  # then a newline, a blank line
  value = re.search(r"assigned the value (\d{5}) in the text above", question)[1]
  binding = dict(re.findall(r"^VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+) ?$", question, re.M))
  chain = [n for n, v in binding.items() if v == value]
  while len(chain) < len(binding) and f"VAR {chain[-1]}" in binding.values():
    chain.append(next(n for n, v in binding.items() if v == f"VAR {chain[-1]}"))
  assert chain == list(ex.outputs) and len(chain) == 5 and ex.answer == " ".join(chain)
  assert question.endswith(f"5 variables are assigned the value {value}, they are: ")


class Pieces:
  """A tokenizer of words and whitespace runs, one id each (a length of 3,800 holds a list)."""

  def __init__(self):
    self.ids, self.pieces = {}, []

  def encode_batch(self, docs, add_special_tokens=False):
    out = []
    for doc in docs:
      pieces = [p for p in re.split(r"(\s+)", doc.decode()) if p]
      for p in pieces:
        if p not in self.ids:
          self.ids[p] = len(self.pieces)
          self.pieces.append(p)
      out.append(np.array([self.ids[p] for p in pieces], np.int64))
    return out

  def decode(self, ids):
    return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("tokenizer, length, common, other, shot", [
    (Pieces(), 6000, 30, 3, 40), (Pieces(), 3800, 6, 1, 20)])
def test_common_words_are_rulers_counted_list_after_its_example(tokenizer, length, common,
                                                                 other, shot):
  ex = tasks.generate("common_words", length, 1, tokenizer)[0]
  prompt = tokenizer.decode(ex.prompt_ids)
  lists = re.findall(r"most often\.\n(.*)\nQuestion", prompt)
  assert len(lists) == 2
  example, listed = ([re.sub(r"^\d+\. ", "", w) for w in re.split(r" (?=\d+\. )", x)]
                     for x in lists)
  assert len(set(example)) == shot
  counts = {w: listed.count(w) for w in set(listed)}
  assert sorted(w for w, c in counts.items() if c == common) == sorted(ex.outputs)
  assert set(counts.values()) == {common, other} and len(ex.outputs) == 10
  assert prompt.endswith("Answer: The top 10 words that appear most often in the list are:")
  assert length - 100 < len(ex.prompt_ids) + 120 <= length
  assert len(ex.prompt_ids) + len(ex.answer_ids) <= length


def test_frequent_words_rank_two_to_four_behind_rulers_noise_word():
  ex = tasks.generate("frequent_words", 6000, 1, BYTE)[0]
  prompt = BYTE.decode(ex.prompt_ids)
  coded = re.search(r"coded words\. (.*)\nQuestion", prompt)[1].split(" ")
  ranked = sorted(set(coded), key=coded.count, reverse=True)
  counts = [coded.count(w) for w in ranked[:5]]
  assert ranked[0] == "..." and tuple(ranked[1:4]) == ex.outputs
  assert counts == sorted(set(counts), reverse=True)  # strictly apart
  assert len(set(coded)) <= (6000 - 50) // 50 and all(len(w) == 6 for w in ranked[1:])


@pytest.mark.parametrize("name", ["niah_single_1", "niah_multivalue", "variable_tracking",
                                  "frequent_words"])
def test_the_prompt_is_tokenized_once_fits_its_budget_and_is_reproducible(name, bpe):
  make = lambda seed: tasks.generate(name, 2500, 2, bpe, seed=seed, essays=ESSAY)
  examples, again, other = make(0), make(0), make(1)
  for ex, ex_again, ex_other in zip(examples, again, other):
    text = bpe.decode(ex.prompt_ids)
    assert np.array_equal(ex.prompt_ids, bpe.encode_batch([text.encode()])[0])  # one piece
    assert 2500 - 120 < len(ex.prompt_ids) + ex.budget <= 2500
    assert len(ex.prompt_ids) + len(ex.answer_ids) <= 2500  # the strict score's row too
    assert np.array_equal(ex.prompt_ids, ex_again.prompt_ids)
    assert not np.array_equal(ex.prompt_ids, ex_other.prompt_ids)
    assert np.array_equal(ex.answer_ids, bpe.encode_batch([ex.answer.encode()])[0])
    assert all(o in text for o in ex.outputs)


def _qa_files(tmp_path):
  squad = {"data": [{"paragraphs": [
      {"context": f"Paragraph {a}.{p}: the {a * 10 + p}th harbour opened in spring.",
       "qas": [{"question": f"Which harbour is in paragraph {a}.{p}?", "is_impossible": False,
                "answers": [{"text": f"the {a * 10 + p}th harbour"}, {"text": "harbour"}]},
               {"question": "Unanswerable?", "is_impossible": True, "answers": []}]}
      for p in range(3)]} for a in range(20)]}
  hotpot = [{"question": f"Who built tower {i}?", "answer": f"Builder {i}",
             "context": [[f"Tower {i}", [f"Tower {i} was built by Builder {i}. ", "It stands."]]]
             + [[f"Other {i}-{j}", [f"Filler text {i} {j}."]] for j in range(9)]}
            for i in range(30)]
  (tmp_path / "squad.json").write_text(json.dumps(squad))
  (tmp_path / "hotpot.json").write_text(json.dumps(hotpot))
  return [str(tmp_path / "squad.json"), str(tmp_path / "hotpot.json")]


def test_qa_tasks_ask_squad_and_hotpotqa_questions_over_their_documents_and_others(tmp_path):
  _, qa_sets = ruler.read_inputs(["qa_1", "qa_2"], qa_paths=_qa_files(tmp_path))
  assert len(qa_sets["squad"].questions) == 60 and len(qa_sets["hotpotqa"].questions) == 30
  for name, first in (("qa_1", "Paragraph"), ("qa_2", "Tower")):
    for ex in tasks.generate(name, 3000, 3, BYTE, qa_sets=qa_sets):
      prompt = BYTE.decode(ex.prompt_ids)
      question = re.search(r"Question: (.*) Answer:$", prompt)[1]
      docs = re.findall(r"Document (\d+):\n(.*?)(?=\n\nDocument|\n\nAnswer the question)", prompt,
                        re.S)
      assert [int(i) for i, _ in docs] == list(range(1, len(docs) + 1)) and len(docs) > 10
      assert any(ex.outputs[0] in d for _, d in docs) and ex.metric == "part"
      assert question.startswith(("Which harbour", "Who built")) and first in prompt
      assert prompt.startswith("Answer the question based on the given documents. Only give me "
                               "the answer and do not output any other words.\n\nThe following "
                               "are given documents.\n\nDocument 1:\n")
      assert len(ex.prompt_ids) + 32 <= 3000 and ex.budget == 32
  (tmp_path / "bad.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="neither SQuAD .* nor HotpotQA"):
    ruler.read_inputs(["qa_1"], qa_paths=[str(tmp_path / "bad.json")])
  with pytest.raises(ValueError, match="task qa_2 needs hotpot_dev_distractor_v1.json: give it "
                     "with --qa_data"):
    tasks.generate("qa_2", 3000, 1, BYTE, qa_sets={"squad": qa_sets["squad"]})


def test_rulers_scores_after_its_clean_up():
  assert scoring.postprocess("  \x00 The numbers: 12,\t 34 \n") == "The numbers: 12,\n 34"
  assert scoring.string_match_all("The Quick-Fox and 42", ["quick-fox", "42", "7"]) == 2 / 3
  assert scoring.string_match_part("It was Builder 3.", ["builder 3", "nobody"]) == 1.0
  assert scoring.string_match_part("nobody knows", ["Builder 3"]) == 0.0
  one = tasks.Example("qa_1", 100, 0, np.zeros(1), np.zeros(1), " x", ("Paris", "paris city"),
                      metric="part")
  assert scoring.ruler_score(one, " paris, France") == 100.0


def test_the_report_gives_each_cell_its_standard_error_and_the_full_suite_an_effective_length():
  names = list(tasks.TASKS)
  examples = [tasks.Example(t, n, s, np.zeros(1), np.zeros(1), " a", ("a", "b"))
              for t in names for n in (100, 200) for s in range(4)]
  predictions = {100: ["a b", "a b", "a b", "a b"], 200: ["a", "a b", "", "a b"]}
  results = [{"correct": ex.sample != 0, "prediction": predictions[ex.length][ex.sample]}
             for ex in examples]
  report = scoring.summarize(examples, results, names)
  cell = report["tasks"]["niah_single_1"]["by_length"]["200"]
  assert cell["samples"] == 4 and cell["ruler"] == 62.5 and cell["strict"] == 75.0
  assert cell["ruler_stderr"] == pytest.approx(np.std([50, 100, 0, 100], ddof=1) / 2)
  assert cell["strict_stderr"] == pytest.approx(np.std([0, 100, 100, 100], ddof=1) / 2)
  mean = report["mean_by_length"]["200"]
  assert mean["ruler"] == 62.5 and mean["ruler_stderr"] == pytest.approx(
      cell["ruler_stderr"] / np.sqrt(len(names)))
  assert report["effective_length"] == 100 and set(report["scoring"]) == {"strict", "ruler"}
  strict_only = scoring.summarize(examples, [{"correct": r["correct"]} for r in results], names)
  assert strict_only["effective_length"] is None and set(strict_only["scoring"]) == {"strict"}
  assert "strict score has no effective length" in strict_only["effective_length_note"]
  part = scoring.summarize(examples[:8], results[:8], names)
  assert part["effective_length"] is None and "not the whole RULER suite" in \
      part["effective_length_note"]


def test_lengths_too_short_and_missing_inputs_are_clear_errors():
  with pytest.raises(tasks.Unfit, match="niah_multikey_3 does not fit 300 tokens: its smallest "
                     r"prompt takes \d+ and generation 128; use longer --lengths"):
    tasks.generate("niah_multikey_3", 300, 1, BYTE)
  with pytest.raises(ValueError, match="give text files with --data"):
    tasks.generate("niah_single_2", 2000, 1, BYTE)
  with pytest.raises(ValueError, match="unknown RULER task 'nope'"):
    tasks.generate("nope", 2000, 1, BYTE)
  skipped = []
  kept = ruler.generate(["niah_single_1", "variable_tracking"], [1000, 1500], 1, BYTE,
                        skipped=skipped)
  assert [(e.task, e.length) for e in kept] == [("niah_single_1", 1000), ("niah_single_1", 1500),
                                                ("variable_tracking", 1500)]
  assert [(s["task"], s["length"]) for s in skipped] == [("variable_tracking", 1000)]


def test_the_training_data_command_writes_prompt_completion_lines(tmp_path, capsys):
  out = tmp_path / "train.jsonl"
  essay = tmp_path / "essay.txt"
  essay.write_text(ESSAY)
  assert ruler_cli.main(["--tasks=niah_single_1,niah_single_2", "--lengths=700,900",
                         "--samples=3", f"--out={out}", f"--data={essay},{essay}"]) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(lines) == 2 * 2 * 3
  assert all(len((r["prompt"]).encode()) + 128 <= r["length"] for r in lines)
  first = tasks.generate("niah_single_1", 700, 3, BYTE, seed=1)[0]
  assert lines[0]["completion"] == first.answer  # the default seed 1, not evaluate's 0
  assert lines[0]["outputs"] == list(first.outputs) and lines[0]["task"] == "niah_single_1"
  capsys.readouterr()
  records = tmp_path / "essay.jsonl"
  records.write_text(json.dumps({"text": ESSAY}) + "\n")
  assert ruler_cli.main(["--tasks=niah_multivalue", "--lengths=1500", "--samples=2",
                         f"--data={records}", f"--data={essay}"]) == 0  # to standard output
  printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [len(_needles(r["prompt"])) for r in printed] == [1, 1]
  assert [len(next(iter(_needles(r["prompt"]).values()))) for r in printed] == [4, 4]
  assert ruler_cli.main(["--tasks=nope", "--lengths=700", "--samples=1", f"--out={out}"]) == 2
  assert "unknown RULER task 'nope'" in capsys.readouterr().err


def _tiny_run(*params):
  return gin_config.read(["configs/tiny_cpu.gin"], [
      "LlamaConfig.preset = 'tiny'", "DataConfig.seq_len = 1024", "DataConfig.batch_size = 2",
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
  assert {"ruler_mean", "ruler_niah_single_1", "ruler_mean_1024"} <= set(last)
  assert "ruler_mean_512" not in last  # S/2 cannot hold the task: skipped
  assert last["ruler_mean"] == 0.0  # two steps from random: nothing retrieved


def test_training_refuses_unknown_or_too_long_ruler_tasks_before_the_workdir_changes(tmp_path):
  with pytest.raises(ConfigError, match="ruler_tasks names unknown tasks \\['nope'\\]"):
    _tiny_run("TrainConfig.ruler_tasks = 'niah_single_1,nope'")
  config = _tiny_run("TrainConfig.ruler_tasks = 'common_words'")
  with pytest.raises(ConfigError, match="common_words.*use longer"):
    train.train(str(tmp_path / "run"), config)
  assert not (tmp_path / "run").exists()
