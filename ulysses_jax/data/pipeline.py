"""Training data: ``DataConfig`` (what to read, how to cut it), and the datasets it makes.

A batch (``ulysses_jax.data.batches``) is a dict of int32 arrays ``[B, S]`` (B global rows, S =
``seq_len``), sharded ``P("data", "seq")``:

* ``tokens``: input ids.
* ``labels``: the next token of the same document where that token is a target, or
  ``IGNORE_LABEL`` where there is none (a document's last token, padding, context: a prompt, a
  user turn). Shifted here, before sharding, so the label of a shard's last token comes from
  the next shard.
* ``segment_ids``: 0, 1, 2, ... for the document pieces of a row, in order; padding takes
  the id after the last piece, so it never attends to real tokens.
* ``positions``: restart at 0 at the start of every piece (and of the padding).

Text rows are windows of S tokens (plus one for the last label) over the concatenation of
documents (``ulysses_jax.data.packing``); a document crossing a row boundary continues in the next
window as a new piece. Training order is a seeded shuffle of documents, then of windows, per
epoch; a mixture (``DataConfig.sources``) draws each row from one source by weight. Either
way a row is a pure function of its global index, so an iterator's whole position is one
integer. Which tokens are targets comes from the records (``ulysses_jax.data.documents``).

``document_windows`` gives evaluation rows instead: each document alone, cut into
consecutive windows of S tokens (see ``ulysses_jax.evaluate``).
"""

import dataclasses
import functools
import os
import re
from collections.abc import Sequence
from typing import Literal, NamedTuple


from ulysses_jax.data import chat
from ulysses_jax.data.batches import Dataset, check_divisible
from ulysses_jax.config_checks import ConfigError, at_least, check_fields
from ulysses_jax.data.corpus import (Corpus, make_tokenizer, merge, resolve_paths,
                                split_corpus, stdlib_files)
from ulysses_jax.data.documents import text_corpus
from ulysses_jax.mesh import make_mesh
from ulysses_jax.data.packing import DocumentWindows, MixedRows, PackedRows
from ulysses_jax.data.retrieval import RetrievalRows, RetrievalTask
from ulysses_jax.data.token_files import TOKEN_DTYPES, token_corpus, token_dir_corpus

