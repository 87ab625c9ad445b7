"""Tests for the shared config validation (ulysses_jax.config_checks) and the model presets."""

import dataclasses
import json
from collections.abc import Sequence
from typing import Literal

import pytest

from ulysses_jax.config_checks import ConfigError, above, at_least, check_fields
from ulysses_jax.models.config import PRESETS, LlamaConfig, preset
from ulysses_jax.optimizer import OptimizerConfig
from ulysses_jax.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class Example:
  count: int = dataclasses.field(default=1, metadata=at_least(1))
  rate: float = dataclasses.field(default=0.5, metadata=above(0))
  flag: bool = False
  mode: Literal["a", "b"] = "a"
  maybe: int | None = None
  names: tuple[str, ...] = ()
  paths: str | Sequence[str] = ()
  scaling: RopeScaling | None = None

  def __post_init__(self):
    check_fields(self)


@pytest.mark.parametrize("field, value, message", [
    ("count", 2.0, "Example.count must be an int, got 2.0"),
    ("count", True, "Example.count must be an int, got True"),
    ("count", "3", "Example.count must be an int, got '3'"),
    ("count", 0, "Example.count must be >= 1, got 0"),
    ("rate", "3e-3", "Example.rate must be a float, got '3e-3'"),
    ("rate", 0, "Example.rate must be > 0, got 0"),
    ("flag", 1, "Example.flag must be a bool, got 1"),
    ("mode", "c", "Example.mode must be one of 'a', 'b', got 'c'"),
    ("maybe", 1.5, "Example.maybe must be an int or None, got 1.5"),
    ("names", ("x", 1), r"Example.names must be a list of a str, got \('x', 1\)"),
    ("paths", 3, "Example.paths must be a str or a list of a str, got 3"),
    ("scaling", {"factor": 2}, "Example.scaling must be a RopeScaling or None"),
])
def test_each_kind_of_bad_value_is_named(field, value, message):
  with pytest.raises(ConfigError, match=message):
    Example(**{field: value})


def test_good_values_pass_and_problems_are_reported_together():
  Example(count=3, rate=1, flag=True, mode="b", maybe=4, names=["x"], paths=["p", "q"],
          scaling=RopeScaling())
  with pytest.raises(ConfigError, match="Example.count must be >= 1, got 0; Example.mode"):
    Example(count=0, mode="z")


def test_optimizer_learning_rate_as_a_string_is_refused():
  with pytest.raises(ConfigError, match="OptimizerConfig.learning_rate must be a float, "
                     "got '3e-3'"):
    OptimizerConfig(learning_rate="3e-3")


def test_a_preset_gives_the_fields_not_given():
  assert preset("llama3.1-8b").hidden_dim == 4096
  config = LlamaConfig(preset="llama3.1-8b", num_layers=2, rope_scaling=None)
  assert (config.hidden_dim, config.num_layers, config.rope_scaling) == (4096, 2, None)
  assert config.replace(mlp_dim=8).num_layers == 2  # replace keeps explicit values
  assert LlamaConfig().hidden_dim == 4096 and LlamaConfig().vocab_size == 32_000
  for name, fields in PRESETS.items():
    assert dataclasses.replace(preset(name), preset="") == fields, name
  with pytest.raises(ConfigError, match=r"LlamaConfig.preset 'gpt5' is unknown; choose one "
                     r"of \['cpu-demo'"):
    LlamaConfig(preset="gpt5")
  with pytest.raises(ConfigError, match="LlamaConfig.remat_policy must be one of 'none'"):
    preset("tiny", remat_policy="fast")


def test_llama_config_round_trips_through_a_dict():
  config = preset("llama3.2-1b", remat_policy="full_offload", remat_names=["qkv"])
  assert config.remat_names == ("qkv",)
  assert LlamaConfig.from_dict(config.to_dict()) == config
  gemma = preset("gemma3-1b", sliding_rope_scaling=RopeScaling(kind="linear", factor=2.0))
  assert LlamaConfig.from_dict(json.loads(json.dumps(gemma.to_dict()))) == gemma
  with pytest.raises(ConfigError, match=r"unknown LlamaConfig fields \['hidden'\]"):
    LlamaConfig.from_dict({"hidden": 3})


def test_layer_windows_follow_sliding_window_and_layer_types():
  assert preset("tiny").layer_windows() == (None, None)
  assert preset("tiny", sliding_window=8).layer_windows() == (8, 8)  # Mistral: every layer
  gemma_like = preset("tiny", sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
  assert gemma_like.layer_windows() == (8, None)
  assert LlamaConfig.from_dict(gemma_like.to_dict()) == gemma_like


@pytest.mark.parametrize("fields, message", [
    (dict(sliding_window=0), "sliding_window must be >= 1"),
    (dict(layer_types=("full_attention",)), "layer_types has 1 entries but num_layers is 2"),
    (dict(sliding_window=4, layer_types=("local", "full_attention")),
     r"layer_types \['local'\] are unknown"),
    (dict(layer_types=("sliding_attention",) * 2), "sliding_window is None"),
    (dict(sliding_rope_scaling=RopeScaling(kind="linear", factor=2.0)),
     "sliding_rope_scaling is set but sliding_rope_theta is None"),
    (dict(attention_scale=0.0), r"attention_scale must be > 0, or None for head_dim \*\* -0.5"),
])
def test_bad_attention_types_are_named(fields, message):
  with pytest.raises(ConfigError, match=message):
    preset("tiny", **fields)
