"""Tests for ulysses_jax.checkpoint: save policy, resharding restore, fallback, stop signals."""

import gc
import logging
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ulysses_jax import checkpoint
from ulysses_jax.mesh import DATA, SEQ, make_mesh

SPECS = {"embed": P((DATA, SEQ), None), "dense": P(None, (DATA, SEQ)), "norm": P()}


@pytest.fixture(autouse=True)
def no_background_errors(monkeypatch, caplog):
  """Fails a test during which a thread died of an exception, an exception was raised where
  nothing could catch it (such as orbax's reads finishing after their event loop closed:
  "RuntimeError: Event loop is closed" from TensorStore's threads) or asyncio logged an
  error (a task's exception never retrieved)."""
  errors = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: errors.append(
      f"unraisable {u.exc_type.__name__}: {u.exc_value}"))
  monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(
      f"thread {a.thread and a.thread.name} {a.exc_type.__name__}: {a.exc_value}"))
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    yield
    time.sleep(0.2)  # reads left running finish within this on an idle machine
    gc.collect()  # tasks dropped with an exception log it when collected
  errors += [f"asyncio: {r.getMessage()[:300]}" for r in caplog.records if r.name == "asyncio"]
  assert not errors, "\n".join(errors)


def _params(mesh):
  values = {"embed": jnp.arange(16 * 8.).reshape(16, 8),
            "dense": -jnp.arange(8 * 24.).reshape(8, 24), "norm": jnp.linspace(0, 1, 8)}
  return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in values.items()}


def _state(mesh, step=0):
  params = _params(mesh)
  opt_state = optax.adam(1e-3).init(params)
  return {"params": params, "opt_state": opt_state, "step": jnp.array(step, jnp.int32),
          "rng": jax.random.key(step)}


def _abstract(state, sharding_for):
  """The abstract target: shapes and dtypes of ``state``, shardings from ``sharding_for``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(path, x)),
      state)


def _mesh_shardings(mesh):
  """Parameters (and their Adam moments) sharded as SPECS on ``mesh``; the rest replicated."""
  def sharding_for(path, x):
    name = next((k.key for k in path if getattr(k, "key", None) in SPECS), None)
    spec = SPECS[name] if name and x.ndim else P()
    return NamedSharding(mesh, spec)
  return sharding_for


def _assert_same(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jnp.issubdtype(w.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_save_policy_keep_and_resume(tmp_path):
  mesh = make_mesh(data=2, seq=4)
  config = checkpoint.CheckpointConfig(save_every=2, keep=2)
  with checkpoint.Checkpointer(tmp_path / "ckpt", config) as ckpt:
    assert ckpt.restore(_abstract(_state(mesh), _mesh_shardings(mesh))) is None
    save = lambda s, **kw: ckpt.save(s, _state(mesh, s), {"next_row": 10 * s},
                                     run_config={"model": {"step": s}}, **kw)
    assert [s for s in range(1, 8) if save(s)] == [2, 4, 6]
    assert save(7, force=True)  # the final save
    assert not save(7, force=True)  # already saved
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
  # Each checkpoint carries its run config, readable without a mesh.
  assert checkpoint.read_run_config(tmp_path / "ckpt") == (7, {"model": {"step": 7}})
  assert checkpoint.read_run_config(tmp_path / "ckpt", 6) == (6, {"model": {"step": 6}})
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5; it has steps \[6, 7\]"):
    checkpoint.read_run_config(tmp_path / "ckpt", 5)
  # A new process on the same directory resumes from the newest.
  with checkpoint.Checkpointer(tmp_path / "ckpt", config) as ckpt:
    restored = ckpt.restore(_abstract(_state(mesh), _mesh_shardings(mesh)))
  assert restored.step == 7 and restored.data_state == {"next_row": 70}
  _assert_same(restored.state, _state(mesh, 7))
  assert isinstance(restored.state["opt_state"][0], optax.ScaleByAdamState)


def test_async_save_owns_its_copy(tmp_path):
  mesh = make_mesh(data=2, seq=4)
  state = _state(mesh, 3)
  expected = jax.tree.map(np.asarray, jax.tree.map(
      lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
      state))
  with checkpoint.Checkpointer(tmp_path, checkpoint.CheckpointConfig(async_save=True)) as ckpt:
    assert ckpt.save(3, state, {}, run_config={}, force=True)
    jax.tree.map(lambda x: x.delete(), state["params"])  # as if donated to the next step
    ckpt.wait()
    restored = ckpt.restore(_abstract(_state(mesh), _mesh_shardings(mesh)))
  _assert_same(restored.state["params"], expected["params"])


@pytest.mark.parametrize("shape", [(1, 8), (8, 1), "single"])
def test_restore_reshards(tmp_path, shape):
  saved_on = make_mesh(data=2, seq=4)
  state = _state(saved_on, 5)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, state, {"next_row": 1}, run_config={}, force=True)
  if shape == "single":
    device = jax.devices()[0]
    sharding_for = lambda path, x: SingleDeviceSharding(device)
  else:
    sharding_for = _mesh_shardings(make_mesh(*shape))
  target = _abstract(state, sharding_for)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(target)
  _assert_same(restored.state, state)
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target)):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def _damage(step_dir):
  """Overwrites every array data file of a checkpoint with garbage (a torn write)."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs
           if os.sep + "d" + os.sep in os.path.join(d, f)]
  assert files
  for f in files:
    with open(f, "wb") as out:
      out.write(b"not a checkpoint")


