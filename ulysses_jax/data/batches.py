"""Batches as global arrays: this process's rows of a batch, stacked and placed on the mesh.

A batch is a dict of int32 arrays ``[B, S]`` (B global rows, S = ``seq_len``), sharded
``P("data", "seq")`` (``sharding.batch_spec``); the row layout is
``ulysses_jax.data.pipeline``'s. Each process builds only the rows that its devices hold.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding

from ulysses_jax.mesh import DATA, sequence_axes, sequence_shards
from ulysses_jax.data.packing import pack_row
from ulysses_jax.sharding import batch_spec


def _data_coords(mesh) -> list[int]:
  """Indices along the data axis of the mesh slices holding this process's devices."""
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(DATA), 0)
  return [i for i, d in enumerate(devices)
          if any(x.process_index == jax.process_index() for x in d.flat)]


def check_divisible(mesh, batch_size: int, seq_len: int):
  shards, axes = sequence_shards(mesh), " x ".join(repr(a) for a in sequence_axes(mesh))
  if seq_len % shards:
    raise ValueError(f"seq_len={seq_len} does not divide over the mesh's {axes} axis of "
                     f"{shards} devices; use a multiple of {shards}")
  if batch_size % mesh.shape[DATA]:
    raise ValueError(f"batch size {batch_size} does not divide over the mesh's {DATA!r} axis "
                     f"of {mesh.shape[DATA]} devices; use a multiple of {mesh.shape[DATA]}")


def make_global_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
  """Global int32 ``[B, S]`` arrays sharded ``sharding.batch_spec`` (``P(DATA, SEQ)``) from
  this process's rows.

  ``local_batch`` holds, in order, the rows of the data-axis slices that this process's
  devices hold (all rows on one process); B = local rows * data size / local slices.
  """
  coords = _data_coords(mesh)
  local_rows, seq_len = next(iter(local_batch.values())).shape
  if local_rows % len(coords):
    raise ValueError(f"{local_rows} local rows do not split over this process's "
                     f"{len(coords)} slices of the {DATA!r} axis")
  global_rows = local_rows // len(coords) * mesh.shape[DATA]
  check_divisible(mesh, global_rows, seq_len)
  global_sharding = NamedSharding(mesh, batch_spec(mesh, seq_len))
  return {k: jax.make_array_from_process_local_data(global_sharding, np.asarray(v, np.int32),
                                                    (global_rows, seq_len))
          for k, v in local_batch.items()}


class Dataset:
  """Batches of ``batch_size`` rows as global arrays; an iterator with a JSON-able position.

  ``next(ds)`` returns the next batch (see the module docstring); ``batch(i)`` is batch i
  from the start (random access, for evaluation: ``range(ds.num_batches)``). Each process
  builds only its own rows. The position counts rows, so resuming with another batch size
  continues where the last run stopped.
  """

  def __init__(self, rows, *, mesh, batch_size: int, vocab_size: int, fingerprint: str,
               source_names: tuple[str, ...] = ()):
    check_divisible(mesh, batch_size, rows.seq_len)
    self._rows, self.mesh, self.batch_size = rows, mesh, batch_size
    self.source_names = source_names
    self.seq_len, self.vocab_size, self.fingerprint = rows.seq_len, vocab_size, fingerprint
    per_slice = batch_size // mesh.shape[DATA]
    self._local = np.concatenate([np.arange(c * per_slice, (c + 1) * per_slice)
                                  for c in _data_coords(mesh)])
    self._next_row = 0

  @property
  def num_batches(self) -> int | None:
    """Batches in one pass (the last padded), or None for an endless training stream."""
    n = self._rows.num_rows
    return None if n is None else -(-n // self.batch_size)

  def local_batch(self, first_row: int) -> dict[str, np.ndarray]:
    """This process's rows of global rows [first_row, first_row + batch_size); rows past
    the end of a finite pass are padding."""
    n, pad = self._rows.num_rows, pack_row(np.zeros(0), np.zeros(0), self.seq_len)
    rows = [pad if n is not None and r >= n else self._rows(r)
            for r in (first_row + self._local).tolist()]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def batch(self, index: int) -> dict[str, jax.Array]:
    return make_global_batch(self.local_batch(index * self.batch_size), self.mesh)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    n = self._rows.num_rows
    if n is not None and self._next_row >= n:
      raise StopIteration
    batch = make_global_batch(self.local_batch(self._next_row), self.mesh)
    self._next_row += self.batch_size
    return batch

  def tokens_by_source(self, state: dict) -> dict[str, int]:
    """For a mixture (``packing.MixedRows``), the tokens each source gave to the rows before
    ``state``'s position, as ``{"tokens_seen/<source>": n}``; else empty."""
    if not self.source_names:
      return {}
    rows = self._rows.rows_per_source(int(state["next_row"]))
    return {f"tokens_seen/{name}": int(n) * self.seq_len
            for name, n in zip(self.source_names, rows)}

  def get_state(self) -> dict:
    return {"next_row": self._next_row, "data": self.fingerprint}

  def set_state(self, state: dict):
    if state.get("data") != self.fingerprint:
      raise ValueError(f"the saved data position belongs to a different data stream:\n"
                       f"  saved: {state.get('data')}\n  now:   {self.fingerprint}\n"
                       "resume with the same data config (batch_size may change)")
    self._next_row = int(state["next_row"])
