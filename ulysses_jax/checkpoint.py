"""Checkpoints: an orbax ``CheckpointManager`` with async saves, resharding restores and
fallback past damaged checkpoints; and a stop flag set by SIGTERM/SIGINT.

Layout under ``directory``::

  <step>/state/    the train-state pytree (params, optimizer state, step, rng): OCDBT array
                   data, each array's shape/dtype and the sharding it was saved with
  <step>/data/     the data iterator position (JSON, ``Dataset.get_state()``)
  <step>/run/      the run's configuration (JSON, see ``run_config`` in ``ulysses_jax.train``):
                   enough to rebuild the model without the gin files (``read_run_config``)
  <step>.damaged-<unix time>/   a checkpoint that failed to restore, moved aside

Saves are atomic: orbax writes a step into ``<step>.orbax-checkpoint-tmp-<n>`` and renames
it to ``<step>`` only once every process finished writing, so a run killed mid-save leaves
a temporary directory that is never listed as a step (and is removed on the next start).
Restores read each array straight into the shardings of the target, which may belong to
a different mesh than the one that saved it.
"""

import dataclasses
import json
import logging
import os
import signal
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from ulysses_jax.config_checks import at_least, check_fields

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """save_every: steps between periodic saves; keep: how many recent checkpoints to keep;
  async_save: write in a background thread while training goes on."""
  save_every: int = dataclasses.field(default=1000, metadata=at_least(1))
  keep: int = dataclasses.field(default=3, metadata=at_least(1))
  async_save: bool = True

  def __post_init__(self):
    check_fields(self)


class Restored(NamedTuple):
  step: int
  state: Any  # the train state, laid out like the abstract target
  data_state: dict  # for Dataset.set_state
  run_config: dict | None  # the run config saved with it (None: saved by an older version)


class Checkpointer:
  """Saves and restores (train state, data position) pairs under one directory.

  ``save(step, ...)`` writes when ``step % save_every == 0`` or ``force=True`` (the last
  step, a stop signal). ``restore(abstract_state)`` returns the newest checkpoint that
  restores, or None when there is none. Call ``close()`` (or use ``with``) before exit, so
  that an async save in flight completes.
  """

  def __init__(self, directory: str, config: CheckpointConfig = CheckpointConfig()):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(config.save_every),
        preservation_policy=ocp.checkpoint_managers.LatestN(config.keep),
        enable_async_checkpointing=config.async_save,
        cleanup_tmp_directories=True))

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, *, run_config: dict,
           force: bool = False) -> bool:
    """Starts saving ``state`` (a pytree of jax arrays), ``data_state`` and ``run_config``
    (both JSON-able).

    Returns whether a save started; with async saves it returns before the write ends
    (the arrays are copied first, so the caller may donate or change them). A step that
    is already saved is skipped.
    """
    if step in self._manager.all_steps():
      return False
    return self._manager.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        run=ocp.args.JsonSave(run_config)))

  def restore(self, abstract_state: Any) -> Restored | None:
    """Restores the newest good checkpoint into the layout of ``abstract_state``.

    ``abstract_state`` is the state's pytree of ``jax.ShapeDtypeStruct`` with the target
    ``sharding`` set on every leaf (e.g. ``jax.eval_shape`` of the init function plus the
    shardings for the current mesh); arrays are read resharded to it. A checkpoint that
    fails to restore is logged, moved aside to ``<step>.damaged-<time>`` (so the step can
    be saved again) and the previous one is tried. Raises if checkpoints exist but none
    restores (nothing is moved then: the target may be what is wrong).
    """
    failed = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        open_every_array(os.path.join(self.directory, str(step), "state"))
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except  # damage surfaces in many layers
        failed.append((step, e))
        continue
      for s, e in failed:  # logged once a fallback worked; else the error below says it all
        _log.warning("checkpoint %s failed to restore (%s: %s); restored step %d instead",
                     os.path.join(self.directory, str(s)), type(e).__name__, e, step)
      self._set_aside([s for s, _ in failed])
      return Restored(step, out.state, out.data, self._run_config(step))
    if failed:
      errors = "\n".join(f"  step {s}: {type(e).__name__}: {e}" for s, e in failed)
      raise RuntimeError(f"no checkpoint in {self.directory} restores into the given state "
                         f"(has the model or optimizer changed?):\n{errors}")
    return None

  def _run_config(self, step: int) -> dict | None:
    if not os.path.isdir(os.path.join(self.directory, str(step), "run")):
      return None
    return self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore())).run

  def _set_aside(self, steps: list[int]):
    if not steps:
      return
    if jax.process_index() == 0:
      stamp = int(time.time())
      for step in steps:
        src = os.path.join(self.directory, str(step))
        os.rename(src, f"{src}.damaged-{stamp}")
        _log.warning("moved damaged checkpoint %s to %s.damaged-%d", src, src, stamp)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("ulysses_jax.checkpoint.set_aside")
    self._manager.reload()

  def wait(self):
    """Blocks until an async save in flight is on disk."""
    self._manager.wait_until_finished()

  def close(self):
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def saved_arrays(state_dir: str) -> dict[tuple[str, ...], dict]:
  """The TensorStore spec of every array of an orbax ``state`` item, by its key path (e.g.
  ``("params", "embed")``); read from its ``_METADATA``, no arrays are opened."""
  with open(os.path.join(state_dir, "_METADATA"), encoding="utf-8") as f:
    metadata = json.load(f)
  base = {"driver": "file", "path": state_dir + os.sep}
  kvstore = {"driver": "ocdbt", "base": base} if metadata["use_ocdbt"] else base
  driver = "zarr3" if metadata["use_zarr3"] else "zarr"
  specs = {}
  for entry in metadata["tree_metadata"].values():
    if entry["value_metadata"]["value_type"] in ("jax.Array", "np.ndarray"):
      keys = tuple(str(k["key"]) for k in entry["key_metadata"])
      specs[keys] = {"driver": driver, "kvstore": {**kvstore, "path": ".".join(keys)}}
  return specs


