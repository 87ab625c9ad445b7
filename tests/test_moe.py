"""The mixture-of-experts layer (``models.moe``) against a dense single-device reference that
runs every expert on every token: forward, router statistics and gradients, on meshes of 8
devices, tiled and untiled, for each family's router and activation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from model_cases import (assert_trees_close, initial_state, mesh_of, model_on, packed_batch,
                         relative_error, tree_on_host)
from ulysses_jax import optimizer, sharding, train_step
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.models.config import LlamaConfig, MoeConfig, preset
from ulysses_jax.models.llama import count_params
from ulysses_jax.models.moe import MoE, RouterStats, load_balancing_loss
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer

E, X, K, F = 16, 6, 2, 8  # width, experts, experts per token, expert width
# name: (MoeConfig, mesh (data, seq[, ring]), mlp_chunk). 24 tokens per row: 6, 12 or 3 per
# device, so tiles of 4 or 2 leave a ragged last tile.
CASES = {
    "qwen3_moe_unnormalised": (MoeConfig(num_experts=X, experts_per_token=K, expert_mlp_dim=F,
                                         norm_topk_prob=False), (2, 4), 4),
    "mixtral": (MoeConfig(num_experts=X, experts_per_token=K, expert_mlp_dim=F), (4, 2), 0),
    # A clamp low enough to bite on these activations.
    "gpt_oss": (MoeConfig(num_experts=X, experts_per_token=K, expert_mlp_dim=F,
                          router="topk_softmax", router_bias=True, expert_bias=True,
                          expert_activation="clamped_swiglu", swiglu_limit=0.5),
                (1, 2, 4), 2),
}
BATCH, SEQ = 4, 24


def reference(w, x_tE, valid_t, moe):
  """Every expert on every token, weighted by a [t, X] matrix zero outside the top k."""
  logits = x_tE @ w["router"] + w.get("router_bias", 0.0)
  probs = jax.nn.softmax(logits, axis=-1)
  top = jnp.argsort(-logits, axis=-1)[:, :moe.experts_per_token]
  rows = jnp.arange(x_tE.shape[0])[:, None]
  if moe.router == "topk_softmax":
    chosen = jax.nn.softmax(logits[rows, top], axis=-1)
  else:
    chosen = probs[rows, top]
    if moe.norm_topk_prob:
      chosen = chosen / chosen.sum(-1, keepdims=True)
  gates_tX = jnp.zeros_like(probs).at[rows, top].set(chosen)
  gate = jnp.einsum("te,xei->txi", x_tE, w["gate_proj"]) + w.get("gate_bias", 0.0)
  up = jnp.einsum("te,xei->txi", x_tE, w["up_proj"]) + w.get("up_bias", 0.0)
  if moe.expert_activation == "silu":
    h = jax.nn.silu(gate) * up
  else:
    limit = moe.swiglu_limit
    g = jnp.minimum(gate, limit)
    h = (jnp.clip(up, -limit, limit) + 1) * g * jax.nn.sigmoid(moe.swiglu_alpha * g)
  y = jnp.einsum("txi,xie->txe", h, w["down_proj"]) + w.get("down_bias", 0.0)
  valid = valid_t.astype(jnp.float32)
  stats = RouterStats(valid @ (gates_tX > 0).astype(jnp.float32), valid @ probs, valid.sum())
  return jnp.einsum("txe,tx->te", y, gates_tX), stats


def random_weights(moe, seed):
  rng = np.random.default_rng(seed)
  X = moe.num_experts  # noqa: N806 (the module's name for it)
  shapes = dict(router=(E, X), gate_proj=(X, E, F), up_proj=(X, E, F), down_proj=(X, F, E))
  if moe.router_bias:
    shapes["router_bias"] = (X,)
  if moe.expert_bias:
    shapes.update(gate_bias=(X, F), up_bias=(X, F), down_bias=(X, E))
  return {k: jnp.asarray(rng.normal(0, 0.5, s), jnp.float32) for k, s in shapes.items()}


def random_inputs(seed, num_experts=X, skew_weights=None):
  """x ``[B, S, E]``, valid ``[B, S]`` and the cotangents of y and of the router's summed
  probabilities. ``skew_weights``: route unevenly through its ``"router"`` (changed in
  place): expert 0 takes most tokens, the last two experts none."""
  rng = np.random.default_rng(seed)
  x_BSE = rng.normal(0, 1, (BATCH, SEQ, E))
  if skew_weights is not None:
    x_BSE[..., 0] = np.abs(x_BSE[..., 0]) + 1  # feature 0 > 1 on every token
    router = np.array(skew_weights["router"])
    router[0, 0], router[0, -2:] = 4.0, -20.0
    skew_weights["router"] = jnp.asarray(router)
  valid_BS = jnp.asarray(rng.random((BATCH, SEQ)) < 0.8)
  cotangent = jnp.asarray(rng.normal(0, 1, (BATCH, SEQ, E)), jnp.float32)
  probs_cotangent = jnp.asarray(rng.normal(0, 1, (num_experts,)), jnp.float32)
  return jnp.asarray(x_BSE, jnp.float32), valid_BS, cotangent, probs_cotangent


def objective(y, stats, cotangent, probs_cotangent):
  """Reaches the router through the weights and the aux statistics."""
  return jnp.sum(y * cotangent) + jnp.sum(stats.probs * probs_cotangent)


def layer_values_and_grads(moe, mesh_shape, chunk, weights, inputs, placement="fsdp"):
  """The MoE layer on ``mesh_shape``: (y, stats, gradients of the weights, of x)."""
  x_BSE, valid_BS, cotangent, probs_cotangent = inputs
  mesh = mesh_of(*mesh_shape)
  config = preset("tiny", hidden_dim=E, moe=moe, mlp_chunk=chunk, expert_placement=placement)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(config, mesh=mesh, rngs=nnx.Rngs(0))))
  shardings = nnx.to_pure_dict(sharding.tree_shardings(state, mesh))
  nnx.replace_by_pure_dict(state, jax.device_put(weights, shardings))

  def ours(state, x):
    y, stats = nnx.merge(graphdef, state)(x, valid_BS)
    return objective(y, stats, cotangent, probs_cotangent), (y, stats)

  (_, (y, stats)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(
      state, x_BSE)
  return y, stats, {k: v.get_value() for k, v in grads[0].items()}, grads[1]


def reference_values_and_grads(moe, weights, inputs):
  """``reference`` on one device: (y, stats, gradients of the weights, of x)."""
  x_BSE, valid_BS, cotangent, probs_cotangent = inputs

  def theirs(w, x):
    y, stats = reference(w, x.reshape(-1, E), valid_BS.reshape(-1), moe)
    y = y.reshape(x.shape)
    return objective(y, stats, cotangent, probs_cotangent), (y, stats)

  (_, (y, stats)), grads = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1), has_aux=True))(
      weights, x_BSE)
  return y, stats, grads[0], grads[1]


def assert_layer_matches(ours, theirs, valid_BS):
  y, stats, w_grads, x_grad = ours
  y_ref, stats_ref, w_grads_ref, x_grad_ref = theirs
  assert relative_error(y, y_ref) < 1e-5
  np.testing.assert_array_equal(stats.counts, stats_ref.counts)
  assert stats.tokens == valid_BS.sum() and stats.counts.sum() == K * valid_BS.sum()
  assert relative_error(stats.probs, stats_ref.probs) < 1e-6
  assert_trees_close(w_grads, w_grads_ref, rtol=1e-5)
  assert relative_error(x_grad, x_grad_ref) < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_moe_layer_matches_dense_reference(case):
  moe, mesh_shape, chunk = CASES[case]
  weights = random_weights(moe, 1)
  inputs = random_inputs(2)
  assert_layer_matches(layer_values_and_grads(moe, mesh_shape, chunk, weights, inputs),
                       reference_values_and_grads(moe, weights, inputs), inputs[1])
  if moe.expert_activation == "clamped_swiglu":  # the clamp is active on both sides
    up = jnp.einsum("te,xei->txi", inputs[0].reshape(-1, E), weights["up_proj"])
    assert jnp.any(up > moe.swiglu_limit) and jnp.any(up < -moe.swiglu_limit)


# Expert parallelism: 8 experts over seq = 4 (2 each) or 8 (one each, fewer than k). Quick:
# one case (each compiles the layer twice); slow: the other, which also compares with the
# gathered placement. Ulysses x ring: the whole train step (test_moe_train_step_...).
EXPERT_CASES = {
    "gpt_oss": (CASES["gpt_oss"][0], (2, 4), 4),
    "qwen3_moe": (CASES["qwen3_moe_unnormalised"][0], (1, 8), 2),
}


@pytest.mark.parametrize("case", ["gpt_oss", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_expert_placement_matches_dense_reference(case):
  """Routing skewed so one expert takes most pairs and two take none: the expert placement's
  output, statistics and gradients equal the dense reference's (and, slow cases, the
  gathered placement's)."""
  moe, mesh_shape, chunk = EXPERT_CASES[case]
  moe = moe.replace(num_experts=8)
  weights = random_weights(moe, 3)
  inputs = random_inputs(4, moe.num_experts, weights)
  ours = layer_values_and_grads(moe, mesh_shape, chunk, weights, inputs, placement="expert")
  counts = np.asarray(ours[1].counts)
  assert counts[-2:].sum() == 0 and counts[0] > 2 * counts.sum() / moe.num_experts, counts
  assert_layer_matches(ours, reference_values_and_grads(moe, weights, inputs), inputs[1])
  if case != "gpt_oss":
    assert_layer_matches(ours, layer_values_and_grads(moe, mesh_shape, chunk, weights, inputs),
                         inputs[1])


