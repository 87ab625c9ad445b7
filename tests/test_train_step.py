"""The train step: SP equivalence over optimizer steps, accumulation, optimizer, donation,
skipped non-finite steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from model_cases import (assert_trees_close, initial_state, mesh_of, model_on, packed_batch,
                         relative_error, tree_on_host)
from ulysses_jax import train_step
from ulysses_jax.train_step import MemoryOptions
from ulysses_jax.models.llama import Llama, init_llama, preset
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer, split_layers

CONFIG = preset("tiny-gqa", loss_chunk=3, mlp_chunk=5)
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=4)
SEQ_LEN = 30  # divisible by neither 4 nor 8
Z_LOSS = 1e-3


def _train(mesh_shape, state, batches, *, config=CONFIG, optimizer_config=OPTIMIZER,
           accum_steps=1, offload_optimizer=False, offload_params=False, master_weights=False):
  """Runs one step per batch from parameters ``state``.

  Returns the final state and the metrics on the host, and whether the step donated (deleted)
  the state it was given.
  """
  mesh = mesh_of(*mesh_shape)
  optimizer = make_optimizer(optimizer_config)
  memory = MemoryOptions(offload_optimizer=offload_optimizer, offload_params=offload_params,
                         master_weights=master_weights)
  graphdef, train_state = train_step.init_train_state(model_on(config, mesh, state), optimizer,
                                                      memory=memory)
  step = train_step.make_train_step(
      graphdef, train_state, optimizer, mesh=mesh, seq_len=batches[0]["tokens"].shape[1],
      accum_steps=accum_steps, z_loss_weight=Z_LOSS, memory=memory)
  first_state = jax.tree.leaves(train_state)
  metrics = []
  for batch in batches:
    train_state, m = step(train_state, batch)
    if offload_optimizer:  # the optimizer state stays in host memory between steps
      assert {x.sharding.memory_kind for x in jax.tree.leaves(train_state.opt_state)} == {
          "pinned_host"}
    layers, rest = split_layers(train_state.params)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(layers)} == {
        "pinned_host" if offload_params else "device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(rest)} == {"device"}
    metrics.append({k: float(v) for k, v in m.items()})
  donated = all(x.is_deleted() for x in first_state)
  return tree_on_host(train_state), metrics, donated


@pytest.fixture(scope="module")
def three_steps_single_device():
  state = initial_state(CONFIG)
  batches = [packed_batch(i, 8, SEQ_LEN, CONFIG.vocab_size) for i in range(3)]
  batches[1]["labels"][:4] = -1  # uneven valid-token counts across shards and micro-batches
  return state, batches, _train((1, 1), state, batches)


@pytest.mark.parametrize("mesh_shape,accum_steps", [
    ((2, 4), 1), ((2, 4), 2),  # accumulation: 2 micro-batches of 4 rows, still SP
    pytest.param((8, 1), 1, marks=pytest.mark.slow),
    pytest.param((1, 8), 1, marks=pytest.mark.slow)])
def test_three_steps_match_single_device(three_steps_single_device, mesh_shape, accum_steps):
  state, batches, (want_state, want_metrics, _) = three_steps_single_device
  got_state, got_metrics, donated = _train(mesh_shape, state, batches, accum_steps=accum_steps)
  for got, want in zip(got_metrics, want_metrics):
    for key in ("loss", "z_loss", "grad_norm"):
      assert relative_error(got[key], want[key]) < 1e-5, (key, got, want)
    assert got["tokens"] == want["tokens"] and got["learning_rate"] == want["learning_rate"]
  assert_trees_close(got_state.params, want_state.params)
  assert_trees_close(got_state.opt_state, want_state.opt_state)
  assert int(got_state.step) == 3 and donated


def test_host_offloaded_optimizer_matches_on_device(three_steps_single_device):
  state, batches, (want_state, _, _) = three_steps_single_device
  got_state, _, _ = _train((2, 4), state, batches, offload_optimizer=True)
  assert_trees_close(got_state.params, want_state.params)
  assert_trees_close(got_state.opt_state, want_state.opt_state)


@pytest.mark.parametrize("remat_policy,remat_group", [("full", 1), ("full_offload", 2)])
def test_host_offloaded_parameters_match_on_device(three_steps_single_device, remat_policy,
                                                   remat_group):
  """Layer parameters and gradients in host memory (brought to the device layer by layer in
  the forward, backward, gradient norm and update) train exactly as on the device, also with
  the layer inputs on the host and layers in remat groups (the single-GPU 8B layout)."""
  state, batches, (want_state, want_metrics, _) = three_steps_single_device
  config = CONFIG.replace(remat_policy=remat_policy, remat_group=remat_group)
  got_state, got_metrics, _ = _train((2, 4), state, batches, offload_optimizer=True,
                                     offload_params=True, config=config)
  for got, want in zip(got_metrics, want_metrics):
    assert relative_error(got["grad_norm"], want["grad_norm"]) < 1e-5, (got, want)
  assert_trees_close(got_state.params, want_state.params)
  assert_trees_close(got_state.opt_state, want_state.opt_state)


def test_metrics_report_the_model_loss_and_the_loss_goes_down(three_steps_single_device):
  state, batches, (final_state, metrics, _) = three_steps_single_device
  graphdef, _ = nnx.split(model_on(CONFIG, mesh_of(1, 1), state))
  batch = batches[0]
  loss = jax.jit(lambda params: nnx.merge(graphdef, params).loss(
      batch["tokens"], batch["labels"], batch["positions"], batch["segment_ids"]).mean())
  assert relative_error(metrics[0]["loss"], loss(state)) < 1e-6
  assert float(loss(final_state.params)) < metrics[0]["loss"] - 0.2
  assert metrics[0]["tokens"] == np.sum(batch["labels"] != -1)
  assert [m["learning_rate"] for m in metrics] == pytest.approx(
      [0.0, 1e-2, 1e-2 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 3)))])


@pytest.mark.slow
def test_host_offloaded_master_weights_take_the_float32_update(three_steps_single_device):
  """bfloat16 parameters with float32 master weights (host-offloaded, streamed) take the
  update that float32 training takes from the same values, and stay the master rounded."""
  state, batches, _ = three_steps_single_device
  bf16_state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
  f32_state = jax.tree.map(lambda x: x.astype(np.float32), bf16_state)  # the same values
  first_step = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=4)
  want, _, _ = _train((1, 1), f32_state, batches[:1], optimizer_config=first_step)
  got, _, _ = _train((2, 4), bf16_state, batches[:1], optimizer_config=first_step,
                     config=CONFIG.replace(param_dtype="bfloat16"), offload_optimizer=True,
                     master_weights=True)
  master = nnx.merge_state(got.opt_state.layers.master, got.opt_state.rest.master)
  assert {x.dtype for x in jax.tree.leaves(got.opt_state)} == {np.dtype(np.float32),
                                                               np.dtype(np.int32)}
  update = lambda params: jax.tree.map(np.subtract, params, f32_state)
  # The gradient of a bfloat16 parameter is bfloat16 (rounded by up to 2^-9), which Adam's
  # normalisation mostly cancels: measured 1e-4 at most.
  assert_trees_close(update(master), update(want.params), rtol=2**-9)
  jax.tree.map(lambda p, m: np.testing.assert_array_equal(p, m.astype(p.dtype)),
               got.params, master)
  # The master holds what bfloat16 cannot: most weights lie between two bfloat16 values.
  kernel = master["layers"]["mlp"]["up_proj"]["kernel"][...]
  assert np.mean(kernel != kernel.astype(jnp.bfloat16).astype(np.float32)) > 0.9


@pytest.mark.slow
def test_micro_batch_gradients_of_bfloat16_parameters_are_summed_in_float32():
  """bfloat16 parameters, float32 master weights, 4 micro-batches: Adam's first moment after
  one step is (1 - b1) x the float32 sum of the 4 bfloat16 micro-batch gradients. A bfloat16
  running sum rounds at every add and misses it on most elements."""
  config = CONFIG.replace(param_dtype="bfloat16")
  state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), initial_state(CONFIG))
  batch = packed_batch(0, 8, SEQ_LEN, CONFIG.vocab_size)
  no_clip = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=4,
                            clip_norm=0.0)
  got, _, _ = _train((1, 1), state, [batch], config=config, optimizer_config=no_clip,
                     accum_steps=4, master_weights=True)
  mu = nnx.merge_state(*(optax.tree.get(group.tx_state, "mu") for group in got.opt_state))

  graphdef, params = nnx.split(model_on(config, mesh_of(1, 1), state))
  total = np.sum(batch["labels"] != -1)

  @jax.jit
  def micro_grads(params, micro):  # as the step computes them: bfloat16, over all tokens
    def objective(params):
      sums = nnx.merge(graphdef, params).loss(micro["tokens"], micro["labels"],
                                              micro["positions"], micro["segment_ids"],
                                              z_loss_weight=Z_LOSS)
      return (sums.loss + sums.z_loss) / total
    return jax.grad(objective)(params)

  # Micro-batch i is rows i, i + 4 (see make_train_step).
  grads = [micro_grads(params, {k: v[i::4] for k, v in batch.items()}) for i in range(4)]
  want = jax.tree.map(lambda *g: sum(np.asarray(x, np.float32) for x in g), *grads)
  got_leaves, want_leaves = jax.tree.leaves(mu), jax.tree.leaves(want)
  close = [np.isclose(g, (1 - no_clip.b1) * w, rtol=1e-5, atol=1e-12)
           for g, w in zip(got_leaves, want_leaves)]
  assert np.mean(np.concatenate([c.ravel() for c in close])) > 0.99


def test_optimizer_decays_everything_but_norms_and_biases():
  params = nnx.State({"proj": {"kernel": nnx.Param(jnp.ones((4, 4))),
                               "bias": nnx.Param(jnp.ones(4))},
                      "norm": {"scale": nnx.Param(jnp.ones(4))}})
  config = OptimizerConfig(learning_rate=0.1, warmup_steps=0, total_steps=10,
                           weight_decay=0.5)
  tx = make_optimizer(config).tx
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  assert np.allclose(updates["proj"]["kernel"][...], -0.1 * 0.5)  # decayed
  assert np.all(updates["proj"]["bias"][...] == 0) and np.all(updates["norm"]["scale"][...] == 0)


def test_step_clips_gradients_to_the_global_norm():
  config = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=4,
                           clip_norm=1e-3)
  optimizer = make_optimizer(config)
  mesh = mesh_of(1, 1)
  graphdef, state = train_step.init_train_state(model_on(CONFIG, mesh, initial_state(CONFIG)),
                                                optimizer)
  step = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=SEQ_LEN)
  state, metrics = step(state, packed_batch(0, 8, SEQ_LEN, CONFIG.vocab_size))
  assert float(metrics["grad_norm"]) > 10 * config.clip_norm  # so clipping acts
  # Adam's first moment after one step is (1 - b1) x the clipped gradient.
  mu = [group.tx_state[0].mu for group in state.opt_state]
  assert float(optax.tree.norm(mu)) == pytest.approx((1 - config.b1) * config.clip_norm,
                                                     rel=1e-5)


def test_a_nonfinite_loss_with_finite_gradients_is_skipped_and_counted(monkeypatch):
  """The loss is made +inf when the first token is 0, which leaves its gradients finite:
  that step keeps parameters and moments, is counted, and does not advance the schedule."""
  model_loss = Llama.loss

  def loss_inf_on_token_0(self, tokens, *args, **kwargs):
    sums = model_loss(self, tokens, *args, **kwargs)
    return sums._replace(loss=sums.loss + jnp.where(tokens[0, 0] == 0, jnp.inf, 0.0))

  monkeypatch.setattr(Llama, "loss", loss_inf_on_token_0)
  mesh = mesh_of(1, 1)
  optimizer = make_optimizer(
      OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=4))
  graphdef, state = train_step.init_train_state(model_on(CONFIG, mesh, initial_state(CONFIG)),
                                                optimizer)
  step = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=SEQ_LEN)
  bad, good = (packed_batch(i, 8, SEQ_LEN, CONFIG.vocab_size) for i in range(2))
  bad["tokens"][0, 0], good["tokens"][0, 0] = 0, 1
  before = tree_on_host(state)

  state, metrics = step(state, bad)
  after_bad = tree_on_host(state)
  assert np.isinf(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
  jax.tree.map(np.testing.assert_array_equal, after_bad.params, before.params)
  jax.tree.map(np.testing.assert_array_equal, after_bad.opt_state, before.opt_state)
  assert (after_bad.nonfinite_in_a_row, after_bad.nonfinite_steps) == (1, 1)

  state, metrics = step(state, good)
  after_good = tree_on_host(state)
  assert np.isfinite(metrics["loss"])
  # The skipped step did not advance the schedule: the good step is its step 0.
  assert metrics["learning_rate"] == pytest.approx(float(optimizer.schedule(0)))
  assert float(optimizer.schedule(0)) != pytest.approx(float(optimizer.schedule(1)))
  assert not any(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after_good.params),
                                                      jax.tree.leaves(before.params)))
  assert (after_good.nonfinite_in_a_row, after_good.nonfinite_steps) == (0, 1)


def test_bad_batches_and_settings_raise_before_compiling():
  mesh = mesh_of(2, 4)
  optimizer = make_optimizer(OPTIMIZER)
  model = model_on(CONFIG, mesh, initial_state(CONFIG))
  graphdef, state = train_step.init_train_state(model, optimizer)
  batch = packed_batch(0, 8, 16, CONFIG.vocab_size)
  step = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=16,
                                    accum_steps=3)
  with pytest.raises(ValueError, match=r"batch size 8 must be divisible by accum_steps \(3\) "
                                       r"x the data axis \(2\)"):
    step.lower(state, batch)
  step = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=16)
  with pytest.raises(ValueError, match=r"missing \['labels'\], unknown \['mask'\]"):
    step.lower(state, {"tokens": batch["tokens"], "mask": batch["tokens"]})
  with pytest.raises(ValueError, match=r"offload_params=True keeps the gradients in host "
                                       r"memory.*use accum_steps=1 \(got 2\)"):
    train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=16, accum_steps=2,
                               memory=MemoryOptions(offload_optimizer=True, offload_params=True))
  with pytest.raises(ValueError, match="offload_params=True needs offload_optimizer=True"):
    MemoryOptions(offload_params=True)
  with pytest.raises(ValueError, match="accum_steps must be >= 1"):
    train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=16, accum_steps=0)
  with pytest.raises(ValueError, match="need 0 <= warmup_steps < total_steps"):
    OptimizerConfig(warmup_steps=10, total_steps=10)
  with pytest.raises(ValueError, match="parameters are float32 already; set "
                                       "LlamaConfig.param_dtype='bfloat16'"):
    train_step.init_train_state(model, optimizer, memory=MemoryOptions(master_weights=True))


@pytest.mark.gpu
def test_streamed_update_keeps_the_optimizer_state_and_parameters_off_the_gpu():
  """Compiled for the GPU, the host-offloaded step keeps the optimizer state (float32 master
  weights and moments of bfloat16 parameters) in host memory and brings the layers' part to
  the device one layer at a time: the step needs far less device memory than on-device. With
  ``offload_params`` the layer parameters and their gradients leave the device as well, also
  in remat groups with the layer inputs on the host (the single-GPU 8B layout)."""
  config = preset("small", dtype="bfloat16", param_dtype="bfloat16", num_layers=8)
  mesh = mesh_of(1, 1)
  optimizer = make_optimizer(OPTIMIZER)
  batch = {k: jax.ShapeDtypeStruct((1, 512), jnp.int32) for k in ("tokens", "labels")}

  def compiled_memory(config=config, **flags):
    memory = MemoryOptions(master_weights=True, **flags)
    graphdef, state = jax.eval_shape(lambda: train_step.init_train_state(
        init_llama(config, mesh), optimizer, memory=memory))
    step = train_step.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=512,
                                      memory=memory)
    return state, step.lower(state, batch).compile().memory_analysis()

  state, on_device = compiled_memory()
  _, offloaded = compiled_memory(offload_optimizer=True)
  _, params_offloaded = compiled_memory(offload_optimizer=True, offload_params=True)
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  device = lambda m: (m.argument_size_in_bytes + m.output_size_in_bytes
                      - m.alias_size_in_bytes + m.temp_size_in_bytes)
  assert offloaded.host_argument_size_in_bytes >= nbytes(state.opt_state)
  # Streaming 8 layers should save nearly all of their state; ask for at least half.
  assert device(offloaded) < device(on_device) - nbytes(state.opt_state.layers) / 2, (
      offloaded, on_device)
  layer_params = nbytes(split_layers(state.params)[0])
  assert params_offloaded.host_argument_size_in_bytes >= (nbytes(state.opt_state)
                                                          + layer_params)
  # Parameters and gradients of 8 layers leave the device; ask for at least one copy's worth.
  assert device(params_offloaded) < device(offloaded) - layer_params, (params_offloaded,
                                                                       offloaded)
  grouped = config.replace(remat_policy="full_offload", remat_group=2)
  _, grouped_offloaded = compiled_memory(grouped, offload_optimizer=True)
  _, grouped_params_offloaded = compiled_memory(grouped, offload_optimizer=True,
                                                offload_params=True)
  assert device(grouped_params_offloaded) < device(grouped_offloaded) - layer_params, (
      grouped_params_offloaded, grouped_offloaded)