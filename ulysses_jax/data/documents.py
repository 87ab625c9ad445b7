"""Documents from files: each record becomes the tokens of one document and which of them are
targets (may be labels), collected into a ``corpus.Corpus`` in file order.

A plain text file is one document. A record (a JSONL line, a Parquet or Arrow row; read by
``ulysses_jax.data.records``) is, by the fields it has:

* ``messages`` (role/content turns) or ShareGPT ``conversations`` (from/value): rendered in the
  model's chat template, the trained turns targets (``ulysses_jax.data.chat``);
* ``prompt`` and ``completion`` (strings): tokenized apart and joined, the completion targets;
* ``input_ids`` (a list of integer ids): pre-tokenized, all targets;
* otherwise its ``text_field`` (a string): all targets.

Nothing is added between documents (no BOS/EOS beyond what the text or template holds):
packing separates them by segment ids. A record of none of these kinds, or whose field has
the wrong type, is an error naming the file, the row and what was found.
"""

import functools
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from ulysses_jax.data import chat
from ulysses_jax.data import records
from ulysses_jax.data.corpus import Corpus

_RECORD_FILES = (".jsonl", *records.TABLE_SUFFIXES)


class _Documents:
  """Documents kept in memory as they are read: token arrays and target flags (None: all
  targets). Any object with ``add(tokens, targets)`` takes its place in ``read_documents``
  (``token_files.TokenDirWriter`` writes them to disk instead)."""

  def __init__(self):
    self.tokens, self.targets = [], []

  def add(self, tokens: np.ndarray, targets: np.ndarray | None):
    if len(tokens):
      self.tokens.append(tokens)
      self.targets.append(targets)

  def corpus(self) -> Corpus:
    lengths = np.array([len(t) for t in self.tokens], np.int64)
    tokens = (np.concatenate(self.tokens) if self.tokens else np.zeros(0, np.uint32))
    targets = None
    if any(t is not None for t in self.targets):
      targets = [np.concatenate([np.ones(len(x), bool) if t is None else t
                                 for x, t in zip(self.tokens, self.targets)])]
    return Corpus([tokens], np.zeros(len(lengths), np.int64), np.cumsum(lengths) - lengths,
                  lengths, targets)


def _kind(record: dict, text_field: str) -> str:
  for kind, fields in (("chat", ("messages", "conversations")),
                       ("prompt_completion", ("prompt", "completion")),
                       ("tokens", ("input_ids",))):
    if any(record.get(f) is not None for f in fields):
      return kind
  return "text"


def _found(record: dict, field: str) -> str:
  if field not in record:
    return f"it has no {field!r}; its fields are {sorted(record)}"
  value = record[field]
  return f"{field!r} is {type(value).__name__} {str(value)[:60]!r}"


def _add_batch(docs: _Documents, locations: list[str], batch: list[dict], tokenizer,
               text_field: str, template: Callable[[], "chat.ChatTemplate"]):
  """Tokenizes one batch of records into ``docs``, in order."""
  pending = []  # text and prompt/completion records: (index, prompt, text), tokenized together
  conversations = []  # (index, messages, where), rendered and tokenized together
  encoded = {}
  for i, (where, record) in enumerate(zip(locations, batch)):
    kind = _kind(record, text_field)
    if kind == "chat":
      conversations.append((i, chat.messages_of(record, where), where))
    elif kind == "tokens":
      ids = record["input_ids"]
      if (isinstance(ids, list) and ids
          and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        ids = np.asarray(ids, np.int64)
      if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        raise ValueError(f"{where}: 'input_ids' must be a list of integer token ids; "
                         f"{_found(record, 'input_ids')}")
      encoded[i] = (ids, None)
    else:
      fields = ("prompt", "completion") if kind == "prompt_completion" else (text_field,)
      for f in fields:
        if not isinstance(record.get(f), str):
          raise ValueError(
              f"{where}: the record needs a string {f!r} (records hold a {text_field!r} field, "
              "set by DataConfig.text_field, 'prompt' and 'completion', 'messages', "
              f"ShareGPT 'conversations' or 'input_ids'); {_found(record, f)}")
      prompt = record["prompt"] if kind == "prompt_completion" else ""
      pending.append((i, prompt.encode("utf-8"), record[fields[-1]].encode("utf-8")))
  if conversations:
    tokenized = template().encode([(messages, where) for _, messages, where in conversations])
    encoded.update(zip([i for i, _, _ in conversations], tokenized))
  prompts = tokenizer.encode_batch([p for _, p, _ in pending])
  texts = tokenizer.encode_batch([t for _, _, t in pending])
  for (i, prompt, _), p, t in zip(pending, prompts, texts):
    encoded[i] = (np.concatenate([p, t]),
                  np.concatenate([np.zeros(len(p), bool), np.ones(len(t), bool)])
                  if prompt else None)
  for i in range(len(batch)):
    docs.add(*encoded[i])


def read_documents(files: Sequence[str], tokenizer, text_field: str, sink, *,
                   template: Callable[[], "chat.ChatTemplate"] | None = None,
                   progress: bool = False):
  """Tokenizes the documents of ``files`` (text and record files) in order into
  ``sink.add(tokens, targets)``, a batch of records at a time.

  ``template``: returns the ``chat.ChatTemplate`` for conversations (called on the first
  one; None: conversations are an error). ``progress``: a progress bar over the records.
  """
  def no_template():
    raise ValueError("the data holds conversations ('messages' or 'conversations') but no "
                     "chat template was given")

  bar = tqdm(unit=" records", disable=not progress, mininterval=1)
  get_template = functools.cache(template or no_template)
  for path in files:
    if not path.endswith(_RECORD_FILES):
      with open(path, "rb") as f:
        sink.add(tokenizer.encode_batch([f.read()])[0], None)
      bar.update()
      continue
    for locations, batch in records.read_records(path):
      _add_batch(sink, locations, batch, tokenizer, text_field, get_template)
      bar.update(len(batch))
  bar.close()


def text_corpus(files: Sequence[str], tokenizer, text_field: str = "text", *,
                template: Callable[[], "chat.ChatTemplate"] | None = None,
                progress: bool = False) -> Corpus:
  """The documents of ``files``, in order, tokenized into memory (``read_documents``)."""
  docs = _Documents()
  read_documents(files, tokenizer, text_field, docs, template=template, progress=progress)
  return docs.corpus()
