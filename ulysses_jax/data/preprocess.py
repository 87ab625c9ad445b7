"""See and keep what the model trains on: the first packed training rows, decoded with the
trained tokens marked, and a token directory written once for long runs.

``training_rows(config, n)`` gives the first ``n`` rows of the training stream exactly as the
trainer's batches hold them (global rows 0, 1, ...: batch ``i`` is rows ``i*B .. i*B+B-1``);
``format_row`` shows one as text: each document piece on its own, and the tokens the loss
falls on (the labels of the tokens before them) marked. ``write_tokens`` tokenizes a
``DataConfig``'s files once into a token directory (``token_files.TokenDirWriter``) that
``DataConfig.paths`` takes instead, memory-mapped: the same documents in the same order, so
the same split and shuffle.
"""

import numpy as np

from ulysses_jax.data import pipeline as data
from ulysses_jax.data.packing import IGNORE_LABEL
from ulysses_jax.data.documents import read_documents
from ulysses_jax.data.token_files import TokenDirWriter

ROW_FIELDS = ("tokens", "labels", "segment_ids", "positions")


def training_rows(config: data.DataConfig, n: int, *, progress: bool = False
                  ) -> list[dict[str, np.ndarray]]:
  """The first ``n`` training rows of ``config`` (dicts of int32 ``[S]`` arrays)."""
  rows = data.make_rows(config, progress=progress)
  return [rows.train(r) for r in range(n)]


def trained(row: dict[str, np.ndarray]) -> np.ndarray:
  """Per token of the row: whether the loss falls on it (the label of the token before)."""
  labels = row["labels"]
  out = np.zeros(len(labels), bool)
  out[1:] = labels[:-1] != IGNORE_LABEL
  return out


def format_row(row: dict[str, np.ndarray], index: int, tokenizer, *,
               marks: tuple[str, str] = ("[[", "]]")) -> str:
  """Row ``index`` as text: a header, then each segment decoded with the trained tokens
  between ``marks``."""
  seg, flags = row["segment_ids"], trained(row)
  labelled = int(np.sum(row["labels"] != IGNORE_LABEL))
  lines = [f"=== row {index}: {len(np.unique(seg))} segments, {labelled} of {len(seg)} "
           f"positions have a label; the tokens they predict are {marks[0]}marked{marks[1]} ==="]
  for s in np.unique(seg):
    idx = np.flatnonzero(seg == s)
    pos = row["positions"][idx]
    lines.append(f"--- segment {s}: row tokens {idx[0]}..{idx[-1]}, positions "
                 f"{pos[0]}..{pos[-1]} ---")
    text, start = [], 0
    cuts = np.flatnonzero(np.diff(flags[idx].astype(np.int8))) + 1
    for end in [*cuts.tolist(), len(idx)]:
      piece = tokenizer.decode(row["tokens"][idx[start:end]], skip_special_tokens=False)
      text.append(f"{marks[0]}{piece}{marks[1]}" if flags[idx[start]] else piece)
      start = end
    lines.append("".join(text))
  return "\n".join(lines)


def row_json(rows: list[dict[str, np.ndarray]]) -> dict:
  """``{"rows": [{"tokens", "labels", "segment_ids", "positions"}, ...]}`` as lists of ints."""
  return {"rows": [{k: row[k].astype(int).tolist() for k in ROW_FIELDS} for row in rows]}


def write_tokens(config: data.DataConfig, out: str, *, progress: bool = False) -> dict:
  """Tokenizes ``config.paths`` into the token directory ``out``, a batch of records at a time
  (memory holds one batch and the documents' lengths); returns its index."""
  if config.sources:
    raise ValueError("--out writes one source; preprocess each source of DataConfig.sources "
                     "on its own (DataConfig.paths) and give the directories to sources")
  if config.source == "retrieval":
    raise ValueError("the retrieval task is synthetic: there is nothing to tokenize")
  files, tokenized = data.config_files(config)
  if tokenized:
    raise ValueError("DataConfig.paths are token files or directories already: nothing to "
                     "tokenize")
  tokenizer, template = data.text_tokenizer(config)
  writer = TokenDirWriter(out)
  read_documents(files, tokenizer, config.text_field, writer, template=template,
                 progress=progress)
  return writer.finish({"tokenizer": config.tokenizer, "files": len(files),
                        "text_field": config.text_field, "chat_template": config.chat_template,
                        "roles_to_train": config.roles_to_train})
