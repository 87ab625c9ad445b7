"""Your own NNX model mixing our layers with Flax's: one call shards it, an optax step keeps the
shardings and compiles once; the layer's call keywords (the docs' example: tests/test_docs.py)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from model_cases import mesh_of, relative_error
from ulysses_jax import UlyssesAttention, sharding
from ulysses_jax.layers import Dense, RMSNorm

E, F, V = 32, 64, 64
FSDP = ("data", "seq")


class OwnModel(nnx.Module):
  """Flax layers annotated with mesh axes, with logical names and not at all, and ours."""

  def __init__(self, mesh, rngs):
    shard = nnx.with_partitioning
    self.embed = nnx.Embed(V, E, rngs=rngs, embedding_init=shard(
        nnx.initializers.normal(0.02), (FSDP, None)))
    self.attn = UlyssesAttention(E, 4, num_kv_heads=2, mesh=mesh, rngs=rngs)
    self.up = nnx.Linear(E, F, rngs=rngs, kernel_init=shard(nnx.initializers.lecun_normal(),
                                                            ("embed", "mlp")))
    self.down = Dense((F,), (E,), axes=("mlp", "embed"), mesh=mesh, rngs=rngs)
    self.norm = RMSNorm(E, mesh=mesh)
    self.out = nnx.Linear(E, V, rngs=rngs)

  def __call__(self, tokens, positions=None, segment_ids=None):
    x = self.embed(tokens)
    x = x + self.attn(x, positions=positions, segment_ids=segment_ids)
    x = x + self.down(jax.nn.gelu(self.up(self.norm(x))))
    return self.out(x)


EXPECTED_SPECS = {
    "embed.embedding": P(FSDP, None),                 # nnx.with_partitioning, mesh axes: kept
    "attn.q_proj.kernel": P(FSDP, None, None),        # ours: FSDP along E
    "attn.k_proj.kernel": P(FSDP, None, None),
    "attn.v_proj.kernel": P(FSDP, None, None),
    "attn.o_proj.kernel": P(None, None, FSDP),
    "up.kernel": P(FSDP, None),                       # nnx.with_partitioning, logical names
    "up.bias": P(),                                   # no metadata: replicated
    "down.kernel": P(None, FSDP),
    "norm.scale": P(None),
    "out.kernel": P(),
    "out.bias": P(),
}


def _specs_match(state, mesh, expected):
  """{path: matches} of each array's sharding against ``NamedSharding(mesh, expected[path])``."""
  flat = {".".join(map(str, path)): x for path, x in nnx.to_flat_state(state)}
  assert sorted(flat) == sorted(expected)
  return {path: x[...].sharding.is_equivalent_to(NamedSharding(mesh, expected[path]), x.ndim)
          for path, x in flat.items()}


def test_one_call_shards_our_layers_and_flax_layers_by_their_partitioning_metadata():
  mesh = mesh_of(2, 4)
  model = sharding.init_sharded(lambda: OwnModel(mesh, nnx.Rngs(0)), mesh)
  params = nnx.state(model, nnx.Param)
  assert all(_specs_match(params, mesh, EXPECTED_SPECS).values()), _specs_match(
      params, mesh, EXPECTED_SPECS)
  # Ours hold their logical names in Flax's metadata, where nnx.get_partition_spec reads them.
  specs = nnx.get_partition_spec(params)
  assert specs["attn"]["q_proj"]["kernel"].get_value() == P("embed", "heads", "head_dim")
  assert specs["embed"]["embedding"].get_value() == P(FSDP, None)


def test_our_layers_built_eagerly_are_already_fsdp_sharded():
  mesh = mesh_of(2, 4)
  attn = UlyssesAttention(E, 4, num_kv_heads=2, mesh=mesh, rngs=nnx.Rngs(0))
  kernel = attn.q_proj.kernel[...]
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(FSDP, None, None)), 3)
  assert {s.data.shape for s in kernel.addressable_shards} == {(E // 8, 4, E // 4)}
  with pytest.raises(ValueError, match=r"size 36, not divisible by the 8 shards of mesh axes "
                                       r"\('data', 'seq'\)"):
    UlyssesAttention(36, 4, mesh=mesh, rngs=nnx.Rngs(0))


@contextlib.contextmanager
def _count_compiles():
  compiles = []
  listener = lambda event, duration, **kwargs: compiles.append(event) if (
      event == "/jax/core/compile/backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_optax_step_keeps_the_shardings_compiles_once_and_never_rematerialises(
    capfd, uncached_compiles):
  mesh = mesh_of(2, 4)
  def make():
    model = OwnModel(mesh, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  model, optimizer = sharding.init_sharded(make, mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, (4, 32), dtype=np.int32)
  segment_ids = np.repeat([[0, 1]], [13, 19], axis=1).repeat(4, 0)
  positions = np.concatenate([np.arange(13), np.arange(19)])[None].repeat(4, 0)

  @nnx.jit
  def train_step(model, optimizer):
    def loss_fn(model):
      logits = model(tokens, positions, segment_ids)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  adam_moments = {f"opt_state.0.{moment}.{path}": spec for path, spec in EXPECTED_SPECS.items()
                  for moment in ("mu", "nu")}
  first = float(train_step(model, optimizer))
  with _count_compiles() as compiles:
    last = [float(train_step(model, optimizer)) for _ in range(3)][-1]
  assert compiles == []
  assert last < first
  assert all(_specs_match(nnx.state(model, nnx.Param), mesh, EXPECTED_SPECS).values())
  matches = _specs_match(nnx.state(optimizer, nnx.OptState), mesh,
                         {**adam_moments, "opt_state.0.count": P(), "step": P()})
  assert all(matches.values()), matches
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_call_keywords_and_bad_shapes_name_the_expected_shape():
  mesh = mesh_of(1, 8)
  attn = UlyssesAttention(E, 4, num_kv_heads=2, mesh=mesh, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 16, E))
  segment_ids = jnp.repeat(jnp.array([[0, 1]]), jnp.array([5, 11]), axis=1,
                           total_repeat_length=16).repeat(2, 0)
  positions = jnp.concatenate([jnp.arange(5), jnp.arange(11)])[None].repeat(2, 0)
  new = attn(x, positions=positions, segment_ids=segment_ids)
  assert relative_error(attn(x, positions, segment_ids), new) == 0  # positional
  with pytest.raises(ValueError, match=r"positions must be an integer \[batch, seq\] array of "
                                       r"shape \(2, 16\) .*, got int32 \(16,\)"):
    attn(x, positions=jnp.arange(16))
  with pytest.raises(ValueError, match=r"segment_ids must be .* got float32 \(2, 16\)"):
    attn(x, segment_ids=jnp.zeros((2, 16)))