def test_expert_placement_needs_experts_divisible_by_seq():
  config = preset("tiny", hidden_dim=E, moe=MoeConfig(num_experts=6), expert_placement="expert")
  with pytest.raises(ConfigError, match=r"6 experts over the mesh's seq axis of 4 devices"):
    MoE(config, mesh=mesh_of(2, 4), rngs=nnx.Rngs(0))


def test_load_balancing_loss_is_switch_transformers_over_all_layers():
  counts = jnp.array([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 1.0]])  # layer 1 dense
  probs = jnp.array([[1.5, 0.3, 0.2], [0.0, 0.0, 0.0], [0.5, 1.0, 0.5]])
  stats = RouterStats(counts, probs, jnp.array([2.0, 0.0, 2.0]))
  f, p = counts.sum(0) / 4, probs.sum(0) / 4
  np.testing.assert_allclose(load_balancing_loss(stats), 3 * np.sum(f * p), rtol=1e-6)


@pytest.mark.parametrize("fields, message", [
    (dict(num_experts=4, experts_per_token=5),
     r"experts_per_token \(5\) must be <= num_experts \(4\)"),
    (dict(router="sigmoid"),
     r"MoeConfig.router must be one of 'softmax_topk', 'topk_softmax', got 'sigmoid'"),
    (dict(expert_activation="gelu"), r"MoeConfig.expert_activation must be one of"),
    (dict(mlp_only_layers=(0, 2)), r"mlp_only_layers \[2\] are not layers"),
    (dict(decoder_sparse_step=3), r"leaves none of the 2 layers a mixture"),
])
def test_bad_moe_configs_are_rejected(fields, message):
  with pytest.raises(ConfigError, match=message):
    LlamaConfig(preset="tiny", moe=MoeConfig(**fields))


