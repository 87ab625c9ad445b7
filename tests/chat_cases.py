"""Chat test material: a small BPE tokenizer trained here and saved as transformers saves it,
chat templates with and without ``{% generation %}``, random conversations, and the check of
packed rows against transformers' ``apply_chat_template``."""

import json
import os

import numpy as np

WORDS = ("alpha beta gamma delta river stone cloud seven orbit maple quartz lantern tiger "
         "violet window zebra échelle naïve 東京 42 3.14 () {} [] <b> :: -- == \n").split(" ")

# ChatML, the assistant's text and end of turn inside {% generation %} (as in SmolLM3 / Qwen
# templates that support assistant masks); BOS from the special tokens.
CHATML_GENERATION = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same template without the tag: turn-by-turn labelling must find the same tokens, except
# the newline after <|im_end|>, which this one's assistant turn adds too.
CHATML_PLAIN = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}",
                                                                          "")
# Llama-3 style: every header is a special token, the system turn is optional and the end of
# turn a special token; a template that raises on a bad role.
LLAMA_GENERATION = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}")
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]


def save_tokenizer(directory, template: str, *, jinja_file: bool = True) -> str:
  """Trains a byte-level BPE tokenizer of ~400 ids on ``WORDS`` and saves it with ``template``
  as transformers does (``chat_template.jinja``, or in ``tokenizer_config.json`` when
  ``jinja_file`` is False); returns the ``tokenizer.json`` path."""
  import tokenizers
  import transformers
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  rng = np.random.default_rng(0)
  tok.train_from_iterator([" ".join(rng.choice(WORDS, 30)) for _ in range(300)], trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                              eos_token="<|im_end|>")
  fast.chat_template = template
  os.makedirs(directory, exist_ok=True)
  fast.save_pretrained(str(directory))
  if not jinja_file:  # the older layout: the template inside tokenizer_config.json
    os.remove(os.path.join(directory, "chat_template.jinja"))
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
      config = json.load(f)
    config["chat_template"] = template
    with open(config_path, "w") as f:
      json.dump(config, f)
  return os.path.join(str(directory), "tokenizer.json")


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
  """Random multi-turn conversations; some open with a system turn, some assistant turns repeat
  the user's text (where searching the rendered text for the answer finds the question)."""
  rng = np.random.default_rng(seed)
  text = lambda: " ".join(rng.choice(WORDS, int(rng.integers(1, 12))))
  out = []
  for _ in range(n):
    messages = [{"role": "system", "content": text()}] if rng.random() < 0.4 else []
    for _ in range(int(rng.integers(1, 4))):
      question = text()
      messages.append({"role": "user", "content": question})
      messages.append({"role": "assistant",
                       "content": question if rng.random() < 0.3 else text()})
    out.append(messages)
  return out


def reference(tokenizer_dir, convs) -> list[tuple[list[int], list[int]]]:
  """transformers' (input ids, assistant mask) of each conversation."""
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
  out = []
  for messages in convs:
    enc = tok.apply_chat_template(messages, return_assistant_tokens_mask=True,
                                  return_dict=True)
    out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
  return out


def check_rows(rows, refs, ignore=-1) -> int:
  """Asserts every whole conversation in ``rows`` (dicts of tokens, labels, segment_ids,
  positions) holds transformers' ids, with the next token as label exactly where the
  reference mask marks it; returns how many whole conversations were found."""
  by_ids = {tuple(ids): mask for ids, mask in refs}
  found = 0
  for row in rows:
    tokens, labels, seg = (np.asarray(row[k]) for k in ("tokens", "labels", "segment_ids"))
    for s in np.unique(seg):
      idx = np.flatnonzero(seg == s)
      piece = tuple(int(t) for t in tokens[idx])
      if piece not in by_ids:
        continue
      mask = np.asarray(by_ids[piece], bool)
      want = np.where(mask[1:], tokens[idx][1:], ignore)
      np.testing.assert_array_equal(labels[idx][:-1], want)
      assert labels[idx][-1] == ignore
      np.testing.assert_array_equal(np.asarray(row["positions"])[idx], np.arange(len(idx)))
      found += 1
  return found
