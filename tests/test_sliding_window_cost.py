"""Sliding-window attention in the FLOP counts: MFU's model FLOPs and the planner's step."""

import math

import pytest

from ulysses_jax import metrics, plan
from ulysses_jax.attention.reference import attention_mask, mean_visible_keys
from ulysses_jax.models.config import preset


@pytest.mark.parametrize("seq_len, window", [(64, 1), (64, 8), (64, 63), (100, 30)])
def test_mean_visible_keys_is_the_masks_mean_to_within_half_a_key(seq_len, window):
  exact = float(attention_mask(seq_len, seq_len, causal=True,
                               sliding_window=window).sum()) / seq_len
  assert abs(mean_visible_keys(seq_len, window) - exact) <= 0.5
  assert mean_visible_keys(seq_len, None) == mean_visible_keys(seq_len, seq_len) == seq_len / 2


def test_flops_per_token_counts_each_layers_window():
  full = preset("tiny")
  half_windowed = preset("tiny", sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"])
  per_layer_full = 12 * (4096 / 2) * full.num_heads * full.head_dim
  per_layer_window = 12 * (16 - 16 ** 2 / (2 * 4096)) * full.num_heads * full.head_dim
  assert math.isclose(metrics.flops_per_token(full, 4096) - metrics.flops_per_token(
      half_windowed, 4096), per_layer_full - per_layer_window)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_ring_steps_are_the_distances_the_ring_fetches(ring):
  """The planner's count equals the shifts ring attention fetches (besides its own block), for
  windows from 1 to past the sequence, natural and zigzag layouts alike."""
  from ulysses_jax.attention.ring import _Ring
  seq_len = 64 * ring
  local_len = seq_len // ring
  for window in [None, 1, 2, 31, 63, 64, 65, 96, 97, 200, seq_len, 2 * seq_len]:
    natural = window is not None and window <= local_len
    fetched = _Ring("ring", ring, True, None, 1, "xla", window,
                    zigzag=not natural).window_sources(local_len) if window else None
    expected = ring - 1 if window is None else sum(shift != 0 for shift, _ in fetched)
    assert plan.ring_steps(ring, seq_len, window) == expected, (window, expected)
  assert plan.ring_steps(1, 64, 16) == 0


def test_the_planner_predicts_less_attention_and_ring_traffic_under_a_window():
  config = preset("llama3.1-8b")
  layout = plan.Layout(1, 1, 8)  # zigzag halves of 65,536 tokens: 2 ring steps instead of 7
  args = dict(batch=1, seq_len=1 << 20, hardware=plan.Hardware.of("h100"))
  full = plan.predict_step(plan.Model.from_config(config), layout, **args)
  windowed = plan.predict_step(
      plan.Model.from_config(config.replace(sliding_window=4096)), layout, **args)
  assert windowed["ring_bytes"] < full["ring_bytes"] / 1.5  # the zigzag exchange stays
  assert windowed["compute_s"] < full["compute_s"]
  assert windowed["all_to_all_bytes"] == full["all_to_all_bytes"]


def test_aot_cost_counts_a_windowed_kernel_by_its_window():
  from tests.test_aot import _HLO
  from ulysses_jax.aot import cost
  windowed = _HLO.replace("flash_attention_forward_causal/",
                          "flash_attention_forward_causal_window32/")
  ops = {op.name: op for op in cost.operations(windowed)}
  assert ops["att"].flops == 4 * 1 * 4 * 256 * (32 - 32 ** 2 / (2 * 256)) * 64