def test_damaged_newest_falls_back(tmp_path, caplog):
  mesh = make_mesh(data=2, seq=4)
  target = _abstract(_state(mesh), _mesh_shardings(mesh))
  config = checkpoint.CheckpointConfig(save_every=1, keep=3)
  with checkpoint.Checkpointer(tmp_path, config) as ckpt:
    for s in (1, 2):
      ckpt.save(s, _state(mesh, s), {"next_row": s}, run_config={})
  _damage(tmp_path / "2")
  # A half-written step 3 (killed before orbax's final rename) is not a checkpoint at all.
  os.makedirs(tmp_path / "3.orbax-checkpoint-tmp-1234" / "state")
  with caplog.at_level(logging.WARNING), checkpoint.Checkpointer(tmp_path, config) as ckpt:
    assert ckpt.all_steps() == [1, 2]
    restored = ckpt.restore(target)
    assert restored.step == 1 and restored.data_state == {"next_row": 1}
    _assert_same(restored.state, _state(mesh, 1))
    assert f"checkpoint {tmp_path / '2'} failed to restore" in caplog.text
    assert ckpt.all_steps() == [1]  # the damaged one is set aside, so step 2 saves again
    assert [p for p in os.listdir(tmp_path) if p.startswith("2.damaged-")]
    assert ckpt.save(2, _state(mesh, 2), {"next_row": 2}, run_config={})
    ckpt.wait()
    assert ckpt.restore(target).step == 2
  assert not os.path.exists(tmp_path / "3.orbax-checkpoint-tmp-1234")  # cleaned up


def test_damaged_checkpoints_leave_nothing_running(tmp_path):
  """Restoring past a damaged checkpoint, again and again: the autouse fixture fails the
  test if any read outlives the restore that started it."""
  mesh = make_mesh(data=2, seq=4)
  target = _abstract(_state(mesh), _mesh_shardings(mesh))
  for attempt in range(5):
    directory = tmp_path / str(attempt)
    with checkpoint.Checkpointer(directory, checkpoint.CheckpointConfig(async_save=False)) as c:
      for s in (1, 2):
        c.save(s, _state(mesh, s), {"next_row": s}, run_config={}, force=True)
    _damage(directory / "2")
    with checkpoint.Checkpointer(directory) as c:
      assert c.restore(target).step == 1


def test_nothing_restores_is_an_error(tmp_path):
  mesh = make_mesh(data=2, seq=4)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, _state(mesh, 1), {}, run_config={}, force=True)
  one_device = SingleDeviceSharding(jax.devices()[0])
  wrong = _abstract({"params": {"other": jnp.zeros(3)}}, lambda path, x: one_device)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(RuntimeError, match=r"no checkpoint in .* restores into the given state"):
      ckpt.restore(wrong)
    assert ckpt.all_steps() == [1]  # nothing moved: the target was what was wrong


def test_bad_config_is_a_clear_error():
  with pytest.raises(ValueError, match="CheckpointConfig.keep must be >= 1, got 0"):
    checkpoint.CheckpointConfig(keep=0)
  with pytest.raises(ValueError, match="CheckpointConfig.save_every must be an int, got 2.5"):
    checkpoint.CheckpointConfig(save_every=2.5)


def test_stop_request_on_signals():
  seen = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
  sigint_handler = signal.getsignal(signal.SIGINT)
  try:
    with checkpoint.StopRequest() as stop:
      assert not stop.should_stop()
      os.kill(os.getpid(), signal.SIGTERM)
      assert stop.should_stop() and stop.signum == signal.SIGTERM
      assert not seen  # the first signal only sets the flag
      os.kill(os.getpid(), signal.SIGTERM)  # a second one goes to the previous handler
      assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is sigint_handler
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_stop_request_leaves_ignored_signals_ignored():
  # As in a job that a shell started in the background.
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with checkpoint.StopRequest() as stop:
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
      os.kill(os.getpid(), signal.SIGINT)
      assert not stop.should_stop()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, previous)
