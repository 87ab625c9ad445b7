"""The max-sequence-length search, the transformers comparison, the communication volume and
the offline kernel-resource report, on tiny shapes (CPU)."""

import ast
import importlib.util
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest

from benchmarks import comm_volume, common, kernel_resources, max_seqlen, train_step
from ulysses_jax import aot, make_mesh
from ulysses_jax.aot import hlo
from ulysses_jax.attention.baselines import ring_attention
from ulysses_jax.kernels import flash_kernels

GRANULARITY = 512


@pytest.mark.parametrize("limit", [0, 100, 128, 129, 1000, 4096, 10**6])
def test_search_finds_the_last_multiple_that_fits(limit):
  tried = []

  def fits(length):
    tried.append(length)
    return length <= limit

  best, first_fail = common.search(fits, 128, 4096)
  assert best == min(limit // 128 * 128, 4096)
  assert first_fail == (0 if limit >= 4096 else best + 128)
  assert all(s % 128 == 0 for s in tried)
  assert len(tried) == len(set(tried)) <= 12
  # Started near the answer: the same result, fewer tries.
  tried.clear()
  assert common.search(fits, 128, 4096, start=1000) == (best, first_fail)
  assert tried[0] == 896 and len(tried) <= 9


def test_parse_config():
  assert max_seqlen.parse_config("offload+opt+mlp64") == max_seqlen.MemoryConfig(
      "offload", offload_optimizer=True, mlp_chunk=64)
  assert max_seqlen.parse_config("full_offload+group4+opt+params+master+mlp8") == (
      max_seqlen.MemoryConfig("full_offload", remat_group=4, offload_optimizer=True,
                              offload_params=True, master_weights=True, mlp_chunk=8))
  assert max_seqlen.parse_config("full_offload+group4+opt+params+master+mlp8").name == (
      "full_offload+group4+opt+params+master+mlp8")
  with pytest.raises(ValueError, match=r"\+params needs \+opt"):
    max_seqlen.parse_config("full+params")
  assert max_seqlen.parse_config("none").name == "none"
  with pytest.raises(ValueError, match="POLICY"):
    max_seqlen.parse_config("full+gpu")
  with pytest.raises(ValueError, match="remat policy"):
    max_seqlen.parse_config("most")


@pytest.mark.slow
def test_max_seqlen_respects_budget_and_remat_offload_fit_more(capsys):
  setup = max_seqlen.Setup("tiny", "float32", data=1, seq=8, batch=1)
  budget = max_seqlen.compiled_bytes(setup, max_seqlen.MemoryConfig("none"), GRANULARITY)
  rows = max_seqlen.main(["--preset", "tiny", "--configs", "none,full+opt",
                          "--granularity", str(GRANULARITY), "--max-len", str(2 * GRANULARITY),
                          "--budget-gib", str(budget / max_seqlen.GIB),
                          "--time-max-tokens", "0"])
  none, offloaded = rows
  assert none["max_tokens"] == GRANULARITY and none["first_fail"] == 2 * GRANULARITY
  assert none["est_GiB"] * max_seqlen.GIB <= budget
  assert max_seqlen.compiled_bytes(setup, max_seqlen.MemoryConfig("none"),
                                   2 * GRANULARITY) > budget
  assert offloaded["max_tokens"] > none["max_tokens"]
  assert offloaded["est_GiB"] * max_seqlen.GIB <= budget
  with pytest.raises(SystemExit):
    max_seqlen.main(["--preset", "tiny", "--criterion", "run"])
  assert "--criterion run needs a GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_timed_steps_run_and_report(tmp_path):
  """The two benchmarks that time real steps (the train step's table, max_seqlen's timed
  rows) run through and report a finite time and loss."""
  row = train_step.main(["--preset", "tiny", "--seq-len", "256", "--steps", "2",
                         "--json", str(tmp_path / "step.json")])
  assert row["step_s"] > 0 and math.isfinite(row["loss"])
  assert json.loads((tmp_path / "step.json").read_text())["rows"][0]["seq_len"] == 256
  setup = max_seqlen.Setup("tiny", "float32", data=1, seq=8, batch=1)
  timed = max_seqlen.run_steps(setup, max_seqlen.MemoryConfig("full"), 256, steps=2)
  assert timed["fits"] and timed["step_s"] > 0


@pytest.mark.slow
def test_eval_forward_reaches_at_least_the_training_length_without_optimizer_state():
  setup = max_seqlen.Setup("tiny", "float32", data=1, seq=8, batch=1)
  budget = max_seqlen.compiled_bytes(setup, max_seqlen.MemoryConfig("full"), GRANULARITY)
  rows = max_seqlen.main(["--preset", "tiny", "--configs", "full,eval",
                          "--granularity", str(GRANULARITY), "--max-len", str(2 * GRANULARITY),
                          "--budget-gib", str(budget / max_seqlen.GIB),
                          "--time-max-tokens", "0"])
  train, forward = rows
  assert train["config"] == "full" and forward["config"] == "eval"
  assert forward["max_tokens"] >= train["max_tokens"] >= GRANULARITY
  assert forward["est_GiB"] * max_seqlen.GIB <= budget
  # The compiled forward takes the parameters and the batch, nothing else: no optimizer
  # state, no gradients (the training step's arguments hold at least parameters + 2 moments).
  evaluate = max_seqlen.parse_config("eval")
  compiled, params, batch, _ = max_seqlen.compile_step(setup, evaluate, GRANULARITY,
                                                       abstract=True)
  shard_bytes = lambda tree: sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                                 for x in jax.tree.leaves(tree))
  assert set(batch) == {"tokens", "labels", "positions", "segment_ids"}
  assert compiled.memory_analysis().argument_size_in_bytes == (shard_bytes(params) +
                                                               shard_bytes(batch))
  assert compiled.memory_analysis().output_size_in_bytes < shard_bytes(params)
  train_compiled = max_seqlen.compile_step(setup, max_seqlen.MemoryConfig("full"), GRANULARITY,
                                           abstract=True)[0]
  assert train_compiled.memory_analysis().argument_size_in_bytes >= 3 * shard_bytes(params)
  assert max_seqlen.parse_config("eval+mlp64") == max_seqlen.MemoryConfig(
      "none", mlp_chunk=64, evaluate=True)
  assert max_seqlen.parse_config("eval+mlp64").name == "eval+mlp64"
  with pytest.raises(ValueError, match="only \\+mlpN"):
    max_seqlen.parse_config("eval+opt")