def open_every_array(state_dir: str):
  """Opens every array of an orbax ``state`` item (reading its metadata), one at a time.

  A damaged checkpoint fails here, with nothing left running. Inside orbax's restore it
  fails in one of many concurrent reads: the others outlive the event loop orbax ran them in,
  and their completions print "Event loop is closed" tracebacks from TensorStore's threads.
  """
  context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
  for spec in saved_arrays(state_dir).values():
    ts.open(spec, open=True, context=context).result()


def read_run_config(directory: str, step: int | None = None) -> tuple[int, dict]:
  """(step, run config) saved with checkpoint ``step`` (default: the newest) under
  ``directory``; reads JSON only, no mesh or devices needed."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory}")
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      create=False)) as manager:
    steps = sorted(manager.all_steps())
    if not steps:
      raise FileNotFoundError(f"{directory} holds no checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise FileNotFoundError(f"{directory} has no checkpoint of step {step}; it has steps "
                              f"{steps}")
    return step, manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore())).run


class StopRequest:
  """A flag set by SIGTERM/SIGINT, for the training loop to save and exit cleanly.

  The handler only records the signal and puts back the previous handler, so a second
  signal acts as it would have without us (Ctrl-C twice interrupts at once). Install from
  the main thread; ``close()`` (or leaving ``with``) restores the previous handlers. A signal
  the process ignores stays ignored: shells start background jobs with SIGINT ignored, so that
  Ctrl-C at the terminal leaves them running.
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.signum = None
    previous = {s: signal.getsignal(s) for s in signals}
    self._previous = {s: h for s, h in previous.items() if h is not signal.SIG_IGN}
    for s in self._previous:
      signal.signal(s, self._handle)

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    self.signum = signum
    signal.signal(signum, self._previous[signum])

  def should_stop(self) -> bool:
    """Whether any process got a signal.

    With several processes this is a small all-gather: call it at the same steps on all.
    """
    local = self.signum is not None
    if jax.process_count() == 1:
      return local
    return bool(multihost_utils.process_allgather(np.array(local)).any())

  def close(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
