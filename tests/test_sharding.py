"""Sharding rules, sharded init (ZeRO-3 layout, checked on the arrays), sequence-local chunks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from model_cases import initial_state, mesh_of, packed_batch
from ulysses_jax import sharding, train_step
from ulysses_jax.mesh import DATA, RING, SEQ
from ulysses_jax.models.llama import Llama, init_llama, preset
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer


def test_logical_to_spec_uses_the_rules_table():
  act, param = ("act_batch", "act_seq", "act_embed"), ("layers", "embed", "mlp")
  assert sharding.logical_to_spec(act) == P(DATA, (RING, SEQ), None)
  # Mesh axes the mesh lacks drop out: the same rules serve (data, seq) and hybrid meshes.
  plain, hybrid = mesh_of(2, 4), mesh_of(2, 2, ring=2)
  assert sharding.logical_to_spec(act, mesh=plain) == P(DATA, SEQ, None)
  assert sharding.logical_to_spec(param, mesh=plain) == P(None, (DATA, SEQ), None)
  assert sharding.logical_to_spec(act, mesh=hybrid) == P(DATA, (RING, SEQ), None)
  assert sharding.logical_to_spec(param, mesh=hybrid) == P(None, (DATA, RING, SEQ), None)
  pure_dp = tuple((k, DATA if k == "embed" else v) for k, v in sharding.DEFAULT_RULES)
  assert sharding.logical_to_spec(("embed", None), pure_dp) == P(DATA, None)
  with pytest.raises(ValueError, match=r"logical axes \['embedd'\] are not in the sharding "
                                       "rules"):
    sharding.logical_to_spec(("embedd",))


def _per_device_fraction(x):
  sizes = {shard.data.size for shard in x.addressable_shards}
  assert len(sizes) == 1, sizes
  return sizes.pop() / x.size


@pytest.fixture(scope="module")
def sharded_state():
  config = preset("tiny-gqa")
  mesh = mesh_of(2, 4)
  model = init_llama(config, mesh, seed=0)
  optimizer = make_optimizer(OptimizerConfig())
  return config, model, train_step.init_train_state(model, optimizer)[1]


def test_init_creates_parameters_sharded_with_single_device_values(sharded_state):
  config, model, _ = sharded_state
  state = nnx.state(model)
  expected = initial_state(config, seed=0)
  for (path, x), want in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                             jax.tree.leaves(expected)):
    # Same random stream; jit and eager fuse `init_std * normal` differently (1 ulp).
    np.testing.assert_allclose(np.asarray(x), want, rtol=1e-6, atol=0,
                               err_msg=jax.tree_util.keystr(path))


def test_large_parameters_and_adam_moments_hold_one_eighth_per_device(sharded_state):
  _, _, state = sharded_state
  adam = [group.tx_state[0] for group in state.opt_state]  # adamw: (ScaleByAdamState, ...)
  checked = 0
  for tree in (state.params, [a.mu for a in adam], [a.nu for a in adam]):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      name = jax.tree_util.keystr(path)
      if x.ndim >= 2 and "scale" not in name:  # every matrix; norm scales are [L, E] vectors
        assert _per_device_fraction(x) == 1 / 8, name
        checked += 1
      else:
        assert _per_device_fraction(x) == 1, name
  assert checked == 3 * 9  # embedding, lm_head, q, k, v, o, gate, up, down; x3 trees
  assert _per_device_fraction(state.step) == 1


def test_compiled_step_arguments_are_one_eighth_of_single_device():
  config = preset("tiny-gqa")
  state = initial_state(config)
  batch = packed_batch(0, 8, 32, config.vocab_size)
  optimizer = make_optimizer(OptimizerConfig())
  argument_bytes, expected_bytes = {}, {}
  for shape in ((1, 1), (2, 4)):
    mesh = mesh_of(*shape)
    model = sharding.put_sharded(lambda mesh=mesh: Llama(config, mesh=mesh, rngs=nnx.Rngs(0)),
                                 state, mesh)
    graphdef, train_state = train_step.init_train_state(model, optimizer)
    step = train_step.make_train_step(graphdef, train_state, optimizer, mesh=mesh, seq_len=32)
    memory = step.lower(train_state, batch).compile().memory_analysis()
    argument_bytes[shape] = memory.argument_size_in_bytes
    expected_bytes[shape] = (
        sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(train_state)) +
        sum(x.nbytes for x in batch.values()) // mesh.size)
  assert argument_bytes == expected_bytes
  # Only norm scales ([L, E] and [E]: 0.3% of this tiny model) and step counters are
  # replicated, so the ratio is 1/8 plus 7/8 of that 0.3%.
  ratio = argument_bytes[(2, 4)] / argument_bytes[(1, 1)]
  assert 1 / 8 <= ratio < 0.128, argument_bytes


def test_local_chunks_round_trip_without_communication():
  mesh = mesh_of(2, 4)
  x = jnp.arange(2 * 36 * 3, dtype=jnp.float32).reshape(2, 36, 3)  # 9 local tokens
  x = jax.device_put(x, NamedSharding(mesh, P(DATA, SEQ)))

  def round_trip(x):
    chunks = sharding.to_local_chunks(x, mesh=mesh, chunk=4, pad_value=-1.0)
    return chunks, sharding.from_local_chunks(chunks, 36, mesh=mesh)

  chunks, back = jax.jit(round_trip)(x)
  assert chunks.shape == (3, 2, 4, 4, 3)  # [N, B, P, c, ...]: 9 local tokens -> 3 chunks of 4
  np.testing.assert_array_equal(back, x)
  # Chunk n holds local tokens 4n..4n+3 of every device: device 1 of seq starts at token 9.
  np.testing.assert_array_equal(chunks[1, 0, 1, :, 0], x[0, 13:17, 0])
  np.testing.assert_array_equal(chunks[2, 0, 0, 1:, 0], -1.0)  # padding
  hlo = jax.jit(round_trip).lower(x).compile().as_text()
  assert not re.search(r"all-gather|all-to-all|collective-permute|all-reduce", hlo)


def test_constrain_and_batch_spec_handle_indivisible_sequences():
  mesh = mesh_of(1, 8)
  assert sharding.batch_spec(mesh, 32) == P(DATA, SEQ)
  assert sharding.batch_spec(mesh, 30) == P(DATA, None)
  x = sharding.constrain(jnp.ones((2, 30)), ("act_batch", "act_seq"), mesh)  # no error
  assert x.shape == (2, 30)


def test_indivisible_parameter_raises_with_the_fix():
  with pytest.raises(ValueError, match=r"\['embedding'\].*size 36, not divisible by the 8 "
                                       r"shards of mesh axes \('data', 'seq'\)"):
    init_llama(preset("tiny", hidden_dim=36, head_dim=8), mesh_of(2, 4))


def test_gather_keeping_the_gradient_in_shards_needs_the_axes():
  with pytest.raises(ValueError, match=r"gradient_in_shards needs the parameter's logical "
                                       r"axes: pass axes="):
    sharding.gather(jnp.ones((8, 16)), jnp.bfloat16, mesh_of(1, 8), gradient_in_shards=True)
