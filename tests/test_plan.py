"""The layout planner: its recommendation and its memory model against XLA's buffer assignment."""

import dataclasses
import json
import math
import pathlib
import re

import gin
import jax
import jax.numpy as jnp
import pytest

from ulysses_jax import aot, make_mesh, plan
from ulysses_jax.hf import config as hf_config
from ulysses_jax.cli import gin_config
from ulysses_jax.gpus import GPUS
from ulysses_jax import train_step as train_step_lib
from ulysses_jax.models import llama
from ulysses_jax.optimizer import OptimizerConfig, make_optimizer

RESULTS = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
# Small enough to compile in seconds, big enough that activations and parameters both count.
# S <= 512 keeps each device's attention to one XLA block.
SMALL = llama.LlamaConfig(vocab_size=4096, hidden_dim=512, num_layers=4, num_heads=8,
                          num_kv_heads=4, head_dim=64, mlp_dim=1536, loss_chunk=256)


def _compiled_peak_bytes(config, data, seq, batch, seq_len):
  """Arguments + outputs - aliased + temporaries of the compiled train step, per device."""
  mesh = make_mesh(data=data, seq=seq, devices=jax.devices()[:data * seq])
  optimizer = make_optimizer(OptimizerConfig())
  graphdef, state = train_step_lib.init_train_state(llama.init_llama(config, mesh), optimizer)
  step = train_step_lib.make_train_step(graphdef, state, optimizer, mesh=mesh, seq_len=seq_len)
  batch_arrays = {k: jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
                  for k in ("tokens", "labels")}
  stats = step.lower(state, batch_arrays).compile().memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