def test_plot_without_matplotlib_stops_before_measuring(monkeypatch, capsys):
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
  with pytest.raises(SystemExit):
    max_seqlen.main(["--preset", "tiny", "--plot", "out.png"])
  assert "--plot out.png needs matplotlib: pip install -e '.[bench]'" in capsys.readouterr().err


@pytest.mark.slow
def test_vs_transformers_same_losses_both_memory_policies_timed_with_spread(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from benchmarks import vs_transformers
  rows = vs_transformers.main(["--preset", "tiny-gqa", "--seq-lens", "64", "--batch", "2",
                               "--repeats", "2", "--json", str(tmp_path / "vs.json")])
  assert [r["memory_policy"] for r in rows] == ["none", "full"]
  for row in rows:  # 3 AdamW steps each: one untimed, two timed
    assert row["first_loss_rel_diff"] <= 1e-4
    assert abs(row["ours_last_loss"] - row["torch_last_loss"]) <= 1e-3 * row["torch_last_loss"]
    assert row["ours_last_loss"] < row["ours_first_loss"]
    for side in ("ours", "torch"):
      assert 0 < row[f"{side}_step_s_min"] <= row[f"{side}_step_s"] <= row[f"{side}_step_s_max"]
    assert row["speed_ratio"] == pytest.approx(row["ours_tokens_per_s"] /
                                               row["torch_tokens_per_s"])
  written = json.loads((tmp_path / "vs.json").read_text())
  assert written["environment"]["device_count"] == jax.device_count()
  assert {"torch", "transformers", "torch_threads"} <= set(written["versions"])
  assert [len(t["ulysses_jax"]) for t in written["step_times"]] == [2, 2]


@pytest.mark.parametrize("scheme", ["ring", "hybrid"])
def test_comm_volume_of_looped_collectives_matches_the_formula(scheme):
  row = comm_volume.measure(scheme, batch=1, seq_len=256, q_heads=8, kv_heads=4, head_dim=8,
                            shards=8, dtype=jnp.float32)
  assert row["ratio"] == 1.0 and row["other_collective_bytes"] == 0, row


def test_executed_collective_bytes_weights_a_loop_body_by_its_trip_count():
  shards = 4  # the ring's loop rotates K and V shards - 1 times
  mesh = make_mesh(data=1, seq=shards, devices=jax.devices()[:shards])
  qkv = jax.ShapeDtypeStruct((1, 256, 4, 8), jnp.float32)
  ring = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True,
                                                layout="zigzag"))
  text = ring.lower(qkv, qkv, qkv).compile().as_text()
  kv_shard_bytes = 2 * 256 // shards * 4 * 8 * 4
  assert hlo.collective_bytes(text)["collective-permute"] == kv_shard_bytes
  assert hlo.executed_collective_bytes(text) == {
      **dict.fromkeys(hlo.COLLECTIVES, 0), "collective-permute": (shards - 1) * kv_shard_bytes}


