"""The planner for generation (``ulysses_jax.plan.generate``, ``ulysses-plan --generate``)
against the programs ``ulysses-aot --generate`` compiled for H100s (stored JSONs, both jax
versions; nothing compiles here): Llama-3.1-8B, 1M tokens on 8 GPUs and 4M on 32."""

import json
import pathlib

import pytest

from ulysses_jax.cli import plan as plan_cli
from ulysses_jax.gpus import GPUS
from ulysses_jax.models.config import preset
from ulysses_jax.plan.generate import GenerationQuestion, predict_generation

RESULTS = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
CASES = {"1m": GenerationQuestion(1_048_576, seq=8),
         "4m": GenerationQuestion(4_194_304, seq=8, ring=4, nodes=4)}


def _kernel_blocks(slots: int) -> int:
  return -(-slots // 64) * 64


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("jax_version", ["0.11.2", "0.12.0.1"])
def test_prediction_matches_the_compiled_programs(case, jax_version):
  compiled = json.loads((RESULTS / f"generate_gpu_h100_llama8b_{case}_jax{jax_version}.json")
                        .read_text())
  config = preset("llama3.1-8b", dtype="bfloat16", param_dtype="bfloat16")
  got = predict_generation(config, CASES[case], GPUS["h100"].with_reserve(None))
  # The cache: the same formula, 2 · L · ⌈Hkv/U⌉ · D · bytes · ⌈C/R'⌉ · B (C = S + G, G the
  # 127 new tokens fed back rounded up to a multiple of R'; U = 8 heads over seq; R' = ring;
  # each device's slots rounded up to the decode kernel's blocks of 64).
  ring = CASES[case].ring
  slots = CASES[case].prompt_len + -(-127 // ring) * ring
  assert got["cache_bytes_per_device"] == compiled["cache_bytes_per_device"] == (
      2 * 32 * 1 * 128 * 2 * _kernel_blocks(slots // ring))
  # Decode: its arguments (weights and cache); the compiled temporaries are 0.04 GiB.
  decode = compiled["decode"]
  assert abs(got["decode_bytes_per_device"] / decode["device_bytes"] - 1) < 0.005
  assert abs(got["decode_roofline_s"] / decode["predicted_s"] - 1) < 0.005
  # Prefill: the compiled program holds no LM head (unused, jit drops it); a run does.
  prefill = compiled["prefill"]
  head = 2 * config.vocab_size * config.hidden_dim
  assert abs((got["prefill_bytes_per_device"] - head) / prefill["device_bytes"] - 1) < 0.02
  temporaries = prefill["device_breakdown"]["temporaries"]
  assert abs(got["prefill_working_bytes"] / temporaries - 1) < 0.07
  assert got["prefill_all_to_all_bytes"] == prefill["collective_bytes"]["all-to-all"]
  assert got["prefill_ring_bytes"] == prefill["collective_bytes"]["collective-permute"]
  assert abs(got["prefill_roofline_s"] / prefill["predicted_total_s"] - 1) < 0.02
  assert got["fits"] and prefill["fits"] and decode["fits"]


def test_the_command_line_prints_and_writes_the_prediction(tmp_path, capsys):
  out = tmp_path / "plan.json"
  result = plan_cli.run(["--generate", "--model=llama3.1-8b", "--prompt_len=1048576",
                         "--devices=8", f"--json={out}"])
  text = capsys.readouterr().out
  assert "KV cache: 16.00 GiB per device" in text and "PREDICTED decode: 9.92 ms" in text
  assert json.loads(out.read_text())["cache_bytes_per_device"] == result[
      "cache_bytes_per_device"]
  assert result["question"]["seq"] == 8 and result["question"]["ring"] == 1


@pytest.mark.parametrize("flags, message", [
    (["--prompt_len=16777216", "--devices=8"], "generation does not fit"),
    (["--devices=8"], "--generate needs --prompt_len"),
    (["--prompt_len=1024", "--devices=8", "--mesh=1x4x1"], "needs 4 devices, not --devices=8"),
])
def test_bad_or_too_long_questions_are_one_error_line(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    plan_cli.run(["--generate", "--model=llama3.1-8b", *flags])
  assert exit_.value.code == (1 if "fit" in message else 2)
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("jax_version", ["0.10.2", "0.12.0.1"])
def test_moe_prediction_matches_the_compiled_programs(jax_version):
  """gpt-oss-20b (sliding and full layers, sinks, 32 experts), 131,072 tokens on 8 H100s: the
  cache to the byte (its windowed layers keep 128 slots), the memory within 3 %. The prefill's
  time is not compared: it is a FLOP bound here and aot's roofline adds the memory-bound
  operations, which dominate at 16K tokens per GPU (0.3 s against 0.65 s). The decode's
  bytes read and time agree: both count the chosen experts only (``generate.experts``)."""
  compiled = json.loads((RESULTS / f"generate_gpu_h100_gpt_oss_20b_128k_jax{jax_version}.json")
                        .read_text())
  config = preset("gpt-oss-20b", dtype="bfloat16", param_dtype="bfloat16")
  got = predict_generation(config, GenerationQuestion(131_072, seq=8),
                           GPUS["h100"].with_reserve(None))
  assert got["cache_bytes_per_device"] == compiled["cache_bytes_per_device"] == (
      2 * 12 * 1 * 64 * 2 * (_kernel_blocks(131_072 + 127) + 128))  # 12 full, 12 of window 128
  assert abs(got["decode_bytes_per_device"] / compiled["decode"]["device_bytes"] - 1) < 0.005
  head = 2 * config.vocab_size * config.hidden_dim
  assert abs((got["prefill_bytes_per_device"] - head) / compiled["prefill"]["device_bytes"]
             - 1) < 0.03
  # Decode: both read at most 4 of the 32 experts per layer (one token per GPU, k = 4), the
  # same expert bytes left out; aot's arguments and the planner's c·params differ by 0.4 MB.
  decode = compiled["decode"]
  assert got["weights_bytes_per_device"] + got["cache_bytes_per_device"] + got[
      "cache_positions_bytes_per_device"] - got["decode_bytes_read"] == decode[
          "unread_expert_bytes"]
  assert abs(got["decode_bytes_read"] / decode["bytes_read"] - 1) < 0.001
  assert abs(got["decode_roofline_s"] / decode["predicted_s"] - 1) < 0.005


@pytest.mark.parametrize("batch, experts_read", [(8, 4), (32, 16), (256, 32)])
def test_aot_and_the_planner_count_the_same_unread_experts(batch, experts_read):
  """A decode step on 1 x 8 routes ⌈B/8⌉ tokens per device to k = 4 of X = 32 experts: it
  reads min(32, 4·⌈B/8⌉) experts per layer (one function, ``generate.experts``), and the
  expert bytes aot leaves out of its arguments (from the sharded abstract weights) equal
  those the planner leaves out of c·params. Nothing compiles."""
  import jax
  from ulysses_jax.aot import generate as aot_generate
  from ulysses_jax.generate.experts import decode_experts_read
  from ulysses_jax.mesh import make_mesh
  from ulysses_jax.models.config import MoeConfig
  config = preset("tiny", num_layers=2, dtype="bfloat16", param_dtype="bfloat16",
                  moe=MoeConfig(num_experts=32, experts_per_token=4, expert_mlp_dim=48,
                                expert_bias=True))
  mesh = make_mesh(1, 8, devices=jax.devices()[:8])
  generator, layout, _ = aot_generate.abstract_generator(
      config, mesh, aot_generate.GenerationSetup(prompt_len=512, batch=batch, mesh_seq=8))
  assert decode_experts_read(config, layout) == experts_read
  aot_unread = aot_generate.unread_expert_bytes(config, layout, generator.params)
  plan = predict_generation(config, GenerationQuestion(512, seq=8, batch=batch),
                            GPUS["h100"].with_reserve(None))
  plan_unread = (plan["weights_bytes_per_device"] + plan["cache_bytes_per_device"]
                 + plan["cache_positions_bytes_per_device"] - plan["decode_bytes_read"])
  per_expert = 2 * (3 * config.hidden_dim * 48 + 2 * 48 + config.hidden_dim)
  assert aot_unread == plan_unread == 2 * (32 - experts_read) * per_expert