# (LlamaConfig overrides, remat, (data, seq), batch, seq_len). Not checked here: "offload"
# (the CPU has no separate host memory, so the offloaded buffers count as device temporaries).
MEMORY_CASES = [
    ({}, "full", (2, 4), 16, 512),
    pytest.param({}, "full", (8, 1), 8, 512, marks=pytest.mark.slow),
    pytest.param({}, "save_names", (1, 8), 16, 512, marks=pytest.mark.slow),
    pytest.param({}, "save_dots", (1, 8), 16, 512, marks=pytest.mark.slow),
    pytest.param({}, "none", (2, 4), 16, 512, marks=pytest.mark.slow),
    pytest.param({"mlp_chunk": 16}, "none", (1, 8), 16, 512, marks=pytest.mark.slow),
    pytest.param({"mlp_chunk": 16}, "save_dots", (1, 8), 16, 512, marks=pytest.mark.slow),
    pytest.param({"hidden_dim": 1024, "num_heads": 16, "num_kv_heads": 8}, "full", (1, 8), 16,
                 512, marks=pytest.mark.slow),
    pytest.param({"mlp_chunk": 16}, "full", (1, 8), 16, 512,
                 marks=pytest.mark.slow),
    # 4 of 16 layer inputs kept, and the 4 of the group being recomputed (XLA needs fewer).
    pytest.param({"num_layers": 16, "remat_group": 4}, "full", (1, 8), 16, 512,
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("overrides,remat,mesh_shape,batch,seq_len", MEMORY_CASES)
def test_memory_prediction_matches_compiled_memory_analysis(overrides, remat, mesh_shape,
                                                            batch, seq_len):
  config = SMALL.replace(remat_policy=remat, dtype="float32", **overrides)
  measured = _compiled_peak_bytes(config, *mesh_shape, batch, seq_len)
  model = plan.Model.from_config(config)
  predicted = plan.predict_memory(model, plan.Layout(*mesh_shape, 1, remat,
                                                     remat_group=config.remat_group),
                                  batch=batch, seq_len=seq_len, dtype="float32")["total"]
  # The planner models the GPU compiler, which writes the donated state in place; XLA:CPU keeps
  # the optimizer update's float32 result beside the state (4 bytes per parameter).
  predicted += 4 * model.params / (mesh_shape[0] * mesh_shape[1])
  assert abs(predicted / measured - 1) < 0.15, (predicted, measured)


# The shipped GPU configs, a grid of their layouts, layouts without rematerialisation and
# layouts without MLP tiles compiled for H100s by `benchmarks.plan_vs_compiler` (the
# compile-only GPU devices of the jax version named; the smaller of the step compiled as is and
# under memory pressure, the footprint the planner predicts; see its module docstring),
# replanned here with the planner as it is now. Each layout's device figure within 10 %, and
# its host figure within 1 %, but the gaps below:
# (JSON, layout) -> why the planner misses it.
_KV_REPLICATED = ("over: head chunks whose KV heads are replicated over seq (2 or 4 KV heads "
                  "per chunk on 8 GPUs), which the fitted 1.1 A per token counts as "
                  "replicated. The planner errs toward 'does not fit'")
# Compiled again 2026-12-08; the planner is fitted to the newest JAX, the one GPU users install.
_ONE_GPU_ON_0_10 = ("over: jax 0.10.2 compiles the one-GPU Llama-3.1-8B layouts (state on the "
                    "host) 0.9 to 5.5 GiB smaller than jax 0.12.0.1 does")
PLANNER_VS_COMPILER = {
    "plan_vs_compiler_jax0.10.2.json": {
        "llama8b_1gpu_1m.gin": _ONE_GPU_ON_0_10 + " (+13.2 %; 0.12.0.1: 59.06 GiB, +2.7 %)",
        "llama8b_1gpu_1m.gin remat_group=4": _ONE_GPU_ON_0_10 + " (+12.8 %)"},
    "plan_vs_compiler_grid_jax0.10.2.json": {
        "llama8b_1gpu_1m.gin seq_len=262144 attn_head_chunks=1": _ONE_GPU_ON_0_10 + " (+12.7 %)",
        "llama8b_1gpu_1m.gin seq_len=524288 attn_head_chunks=4": _ONE_GPU_ON_0_10 + " (+15.7 %)",
        "llama8b_1gpu_1m.gin seq_len=786432 attn_head_chunks=2": _ONE_GPU_ON_0_10 + " (+11.6 %)"},
    "plan_vs_compiler_jax0.11.2.json": {
        "llama8b_8gpu_8m.gin": _KV_REPLICATED + " (+13.2 %)",
        "llama8b_8gpu_8m.gin attn_head_chunks=4": _KV_REPLICATED + " (+13.4 %)"},
    "plan_vs_compiler_jax0.12.0.1.json": {
        "llama8b_8gpu_8m.gin attn_head_chunks=4": _KV_REPLICATED + " (+15.3 %)"},
    "plan_vs_compiler_grid_jax0.11.2.json": {
        "llama8b_8gpu_8m.gin seq_len=4194304 attn_head_chunks=2": _KV_REPLICATED + " (+14.2 %)",
        "llama8b_8gpu_8m.gin seq_len=4194304 offload_optimizer=False offload_params=False": (
            _KV_REPLICATED + " (+11.8 %)")},
    "plan_vs_compiler_grid_jax0.12.0.1.json": {},
    "plan_vs_compiler_none_jax0.12.0.1.json": {},
    "plan_vs_compiler_untiled_jax0.12.0.1.json": {},
}


@pytest.mark.parametrize("name", sorted(PLANNER_VS_COMPILER))
def test_memory_prediction_matches_the_gpu_compiler(name):
  from benchmarks import plan_vs_compiler
  kind = re.match(r"plan_vs_compiler_(?:(\w+)_)?jax", name)[1] or "configs"
  layouts = plan_vs_compiler.LAYOUTS[kind]
  rows = plan_vs_compiler.replan(str(RESULTS / name), layouts)
  assert len(rows) == len(layouts)
  errors = {row["config"]: row["plan_device_gib"] / row["least_compiled_gib"] - 1
            for row in rows}
  assert {c for c, e in errors.items() if abs(e) > 0.10} == set(PLANNER_VS_COMPILER[name]), (
      errors)
  assert all(errors[c] > 0 for c in PLANNER_VS_COMPILER[name])  # the gaps err toward "no fit"
  for row in rows:
    assert row["plan_host_gib"] == pytest.approx(row["compiled_host_gib"], rel=0.01, abs=0.01)


def _config_layout(gin_file, mesh_shape, params):
  """The config's model, layout and predict_memory keywords (gin read on CPU, no compile)."""
  try:
    config = gin_config.read([gin_file], params)
  finally:
    gin.clear_config()
  run, model, data = config.train, config.model, config.data
  layout = plan.Layout.from_config(run, model, math.prod(mesh_shape))
  sizes = dict(batch=data.batch_size // run.accum_steps, seq_len=data.seq_len,
               dtype=model.dtype, param_dtype=model.param_dtype,
               master_weights=run.master_weights)
  return plan.Model.from_config(model), layout, sizes


# The mixture-of-experts fine-tunes compiled for 8 H100s (device arguments + outputs +
# temporaries as compiled, benchmarks/results/aot_moe/, RESULTS.md "Qwen3-30B-A3B fine-tuning
# ..."): (gin file, preset whose config.json init_from holds, tokens, jax versions compiled).
_QWEN3_FT = "configs/finetune_qwen3_30b_a3b_8gpu_2m.gin"
_GPT_OSS_FT = "configs/finetune_gpt_oss_20b_8gpu_2m.gin"
_GPT_OSS_GAP = pytest.mark.xfail(strict=True, reason=(
    "not captured: gpt-oss-20b's compiled peak holds the layer's input in float32 twice and "
    "five copies of q and the attention output; the planner is 16 to 25 % under"))
COMPILED_MOE_H100 = [
    (_QWEN3_FT, "qwen3-30b-a3b", 1 << 20, ("0.10.2", "0.12.0.1")),
    (_QWEN3_FT, "qwen3-30b-a3b", 1 << 21, ("0.10.2", "0.12.0.1")),
    (_QWEN3_FT, "qwen3-30b-a3b", 1 << 22, ("0.10.2", "0.12.0.1")),
    pytest.param(_GPT_OSS_FT, "gpt-oss-20b", 1 << 21, ("0.10.2", "0.12.0.1"), marks=_GPT_OSS_GAP),
    pytest.param(_GPT_OSS_FT, "gpt-oss-20b", 1 << 22, ("0.10.2", "0.12.0.1"), marks=_GPT_OSS_GAP),
]


@pytest.mark.parametrize("gin_file,preset,seq_len,versions", COMPILED_MOE_H100)
def test_moe_memory_prediction_matches_the_compiled_fine_tunes(gin_file, preset, seq_len,
                                                               versions, tmp_path):
  """The planner predicts the footprint under memory pressure, which these steps (far below
  the GPU's capacity) undercut by less than the compiled-as-is figures stored: within 11 %
  under them, and never over by more than 5 %."""
  (tmp_path / "config.json").write_text(json.dumps(hf_config.config_to_hf(llama.preset(preset))))
  model, layout, sizes = _config_layout(gin_file, (1, 8, 1), [
      f'TrainConfig.init_from="{tmp_path}"', f"DataConfig.seq_len={seq_len}"])
  predicted = plan.predict_memory(model, layout, **sizes)["total"]
  name = preset.replace("-", "_").replace(".", "_")
  for version in versions:
    path = RESULTS / "aot_moe" / f"{name}_{seq_len}_jax{version}.json"
    compiled = json.loads(path.read_text())["device_bytes"]
    assert -0.11 < predicted / compiled - 1 < 0.05, (version, predicted / 2**30, compiled / 2**30)


# Llama-3.1-70B with rings of 16 to 256 (``benchmarks.scaling_compiled --fit``, compiled for
# H100s, the smaller of as is and under pressure, 2026-12-08): 70.97 to 71.08 GiB with jax
# 0.10.2 and 0.11.2, the planner 0.2 % over; 65.58 to 65.65 with jax 0.12.0.1, the planner 8.4
# to 8.5 % over, within the 10 % the planner is held to elsewhere (2026-12-07, before the head
# gradient's barrier: 72.75 to 72.97 and 67.47 to 67.65 GiB; 2026-11-25, jax 0.10.2: 72.31 to
# 74.49).
@pytest.mark.parametrize("version, low, high", [("0.10.2", -0.03, 0.03), ("0.11.2", -0.03, 0.03),
                                                ("0.12.0.1", 0.0, 0.10)])
def test_ring_memory_matches_the_compiled_70b_ring_layouts(version, low, high):
  rows = json.loads((RESULTS / f"scaling_fit_70b_jax{version}.json").read_text())["rows"]
  rings = [row for row in rows if int(row["mesh"].split("x")[2]) > 1]
  assert len(rings) == 5
  for row in rings:
    data, seq, ring = map(int, row["mesh"].split("x"))
    layout = plan.Layout(data, seq, ring, remat=row["remat"], remat_group=row["remat_group"],
                         offload_optimizer="opt" in row["on_host"],
                         offload_params="params" in row["on_host"],
                         attn_head_chunks=row["head_chunks"])
    model = plan.Model.from_config(llama.preset("llama3.1-70b", mlp_chunk=row["mlp_chunk"]))
    predicted = plan.predict_memory(
        model, layout, batch=1, seq_len=row["seq_len"],
        param_dtype="float32" if row["params"] == "fp32" else "bfloat16",
        master_weights="master" in row["params"])["total"] / 2**30
    assert low < predicted / row["compiled_gib"] - 1 < high, (row["nodes"], predicted)


def test_step_traffic_of_head_chunks_and_the_ring_matches_the_gpu_compiler():
  # The compiles above: all-to-all 2560 GiB per device per step with 1 head chunk, 5120 GiB
  # with 4 (each chunk's 2 KV heads replicated over the 8 GPUs, its attention recomputed);
  # the 32-GPU ring's collective permutes 14924 GiB (14912 before the ring's memory fix,
  # d9fd7da, compiled 2026-11-25). The compiler counts every byte, the
  # planner (P-1)/P of the all-to-all (a device keeps its own part).
  traffic = {}
  for gin_file, mesh_shape, params in (
      ("configs/llama8b_8gpu_8m.gin", (1, 8, 1), ["LlamaConfig.attn_head_chunks=1"]),
      ("configs/llama8b_8gpu_8m.gin", (1, 8, 1), ["LlamaConfig.attn_head_chunks=4"]),
      ("configs/llama8b_32gpu_32m.gin", (1, 8, 4), [])):
    model, layout, sizes = _config_layout(gin_file, mesh_shape, params)
    step = plan.predict_step(model, layout, hardware=plan.Hardware.of("h100"), **sizes)
    traffic[layout.ring, layout.attn_head_chunks] = (
        step["all_to_all_bytes"] / 2**30 * 8 / 7, step["ring_bytes"] / 2**30, step["step_s"])
  assert traffic[1, 1][0] == pytest.approx(2560) and traffic[1, 4][0] == pytest.approx(5120)
  assert traffic[4, 4][:2] == pytest.approx((5120, 14924), rel=0.01)
  assert traffic[1, 4][2] > traffic[1, 1][2]  # the recomputed attention costs time


def _hardware(gpu="h100", gpu_gb=None, host_gb_per_gpu=256.0):
  """``plan.Hardware`` of the table's ``gpu``, with ``gpu_gb`` GB of memory if given."""
  spec = GPUS[gpu] if gpu_gb is None else dataclasses.replace(GPUS[gpu],
                                                               memory_bytes=int(gpu_gb * 1e9))
  return plan.Hardware.of(spec, host_gb_per_gpu=host_gb_per_gpu)


def test_plans_llama8b_at_a_million_tokens_on_one_gpu_with_head_chunks():
  model = plan.Model.from_config(llama.preset("llama3.1-8b"))
  hardware = _hardware(gpu_gb=80, host_gb_per_gpu=230)
  knobs = plan.Knobs(precisions=plan.precisions("bfloat16", False), mlp_chunks=(2048,))
  rows = plan.plan(model, seq_len=2**20, devices=1, hardware=hardware, knobs=knobs)
  assert rows, "no layout fits"
  best = rows[0]
  assert best["layout"].attn_head_chunks > 1 and best["layout"].offload_params
  assert best["memory"]["total"] <= 80e9 and best["memory"]["host"] <= 230e9
  assert all(r["layout"].attn_head_chunks > 1 for r in rows)  # whole heads do not fit


def test_head_chunks_must_divide_the_kv_heads():
  model = plan.Model.from_config(llama.preset("llama3.1-8b"))
  predict = lambda layout: plan.predict_memory(model, layout, batch=1, seq_len=2**15)
  with pytest.raises(ValueError, match=r"\(3\) must divide num_kv_heads \(8\) .*; use one of"):
    predict(plan.Layout(1, 1, 1, attn_head_chunks=3))
  with pytest.raises(ValueError, match=r"'full' or 'full_offload' only"):
    predict(plan.Layout(1, 1, 1, "save_names", attn_head_chunks=2))
  with pytest.raises(ValueError, match=r"attn_head_chunks must be >= 1"):
    plan.Layout(1, 1, 1, attn_head_chunks=0)
  found = {x.attn_head_chunks for x in plan.layouts(1, 1, head_chunks=(1, 2, 4))
           if x.remat == "save_names"}
  assert found == {1}


def test_recommends_a_hybrid_for_llama8b_at_a_million_tokens_on_32_gpus():
  model = plan.Model.from_config(llama.preset("llama3.1-8b"))
  hardware = _hardware(gpu_gb=80)
  rows = plan.plan(model, seq_len=2**20, devices=32, hardware=hardware)
  best = rows[0]["layout"]
  assert best.data * best.seq * best.ring == 32
  assert 1 < best.seq <= 8 and best.ring > 1, best
  assert all(r["memory"]["total"] <= 80e9 for r in rows)
  # Layouts whose all-to-all leaves the node are predicted slower than the recommendation.
  wide = [r for r in rows if r["layout"].seq > 8]
  assert wide and all(r["step"]["step_s"] > rows[0]["step"]["step_s"] for r in wide)


def test_memory_terms_scale_as_documented():
  model = plan.Model.from_config(llama.preset("llama3.1-8b"))
  memory = lambda **kw: plan.predict_memory(
      model, plan.Layout(**{"keep_attention": False, **kw}), batch=1, seq_len=2**20)
  base = memory(data=1, seq=8, ring=4)
  # Per-device activations depend on seq*ring only; state shrinks with the device count.
  assert memory(data=1, seq=4, ring=8)["saved"] == base["saved"]
  assert memory(data=1, seq=8, ring=4, remat="save_names")["saved"] > base["saved"]
  assert memory(data=1, seq=8, ring=4, remat="none")["total"] > 80e9
  assert base["state"] == pytest.approx(12 * model.params / 32)
  assert base["host"] == 0
  assert 8.03e9 < model.params < 8.04e9
  # Moments on the host: 4 of the 12 bytes per parameter stay, 8 go; the update streams one
  # layer's moments and the other parameters'.
  host_opt = memory(data=1, seq=8, ring=4, offload_optimizer=True)
  assert host_opt["state"] == pytest.approx(4 * model.params / 32)
  assert host_opt["host"] == pytest.approx(8 * model.params / 32)
  assert host_opt["total"] == pytest.approx(base["total"] - 8 * model.params / 32)
  one_gpu = plan.predict_memory(model, plan.Layout(1, 1, 1, offload_optimizer=True), batch=1,
                                seq_len=1024)
  outside_layers = model.params - model.num_layers * model.layer_params  # embedding, head
  assert one_gpu["total"] == pytest.approx(
      8 * model.params + 2 * 8 * (model.layer_params + outside_layers))
  # bfloat16 parameters with float32 master weights: 2 + 2 bytes per parameter on the device
  # (parameters, gradients), 12 on the host (master, two moments).
  master = plan.predict_memory(model, plan.Layout(1, 8, 4, offload_optimizer=True), batch=1,
                               seq_len=2**20, param_dtype="bfloat16", master_weights=True)
  assert master["state"] + master["grads"] == pytest.approx(4 * model.params / 32)
  assert master["host"] == pytest.approx(12 * model.params / 32)
  # full_offload: the layer inputs (L x tokens per device x E, bf16) move to the host.
  full_offload = memory(data=1, seq=8, ring=4, remat="full_offload")
  assert full_offload["saved"] == 0
  assert full_offload["host"] == base["saved"] == 32 * 2**15 * 4096 * 2
  # Keeping attention's output (bf16) and lse (float32) of every layer: L x T x Hq x (2D + 4),
  # on the device; full_offload recomputes them (nothing more on the host or the device).
  kept = 32 * 2**15 * 32 * (2 * 128 + 4)
  assert memory(data=1, seq=8, ring=4, keep_attention=True)["saved"] == base["saved"] + kept
  kept_offload = memory(data=1, seq=8, ring=4, remat="full_offload", keep_attention=True)
  assert (kept_offload["host"], kept_offload["saved"]) == (full_offload["host"], 0)
  # Groups of 4 layers: 32/4 group inputs, and the 4 layer inputs of the group recomputed.
  grouped = memory(data=1, seq=8, ring=4, remat="full_offload", remat_group=4)
  assert grouped["host"] == full_offload["host"] * (8 + 4) / 32
  # Layer parameters and gradients on the host: the device keeps the others' and one layer's.
  host_params = memory(data=1, seq=8, ring=4, offload_optimizer=True, offload_params=True)
  moved = (model.num_layers - 1) * model.layer_params
  assert host_params["state"] == pytest.approx(host_opt["state"] - 4 * moved / 32)
  assert host_params["grads"] == pytest.approx(host_opt["grads"] - 4 * moved / 32)
  assert host_params["host"] == pytest.approx(
      host_opt["host"] + 8 * model.num_layers * model.layer_params / 32)


def test_layouts_factorise_the_devices_and_divide_the_batch():
  found = {(x.data, x.seq, x.ring) for x in plan.layouts(8, 2, remats=("full",))}
  assert found == {(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 4, 1)}


def test_layer_parameters_on_the_host_need_the_optimizer_state_there():
  assert plan.Layout(1, 1, 1, offload_optimizer=True, offload_params=True).offload_params
  with pytest.raises(ValueError, match=r"offload_params=True needs offload_optimizer=True"):
    plan.Layout(1, 1, 1, offload_params=True)


def test_a_mixture_of_experts_counts_what_it_holds_and_what_a_token_runs():
  """Held parameters (memory, FSDP traffic) are all experts'; FLOPs only the k a token runs;
  the planner's counts agree with the model's own (it leaves out the q/k norm scales)."""
  for name in ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"):
    config = llama.preset(name)
    model = plan.Model.from_config(config)
    assert model.params == pytest.approx(llama.count_params(config), rel=1e-3)
    assert model.compute_params == pytest.approx(llama.count_params(config, active=True),
                                                 rel=1e-3)
  qwen = plan.Model.from_config(llama.preset("qwen3-30b-a3b"))
  gpt_oss = plan.Model.from_config(llama.preset("gpt-oss-20b"))
  # Gathering the experts moves less than sending tokens to them above 3·X·I / (2k) tokens.
  assert plan.moe.placement(qwen, 1)["crossover_tokens"] == 18_432
  assert plan.moe.placement(gpt_oss, 1)["crossover_tokens"] == 34_560
  layout = plan.Layout(1, 8, 1, "full_offload", offload_optimizer=True)
  step = plan.predict_step(qwen, layout, batch=1, seq_len=2**21,
                           hardware=plan.Hardware.of("h100"))
  assert step["experts"]["placement"] == "fsdp" and "gathering moves less" in step["experts"]["why"]
  # The MLP term of the working set is the experts' (k copies of each token of a tile).
  sizes = dict(batch=1, seq_len=2**21, dtype="bfloat16", param_dtype="bfloat16")
  tiled = dataclasses.replace(qwen, mlp_chunk=2048)
  work = plan.predict_memory(tiled, layout, **sizes)["working"]
  dense = dataclasses.replace(tiled, moe_layers=0)
  assert work - plan.predict_memory(dense, layout, **sizes)["working"] == pytest.approx(
      plan.moe.working_bytes(tiled, 2048, 2) - 2 * 4.0 * 6144 * 2048)  # c·4·F·tile


def test_the_planner_keeps_attention_residuals_where_they_fit_and_else_recomputes_them():
  """Llama-3.1-8B, remat "full" on one pinned mesh: where attention's kept output and lse fit,
  the plan keeps them (a faster step: one attention forward fewer); with a budget between the
  two footprints it falls back to recomputing them, and the recommendation says so."""
  from types import SimpleNamespace
  from ulysses_jax.cli import plan_text
  model = plan.Model.from_config(llama.preset("llama3.1-8b", mlp_chunk=2048))
  sizes = dict(batch=1, seq_len=2**19)
  layout = plan.Layout(1, 8, 1, remat="full")
  kept, recomputed = (plan.predict_memory(model, dataclasses.replace(layout, keep_attention=k),
                                          **sizes)["total"] for k in (True, False))
  knobs = plan.Knobs(precisions=plan.precisions("float32", False), mlp_chunks=(2048,),
                     remats=("full",), remat_groups=(1,), head_chunks=(1,), offloads=("none",),
                     mesh=(1, 8, 1))
  roomy = plan.Hardware.of("h100")
  [row] = plan.plan(model, devices=8, hardware=roomy, knobs=knobs, **sizes)
  assert row["layout"].keep_attention and kept < roomy.budget_bytes
  tight = dataclasses.replace(roomy, budget_bytes=(kept + recomputed) / 2)
  [row] = plan.plan(model, devices=8, hardware=tight, knobs=knobs, **sizes)
  assert not row["layout"].keep_attention
  args = SimpleNamespace(accum_steps=1, dtype="bfloat16", seq_len=2**19, batch=1, init_from="")
  assert plan_text.settings(row, args)["LlamaConfig.remat_keep_attention"] is False
  assert "recomputes attention's forward" in plan_text.recommendation(row, args)


@pytest.mark.gpu_compile
@pytest.mark.skipif(not aot.cuda_plugin_installed(), reason="needs JAX's CUDA plugin")
def test_recomputed_flops_match_the_gpu_compiler_for_each_remat_policy_and_mlp_tile():
  """The FLOPs the planner adds for rematerialising, against the gradient of the loss compiled
  for one H100, bfloat16, attention kept: "full" recomputes the layers but their down
  projections (not the embedding or the LM head), "save_names" not q, k and v either; a tiled
  MLP (``mlp_chunk``) recomputes its gate and up projections in the backward under "none" too;
  "none" without tiles and "save_dots" with them recompute nothing. Differences between the
  compiles cancel what all run (the attention kernels, whose compiled FLOPs the planner counts
  otherwise)."""
  from flax import nnx
  from ulysses_jax import sharding
  from ulysses_jax.aot import cost
  seq_len = 2048
  base = SMALL.replace(dtype="bfloat16", vocab_size=8192, loss_chunk=512)
  mesh = make_mesh(1, 1, devices=aot.gpu_devices("h100", "1x1x1"))
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  hardware = plan.Hardware.of("h100")
  compiled, predicted = {}, {}
  for remat, mlp_chunk in (("full", 512), ("save_names", 512), ("none", 512), ("none", 0),
                           ("save_dots", 512)):
    config = base.replace(remat_policy=remat, mlp_chunk=mlp_chunk)
    graphdef, state = nnx.split(nnx.eval_shape(lambda c=config: llama.Llama(
        c, mesh=mesh, rngs=nnx.Rngs(0))))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state, sharding.tree_shardings(state, mesh))
    loss = lambda s, t, g=graphdef: nnx.merge(g, s).loss(t, t).mean()
    text = jax.jit(jax.grad(loss)).lower(state, tokens).compile().as_text()
    compiled[remat, mlp_chunk] = sum(op.count * op.flops for op in cost.operations(text))
    step = plan.predict_step(plan.Model.from_config(config), plan.Layout(1, 1, 1, remat),
                             batch=1, seq_len=seq_len, hardware=hardware)
    predicted[remat, mlp_chunk] = step["compute_s"] * hardware.flops
  for more, less in ((("full", 512), ("none", 512)), (("save_names", 512), ("none", 512)),
                     (("none", 512), ("none", 0)), (("none", 512), ("save_dots", 512))):
    extra = compiled[more] - compiled[less]
    assert extra > 0 and predicted[more] - predicted[less] == pytest.approx(extra, rel=0.02), (
        more, less, compiled, predicted)