@pytest.mark.parametrize("kernel", kernel_resources.KERNELS)
def test_kernel_resources_lowers_each_triton_kernel_for_hopper(kernel):
  tile = flash_kernels.Tile(64, 32, 4, 2)
  text = kernel_resources.triton_ir(kernel, 64, tile, segments=True)
  assert f"tt.func public @flash_attention_{kernel}" in text
  assert "tt.dot" in text
  # The hook is gone afterwards: lowering again captures nothing by accident.
  with kernel_resources._capture_triton_modules() as modules:
    pass
  assert modules == []


def test_kernel_resources_compiles_for_a_gpu(tmp_path):
  pytest.importorskip("triton", reason="pip install -e '.[kernel-tools]'")
  tile = flash_kernels.Tile(64, 64, 4, 2)
  small = kernel_resources.compile_for_gpu(
      kernel_resources.triton_ir("dq", 64, tile, segments=False), tile, str(tmp_path))
  large = flash_kernels.Tile(128, 128, 4, 2)
  big = kernel_resources.compile_for_gpu(
      kernel_resources.triton_ir("dq", 64, large, segments=False), large, str(tmp_path))
  assert 0 < small["registers"] <= 255 and small["spill_bytes"] >= 0
  assert big["smem_KiB"] > small["smem_KiB"] > 0


def test_benchmarks_write_json_only_where_asked(tmp_path, monkeypatch):
  tracked = pathlib.Path(comm_volume.__file__).parent / "results" / "comm_volume.json"
  before = tracked.read_bytes()
  monkeypatch.chdir(tmp_path)  # where the old default path would have been created
  small = ["--heads", "8:4", "--shards", "2", "--tokens-per-device", "16", "--fixed-seq-len",
           "32", "--head-dim", "8"]
  rows = comm_volume.main(small)
  assert rows and not list(tmp_path.rglob("*.json")) and tracked.read_bytes() == before
  comm_volume.main([*small, "--json", "out/comm.json"])
  assert len(json.loads((tmp_path / "out" / "comm.json").read_text())["rows"]) == len(rows)
  # No benchmark has a default output path: every --json defaults to "" (nothing written).
  for script in pathlib.Path(comm_volume.__file__).parent.glob("*.py"):
    for call in ast.walk(ast.parse(script.read_text())):
      if (isinstance(call, ast.Call) and call.args and
          getattr(call.args[0], "value", None) == "--json"):
        defaults = [k.value.value for k in call.keywords if k.arg == "default"]
        assert defaults == [""], (script.name, defaults)


