"""Conversations in the model's chat template (``ulysses_jax.data.chat``), token for token against
transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on a BPE
tokenizer trained here; Parquet, Arrow and JSONL chat data packed into rows."""

import json

import numpy as np
import pytest

from tests import chat_cases
from ulysses_jax.data import chat
from ulysses_jax.data import pipeline as data
from ulysses_jax.data.corpus import HFTokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
  """(tokenizer.json path, conversations, transformers' (ids, mask) of each)."""
  directory = tmp_path_factory.mktemp("chatml")
  path = chat_cases.save_tokenizer(directory, chat_cases.CHATML_GENERATION)
  convs = chat_cases.conversations(24)
  return path, convs, chat_cases.reference(directory, convs)


def _template(path, chat_template="", roles=("assistant",)):
  text, special = chat.find_template(path, chat_template)
  return chat.ChatTemplate(text, special, HFTokenizer(path), roles)


def test_generation_blocks_give_transformers_ids_and_mask(chatml):
  path, convs, refs = chatml
  template = _template(path)
  assert template.by_generation
  for messages, (ids, mask) in zip(convs, refs):
    [(got_ids, targets)] = template.encode([(messages, "conversation")])
    assert got_ids.tolist() == ids
    assert targets.astype(int).tolist() == mask
    assert 0 < sum(mask) < len(mask)


@pytest.mark.parametrize("template_text, layout", [
    (chat_cases.CHATML_PLAIN, "jinja"),
    (chat_cases.LLAMA_GENERATION, "config"),
])
def test_turn_by_turn_and_other_templates(tmp_path, chatml, template_text, layout):
  """Without {% generation %}, turn by turn: the tagged template's mask plus the newline each
  assistant turn writes after its end token. A Llama-3 style template read from
  tokenizer_config.json (the older layout) matches transformers exactly."""
  _, convs, _ = chatml
  path = chat_cases.save_tokenizer(tmp_path, template_text, jinja_file=layout == "jinja")
  if layout == "jinja":
    refs = chat_cases.reference(
        chat_cases.save_tokenizer(tmp_path / "tagged", chat_cases.CHATML_GENERATION)
        .rsplit("/", 1)[0], convs)
  else:
    refs = chat_cases.reference(tmp_path, convs)
  template = _template(path)
  assert template.by_generation == (layout == "config")
  newline = HFTokenizer(path).encode_with_offsets(["\n"])[0][0].tolist()
  for messages, (ids, mask) in zip(convs, refs):
    [(got_ids, targets)] = template.encode([(messages, "conversation")])
    assert got_ids.tolist() == ids
    want = np.asarray(mask, bool)
    if layout == "jinja":  # the "\n" after each assistant <|im_end|> is the turn's too
      after = np.r_[False, want[:-1]] & ~want & (np.asarray(ids) == newline[0])
      want |= after
    np.testing.assert_array_equal(targets, want)


def test_roles_to_train_and_untrainable_conversations(chatml):
  path, convs, _ = chatml
  both = _template(path, roles=("user", "assistant"))
  assert not both.by_generation  # other roles than the assistant: turn by turn
  [(_, targets)] = both.encode([(convs[0], "c0")])
  [(_, only_assistant)] = _template(path).encode([(convs[0], "c0")])
  assert targets.sum() > only_assistant.sum() and (targets | ~only_assistant).all()
  assert not targets[0]  # the BOS the template writes before the first turn is no turn's
  with pytest.raises(ValueError, match=r"c1: this conversation has no token to train.*"
                     r"roles: \['user'\]"):
    _template(path).encode([(convs[0], "c0"), ([{"role": "user", "content": "hello"}], "c1")])