def test_moe_config_round_trips_through_json():
  config = preset("tiny", moe=MoeConfig(num_experts=4, mlp_only_layers=(0,)),
                  router_aux_loss_coef=0.01)
  assert LlamaConfig.from_dict(config.to_dict()) == config
  assert config.sparse_layers() == (False, True)


MOE_MODEL = preset("tiny-gqa", loss_chunk=8, mlp_chunk=3, router_aux_loss_coef=0.1,
                   moe=MoeConfig(num_experts=4, experts_per_token=2, expert_mlp_dim=24,
                                 mlp_only_layers=(0,)))


def _one_step(mesh_shape, state, batch, placement="fsdp", **memory):
  mesh = mesh_of(*mesh_shape)
  model = MOE_MODEL.replace(expert_placement=placement)
  # eps 1: Adam's first step is then about linear in the gradient, so the comparison measures
  # the gradients (with a small eps it is sign(g) per element, chaotic where g is about 0).
  optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=2,
                                             eps=1.0))
  memory = train_step.MemoryOptions(**memory)
  graphdef, train_state = train_step.init_train_state(model_on(model, mesh, state),
                                                      optimizer, memory=memory)
  step = train_step.make_train_step(graphdef, train_state, optimizer, mesh=mesh,
                                    seq_len=batch["tokens"].shape[1], accum_steps=2,
                                    memory=memory)
  new_state, metrics = step(train_state, batch)
  return tree_on_host(nnx.to_pure_dict(new_state.params)), jax.device_get(metrics)