def test_sliding_window_benchmark_times_each_window_beside_full_causal(tmp_path):
  from benchmarks import sliding_window
  rows = sliding_window.main(["--seq_len", "1024", "--windows", "64", "--iters", "1",
                              "--json", str(tmp_path / "window.json")])
  assert [r["window"] for r in rows] == [64, "full"]
  assert rows[1]["forward_ratio"] == rows[1]["flop_ratio"] == 1.0
  assert rows[0]["flop_ratio"] < 0.15 and rows[0]["forward_s"] > 0
  assert json.loads((tmp_path / "window.json").read_text())["seq_len"] == 1024


def test_a_preset_checkpoint_gives_a_fine_tuning_case_its_model(tmp_path):
  """``max_seqlen --gpu --init-from-preset``: configs/finetune_mistral7b_8gpu_8m.gin reads
  Mistral-7B-v0.1's shapes and window from the preset's config.json; a case's gin param still
  overrides a field (full attention, same shapes)."""
  from benchmarks import max_seqlen_gpu
  from ulysses_jax.cli import gin_config
  checkpoint = max_seqlen_gpu.preset_checkpoint("mistral-7b-v0.1", str(tmp_path))
  bind = [f"TrainConfig.init_from = '{checkpoint}'"]
  gin_file = ["configs/finetune_mistral7b_8gpu_8m.gin"]
  windowed = gin_config.read(gin_file, bind).model
  full = gin_config.read(gin_file, bind + ["LlamaConfig.sliding_window = None"]).model
  assert windowed.layer_windows() == (4096,) * 32 and full.layer_windows() == (None,) * 32
  assert (windowed.hidden_dim, windowed.num_kv_heads) == (full.hidden_dim, full.num_kv_heads)
  assert windowed.replace(sliding_window=None) == full


@pytest.mark.gpu_compile
@pytest.mark.skipif(not aot.cuda_plugin_installed(),
                    reason="needs JAX's CUDA plugin (make test-gpu-compile)")
def test_sliding_window_benchmark_counts_the_flops_compiled_for_an_h100():
  """``--gpu=h100``: the windowed program runs the windowed Triton kernels, whose FLOPs the
  cost walk counts by the window; the full one the causal kernels."""
  from benchmarks import sliding_window
  # The command line's precision: under conftest's "highest" the float32 Triton kernels take
  # minutes to compile here (138 s against 13 s).
  with jax.default_matmul_precision("default"):
    rows = sliding_window.main(["--gpu=h100", "--seq_len", "2048", "--windows", "128"])
  assert [(r["window"], r["backend"]) for r in rows] == [(128, "pallas"), ("full", "pallas")]
  assert rows[0]["kernels"] == ("flash_attention_dkv_causal_window128 flash_attention_dq_causal"
                                "_window128 flash_attention_forward_causal_window128")
  assert "window" not in rows[1]["kernels"]
  full_forward = 4 * 4 * 2048 * 2048 / 2 * 64  # 4 B Hq Sq Skv D, halved (causal)
  assert rows[1]["forward_gflop"] * 1e9 == pytest.approx(full_forward)
  # forward, dq and dk/dv kernels: 4 + 6 + 8 times B Hq Sq Skv D / 2, nothing else counted
  assert rows[1]["fwd_bwd_gflop"] == pytest.approx((4 + 6 + 8) / 4 * rows[1]["forward_gflop"])
  assert rows[0]["fwd_bwd_ratio"] == pytest.approx(rows[0]["flop_ratio"], rel=1e-3)