def test_template_errors_and_bad_records_name_the_row(tmp_path, chatml):
  path, _, _ = chatml
  with pytest.raises(ValueError, match="fails on this conversation: unknown role tool"):
    template_path = tmp_path / "llama.jinja"
    template_path.write_text(chat_cases.LLAMA_GENERATION)
    _template(path, str(template_path)).encode([([{"role": "tool", "content": "x"}], "row 3")])
  # Turn by turn needs each first-turns rendering to be a prefix of the whole, and to render.
  convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
           {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
  last_only = tmp_path / "last_only.jinja"  # earlier answers dropped, as reasoning templates do
  last_only.write_text("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'user' or "
                       "loop.last %}{{ m['content'] }}{% endif %}\n{% endfor %}")
  with pytest.raises(ValueError, match=r"row 5: the chat template renders turn 1 differently "
                     r"once later turns follow.*\{% generation %\}"):
    _template(path, str(last_only)).encode([(convo, "row 5")])
  ends_with_answer = tmp_path / "ends.jinja"
  ends_with_answer.write_text("{% if messages[-1]['role'] != 'assistant' %}{{ raise_exception("
                              "'end with an answer') }}{% endif %}{% for m in messages %}"
                              "{{ m['content'] }}\n{% endfor %}")
  with pytest.raises(ValueError, match=r"row 6: labelling turn by turn renders the first turns "
                     r"alone, and the chat template fails on turns 0..1 \(end with an answer\)"):
    _template(path, str(ends_with_answer)).encode([(convo, "row 6")])
  with pytest.raises(ValueError, match=r"row 9: 'messages' must be a non-empty list.*str"):
    chat.messages_of({"messages": "hi"}, "row 9")
  with pytest.raises(ValueError, match=r"row 2: messages\[1\] needs a string 'role'"):
    chat.messages_of({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
                     "row 2")
  with pytest.raises(ValueError, match=r"conversations\[0\] needs 'from' in"):
    chat.messages_of({"conversations": [{"from": "robot", "value": "x"}]}, "row 0")
  assert chat.messages_of({"conversations": [{"from": "human", "value": "q"},
                                             {"from": "gpt", "value": "a"}]}, "r") == [
      {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  with pytest.raises(ValueError, match="has no chat_template.jinja"):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text("{}")
    chat.find_template(str(bare / "tokenizer.json"))


def _write_parquet(directory, records, files=2):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  directory.mkdir()
  for i, part in enumerate(np.array_split(np.arange(len(records)), files)):
    table = pa.Table.from_pylist([records[j] for j in part])
    pq.write_table(table, directory / f"part-{i}.parquet", row_group_size=3)
  return str(directory)


def _write_arrow(directory, records):
  pa = pytest.importorskip("pyarrow")
  directory.mkdir()
  table = pa.Table.from_pylist(records)
  with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
    with pa.ipc.new_stream(sink, table.schema) as writer:
      for batch in table.to_batches(max_chunksize=5):
        writer.write_batch(batch)
  (directory / "state.json").write_text(json.dumps(
      {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": "train"}))
  return str(directory)


@pytest.mark.parametrize("layout", ["parquet", "arrow", "jsonl", "sharegpt"])
def test_chat_files_pack_into_rows_with_transformers_labels(tmp_path, chatml, layout):
  path, convs, refs = chatml
  records = [{"messages": m} for m in convs]
  if layout == "parquet":
    paths = _write_parquet(tmp_path / "pq", records)
  elif layout == "arrow":
    paths = _write_arrow(tmp_path / "saved", records)
  else:
    if layout == "sharegpt":
      sharegpt = {"user": "human", "assistant": "gpt", "system": "system"}
      records = [{"conversations": [{"from": sharegpt[t["role"]], "value": t["content"]}
                                    for t in m]} for m in convs]
    paths = str(tmp_path / "chat.jsonl")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  config = data.DataConfig(source="files", paths=paths, tokenizer=path, seq_len=256,
                           batch_size=2, eval_fraction=0.1)
  rows = data.make_rows(config)
  assert chat_cases.check_rows([rows.train(r) for r in range(8)], refs) >= 8
  assert chat_cases.check_rows([rows.eval(r) for r in range(rows.eval.num_rows)], refs) >= 1
  assert rows.vocab_size == HFTokenizer(path).vocab_size
