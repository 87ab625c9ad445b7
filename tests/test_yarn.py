"""YaRN RoPE against transformers' ``_compute_yarn_parameters``, and its Hugging Face fields."""

import pytest

from model_cases import relative_error
from ulysses_jax.hf.weights import config_from_hf, config_to_hf, rope_scaling_from_hf
from ulysses_jax.rope import RopeScaling, attention_factor, inverse_frequencies

transformers = pytest.importorskip("transformers")

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("fields", [
    {},
    dict(beta_fast=16.0, beta_slow=2.0),
    dict(truncate=False, attention_factor=1.3),
    dict(factor=1.0, original_max_position_embeddings=32),  # no attention rescaling
])
def test_yarn_matches_transformers(fields):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  rope = {**YARN, "rope_theta": 10_000.0, **fields}
  hf = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32,
                                max_position_embeddings=256, rope_parameters=rope)
  expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
  scaling = rope_scaling_from_hf(hf.to_dict())
  assert scaling.kind == "yarn"
  assert relative_error(inverse_frequencies(32, 10_000.0, scaling),
                        expected_inv_freq.numpy()) < 1e-6
  assert attention_factor(scaling) == pytest.approx(expected_factor, rel=1e-12)
  assert abs(attention_factor(scaling) - 1) > 0.1 or rope["factor"] == 1.0


def test_yarn_round_trips_through_config_json():
  scaling = RopeScaling(kind="yarn", factor=4.0, original_max_position=64, beta_fast=16.0,
                        attention_factor=1.0, truncate=False)
  from ulysses_jax.models.config import preset
  config = preset("tiny", rope_scaling=scaling)
  assert config_from_hf({**config_to_hf(config), "model_type": "llama"}).rope_scaling == scaling
  with pytest.raises(ValueError, match="mscale"):
    config_from_hf({**config_to_hf(config), "rope_scaling": {**YARN, "mscale": 1.0,
                                                             "mscale_all_dim": 1.0}})
