"""Records as users store them: JSONL lines, Parquet files and ``datasets.save_to_disk``
directories (Arrow IPC files), read a batch at a time.

``read_records(path)`` yields ``(location, records)``: a list of dicts (one per line or table
row) and, for each, where it came from (``"data.jsonl:3"``, line numbers from 1;
``"part-0.parquet row 7"``, rows from 0), for error messages. Parquet files are read one row
group at a time and Arrow files one record batch at a time, so a file never sits in memory
whole. A column of integer lists (pre-tokenized ``input_ids``) arrives as NumPy arrays, the
rest as Python values. Parquet and Arrow need ``pyarrow`` (the ``data`` extra).

``data_files(path)`` lists the files of a directory that is a dataset: a ``save_to_disk``
directory (its ``state.json``), or a directory of ``*.parquet`` files.
"""

import glob
import json
import os
from collections.abc import Iterator

import numpy as np

BATCH_ROWS = 1024
TABLE_SUFFIXES = (".parquet", ".arrow")
_INSTALL_HINT = "pip install 'ulysses_jax[data]' (or pip install pyarrow)"


def _pyarrow():
  try:
    import pyarrow  # pylint: disable=import-outside-toplevel
    import pyarrow.ipc  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import pyarrow.parquet  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise ImportError(f"Parquet and Arrow data need pyarrow: {_INSTALL_HINT}") from e
  return pyarrow


def data_files(directory: str) -> list[str] | None:
  """The data files of a dataset directory, in order, or None if it is not one.

  A ``save_to_disk`` directory lists its Arrow files in ``state.json`` (``_data_files``); a
  ``DatasetDict``'s top directory (``dataset_dict.json``) is an error naming its splits."""
  if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
    splits = sorted(d for d in os.listdir(directory)
                    if os.path.isdir(os.path.join(directory, d)))
    example = os.path.join(directory, splits[0] if splits else "train")
    raise ValueError(f"{directory} is a DatasetDict with splits {splits}; give the directory "
                     f"of one split, e.g. {example}")
  state = os.path.join(directory, "state.json")
  if os.path.isfile(state):
    with open(state, encoding="utf-8") as f:
      names = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    if not names:
      raise ValueError(f"{state} lists no data files (_data_files); is the dataset saved whole?")
    return [os.path.join(directory, n) for n in names]
  parquet = sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))
  return parquet or None


def read_records(path: str, batch_rows: int = BATCH_ROWS
                 ) -> Iterator[tuple[list[str], list[dict]]]:
  """(locations, records) batches of a ``.jsonl``, ``.parquet`` or ``.arrow`` file."""
  if path.endswith(".jsonl"):
    yield from _jsonl(path, batch_rows)
  elif path.endswith(".parquet"):
    yield from _table_batches(path, _parquet_batches(path, batch_rows))
  elif path.endswith(".arrow"):
    yield from _table_batches(path, _arrow_batches(path))
  else:
    raise ValueError(f"{path}: not a record file (.jsonl, .parquet or .arrow)")


def jsonl_lines(path: str) -> Iterator[tuple[str, object, str]]:
  """(``"PATH, line N"``, its JSON value, the line) for each non-blank line of a JSONL file;
  raises ``ValueError`` naming the line of one that is not JSON."""
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}, line {number}"
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
      yield where, value, line


def _jsonl(path: str, batch_rows: int):
  locations, records = [], []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
      if not isinstance(record, dict):
        raise ValueError(f"{path}:{lineno}: not a JSON object: {line.strip()[:40]!r}")
      locations.append(f"{path}:{lineno}")
      records.append(record)
      if len(records) == batch_rows:
        yield locations, records
        locations, records = [], []
  if records:
    yield locations, records


def _parquet_batches(path: str, batch_rows: int):
  pa = _pyarrow()
  try:
    parquet = pa.parquet.ParquetFile(path)
  except (pa.ArrowInvalid, OSError) as e:
    raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
  with parquet:
    for group in range(parquet.num_row_groups):
      yield from parquet.read_row_group(group).to_batches(max_chunksize=batch_rows)


def _arrow_batches(path: str):
  """Record batches of an Arrow IPC stream (what ``save_to_disk`` writes) or IPC file."""
  pa = _pyarrow()
  with pa.memory_map(path) as source:
    try:
      reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
      try:
        reader = pa.ipc.open_file(source)
      except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: not an Arrow IPC stream or file ({e})") from None
      yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
      return
    yield from reader


def _table_batches(path: str, batches):
  pa, row = _pyarrow(), 0
  for batch in batches:
    columns = {name: _column_values(batch.column(i), pa)
               for i, name in enumerate(batch.schema.names)}
    n = batch.num_rows
    yield ([f"{path} row {row + i}" for i in range(n)],
           [dict(zip(columns, values)) for values in zip(*columns.values())] if columns
           else [{} for _ in range(n)])
    row += n


def _column_values(column, pa) -> list:
  """A column's values: NumPy arrays for a list of integers (no copy through Python)."""
  kind = column.type
  if ((pa.types.is_list(kind) or pa.types.is_large_list(kind))
      and pa.types.is_integer(kind.value_type) and column.null_count == 0):
    offsets = np.asarray(column.offsets)
    values = column.values.to_numpy(zero_copy_only=False)
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
  return column.to_pylist()
