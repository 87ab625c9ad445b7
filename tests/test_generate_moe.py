"""Generation for models with attention sinks and mixture-of-experts layers against
transformers' ``generate`` (greedy, float32), token for token: Qwen3-MoE (a dense first
layer), Mixtral (a window on every layer) and gpt-oss (sinks |s| in [2, 4] of both signs,
q/k/v/o biases, alternating sliding and full layers, YaRN, a router bias), prompts of unequal
lengths longer than the windows, on Ulysses, data x seq and Ulysses x ring meshes; the decode
attention with sinks against a dense reference."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_generate import MESHES, NEW_TOKENS, Reference, _random_cache  # noqa: E402
from test_hf import random_hf_model  # noqa: E402
from test_hf_moe import FAMILIES, random_gpt_oss  # noqa: E402
from ulysses_jax import generate as gen  # noqa: E402
from ulysses_jax.attention.reference import dense_attention  # noqa: E402
from ulysses_jax.cli import generate as generate_cli  # noqa: E402
from ulysses_jax.generate import attention as gen_attention  # noqa: E402
from ulysses_jax.hf.weights import load_llama  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402

MODELS = {"qwen3_moe": lambda: random_hf_model(FAMILIES["qwen3_moe"][0],
                                               **FAMILIES["qwen3_moe"][1]),
          "mixtral": lambda: random_hf_model(FAMILIES["mixtral"][0], **FAMILIES["mixtral"][1]),
          "gpt_oss": random_gpt_oss}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  made = {}

  def get(family):
    if family not in made:
      made[family] = Reference(MODELS[family](), tmp_path_factory.mktemp(family), len(family))
    return made[family]
  return get


def test_decode_attention_with_sinks_and_the_new_token_equals_dense():
  """Heads over seq (2 KV heads, 4 query heads: a shard's sinks are its heads'), slots over
  ring = 4 with empty shards: the sink enters once, after the combine and the new token."""
  mesh = make_mesh(1, 2, 4)
  layout = gen.plan_cache(mesh, batch=2, prompt_len=32, max_new_tokens=9, kv_heads=2,
                          head_dim=16, dtype="float32", layer_windows=(None,))
  assert (layout.heads_axis, layout.slot_shards) == ("seq", 4)
  rng = np.random.default_rng(0)
  lengths = np.array([3, 29])
  q, k, v, positions = _random_cache(layout, rng, 4, lengths)
  new_k, new_v = (rng.standard_normal((2, 1, 2, 16)).astype(np.float32) for _ in range(2))
  sinks = rng.uniform(2, 4, 4) * np.array([1, -1, -1, 1])
  got = jax.jit(lambda *xs: gen_attention.cache_attention(
      layout, *xs[:5], scale=0.25, window=None, new_kv=xs[5:7], sinks_H=xs[7]))(
          q, k, v, lengths[:, None].astype(np.int32), positions, new_k, new_v,
          jnp.asarray(sinks, jnp.float32))
  for row in range(2):
    keys = np.flatnonzero(positions[row] >= 0)
    k_row = np.concatenate([k[row:row + 1, :, keys].transpose(0, 2, 1, 3), new_k[row:row + 1]], 1)
    v_row = np.concatenate([v[row:row + 1, :, :, keys].transpose(0, 3, 1, 2),
                            new_v[row:row + 1]], 1)
    expected = dense_attention(q[row:row + 1], k_row, v_row, causal=False, scale=0.25,
                               sinks=jnp.asarray(sinks, jnp.float32))
    np.testing.assert_allclose(np.asarray(got[row:row + 1]), expected, atol=1e-5, rtol=0)


# Every family on every mesh would cost the slow suite three times its budget: gpt-oss (every
# feature) on all three and chunked, each MoE family on the two meshes where its cache takes
# another path (2 KV heads: slots over seq on 1 x 8 and 2 x 4, heads over seq on 1 x 2 x 4).
GREEDY_CASES = [("gpt_oss", "ulysses_1x8", None), ("gpt_oss", "data_2x4", None),
                ("gpt_oss", "ulysses_ring_1x2x4", None), ("gpt_oss", "ulysses_ring_1x2x4", 8),
                ("qwen3_moe", "data_2x4", None), ("qwen3_moe", "ulysses_ring_1x2x4", 8),
                ("mixtral", "ulysses_1x8", None), ("mixtral", "ulysses_ring_1x2x4", None)]


# Slow: loading, the reference and two compiles take 7 to 15 s a case on CI's CPUs; the quick
# suite has the attention test above.
@pytest.mark.slow
@pytest.mark.parametrize("family, mesh, chunk_len", GREEDY_CASES)
def test_greedy_equals_transformers(family, mesh, chunk_len, references, tmp_path):
  """``chunk_len=8``: the longest prompt in three chunks, each attending the cache so far.
  gpt-oss on 1 x 8 runs the command line (weights replicated, ``generate.PARAM_RULES``); the
  others the Python API (weights as training shards them)."""
  ref = references(family)
  if (family, mesh) == ("gpt_oss", "ulysses_1x8"):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.json"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref.prompts))
    assert generate_cli.main([f"--hf={ref.path}", f"--prompts={prompts}",
                              f"--max_new_tokens={NEW_TOKENS}", "--mesh_seq=8",
                              "--platform=cpu", "--cpu_devices=8", f"--json={out}"]) == 0
    got = [r["output_ids"] for r in json.loads(out.read_text())["results"]]
    assert got == ref.until_eos()
    return
  model = load_llama(ref.path, make_mesh(*MESHES[mesh]))
  assert gen.generate(model, ref.prompts, max_new_tokens=NEW_TOKENS,
                      chunk_len=chunk_len) == ref.expected


@pytest.mark.slow  # 3 to 4 s: over the quick suite's 3 s a test
def test_decode_experts_over_the_stack_equal_the_layers_own():
  """``experts.stacked_experts`` (the decode step's experts where the grouped matmul is the
  Mosaic kernel, layer i's tokens sent to groups i·X + e of all layers' experts) equals the
  layer's own ``MoE`` on its slice, on a 2 x 4 mesh, with every feature of gpt-oss's experts
  (run here with XLA's ragged_dot)."""
  from flax import nnx
  from ulysses_jax.generate import experts
  from ulysses_jax.models.config import LlamaConfig, MoeConfig
  from ulysses_jax.models.llama import init_llama
  config = LlamaConfig(preset="tiny", num_layers=2, moe=MoeConfig(
      num_experts=4, experts_per_token=2, expert_mlp_dim=32, router="topk_softmax",
      router_bias=True, expert_bias=True, expert_activation="clamped_swiglu"))
  model = init_llama(config, make_mesh(2, 4), seed=1)
  rng = np.random.default_rng(0)
  for name in ("router_bias", "gate_bias", "up_bias", "down_bias"):  # zeros at init
    param = getattr(model.layers.moe, name)
    param[...] = jnp.asarray(rng.normal(0, 0.5, param.shape), param.dtype)
  x = jnp.asarray(rng.standard_normal((2, 8, config.hidden_dim)), jnp.float32)
  valid = jnp.ones((2, 8), bool)

  @nnx.jit
  def both(model, x):  # the last layer: its groups start at X, not 0
    layer = model.layer(1)
    return (experts.stacked_experts(model, 1, x, norm=layer.mlp_norm),
            layer.moe(x, valid, norm=layer.mlp_norm)[0])

  stacked, own = both(model, x)
  np.testing.assert_allclose(np.asarray(stacked), np.asarray(own), atol=1e-5, rtol=1e-5)
