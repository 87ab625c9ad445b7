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
"""