SOURCES = ("stdlib", "files", "retrieval")
LONG_DOCUMENTS = ("split", "truncate")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to cut it into batches (gin-configurable).

  source: "stdlib" (the Python standard library's ``*.py`` files: real text present on
    every machine), "files" (``paths``: plain text files, one document each; ``.jsonl``,
    ``.parquet`` and ``.arrow`` files, Parquet directories and ``save_to_disk`` directories,
    one document per record (``ulysses_jax.data.documents``: text, prompt/completion with the loss
    on the completion, chat ``messages`` or ShareGPT ``conversations`` with the loss on the
    trained turns, pre-tokenized ``input_ids``); pre-tokenized ``.bin``/``.npy`` token files
    and directories that ``ulysses_jax.preprocess --out`` wrote), or "retrieval"
    (``RetrievalTask``).
  paths: files, directories or globs (``**`` recurses), for source="files".
  sources: a weighted mixture instead of ``paths``: ``"PATHS@WEIGHT,PATHS@WEIGHT,..."``, each
    PATHS a file, directory or glob (``"books/*.parquet@0.3,short.jsonl@0.7"``); each training
    row comes from one source, drawn by weight from the seed (``packing.MixedRows``); each
    source holds out its own ``eval_fraction``.
  tokenizer: "byte" or the path of a Hugging Face ``tokenizer.json`` (for a fine-tune, the
    checkpoint's own); its vocabulary must fit the model's ``vocab_size``. Conversations use
    the chat template saved beside it (``ulysses_jax.data.chat``).
  chat_template: a ``.jinja`` file to use instead of the tokenizer's own template.
  roles_to_train: the roles of conversation turns that carry the loss (comma-separated).
  text_field: the record field holding a text record's text.
  token_dtype: integer dtype of raw ``.bin`` token files (``.npy`` files carry their own).
  eos_id: in token files, the id ending each document; None: each file is one document.
  seq_len: S, tokens per row; must divide by the mesh's seq axis.
  batch_size: global rows per batch; must divide by the mesh's data axis.
  long_documents: documents longer than ``seq_len``: "split" over consecutive rows (each
    piece a new segment) or "truncate" to their first ``seq_len`` tokens.
  seed: shuffles the training order (not the train/eval split).
  eval_fraction: share of the tokens held out for evaluation, in [0, 1).
  """
  source: Literal[SOURCES] = "stdlib"
  paths: str | Sequence[str] = ()
  sources: str = ""
  tokenizer: str = "byte"
  chat_template: str = ""
  roles_to_train: str = "assistant"
  text_field: str = "text"
  token_dtype: Literal[TOKEN_DTYPES] = "uint16"
  eos_id: int | None = None
  seq_len: int = dataclasses.field(default=1024, metadata=at_least(1))
  batch_size: int = dataclasses.field(default=8, metadata=at_least(1))
  long_documents: Literal[LONG_DOCUMENTS] = "split"
  seed: int = 0
  eval_fraction: float = 0.01
  retrieval: RetrievalTask = RetrievalTask()

  def __post_init__(self):
    if isinstance(self.paths, list):  # gin gives lists; keep the config hashable
      object.__setattr__(self, "paths", tuple(self.paths))
    check_fields(self)
    if not 0 <= self.eval_fraction < 1:
      raise ConfigError(f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}")
    if self.source == "stdlib" and (self.paths or self.sources):
      raise ConfigError("DataConfig.source='stdlib' reads the Python standard library; it "
                        "takes no paths or sources (set DataConfig.source='files' to read them)")
    if self.paths and self.sources:
      raise ConfigError("give DataConfig.paths (one source) or DataConfig.sources (a weighted "
                        "mixture), not both")
    if not [r for r in self.roles_to_train.split(",") if r.strip()]:
      raise ConfigError("DataConfig.roles_to_train names no role; give e.g. 'assistant'")
    self.mixture()  # checks its syntax

  def mixture(self) -> list[tuple[str, float]]:
    """(paths, weight) of each source of ``sources``; [] for a single source."""
    parts = []
    for item in filter(None, (x.strip() for x in self.sources.split(","))):
      paths, at, weight = item.rpartition("@")
      try:
        value = float(weight) if at and paths else -1.0
      except ValueError:
        value = -1.0
      if not value > 0:
        raise ConfigError(f"DataConfig.sources: {item!r} is not PATHS@WEIGHT with a weight "
                          "> 0; write e.g. 'books/*.parquet@0.3,short.jsonl@0.7'")
      parts.append((paths, value))
    return parts



def load_corpus(config: DataConfig, paths: str | Sequence[str] | None = None, *,
                vocab_size: int | None = None, progress: bool = False
                ) -> tuple[Corpus, int, str]:
  """(corpus in file order, smallest vocabulary it fits, a description) of ``paths``
  (default: ``config.paths``, or the standard library for source="stdlib"); documents cut to
  ``seq_len`` when ``long_documents="truncate"``. ``progress``: a bar while tokenizing."""
  files, tokenized = config_files(config, paths)
  if tokenized:
    dirs = [f for f in files if os.path.isdir(f)]
    parts = [token_dir_corpus(d, vocab_size) for d in dirs]
    if len(dirs) < len(files):
      parts.append(token_corpus([f for f in files if not os.path.isdir(f)], config.token_dtype,
                                config.eos_id, vocab_size))
    corpus, data_vocab = merge([c for c, _ in parts]), max(v for _, v in parts)
  else:
    tokenizer, template = text_tokenizer(config)
    _check_vocab(tokenizer.vocab_size, vocab_size, f"tokenizer {config.tokenizer!r}")
    corpus = text_corpus(files, tokenizer, config.text_field, template=template,
                         progress=progress)
    data_vocab = max(tokenizer.vocab_size, _check_ids(corpus, vocab_size))
  if corpus.num_tokens == 0:
    raise ValueError(f"the {config.source} corpus is empty: {len(files)} file(s) but no tokens")
  if config.long_documents == "truncate":
    corpus = corpus.truncated(config.seq_len)
  name = (f"{config.source} files={len(files)} tokens={corpus.num_tokens} "
          f"tokenizer={config.tokenizer} text_field={config.text_field} "
          f"long_documents={config.long_documents} seq_len={config.seq_len}")
  if config.chat_template or config.roles_to_train != "assistant":
    name += f" chat_template={config.chat_template} roles_to_train={config.roles_to_train}"
  return corpus, data_vocab, name


def config_files(config: DataConfig, paths: str | Sequence[str] | None = None
                 ) -> tuple[list[str], bool]:
  """The files of ``paths`` (default ``config.paths``; the standard library for
  source="stdlib") and whether they are tokenized already (token files and directories)."""
  files = stdlib_files() if config.source == "stdlib" else resolve_paths(
      config.paths if paths is None else paths)
  tokenized = [f.endswith((".bin", ".npy")) or os.path.isdir(f) for f in files]
  if any(tokenized) and not all(tokenized):
    raise ValueError("mix of token files (.bin/.npy, preprocessed directories) and text or "
                     "record files: they need different tokenizers; give one kind")
  return files, all(tokenized)


def text_tokenizer(config: DataConfig):
  """(the tokenizer, a function returning the ``chat.ChatTemplate``) of a text config."""
  tokenizer = make_tokenizer(config.tokenizer)
  return tokenizer, functools.partial(_chat_template, config, tokenizer)


def _chat_template(config: DataConfig, tokenizer) -> chat.ChatTemplate:
  template, special = chat.find_template(config.tokenizer, config.chat_template)
  roles = [r.strip() for r in config.roles_to_train.split(",") if r.strip()]
  return chat.ChatTemplate(template, special, tokenizer, roles)


def _check_ids(corpus: Corpus, vocab_size: int | None) -> int:
  """Max id + 1 of a tokenized corpus (pre-tokenized ``input_ids`` may exceed the tokenizer's
  vocabulary); raises for a negative id or one beyond ``vocab_size``."""
  tokens = corpus.arrays[0]
  if not len(tokens):
    return 0
  low, high = int(tokens.min()), int(tokens.max())
  if low < 0 or (vocab_size is not None and high >= vocab_size):
    bad = low if low < 0 else high
    raise ValueError(f"the data holds token id {bad} (pre-tokenized input_ids); ids must be in "
                     f"[0, {vocab_size if vocab_size is not None else 'vocab_size'}): tokenize "
                     "with the model's own tokenizer")
  return high + 1


class Rows(NamedTuple):
  """What a ``DataConfig`` trains and evaluates on, before batching: row functions (index ->
  row, ``packing``), the smallest vocabulary the data fits, the streams' fingerprints and, for
  a mixture, each source's name in the metrics (its PATHS, other characters than letters,
  digits and ``./-`` as ``_``)."""
  train: object
  eval: object | None
  vocab_size: int
  fingerprint: str
  source_names: tuple[str, ...] = ()


def make_rows(config: DataConfig, *, vocab_size: int | None = None,
              progress: bool = False) -> Rows:
  """The train and eval rows of ``config`` (no devices needed); every data problem raises."""
  if config.source == "retrieval":
    task = config.retrieval
    _check_vocab(task.vocab_size, vocab_size, "the retrieval task")
    return Rows(RetrievalRows(task, config.seq_len, config.seed, "train"),
                RetrievalRows(task, config.seq_len, config.seed, "eval"), task.vocab_size,
                f"retrieval {task} seq_len={config.seq_len} seed={config.seed}")
  mixture = config.mixture() or [(config.paths, 1.0)]
  trains, evals, vocab, names = [], [], 0, []
  for k, (paths, _) in enumerate(mixture):
    corpus, data_vocab, name = load_corpus(config, paths, vocab_size=vocab_size,
                                           progress=progress)
    where = f" (source {paths!r})" if config.sources else ""
    train, eval_ = split_corpus(corpus, config.eval_fraction)
    if eval_ is not None and eval_.num_tokens == 0:
      raise ValueError(f"eval_fraction={config.eval_fraction} of {corpus.num_tokens} tokens"
                       f"{where} holds out nothing; raise it, or set 0 for no evaluation split")
    if train.num_tokens <= config.seq_len:
      raise ValueError(f"the training split{where} has {train.num_tokens} tokens, too few for "
                       f"one row of seq_len={config.seq_len} (+1 for its last label)")
    seed = [config.seed, k] if config.sources else config.seed
    trains.append(PackedRows(train, config.seq_len, seed, shuffle=True))
    evals.append(eval_)
    vocab, names = max(vocab, data_vocab), names + [name]
  if config.sources:
    train_rows = MixedRows(trains, [w for _, w in mixture], config.seed)
    name = "mixture " + " + ".join(f"{w}: {n}" for (_, w), n in zip(mixture, names))
  else:
    train_rows, name = trains[0], names[0]
  eval_rows = (None if config.eval_fraction == 0 else
               PackedRows(merge(evals), config.seq_len, 0, shuffle=False))
  return Rows(train_rows, eval_rows, vocab, f"{name} seed={config.seed}",
              tuple(re.sub(r"[^\w./-]", "_", p) for p, _ in config.mixture()))


def make_datasets(config: DataConfig = DataConfig(), mesh=None, *,
                  vocab_size: int | None = None) -> tuple[Dataset, Dataset | None]:
  """(train, eval) datasets; eval is None when ``eval_fraction`` is 0.

  ``mesh`` defaults to ``make_mesh()``; ``vocab_size`` (the model's) is checked against the
  data's ids. Every data problem raises here, before training starts. ``Dataset.vocab_size``
  is the smallest model vocabulary the data fits.
  """
  mesh = make_mesh() if mesh is None else mesh
  check_divisible(mesh, config.batch_size, config.seq_len)
  rows = make_rows(config, vocab_size=vocab_size)
  make = functools.partial(Dataset, mesh=mesh, batch_size=config.batch_size,
                           vocab_size=rows.vocab_size)
  train = make(rows.train, fingerprint=f"train: {rows.fingerprint}",
               source_names=rows.source_names)
  return train, rows.eval and make(rows.eval, fingerprint=f"eval: {rows.fingerprint}")


def document_windows(config: DataConfig, mesh, *, vocab_size: int | None = None) -> Dataset:
  """Evaluation rows (``packing.DocumentWindows``) of every document of ``config``'s files, in
  file order, ``config.batch_size`` rows per batch (the last batch padded); no split, no
  shuffle.
  """
  if config.source == "retrieval":
    raise ConfigError("document_windows reads text or token files, not the retrieval task")
  check_divisible(mesh, config.batch_size, config.seq_len)
  corpus, data_vocab, name = load_corpus(config, vocab_size=vocab_size)
  return Dataset(DocumentWindows(corpus, config.seq_len), mesh=mesh,
                 batch_size=config.batch_size, vocab_size=data_vocab,
                 fingerprint=f"windows: {name}")


def _check_vocab(data_vocab: int, model_vocab: int | None, what: str):
  if model_vocab is not None and data_vocab > model_vocab:
    raise ConfigError(f"{what} uses ids up to {data_vocab - 1}, beyond the model's "
                      f"vocab_size={model_vocab}: use the model's own tokenizer (the "
                      f"tokenizer.json of its checkpoint) or a model with vocab_size >= "
                      f"{data_vocab}")