@pytest.fixture(scope="module")
def moe_step_single_device():
  state = initial_state(MOE_MODEL)
  batch = packed_batch(0, 4, 24, MOE_MODEL.vocab_size)
  return state, batch, _one_step((1, 1), state, batch)


# Slow (a train step compiles for ~15 s of CPU): the quick suite has the whole model's
# gradient with the load-balancing loss against transformers (test_hf_moe).
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, placement, memory", [
    ((2, 4), "fsdp", {}), ((1, 2, 4), "fsdp", dict(offload_optimizer=True)),
    ((2, 4), "expert", {}), ((1, 2, 4), "expert", dict(offload_optimizer=True))])
def test_moe_train_step_matches_single_device(moe_step_single_device, mesh_shape, placement,
                                              memory):
  """Two micro-batches, each with its load-balancing loss (coefficient 0.1): the update and
  the routing metrics of a sharded step, with either expert placement, equal one device's."""
  state, batch, (want_params, want) = moe_step_single_device
  params, metrics = _one_step(mesh_shape, state, batch, placement, **memory)
  assert_trees_close(params, want_params)
  keys = {"router_aux_loss", "expert_share_min/layer_01", "expert_share_max/layer_01"}
  assert keys <= set(metrics) and "expert_share_min/layer_00" not in metrics
  for key in keys | {"loss", "grad_norm"}:
    assert relative_error(metrics[key], want[key]) < 1e-5, key
  assert metrics["expert_share_min/layer_01"] <= 0.25 <= metrics["expert_share_max/layer_01"]
  assert metrics["router_aux_loss"] >= 1.0  # Switch's loss is at least 1 (even routing)


# Published counts, in billions: Qwen3-30B-A3B's model card (30.5B, 3.3B activated with the
# embeddings: 3.353B, truncated), Mixtral's announcement (46.7B, 12.9B per token),
# gpt-oss's model card (arXiv 2508.10925: 20.91B, 3.61B active, counting the unembedding but
# not the embedding). Each within its last digit (gpt-oss's second decimal rounded).
@pytest.mark.parametrize("name, total, active, active_counts_embedding, digit", [
    ("qwen3-30b-a3b", 30.5, 3.3, True, 0.1), ("mixtral-8x7b", 46.7, 12.9, True, 0.1),
    ("gpt-oss-20b", 20.91, 3.61, False, 0.01)])
def test_moe_presets_have_their_published_parameter_counts(name, total, active,
                                                           active_counts_embedding, digit):
  config = preset(name)
  assert abs(count_params(config) / 1e9 - total) < digit
  ours = count_params(config, active=True, include_embedding=active_counts_embedding)
  assert abs(ours / 1e9 - active) < digit


def test_mixed_models_count_only_the_mlp_each_layer_runs():
  dense = preset("tiny")
  mixed = MOE_MODEL.replace(num_heads=4, num_kv_heads=4)  # layer 0 dense, layer 1 MoE
  e, f = dense.hidden_dim, dense.mlp_dim
  moe = mixed.moe
  experts = 3 * e * moe.expert_mlp_dim
  assert count_params(mixed) == (count_params(dense) - 3 * e * f
                                 + e * moe.num_experts + moe.num_experts * experts)
  assert count_params(mixed, active=True) == (count_params(mixed) - (
      moe.num_experts - moe.experts_per_token) * experts)


def test_router_and_expert_biases_get_no_weight_decay():
  """Like every other bias: gpt-oss's router and expert biases; the experts' matrices decay."""
  config = preset("tiny", hidden_dim=16, moe=MoeConfig(
      num_experts=4, experts_per_token=2, expert_mlp_dim=8, router="topk_softmax",
      router_bias=True, expert_bias=True, expert_activation="clamped_swiglu"))
  layer = nnx.eval_shape(lambda: MoE(config, mesh=mesh_of(1, 1), rngs=nnx.Rngs(0)))
  decay = nnx.to_pure_dict(optimizer._decay_mask(nnx.state(layer, nnx.Param)))
  flat = {"/".join(k): v for k, v in traverse_util.flatten_dict(decay).items()}
  biases = [k for k in flat if k.endswith("bias")]
  assert len(biases) == 4 and not any(flat[k] for k in biases), flat
  assert flat["gate_proj"] and flat["down_proj"], flat