def test_data_pipeline_times_each_case_against_the_gpu_need(tmp_path):
  pytest.importorskip("pyarrow")
  pytest.importorskip("tokenizers")
  from benchmarks import data_pipeline
  rows = data_pipeline.main(["--tokens=200000", "--seq_len=4096", "--conversations=40",
                             "--text_files=20", f"--json={tmp_path / 'data.json'}"])
  assert [r["case"] for r in rows] == ["parquet_tokens", "jsonl_text", "token_dir",
                                       "chat_generation", "chat_turns"]
  assert rows[1]["tokens"] == rows[2]["tokens"]  # the same text, tokenized once
  needs = data_pipeline.gpu_needs()
  assert len(needs) == 7 and needs[0]["tok_s_per_host"] == 8 * 15_490
  for r in rows:
    assert r["tokens"] > 0 and r["load_s"] > 0 and r["pack_s"] > 0
    assert r["ratio"] == pytest.approx(r["total_tok_s"] / max(n["tok_s_per_host"] for n in needs))
  assert 150_000 < rows[0]["tokens"] <= 200_000  # whole documents up to --tokens
  written = json.loads((tmp_path / "data.json").read_text())
  assert written["rows"][0]["case"] == "parquet_tokens" and written["needs"] == needs


@pytest.mark.parametrize("mode", ["gpu", "cpu"], ids=["one_gpu_shapes", "tiny_cpu_shapes"])
def test_every_shipped_gpu_config_cut_to_one_device_reads(mode, tmp_path):
  """first-contact's cut of each GPU config (configs/*.gin with configs/runs/gpu.gin) is a
  valid one-device run in bfloat16, a few steps (a fine-tuning config's checkpoint, which
  the stage writes first, left out here)."""
  from benchmarks import first_contact
  from ulysses_jax.cli import gin_config
  configs = first_contact.shipped_gpu_configs()
  assert configs[0] == "configs/llama1b_128k.gin" and len(configs) >= 10
  for config in configs:
    params = first_contact.cut(config, first_contact.SIZES[mode], str(tmp_path), 4)
    fine_tuning = first_contact.family_of(config) is not None
    assert fine_tuning == any(p.startswith("TrainConfig.init_from") for p in params)
    run = gin_config.read([config], params + ["TrainConfig.init_from = ''"] * fine_tuning)
    assert (run.train.mesh_data, run.train.mesh_seq, run.train.mesh_ring,
            run.train.steps) == (1, 1, 1, 4), config
    assert run.train.platform == {"gpu": "gpu", "cpu": "cpu"}[mode]
    assert run.model.dtype == "bfloat16" and run.data.seq_len == first_contact.SIZES[
        mode].seq_len


@pytest.mark.slow
def test_gpu_session_first_contact_runs_on_the_cpu(tmp_path):
  """``benchmarks/gpu_session.sh first-contact`` end to end on the CPU with tiny shapes: a
  from-scratch config (SIGTERM, resume, evaluate, generate, export, transformers, doctor)
  and a fine-tuning one from a random mixture-of-experts checkpoint; every row passes."""
  import os
  import subprocess
  import sys

  from child_env import child_env
  pytest.importorskip("transformers")
  env = child_env(FIRST_CONTACT_MODE="cpu", FIRST_CONTACT_CONFIGS="configs/llama1b_128k.gin,"
                  "configs/finetune_qwen3_30b_a3b_8gpu_2m.gin",
                  PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
  root = pathlib.Path(__file__).parent.parent
  run = subprocess.run(["bash", "benchmarks/gpu_session.sh", "first-contact", str(tmp_path)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  report = json.loads((tmp_path / "first_contact" / "first_contact.json").read_text())
  commands = [r["command"] for r in report["rows"]]
  assert commands[1:4] == ["ulysses-train llama1b_128k (SIGTERM after step 2)",
                           "ulysses-train llama1b_128k (resumed)",
                           "ulysses-train finetune_qwen3_30b_a3b_8gpu_2m"]
  assert [r["exit_code"] for r in report["rows"][1:3]] == [75, 0]
  assert all(r["passed"] for r in report["rows"])
  assert "commands passed" in run.stdout and "ulysses-doctor" in run.stdout
