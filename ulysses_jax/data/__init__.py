"""Training data, from files (or a Grain dataset) to the trainer's sharded batches.

* ``pipeline``: ``DataConfig`` (what to read, how to cut it) and the datasets it makes;
* ``corpus``, ``records``, ``documents``, ``token_files``, ``chat``: reading documents
  (text files, JSON lines, Parquet, Hugging Face ``save_to_disk`` directories, token
  directories, chat records) and choosing the tokens the loss falls on;
* ``packing``: documents into rows of ``seq_len`` tokens with segment ids and positions;
* ``batches``: rows into global ``[B, S]`` arrays sharded ``P("data", "seq")``;
* ``retrieval``: the synthetic key-value retrieval task;
* ``grain_dataset``: a Grain dataset of documents as the training stream;
* ``preprocess``: the first packed rows as text, and a token directory written once.

Until 0.2 ``ulysses_jax.data`` was one module, now ``data.pipeline``; its names still resolve
here, with a ``DeprecationWarning``, for one release.
"""

import warnings

_PIPELINE_NAMES = ("DataConfig", "Rows", "SOURCES", "LONG_DOCUMENTS", "load_corpus",
                   "config_files", "text_tokenizer", "make_rows", "make_datasets",
                   "document_windows")


def __getattr__(name):
  if name not in _PIPELINE_NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  from ulysses_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  warnings.warn(f"ulysses_jax.data.{name} is now ulysses_jax.data.pipeline.{name}; import it "
                "from there (the old name goes in the next release)", DeprecationWarning,
                stacklevel=2)
  return getattr(pipeline, name)
